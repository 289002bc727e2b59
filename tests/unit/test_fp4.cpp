// FP4: E2M1 against the format's table (all 16 codes, ties to even, saturation, stochastic
// rounding's expectation), NVFP4 and MXFP4 block quantization against the recipes' formulas
// computed here independently, the exact BF16 widening, packing, and the random Hadamard
// transform.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "octet/error.h"
#include "octet/fp4.h"
#include "octet/gemm.h"
#include "octet/rng.h"

namespace octet {
namespace {

const float kTable[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

TEST(E2M1, DecodesAll16Codes) {
  for (int code = 0; code < 16; ++code) {
    const float v = e2m1_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(v, kTable[code]) << "code " << code;
    EXPECT_EQ(std::signbit(v), code >= 8) << "code " << code;
    // S.EE.M with bias 1: E = 0 is subnormal (M * 0.5), else 2^(E-1) * (1 + M / 2).
    const int e = (code >> 1) & 3, m = code & 1;
    const float magnitude = e == 0 ? 0.5f * m : std::ldexp(1.0f + 0.5f * m, e - 1);
    EXPECT_EQ(std::fabs(v), magnitude) << "code " << code;
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(code | 0xF0)), v) << "high bits ignored";
  }
}

TEST(E2M1, EncodesEveryCodeBackAndRoundsToNearestEven) {
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(float_to_e2m1(kTable[code]), code) << kTable[code];
  }
  // Midpoints go to the code with mantissa bit 0.
  const float ties[][2] = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f}, {1.75f, 2.0f},
                           {2.5f, 2.0f},  {3.5f, 4.0f},  {5.0f, 4.0f}};
  for (const auto& [x, expected] : ties) {
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(x)), expected) << x;
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(-x)), -expected) << -x;
    // Just off the midpoint: the nearer neighbour.
    const float up = std::nextafter(x, 10.0f), down = std::nextafter(x, 0.0f);
    const float above = e2m1_to_float(float_to_e2m1(up)),
                below = e2m1_to_float(float_to_e2m1(down));
    EXPECT_GT(above, below) << x;
    EXPECT_LE(std::fabs(above - up), std::fabs(below - up)) << x;
  }
  // Saturation: past 6, infinities; tiny values to signed zero.
  for (float x : {6.5f, 7.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(float_to_e2m1(x), 0x7) << x;
    EXPECT_EQ(float_to_e2m1(-x), 0xF) << -x;
  }
  EXPECT_EQ(float_to_e2m1(1e-30f), 0x0);
  EXPECT_EQ(float_to_e2m1(-1e-30f), 0x8);
  // Exhaustive against the nearest table value on a fine grid.
  for (int i = -1400; i <= 1400; ++i) {
    const float x = static_cast<float>(i) / 200.0f;
    const float q = e2m1_to_float(float_to_e2m1(x));
    for (float candidate : kTable) {
      EXPECT_LE(std::fabs(q - x), std::fabs(candidate - x) + 1e-7f) << x;
    }
  }
}

TEST(E2M1, StochasticRoundingIsUnbiasedAndPicksNeighbours) {
  for (float x : {0.1f, 0.6f, 1.2f, 2.9f, 4.5f, 5.9f, -0.3f, -3.3f}) {
    double sum = 0.0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
      const float q = e2m1_to_float(float_to_e2m1_stochastic(x, philox_uniform(7, 0, i)));
      // Only the two table values around x.
      EXPECT_TRUE(std::fabs(q - x) <= 2.0f && (q == 0.0f || std::signbit(q) == std::signbit(x)))
          << x << " -> " << q;
      sum += q;
    }
    // |x - mean| within 5 standard errors (spacing <= 2, so sigma <= 1 per sample).
    EXPECT_NEAR(sum / n, x, 5.0 / std::sqrt(double{n})) << x;
  }
  for (int code = 0; code < 16; ++code) {  // exact values stay exact for every u
    for (float u : {0.0f, 0.5f, 0.999999f}) {
      EXPECT_EQ(e2m1_to_float(float_to_e2m1_stochastic(kTable[code], u)), kTable[code]);
    }
  }
  EXPECT_EQ(float_to_e2m1_stochastic(100.0f, 0.3f), 0x7);  // saturates
}

