// Quantizers (per-tensor, block, MXFP8), Float8Tensor dequantization, make_quantizer and
// fp8_autocast. Scales are recomputed here from the block amaxes with plain formulas; codes
// come from the scalar reference encoder float_to_fp8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "octet/recipe.h"
#include "test_util.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

// Values spread over many binades, with signs, as activations and gradients are.
std::vector<float> random_values(int64_t count, uint32_t seed, float log2_spread = 6.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-log2_spread, log2_spread);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng) * std::exp2(exponent(rng));
  return values;
}

Tensor random_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  return Tensor::from_floats({rows, cols}, random_values(rows * cols, seed));
}

std::vector<uint8_t> codes_of(const Tensor& tensor) {
  const auto* begin = static_cast<const uint8_t*>(tensor.raw());
  return std::vector<uint8_t>(begin, begin + tensor.numel());
}

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = x[r * cols + c];
  }
  return out;
}

float largest_power_of_2_at_most(float value) {
  int e = 0;
  std::frexp(value, &e);  // value = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, e - 1);
}

// ---- Independent block reference ----

struct BlockReference {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};

BlockReference reference_blocks(const std::vector<float>& x, int64_t rows, int64_t cols,
                                int block_rows, int block_cols, DType format, bool pow2) {
  const float max_value = format == DType::E4M3 ? 448.0f : 57344.0f;
  const int64_t nbr = (rows + block_rows - 1) / block_rows;
  const int64_t nbc = (cols + block_cols - 1) / block_cols;
  BlockReference ref{std::vector<uint8_t>(x.size()), std::vector<float>(nbr * nbc)};
  for (int64_t br = 0; br < nbr; ++br) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * block_rows; r < std::min(rows, (br + 1) * block_rows); ++r) {
        for (int64_t c = bc * block_cols; c < std::min(cols, (bc + 1) * block_cols); ++c) {
          amax = std::max(amax, std::fabs(x[r * cols + c]));
        }
      }
      float scale = amax == 0.0f ? 1.0f : max_value / amax;
      if (pow2) scale = largest_power_of_2_at_most(scale);
      ref.scale_inv[br * nbc + bc] = 1.0f / scale;
      for (int64_t r = br * block_rows; r < std::min(rows, (br + 1) * block_rows); ++r) {
        for (int64_t c = bc * block_cols; c < std::min(cols, (bc + 1) * block_cols); ++c) {
          ref.codes[r * cols + c] = float_to_fp8(x[r * cols + c] * scale, format, true);
        }
      }
    }
  }
  return ref;
}

// E8M0 code of the smallest power of two >= value, from frexp.
uint8_t reference_e8m0_ceil(float value) {
  if (value == 0.0f) return 0;
  int e = 0;
  const float mantissa = std::frexp(value, &e);  // value = m * 2^e
  const int power = mantissa == 0.5f ? e - 1 : e;
  return static_cast<uint8_t>(std::clamp(power + 127, 0, 254));
}

BlockReference reference_mxfp8(const std::vector<float>& x, int64_t rows, int64_t cols,
                               DType format) {
  const float max_value = format == DType::E4M3 ? 448.0f : 57344.0f;
  const int64_t nbc = (cols + 31) / 32;
  BlockReference ref{std::vector<uint8_t>(x.size()), std::vector<float>(rows * nbc)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t c1 = std::min(cols, (bc + 1) * 32);
      float amax = 0.0f;
      for (int64_t c = bc * 32; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const uint8_t code = reference_e8m0_ceil(amax / max_value);
      ref.scale_inv[r * nbc + bc] = code;
      const float scale = std::ldexp(1.0f, 127 - code);
      for (int64_t c = bc * 32; c < c1; ++c) {
        ref.codes[r * cols + c] = float_to_fp8(x[r * cols + c] * scale, format, true);
      }
    }
  }
  return ref;
}

bool is_power_of_2(float value) {
  int e = 0;
  return std::frexp(value, &e) == 0.5f;
}

// F32 block scales, or U8 E8M0 codes compared as numbers.
void expect_scales(const Tensor& scales, const std::vector<float>& expected) {
  ASSERT_EQ(scales.numel(), static_cast<int64_t>(expected.size()));
  std::vector<float> got;
  if (scales.dtype() == DType::U8) {
    const auto* codes = scales.data<uint8_t>();
    got.assign(codes, codes + scales.numel());
  } else {
    got = scales.to_floats();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << "scale " << i;
  }
}