Tensor random_matrix(int64_t rows, int64_t cols, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
  t.data<float>()[3] = 9.0f * scale;  // an outlier in the first block
  return t;
}

// The NVFP4 formulas of include/octet/fp4.h, element by element.
void expect_nvfp4(const Tensor& x, const Float4Tensor& q, int block_rows) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  const float* v = x.data<float>();
  float amax = 0.0f;
  for (int64_t i = 0; i < x.numel(); ++i) amax = std::max(amax, std::fabs(v[i]));
  EXPECT_EQ(q.amax, amax);
  const float global_encode = 448.0f * 6.0f / amax;
  EXPECT_EQ(q.global_scale_inv, 1.0f / global_encode);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float block = 0.0f;
      const int64_t r0 = r / block_rows * block_rows, c0 = c / 16 * 16;
      for (int64_t i = r0; i < std::min(rows, r0 + block_rows); ++i) {
        for (int64_t j = c0; j < std::min(cols, c0 + 16); ++j) {
          block = std::max(block, std::fabs(v[i * cols + j]));
        }
      }
      const float s =
          fp8_to_float(float_to_fp8(block / 6.0f * global_encode, DType::E4M3, true), DType::E4M3);
      ASSERT_EQ(q.block_scale(r, c), s) << r << "," << c;
      const uint8_t expected = float_to_e2m1(v[r * cols + c] * (global_encode / s));
      ASSERT_EQ(q.code(r, c), expected) << r << "," << c;
    }
  }
}

TEST(NVFP4, OneByOneSixteenBlocksFollowTheRecipe) {
  const Tensor x = random_matrix(5, 40, 1);  // a partial last block and an odd row count
  const Float4Tensor q = quantize_fp4(x, {});
  EXPECT_EQ(q.data.shape(), (Shape{5, 20}));
  EXPECT_EQ(q.scale.shape(), (Shape{5, 3}));
  expect_nvfp4(x, q, 1);
  // The block holding the amax uses E4M3's maximum scale and E2M1's maximum code.
  EXPECT_EQ(q.block_scale(0, 3), 448.0f);
  EXPECT_EQ(q.code(0, 3), 0x7);
  // Dequantized: each element within half a step of E2M1 (at most 1 at the top) times its scale.
  const Tensor d = q.dequantize();
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 40; ++c) {
      const float step = q.block_scale(r, c) * q.global_scale_inv;
      EXPECT_LE(std::fabs(d.data<float>()[r * 40 + c] - x.data<float>()[r * 40 + c]),
                1.0f * step * 1.0001f)
          << r << "," << c;
    }
  }
}

TEST(NVFP4, SixteenBySixteenBlocksShareOneScale) {
  const Tensor x = random_matrix(35, 48, 2);
  Fp4Options o;
  o.block_2d = true;
  const Float4Tensor q = quantize_fp4(x, o);
  EXPECT_EQ(q.scale.shape(), (Shape{3, 3}));
  expect_nvfp4(x, q, 16);
  EXPECT_EQ(q.block_scale(0, 0), q.block_scale(15, 15));
  EXPECT_THROW(quantize_fp4(x, {Fp4Recipe::MXFP4, true}), Error);
}

TEST(NVFP4, KeepsRelativeAccuracyAtLargeAndTinyMagnitudes) {
  const Tensor unit = random_matrix(4, 64, 3);
  const Tensor reference = quantize_fp4(unit, {}).dequantize();
  for (float magnitude : {1e-30f, 1e-10f, 1e10f, 1e30f}) {
    Tensor x = Tensor::empty(unit.shape(), DType::F32);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = unit.data<float>()[i] * magnitude;
    const Tensor d = quantize_fp4(x, {}).dequantize();
    for (int64_t i = 0; i < x.numel(); ++i) {
      EXPECT_NEAR(d.data<float>()[i] / magnitude, reference.data<float>()[i],
                  1e-5f * std::fabs(reference.data<float>()[i]) + 1e-6f)
          << magnitude << " at " << i;
    }
  }
}