void expect_codes(const Tensor& data, const std::vector<uint8_t>& expected) {
  const std::vector<uint8_t> got = codes_of(data);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << "element " << i;
  }
}

// ---- Per-tensor ----

TEST(QuantizerPerTensor, FixedScale) {
  const Tensor x = random_matrix(33, 47, 1);
  const std::vector<float> values = x.to_floats();
  const Float8Tensor q = Quantizer::fixed(DType::E4M3, 2.0f).quantize(x);
  EXPECT_EQ(q.mode, ScalingMode::PerTensor);
  EXPECT_EQ(q.rows, 33);
  EXPECT_EQ(q.cols, 47);
  EXPECT_FALSE(q.has_columnwise());
  EXPECT_EQ(q.data.shape(), (Shape{33, 47}));
  EXPECT_EQ(q.data.dtype(), DType::E4M3);
  EXPECT_EQ(q.scale, 2.0f);
  expect_scales(q.scale_inv, {0.5f});
  float amax = 0.0f;
  std::vector<uint8_t> expected(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    amax = std::max(amax, std::fabs(values[i]));
    expected[i] = float_to_fp8(values[i] * 2.0f, DType::E4M3, true);
  }
  EXPECT_EQ(q.amax, amax);
  expect_codes(q.data, expected);
}

TEST(QuantizerPerTensor, FixedScaleSaturates) {
  const Tensor x = Tensor::from_floats({1, 4}, {1000.0f, -1000.0f, 1.0f, 0.0f});
  const Float8Tensor q = Quantizer::fixed(DType::E4M3, 1.0f).quantize(x);
  const std::vector<float> back = q.dequantize().to_floats();
  EXPECT_EQ(back, (std::vector<float>{448.0f, -448.0f, 1.0f, 0.0f}));
}

TEST(QuantizerPerTensor, CurrentScalingFromAmax) {
  for (DType format : {DType::E4M3, DType::E5M2}) {
    for (bool pow2 : {false, true}) {
      const Tensor x = random_matrix(40, 72, 2);
      float amax = 0.0f;
      for (float v : x.to_floats()) amax = std::max(amax, std::fabs(v));
      float scale = fp8_max(format) / amax;
      if (pow2) scale = largest_power_of_2_at_most(scale);
      const Float8Tensor q = Quantizer::current(format, pow2).quantize(x);
      EXPECT_EQ(q.format, format);
      EXPECT_EQ(q.amax, amax);
      EXPECT_EQ(q.scale, scale);
      expect_scales(q.scale_inv, {1.0f / scale});
      // The largest element lands on (or, with pow2, below) the format's maximum.
      float code_amax = 0.0f;
      for (uint8_t code : codes_of(q.data)) {
        code_amax = std::max(code_amax, std::fabs(fp8_to_float(code, format)));
      }
      EXPECT_LE(code_amax, fp8_max(format));
      if (!pow2) {
        EXPECT_EQ(code_amax, fp8_max(format));
      }
    }
  }
}

TEST(QuantizerPerTensor, CurrentScalingZeroInputHasScaleOne) {
  const Float8Tensor q =
      Quantizer::current(DType::E4M3).quantize(Tensor::zeros({4, 8}, DType::F32));
  EXPECT_EQ(q.scale, 1.0f);
  EXPECT_EQ(q.amax, 0.0f);
  for (uint8_t code : codes_of(q.data)) EXPECT_EQ(code, 0);
}