TEST(MXFP4, PowerOfTwoScalesPerThirtyTwo) {
  const Tensor x = random_matrix(3, 70, 4);
  Fp4Options o;
  o.recipe = Fp4Recipe::MXFP4;
  const Float4Tensor q = quantize_fp4(x, o);
  EXPECT_EQ(q.scale.shape(), (Shape{3, 3}));
  EXPECT_EQ(q.global_scale_inv, 1.0f);
  const float* v = x.data<float>();
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 70; ++c) {
      float block = 0.0f;
      for (int64_t j = c / 32 * 32; j < std::min<int64_t>(70, c / 32 * 32 + 32); ++j) {
        block = std::max(block, std::fabs(v[r * 70 + j]));
      }
      const float s = std::exp2(std::ceil(std::log2(block / 6.0f)));
      ASSERT_EQ(q.block_scale(r, c), s);
      ASSERT_EQ(q.code(r, c), float_to_e2m1(v[r * 70 + c] / s));
      EXPECT_LE(std::fabs(v[r * 70 + c]), 6.0f * s);  // never saturates
    }
  }
}

TEST(FP4, WidenedBf16IsExactAndPackingIsLowNibbleFirst) {
  for (Fp4Recipe recipe : {Fp4Recipe::NVFP4, Fp4Recipe::MXFP4}) {
    const Tensor x = random_matrix(6, 33, 5);  // odd columns: the last high nibble is 0
    const Float4Tensor q = quantize_fp4(x.to(DType::BF16), {recipe});
    const Tensor wide = q.widen_bf16();
    const Tensor d = q.dequantize();
    for (int64_t r = 0; r < 6; ++r) {
      for (int64_t c = 0; c < 33; ++c) {
        const float exact = e2m1_to_float(q.code(r, c)) * q.block_scale(r, c);
        ASSERT_EQ(bf16_to_float(wide.data<bfloat16>()[r * 33 + c].bits), exact);
        ASSERT_EQ(d.data<float>()[r * 33 + c], exact * q.global_scale_inv);
        const uint8_t byte = q.data.data<uint8_t>()[r * 17 + c / 2];
        ASSERT_EQ(c % 2 == 0 ? byte & 0xF : byte >> 4, q.code(r, c));
      }
      EXPECT_EQ(q.data.data<uint8_t>()[r * 17 + 16] >> 4, 0);
    }
  }
}

// The quantizer's own element conversion against the format table at every rounding
// threshold, representable value and their float neighbours (MXFP4 blocks whose amax is 6
// have scale 1, so the quantizer sees these values exactly).
TEST(FP4, QuantizerRoundsEveryThresholdAsTheTable) {
  std::vector<float> sweep;
  for (const float t : {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f,
                        4.0f, 5.0f, 5.999f}) {
    for (const float v : {t, std::nextafter(t, 0.0f), std::nextafter(t, 10.0f)}) {
      sweep.push_back(v);
      sweep.push_back(-v);
    }
  }
  sweep.push_back(-0.0f);
  sweep.push_back(1e-30f);
  const int64_t per_row = 31, rows = (static_cast<int64_t>(sweep.size()) + per_row - 1) / per_row;
  Tensor x = Tensor::zeros({rows, 32}, DType::F32);
  for (int64_t r = 0; r < rows; ++r) x.data<float>()[r * 32] = 6.0f;
  for (size_t i = 0; i < sweep.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / per_row, c = 1 + static_cast<int64_t>(i) % per_row;
    x.data<float>()[r * 32 + c] = sweep[i];
  }
  const Float4Tensor q = quantize_fp4(x, {Fp4Recipe::MXFP4});
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_EQ(q.block_scale(r, 0), 1.0f);
    for (int64_t c = 0; c < 32; ++c) {
      const float v = x.data<float>()[r * 32 + c];
      ASSERT_EQ(q.code(r, c), float_to_e2m1(v)) << v;
    }
  }
  // Stochastic rounding of the same values, element by element against the scalar conversion.
  Fp4Options o{Fp4Recipe::MXFP4};
  o.stochastic = true;
  o.seed = 5;
  for (uint64_t offset = 0; offset < 64; offset += 16) {
    o.offset = offset;
    const Float4Tensor s = quantize_fp4(x, o);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < 32; ++c) {
        const float v = x.data<float>()[r * 32 + c];
        const uint64_t index = static_cast<uint64_t>(r * 32 + c);
        ASSERT_EQ(s.code(r, c), float_to_e2m1_stochastic(v, philox_uniform(5, offset, index))) << v;
      }
    }
  }
}