TEST(QuantizerPerTensor, DelayedUsesMetaScaleAndRecordsAmax) {
  FP8Meta meta({TensorRole::Input, TensorRole::Weight}, 4);
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 4;
  recipe.fp8_format = recipe::Format::E4M3;
  const Quantizer quantizer = Quantizer::delayed(DType::E4M3, &meta, 1);
  const Tensor x = random_matrix(16, 24, 3);
  const std::vector<float> values = x.to_floats();
  float amax = 0.0f;
  for (float v : values) amax = std::max(amax, std::fabs(v));

  const Float8Tensor first = quantizer.quantize(x);  // meta scale 1 at first
  EXPECT_EQ(first.scale, 1.0f);
  EXPECT_EQ(first.amax, amax);
  EXPECT_EQ(meta.amax_history(0, 1), amax);
  EXPECT_EQ(meta.amax_history(0, 0), 0.0f);
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(codes_of(first.data)[i], float_to_fp8(values[i], DType::E4M3, true));
  }

  meta.update(recipe);
  const float scale = 448.0f / amax;
  ASSERT_EQ(meta.scale(1), scale);
  const Tensor half = Tensor::from_floats({16, 24}, [&] {
    std::vector<float> v = values;
    for (float& e : v) e *= 0.5f;
    return v;
  }());
  const Float8Tensor second = quantizer.quantize(half, true, true);
  EXPECT_EQ(second.scale, scale);  // the meta's scale at the time of the call
  expect_scales(second.scale_inv, {1.0f / scale});
  expect_scales(second.scale_inv_t, {1.0f / scale});
  EXPECT_EQ(meta.amax_history(0, 1), amax * 0.5f);
  EXPECT_EQ(meta.amax_history(3, 1), amax);  // the previous step, rolled to the end
  const std::vector<uint8_t> codes = codes_of(second.data);
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(codes[i], float_to_fp8(values[i] * 0.5f * scale, DType::E4M3, true));
  }
}

TEST(QuantizerPerTensor, ColumnwiseIsTheTransposeForF32AndBF16) {
  // A 3-d input is seen as [rows = 2*5, cols = 53].
  const Tensor x32 = Tensor::from_floats({2, 5, 53}, random_values(2 * 5 * 53, 4));
  for (const Tensor& x : {x32, x32.to(DType::BF16)}) {
    const std::vector<float> values = x.to_floats();
    const Float8Tensor q = Quantizer::fixed(DType::E5M2, 4.0f).quantize(x, true, true);
    ASSERT_EQ(q.rows, 10);
    ASSERT_EQ(q.cols, 53);
    ASSERT_EQ(q.data_t.shape(), (Shape{53, 10}));
    const std::vector<uint8_t> rowwise = codes_of(q.data);
    const std::vector<uint8_t> columnwise = codes_of(q.data_t);
    for (int64_t r = 0; r < 10; ++r) {
      for (int64_t c = 0; c < 53; ++c) {
        ASSERT_EQ(rowwise[r * 53 + c], float_to_fp8(values[r * 53 + c] * 4.0f, DType::E5M2, true));
        ASSERT_EQ(columnwise[c * 10 + r], rowwise[r * 53 + c]);
      }
    }
    const Float8Tensor only_t = Quantizer::fixed(DType::E5M2, 4.0f).quantize(x, false, true);
    EXPECT_FALSE(only_t.has_rowwise());
    EXPECT_EQ(codes_of(only_t.data_t), columnwise);
    EXPECT_EQ(only_t.amax, q.amax);
  }
}

// ---- Block scaling ----

struct BlockCase {
  int64_t rows, cols;
  int block_rows, block_cols;
  bool pow2;
  DType format;
};

class QuantizerBlock : public ::testing::TestWithParam<BlockCase> {};

TEST_P(QuantizerBlock, MatchesPerBlockReference) {
  const BlockCase p = GetParam();
  std::vector<float> values = random_values(p.rows * p.cols, 5);
  // The first block all zero: amax 0 gives scale 1.
  for (int64_t r = 0; r < std::min<int64_t>(p.rows, p.block_rows); ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(p.cols, p.block_cols); ++c) {
      values[r * p.cols + c] = 0.0f;
    }
  }
  const Tensor x = Tensor::from_floats({p.rows, p.cols}, values);
  const Quantizer quantizer = Quantizer::block(p.format, p.block_rows, p.block_cols, p.pow2, 0.0f);
  for (bool rowwise : {true, false}) {
    const Float8Tensor q = quantizer.quantize(x, rowwise, true);
    EXPECT_EQ(q.mode, ScalingMode::Block);
    EXPECT_EQ(q.block_rows, p.block_rows);
    EXPECT_EQ(q.block_cols, p.block_cols);
    if (rowwise) {
      const BlockReference ref =
          reference_blocks(values, p.rows, p.cols, p.block_rows, p.block_cols, p.format, p.pow2);
      ASSERT_EQ(q.scale_inv.shape(), (Shape{(p.rows + p.block_rows - 1) / p.block_rows,
                                            (p.cols + p.block_cols - 1) / p.block_cols}));
      expect_scales(q.scale_inv, ref.scale_inv);
      expect_codes(q.data, ref.codes);
    }
    // Columnwise: blocks laid out in the transpose's own orientation.
    const BlockReference ref_t = reference_blocks(transpose(values, p.rows, p.cols), p.cols, p.rows,
                                                  p.block_rows, p.block_cols, p.format, p.pow2);
    ASSERT_EQ(q.scale_inv_t.shape(), (Shape{(p.cols + p.block_rows - 1) / p.block_rows,
                                            (p.rows + p.block_cols - 1) / p.block_cols}));
    expect_scales(q.scale_inv_t, ref_t.scale_inv);
    expect_codes(q.data_t, ref_t.codes);
  }
}