TEST(FP4, StochasticQuantizationIsUnbiasedAndSeeded) {
  const Tensor x = random_matrix(1, 64, 6);
  Fp4Options o;
  o.stochastic = true;
  std::vector<double> mean(64, 0.0);
  const int trials = 4000;
  for (int t = 0; t < trials; ++t) {
    o.offset = static_cast<uint64_t>(t) * 64;
    const Tensor d = quantize_fp4(x, o).dequantize();
    for (int i = 0; i < 64; ++i) mean[i] += d.data<float>()[i] / trials;
  }
  const Float4Tensor nearest = quantize_fp4(x, {});
  for (int i = 0; i < 64; ++i) {
    const double step = 2.0 * nearest.block_scale(0, i) * nearest.global_scale_inv;
    EXPECT_NEAR(mean[i], x.data<float>()[i], 5.0 * step / std::sqrt(double{trials})) << i;
  }
  o.offset = 0;
  EXPECT_TRUE(quantize_fp4(x, o).data.to_floats() == quantize_fp4(x, o).data.to_floats());
  // Element i rounds with philox_uniform(seed, offset, i), whatever the row length (37: rows
  // start mid-way through a Philox block of four).
  const Tensor odd = random_matrix(3, 37, 8);
  o.seed = 99;
  o.offset = 12345;
  const Float4Tensor q = quantize_fp4(odd, o);
  const float global_encode = 448.0f * 6.0f / q.amax;
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 37; ++c) {
      const float v = odd.data<float>()[r * 37 + c] * (global_encode / q.block_scale(r, c));
      const uint64_t index = static_cast<uint64_t>(r * 37 + c);
      ASSERT_EQ(q.code(r, c), float_to_e2m1_stochastic(v, philox_uniform(99, 12345, index)))
          << r << "," << c;
    }
  }
}

TEST(FP4, BadInputsAndNonFiniteAmax) {
  EXPECT_THROW(quantize_fp4(Tensor::zeros({4, 16}, DType::I32), {}), Error);
  EXPECT_THROW(quantize_fp4(Tensor::zeros({0, 16}, DType::F32), {}), Error);
  EXPECT_THROW(parse_fp4_recipe("fp4"), Error);
  EXPECT_EQ(parse_fp4_recipe("mxfp4"), Fp4Recipe::MXFP4);
  Tensor x = random_matrix(2, 32, 7);
  x.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(quantize_fp4(x, {}).amax));
  const Float4Tensor zeros = quantize_fp4(Tensor::zeros({2, 32}, DType::F32), {});
  EXPECT_EQ(zeros.amax, 0.0f);
  for (float v : zeros.dequantize().to_floats()) EXPECT_EQ(v, 0.0f);
}