INSTANTIATE_TEST_SUITE_P(OddShapes, QuantizerBlock,
                         ::testing::Values(BlockCase{130, 300, 1, 128, true, DType::E4M3},
                                           BlockCase{130, 300, 1, 128, false, DType::E4M3},
                                           BlockCase{257, 129, 1, 128, true, DType::E5M2},
                                           BlockCase{130, 300, 128, 128, true, DType::E4M3},
                                           BlockCase{257, 129, 128, 128, false, DType::E4M3},
                                           BlockCase{257, 129, 128, 128, true, DType::E5M2},
                                           BlockCase{70, 45, 16, 32, false, DType::E4M3}));

TEST(QuantizerBlockScaling, BF16InputMatchesItsF32Values) {
  const Tensor x = random_matrix(131, 200, 6).to(DType::BF16);
  const std::vector<float> values = x.to_floats();
  const Float8Tensor q = Quantizer::block(DType::E4M3, 1, 128).quantize(x, true, true);
  const BlockReference ref = reference_blocks(values, 131, 200, 1, 128, DType::E4M3, true);
  expect_scales(q.scale_inv, ref.scale_inv);
  expect_codes(q.data, ref.codes);
  const BlockReference ref_t =
      reference_blocks(transpose(values, 131, 200), 200, 131, 1, 128, DType::E4M3, true);
  expect_codes(q.data_t, ref_t.codes);
}

TEST(QuantizerBlockScaling, EpsilonBoundsTheScale) {
  const Tensor x = Tensor::from_floats({2, 4}, {0, 0, 0, 0, 1e-6f, 0, 0, 0});
  const Float8Tensor q = Quantizer::block(DType::E4M3, 1, 4, false, 1.0f).quantize(x);
  expect_scales(q.scale_inv, {1.0f / 448.0f, 1.0f / 448.0f});
}

// ---- MXFP8 ----

TEST(QuantizerMXFP8, E8M0CodesAtTheEdges) {
  std::vector<float> values(4 * 32, 0.0f);  // row 3 stays zero
  for (int c = 0; c < 32; ++c) {
    values[0 * 32 + c] = 448.0f * static_cast<float>(c) / 31.0f;   // amax 448
    values[1 * 32 + c] = -449.0f * static_cast<float>(c) / 31.0f;  // amax 449
    values[2 * 32 + c] = 0.75f * static_cast<float>(c % 5);        // amax 3
  }
  const Float8Tensor q =
      Quantizer::mxfp8(DType::E4M3).quantize(Tensor::from_floats({4, 32}, values));
  EXPECT_EQ(q.mode, ScalingMode::MXFP8);
  ASSERT_EQ(q.scale_inv.dtype(), DType::U8);
  ASSERT_EQ(q.scale_inv.shape(), (Shape{4, 1}));
  const uint8_t* scale_codes = q.scale_inv.data<uint8_t>();
  EXPECT_EQ(scale_codes[0], 127);      // 448 / 448 = 1 = 2^0
  EXPECT_EQ(scale_codes[1], 128);      // 449 / 448 just above 1 -> 2^1
  EXPECT_EQ(scale_codes[2], 127 - 7);  // 3 / 448 in (2^-8, 2^-7] -> 2^-7
  EXPECT_EQ(scale_codes[3], 0);        // zero block
  const std::vector<uint8_t> codes = codes_of(q.data);
  EXPECT_EQ(fp8_to_float(codes[31], DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_to_float(codes[32 + 31], DType::E4M3), -224.0f);  // -449 / 2 rounds to -224
  for (int c = 0; c < 32; ++c) EXPECT_EQ(codes[3 * 32 + c], 0);
  const std::vector<float> deq = q.dequantize().to_floats();
  for (int c = 0; c < 32; ++c) {
    EXPECT_EQ(deq[2 * 32 + c], values[2 * 32 + c]);  // multiples of 0.75 are exact
    EXPECT_EQ(deq[3 * 32 + c], 0.0f);
  }
}

TEST(QuantizerMXFP8, MatchesIndependentReference) {
  for (DType format : {DType::E4M3, DType::E5M2}) {
    const int64_t rows = 67, cols = 100;  // 100 = 3 * 32 + 4: a partial block per row
    const std::vector<float> values = random_values(rows * cols, 8, 20.0f);
    const Tensor x = Tensor::from_floats({rows, cols}, values);
    const Float8Tensor q = Quantizer::mxfp8(format).quantize(x, true, true);
    EXPECT_EQ(q.block_rows, 1);
    EXPECT_EQ(q.block_cols, 32);
    const BlockReference ref = reference_mxfp8(values, rows, cols, format);
    ASSERT_EQ(q.scale_inv.shape(), (Shape{rows, 4}));
    expect_scales(q.scale_inv, ref.scale_inv);
    expect_codes(q.data, ref.codes);
    const BlockReference ref_t = reference_mxfp8(transpose(values, rows, cols), cols, rows, format);
    ASSERT_EQ(q.scale_inv_t.shape(), (Shape{cols, 3}));
    expect_scales(q.scale_inv_t, ref_t.scale_inv);
    expect_codes(q.data_t, ref_t.codes);
  }
}

// ---- Dequantization ----

// Half a unit in the last place of the FP8 grid: 2^-4 relative for E4M3 normals (3 mantissa
// bits), 2^-3 for E5M2; half the smallest subnormal below the normal range. In the scaled
// domain, so multiplied by the block's scale_inv. The last factor covers the FP32 roundings of
// x * scale and code * scale_inv.
float error_bound(float value, float scale_inv, DType format) {
  const bool e4m3 = format == DType::E4M3;
  const float relative = e4m3 ? 0.0625f : 0.125f;
  const float subnormal_half = e4m3 ? std::ldexp(1.0f, -10) : std::ldexp(1.0f, -17);
  return std::max(relative * std::fabs(value), subnormal_half * scale_inv) * (1.0f + 1e-6f);
}

float block_scale_inv(const Float8Tensor& q, const Tensor& scale_inv, int64_t r, int64_t c,
                      int64_t cols) {
  if (q.mode == ScalingMode::PerTensor) return scale_inv.data<float>()[0];
  const int64_t nbc = (cols + q.block_cols - 1) / q.block_cols;
  const int64_t index = (r / q.block_rows) * nbc + c / q.block_cols;
  if (q.mode == ScalingMode::MXFP8) return e8m0_to_float(scale_inv.data<uint8_t>()[index]);
  return scale_inv.data<float>()[index];
}

TEST(Float8TensorDequantize, WithinHalfUlpInEveryMode) {
  const int64_t rows = 150, cols = 170;
  const std::vector<float> values = random_values(rows * cols, 9, 8.0f);
  const Tensor x = Tensor::from_floats({rows, cols}, values);
  for (DType format : {DType::E4M3, DType::E5M2}) {
    const Quantizer quantizers[] = {Quantizer::current(format), Quantizer::current(format, true),
                                    Quantizer::block(format, 1, 128, false),
                                    Quantizer::block(format, 128, 128, true),
                                    Quantizer::mxfp8(format)};
    for (const Quantizer& quantizer : quantizers) {
      SCOPED_TRACE(::testing::Message()
                   << dtype_name(format) << " " << scaling_mode_name(quantizer.mode()));
      const Float8Tensor q = quantizer.quantize(x, true, true);
      const std::vector<float> deq = q.dequantize().to_floats();
      const std::vector<float> deq_t = q.dequantize_t().to_floats();
      const std::vector<uint8_t> codes = codes_of(q.data);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float scale_inv = block_scale_inv(q, q.scale_inv, r, c, cols);
          const float v = values[r * cols + c];
          const float d = deq[r * cols + c];
          ASSERT_EQ(d, fp8_to_float(codes[r * cols + c], format) * scale_inv);
          ASSERT_LE(std::fabs(v - d), error_bound(v, scale_inv, format))
              << "at " << r << "," << c << ": " << v << " -> " << d;
          const float scale_inv_t = block_scale_inv(q, q.scale_inv_t, c, r, rows);
          const float dt = deq_t[c * rows + r];
          ASSERT_LE(std::fabs(v - dt), error_bound(v, scale_inv_t, format));
        }
      }
      // One usage alone still dequantizes both ways.
      const Float8Tensor only_t = quantizer.quantize(x, false, true);
      EXPECT_EQ(only_t.dequantize().to_floats(), transpose(deq_t, cols, rows));
      const Float8Tensor only_rows = quantizer.quantize(x, true, false);
      EXPECT_EQ(only_rows.dequantize_t().to_floats(), transpose(deq, rows, cols));
    }
  }
}