// The widened BF16 GEMM equals the float64 product of the dequantized operands to FP32
// accumulation: Y = X W^T (1x16 activations, 16x16 weights) and the weight used untransposed.
TEST(FP4, GemmEqualsTheDequantizedProduct) {
  for (Fp4Recipe recipe : {Fp4Recipe::NVFP4, Fp4Recipe::MXFP4}) {
    const Tensor x = random_matrix(9, 96, 10, 3.0f), w = random_matrix(7, 96, 11, 0.02f);
    const Float4Tensor xq = quantize_fp4(x, {recipe});
    Fp4Options weight_options{recipe};
    weight_options.block_2d = recipe == Fp4Recipe::NVFP4;
    const Float4Tensor wq = quantize_fp4(w, weight_options);
    Tensor y = Tensor::empty({9, 7}, DType::F32), expected = Tensor::empty({9, 7}, DType::F32);
    gemm(xq, wq, y, false, true, 0.5f);
    gemm_reference(xq.dequantize(), wq.dequantize(), expected, false, true, 0.5f);
    for (int64_t i = 0; i < y.numel(); ++i) {
      EXPECT_NEAR(y.data<float>()[i], expected.data<float>()[i],
                  1e-5f * std::fabs(expected.data<float>()[i]) + 1e-7f)
          << fp4_recipe_name(recipe) << " at " << i;
    }
    // The quantization error against the unquantized product stays at E2M1's level.
    Tensor exact = Tensor::empty({9, 7}, DType::F32);
    gemm_reference(x, w, exact, false, true, 0.5f);
    double error = 0, norm = 0;
    for (int64_t i = 0; i < y.numel(); ++i) {
      error += std::pow(double{y.data<float>()[i]} - exact.data<float>()[i], 2);
      norm += std::pow(double{exact.data<float>()[i]}, 2);
    }
    EXPECT_LT(std::sqrt(error / norm), 0.2) << fp4_recipe_name(recipe);
  }
  // The 16x16 weight also serves untransposed (dgrad: dX = dY W); 1x16 blocks across K do not.
  const Tensor dy = random_matrix(9, 32, 12), w = random_matrix(32, 48, 13);
  Fp4Options square;
  square.block_2d = true;
  const Float4Tensor dyq = quantize_fp4(dy, {}), wq = quantize_fp4(w, square);
  Tensor dx = Tensor::empty({9, 48}, DType::F32), expected = Tensor::empty({9, 48}, DType::F32);
  gemm(dyq, wq, dx, false, false);
  gemm_reference(dyq.dequantize(), wq.dequantize(), expected, false, false);
  for (int64_t i = 0; i < dx.numel(); ++i) {
    EXPECT_NEAR(dx.data<float>()[i], expected.data<float>()[i],
                1e-5f * std::fabs(expected.data<float>()[i]) + 1e-6f);
  }
  EXPECT_THROW(gemm(dyq, quantize_fp4(w, {}), dx, false, false), Error);
  Tensor c = Tensor::empty({32, 48}, DType::F32);
  EXPECT_THROW(gemm(dyq, quantize_fp4(dy.reshape({9, 32}), {}), c, true, false), Error);
}

TEST(Hadamard, OrthogonalInvertibleAndKeepsGemmProducts) {
  const Tensor a = random_matrix(3, 32, 8), b = random_matrix(4, 32, 9);
  const Tensor ha = random_hadamard_transform(a, 42), hb = random_hadamard_transform(b, 42);
  const Tensor back = random_hadamard_transform(ha, 42, true);
  for (int64_t i = 0; i < a.numel(); ++i) {
    EXPECT_NEAR(back.data<float>()[i], a.data<float>()[i], 1e-5f);
  }
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      double plain = 0, transformed = 0;
      for (int64_t k = 0; k < 32; ++k) {
        plain += double{a.data<float>()[i * 32 + k]} * b.data<float>()[j * 32 + k];
        transformed += double{ha.data<float>()[i * 32 + k]} * hb.data<float>()[j * 32 + k];
      }
      EXPECT_NEAR(transformed, plain, 1e-4) << i << "," << j;
    }
  }
  // The outlier (9 at column 3) is spread: every element of its block is 9/4 +- the rest.
  float block_max = 0.0f;
  for (int k = 0; k < 16; ++k) block_max = std::max(block_max, std::fabs(ha.data<float>()[k]));
  EXPECT_LT(block_max, 9.0f * 0.75f);
  const Tensor other_seed = random_hadamard_transform(a, 43);
  EXPECT_FALSE(other_seed.to_floats() == ha.to_floats());
  EXPECT_THROW(random_hadamard_transform(Tensor::zeros({2, 24}, DType::F32), 1), Error);
}

}  // namespace
}  // namespace octet