// ---- Errors ----

TEST(QuantizerErrors, RejectBadInputs) {
  const Quantizer quantizer = Quantizer::current(DType::E4M3);
  try {
    quantizer.quantize(Tensor::zeros({4, 4}, DType::I32));
    FAIL() << "expected an error for an i32 input";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("i32"), std::string::npos) << message;
  }
  EXPECT_THROW(quantizer.quantize(Tensor::zeros({0, 4}, DType::F32)), Error);
  EXPECT_THROW(quantizer.quantize(Tensor::zeros({2, 4}, DType::F32), false, false), Error);
  EXPECT_THROW(Quantizer::fixed(DType::E4M3, std::numeric_limits<float>::infinity()), Error);
  EXPECT_THROW(Quantizer::fixed(DType::E4M3, std::nanf("")), Error);
  EXPECT_THROW(Quantizer::fixed(DType::E4M3, 0.0f), Error);
  EXPECT_THROW(Quantizer::fixed(DType::BF16, 1.0f), Error);
  EXPECT_THROW(Quantizer::block(DType::E4M3, 0, 128), Error);
  EXPECT_THROW(Quantizer::delayed(DType::E4M3, nullptr, 0), Error);
  FP8Meta meta({TensorRole::Input}, 2);
  EXPECT_THROW(Quantizer::delayed(DType::E4M3, &meta, 1), Error);
  Float8Tensor nothing;
  EXPECT_THROW(nothing.dequantize(), Error);
}

// ---- make_quantizer ----

TEST(MakeQuantizer, FollowsRecipeAndRole) {
  const Tensor x = random_matrix(130, 260, 10);
  FP8Meta meta({TensorRole::Input, TensorRole::GradOutput}, 16);

  recipe::DelayedScaling delayed;  // HYBRID by default
  EXPECT_THROW(make_quantizer(delayed, TensorRole::Input), Error);
  const Quantizer grad = make_quantizer(delayed, TensorRole::GradOutput, &meta, 1);
  EXPECT_EQ(grad.format(), DType::E5M2);
  EXPECT_EQ(grad.mode(), ScalingMode::PerTensor);
  grad.quantize(x);
  EXPECT_GT(meta.amax_history(0, 1), 0.0f);  // recorded into the given index
  EXPECT_EQ(meta.amax_history(0, 0), 0.0f);
  EXPECT_EQ(make_quantizer(delayed, TensorRole::Input, &meta, 0).format(), DType::E4M3);

  recipe::Float8CurrentScaling current;
  current.fp8_format = recipe::Format::E4M3;
  current.power_2_scale = true;
  const Quantizer cur = make_quantizer(current, TensorRole::GradInput);
  EXPECT_EQ(cur.format(), DType::E4M3);
  EXPECT_EQ(cur.mode(), ScalingMode::PerTensor);
  const float scale = cur.quantize(x).scale;
  EXPECT_TRUE(is_power_of_2(scale)) << "power_2_scale was not passed on: " << scale;

  const Quantizer mx = make_quantizer(recipe::MXFP8BlockScaling{}, TensorRole::Weight);
  EXPECT_EQ(mx.mode(), ScalingMode::MXFP8);
  EXPECT_EQ(mx.format(), DType::E4M3);

  recipe::Float8BlockScaling block;
  block.weight_block = 64;
  block.activation_block = 32;
  block.fp8_format = recipe::Format::HYBRID;
  const Float8Tensor weight = make_quantizer(block, TensorRole::Weight).quantize(x);
  EXPECT_EQ(weight.mode, ScalingMode::Block);
  EXPECT_EQ(weight.format, DType::E4M3);
  EXPECT_EQ(weight.block_rows, 64);
  EXPECT_EQ(weight.block_cols, 64);
  const Float8Tensor input = make_quantizer(block, TensorRole::Input).quantize(x);
  EXPECT_EQ(input.block_rows, 1);
  EXPECT_EQ(input.block_cols, 32);
  const Float8Tensor gradient = make_quantizer(block, TensorRole::GradOutput).quantize(x);
  EXPECT_EQ(gradient.format, DType::E5M2);
  EXPECT_EQ(gradient.block_rows, 1);
  for (float s : gradient.scale_inv.to_floats()) {
    EXPECT_TRUE(is_power_of_2(s)) << s;  // power_2_scale defaults to true
  }
}

// ---- fp8_autocast ----

TEST(Fp8Autocast, NestsAndRestores) {
  EXPECT_EQ(fp8_autocast_depth(), 0);
  EXPECT_FALSE(fp8_enabled());
  EXPECT_TRUE(std::holds_alternative<recipe::DelayedScaling>(fp8_recipe()));
  {
    fp8_autocast outer(true, recipe::Float8CurrentScaling{});
    EXPECT_EQ(fp8_autocast_depth(), 1);
    EXPECT_TRUE(fp8_enabled());
    const recipe::Recipe& outer_recipe = fp8_recipe();
    EXPECT_TRUE(std::holds_alternative<recipe::Float8CurrentScaling>(outer_recipe));
    {
      fp8_autocast inner(false, recipe::MXFP8BlockScaling{});
      EXPECT_EQ(fp8_autocast_depth(), 2);
      EXPECT_FALSE(fp8_enabled());
      EXPECT_TRUE(std::holds_alternative<recipe::MXFP8BlockScaling>(fp8_recipe()));
      {
        fp8_autocast innermost;  // enabled, DelayedScaling
        EXPECT_TRUE(fp8_enabled());
        EXPECT_TRUE(std::holds_alternative<recipe::DelayedScaling>(fp8_recipe()));
      }
      // The outer scope's recipe reference survives inner scopes coming and going.
      EXPECT_TRUE(std::holds_alternative<recipe::Float8CurrentScaling>(outer_recipe));
    }
    EXPECT_EQ(fp8_autocast_depth(), 1);
    EXPECT_TRUE(fp8_enabled());
    EXPECT_TRUE(std::holds_alternative<recipe::Float8CurrentScaling>(fp8_recipe()));
  }
  EXPECT_EQ(fp8_autocast_depth(), 0);
  EXPECT_FALSE(fp8_enabled());
}

TEST(Fp8Autocast, RestoredAfterException) {
  try {
    fp8_autocast outer(true, recipe::Float8BlockScaling{});
    fp8_autocast inner(true, recipe::MXFP8BlockScaling{});
    EXPECT_EQ(fp8_autocast_depth(), 2);
    throw std::runtime_error("step failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(fp8_autocast_depth(), 0);
  EXPECT_FALSE(fp8_enabled());
  EXPECT_TRUE(std::holds_alternative<recipe::DelayedScaling>(fp8_recipe()));
}

TEST(Fp8Autocast, IsThreadLocal) {
  fp8_autocast scope(true, recipe::MXFP8BlockScaling{});
  int other_depth = -1;
  bool other_enabled = true;
  std::thread other([&] {
    other_depth = fp8_autocast_depth();
    other_enabled = fp8_enabled();
  });
  other.join();
  EXPECT_EQ(other_depth, 0);
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(fp8_autocast_depth(), 1);
}

}  // namespace
}  // namespace octet
