// Weight-only FP8 for inference: per-channel and 128 x 128 block quantization against the E4M3
// table, the few-rows kernel on every instruction-set path and the many-rows path against the
// reference product of the dequantized weight (with bias and activation epilogues, BF16 and F32
// activations), block scales taken from each weight's own block, and a GPT whose weights are
// FP8 (both scalings) against the same GPT in BF16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "octet/engine.h"
#include "octet/gemm.h"
#include "test_util.h"

namespace octet {
namespace {

Tensor random_tensor(Shape shape, float scale, uint32_t seed, DType dtype = DType::F32) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = normal(rng);
  return Tensor::from_floats(shape, values).to(dtype);
}

// A weight whose 128 x 128 blocks span a factor of ~10^4 in magnitude (and one all-zero
// block), partial blocks at both edges.
Tensor block_varied_weight(int64_t N, int64_t K, uint32_t seed, int64_t zero_row = -1,
                           int64_t zero_col = -1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t bn = n / kFp8WeightBlock, bk = k / kFp8WeightBlock;
      const bool zero = bn == zero_row && bk == zero_col;
      w[static_cast<size_t>(n * K + k)] =
          zero ? 0.0f : normal(rng) * std::pow(10.0f, static_cast<float>((bn + 2 * bk) % 5 - 2));
    }
  }
  return Tensor::from_floats({N, K}, w);
}

TEST(Fp8WeightOnly, QuantizesEachRowToTheE4M3Table) {
  // Row 0 spans tiny to large (subnormal codes); row 1 all zero; row 2 one value.
  std::vector<float> w = {448.0f, -1e-3f, 0.5f, 3e-4f, 0.0f, 0.0f,
                          0.0f,   0.0f,   0.0f, -2.0f, 0.0f, 0.0f};
  Fp8WeightOnly q = quantize_weight_fp8(Tensor::from_floats({3, 4}, w));
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes.raw());
  const float* scale_inv = q.scale_inv.data<float>();
  EXPECT_FLOAT_EQ(scale_inv[0], 1.0f);
  EXPECT_FLOAT_EQ(scale_inv[1], 1.0f);
  EXPECT_FLOAT_EQ(scale_inv[2], 2.0f / 448.0f);
  for (int n = 0; n < 3; ++n) {
    for (int k = 0; k < 4; ++k) {
      const float scaled = w[static_cast<size_t>(n * 4 + k)] / scale_inv[n];
      EXPECT_EQ(codes[n * 4 + k], float_to_fp8(scaled, DType::E4M3, true)) << n << "," << k;
    }
  }
  EXPECT_EQ(codes[2 * 4 + 1], 0xfe);  // -448: -2 scaled to the format's largest magnitude
  Tensor back = dequantize_weight_fp8(q, DType::F32);
  EXPECT_FLOAT_EQ(back.data<float>()[0], 448.0f);
  EXPECT_FLOAT_EQ(back.data<float>()[9], -2.0f);
  EXPECT_THROW(quantize_weight_fp8(Tensor::zeros({4}, DType::F32)), Error);
  // A BF16 weight (read as BF16) quantizes as its values in F32 do, under both scalings.
  const Tensor wide = random_tensor({130, 300}, 0.05f, 20).to(DType::BF16).to(DType::F32);
  for (Fp8WeightScaling scaling : {Fp8WeightScaling::PerChannel, Fp8WeightScaling::Block128}) {
    const Fp8WeightOnly from_f32 = quantize_weight_fp8(wide, scaling);
    const Fp8WeightOnly from_bf16 = quantize_weight_fp8(wide.to(DType::BF16), scaling);
    EXPECT_EQ(from_bf16.codes.to_floats(), from_f32.codes.to_floats());
    EXPECT_EQ(from_bf16.scale_inv.to_floats(), from_f32.scale_inv.to_floats());
  }
  // A non-finite weight is named before any work.
  w[6] = -INFINITY;
  try {
    quantize_weight_fp8(Tensor::from_floats({3, 4}, w));
    ADD_FAILURE() << "an infinite weight was quantized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight [1, 2] is -inf: expected finite values (row 1)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Fp8WeightOnly, EveryCodeWidensExactly) {
  // One-hot rows of A times a weight row holding all 256 codes (NaNs excluded) read each code
  // through the vector widening: one and two rows take the kernel reading a column at a time,
  // three and more the blocks of columns (BF16 A on AVX-512 BF16).
  for (Isa isa : testing::available_isas()) {
    testing::IsaGuard guard;
    set_active_isa(isa);
    Fp8WeightOnly w;
    w.codes = Tensor::empty({1, 256}, DType::E4M3);
    w.scale_inv = Tensor::from_floats({1}, {1.0f});
    uint8_t* codes = static_cast<uint8_t*>(w.codes.raw());
    for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>((i & 0x7f) == 0x7f ? 0 : i);
    for (int64_t M : {1, 3}) {
      for (int i = 0; i < 256; ++i) {
        if ((i & 0x7f) == 0x7f) continue;
        for (DType dtype : {DType::F32, DType::BF16}) {
          std::vector<float> one_hot(static_cast<size_t>(M * 256), 0.0f);
          for (int64_t m = 0; m < M; ++m) one_hot[static_cast<size_t>(m * 256 + i)] = 1.0f;
          Tensor a = Tensor::from_floats({M, 256}, one_hot).to(dtype);
          Tensor c = Tensor::empty({M, 1}, DType::F32);
          gemm(a, w, c);
          for (int64_t m = 0; m < M; ++m) {
            ASSERT_EQ(c.data<float>()[m], fp8_to_float(static_cast<uint8_t>(i), DType::E4M3))
                << isa_name(isa) << " " << dtype_name(dtype) << " M " << M << " code " << i;
          }
        }
      }
    }
  }
}

std::vector<float> absolute(std::vector<float> values) {
  for (float& v : values) v = std::fabs(v);
  return values;
}

// The few-rows kernels (every instruction set, 1 to 40 rows) and the many-rows path (300 rows)
// against the reference product of the dequantized weight.
void gemm_equals_the_dequantized_product(const Fp8WeightOnly& q, const Tensor& deq,
                                         const Tensor& bias, const char* what) {
  const int64_t K = deq.dim(1), N = deq.dim(0);
  for (Isa isa : testing::available_isas()) {
    testing::IsaGuard guard;
    set_active_isa(isa);
    for (int64_t M : {1, 3, 8, 9, 20, 40, 300}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        for (bool epilogue_on : {false, true}) {
          Epilogue epilogue;
          if (epilogue_on) {
            epilogue.bias = &bias;
            epilogue.activation = Activation::GeluTanh;
          }
          Tensor a = random_tensor({M, K}, 1.0f, 3 + static_cast<uint32_t>(M), dtype);
          Tensor c = Tensor::empty({M, N}, dtype);
          gemm(a, q, c, epilogue);
          Tensor expected = Tensor::empty({M, N}, DType::F32);
          gemm_reference(a, deq, expected, false, true, 1.0f, 0.0f, epilogue);
          // Within FP32 sums of the exact products (2 (K + 2) u sum |a| |w|, u = 2^-24); BF16
          // adds the weight widened to BF16 past the kernels' rows and C's rounding (2^-8 of
          // the same sum, 2^-9 of C); GELU's slope is under 1.2.
          Tensor sum_abs = Tensor::empty({M, N}, DType::F32);
          gemm_reference(Tensor::from_floats({M, K}, absolute(a.to_floats())),
                         Tensor::from_floats({N, K}, absolute(deq.to_floats())), sum_abs, false,
                         true);
          const std::vector<float> got = c.to_floats(), want = expected.to_floats(),
                                   bound = sum_abs.to_floats();
          for (size_t i = 0; i < got.size(); ++i) {
            const double tolerance = dtype == DType::F32
                                         ? 1.2 * 2.0 * (K + 2) * std::ldexp(1.0, -24) * bound[i] +
                                               1e-6 * std::fabs(want[i])
                                         : 1.2 * std::ldexp(1.0, -8) * bound[i] +
                                               std::ldexp(1.0, -8) * std::fabs(want[i]);
            ASSERT_NEAR(got[i], want[i], tolerance)
                << what << " " << isa_name(isa) << " M " << M << " " << dtype_name(dtype)
                << " epilogue " << epilogue_on << " element " << i;
          }
        }
      }
    }
  }
}

TEST(Fp8WeightOnly, GemmEqualsTheDequantizedProduct) {
  for (Fp8WeightScaling scaling : {Fp8WeightScaling::PerChannel, Fp8WeightScaling::Block128}) {
    const bool blocks = scaling == Fp8WeightScaling::Block128;
    // K not a multiple of any vector width; under blocks 2 x 3 of them, the last ones partial.
    const int64_t N = blocks ? 150 : 37, K = blocks ? 300 : 70;
    Tensor w = blocks ? block_varied_weight(N, K, 1) : random_tensor({N, K}, 0.05f, 1);
    Tensor bias = random_tensor({N}, 0.1f, 2);
    Fp8WeightOnly q = quantize_weight_fp8(w, scaling);
    const Tensor deq = dequantize_weight_fp8(q, DType::F32);
    gemm_equals_the_dequantized_product(q, deq, bias, fp8_weight_scaling_name(scaling));
  }
}

// Zero and subnormal codes (zero exponent) cannot be widened by shift and mask: a load of 64
// codes holding one takes the table lookup. Such codes at chosen places of otherwise normal
// rows (the first and last code, both halves of a 64-code load, the tail past K's last
// multiple of 64): a column of ones in A reads each exactly, and a random A's product is
// within FP32 summation error of the dequantized one; through the column kernel (1 and 2
// rows), the blocks (3 and 5 rows, 6 columns: a block of 4 and 2 single columns) and passes
// of 8 rows (9).
TEST(Fp8WeightOnly, QuantizesEach128BlockToTheE4M3Table) {
  const int64_t N = 130, K = 260;  // 2 x 3 blocks, the last row and column of blocks partial
  const Tensor weight = block_varied_weight(N, K, 7, /*zero block*/ 1, 2);
  Fp8WeightOnly q = quantize_weight_fp8(weight, Fp8WeightScaling::Block128);
  ASSERT_EQ(q.scaling, Fp8WeightScaling::Block128);
  ASSERT_EQ(q.scale_inv.shape(), (Shape{2, 3}));
  EXPECT_EQ(q.nbytes(), static_cast<size_t>(N * K + 6 * 4));
  const std::vector<float> w = weight.to_floats();
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes.raw());
  const float* scale_inv = q.scale_inv.data<float>();
  const Tensor back = dequantize_weight_fp8(q, DType::F32);
  for (int64_t bn = 0; bn < 2; ++bn) {
    for (int64_t bk = 0; bk < 3; ++bk) {
      float amax = 0.0f;
      for (int64_t n = bn * 128; n < std::min(N, bn * 128 + 128); ++n) {
        for (int64_t k = bk * 128; k < std::min(K, bk * 128 + 128); ++k)
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(n * K + k)]));
      }
      const float scale = amax > 0.0f ? 448.0f / amax : 1.0f;
      ASSERT_EQ(scale_inv[bn * 3 + bk], 1.0f / scale) << bn << "," << bk;
      for (int64_t n = bn * 128; n < std::min(N, bn * 128 + 128); ++n) {
        for (int64_t k = bk * 128; k < std::min(K, bk * 128 + 128); ++k) {
          const uint8_t code = float_to_fp8(w[static_cast<size_t>(n * K + k)] * scale, DType::E4M3,
                                            /*saturate=*/true);
          ASSERT_EQ(codes[n * K + k], code) << n << "," << k;
          ASSERT_EQ(back.data<float>()[n * K + k], fp8_to_float(code, DType::E4M3) * (1.0f / scale))
              << n << "," << k;
        }
      }
    }
  }
  EXPECT_EQ(scale_inv[1 * 3 + 2], 1.0f);  // the all-zero block
  // Each non-zero block's largest magnitude lands on the format's largest code (448).
  for (int64_t bn = 0; bn < 2; ++bn) {
    for (int64_t bk = 0; bk < 3; ++bk) {
      int top = 0;
      for (int64_t n = bn * 128; n < std::min(N, bn * 128 + 128); ++n) {
        for (int64_t k = bk * 128; k < std::min(K, bk * 128 + 128); ++k)
          top = std::max(top, codes[n * K + k] & 0x7f);
      }
      EXPECT_EQ(top, bn == 1 && bk == 2 ? 0 : 0x7e) << bn << "," << bk;
    }
  }
  std::vector<float> bad = w;
  bad[static_cast<size_t>(129 * K + 200)] = std::nanf("");
  try {
    quantize_weight_fp8(Tensor::from_floats({N, K}, bad), Fp8WeightScaling::Block128);
    ADD_FAILURE() << "a NaN weight was quantized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight [129, 200] is nan: expected finite values (row "
                                         "129, 128 x 128 block [1, 1])"),
              std::string::npos)
        << e.what();
  }
}

// One-hot rows of A read single weights through every kernel: C[m, n] must be the dequantized
// W[n, k] exactly, on both sides of every block boundary (rows 127 | 128 and 255 | 256,
// columns 127 | 128 and 255 | 256, the partial last blocks), for 1 to 9 rows of A (the column
// kernel, the two-column one, passes of 8 rows) in F32 and BF16, on every instruction set.
TEST(Fp8WeightOnly, BlockScalesTakeEachWeightsOwnBlock) {
  const int64_t N = 300, K = 300;
  Fp8WeightOnly q = quantize_weight_fp8(block_varied_weight(N, K, 8), Fp8WeightScaling::Block128);
  const Tensor deq = dequantize_weight_fp8(q, DType::F32);
  const float* d = deq.data<float>();
  const std::vector<int64_t> ks = {0, 127, 128, 255, 256, 290, 299};
  for (Isa isa : testing::available_isas()) {
    testing::IsaGuard guard;
    set_active_isa(isa);
    for (int64_t M : {1, 2, 3, 5, 9}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        for (int64_t k : ks) {
          std::vector<float> one_hot(static_cast<size_t>(M * K), 0.0f);
          for (int64_t m = 0; m < M; ++m) one_hot[static_cast<size_t>(m * K + k)] = 1.0f;
          Tensor c = Tensor::empty({M, N}, DType::F32);
          gemm(Tensor::from_floats({M, K}, one_hot).to(dtype), q, c);
          // (Past 8 rows the scalar path widens the weight to BF16 for a BF16 A: W rounded.)
          const bool rounded = isa == Isa::Scalar && dtype == DType::BF16 && M > 8;
          for (int64_t m = 0; m < M; ++m) {
            for (int64_t n = 0; n < N; ++n) {
              const float want =
                  rounded ? bf16_to_float(float_to_bf16(d[n * K + k])) : d[n * K + k];
              ASSERT_EQ(c.data<float>()[m * N + n], want)
                  << isa_name(isa) << " " << dtype_name(dtype) << " M " << M << " row " << m
                  << " column " << n << " k " << k;
            }
          }
        }
      }
    }
  }
}

// E4M3's exponent absorbs most outliers under one scale per row (a value 2000x the row's
// others leaves them normal numbers). An input channel whose weights are 10^5 times the
// others' in every row (here column 5, and K = 2048: 16 blocks along K) is past it: one scale
// per row puts every other weight of every row among E4M3's few subnormal steps, one per
// 128 x 128 block only those of the first 128 columns. Measured on the product's part from
// the other columns, against the exact product of the unquantized weight.
TEST(Fp8WeightOnly, BlockScalingConfinesAnOutlierChannelToItsBlocks) {
  const int64_t N = 256, K = 2048, M = 4, outlier_column = 5;
  const float outlier = 1000.0f;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> w(static_cast<size_t>(N * K));
  for (float& v : w) v = normal(rng);
  for (int64_t n = 0; n < N; ++n) w[static_cast<size_t>(n * K + outlier_column)] = outlier;
  const Tensor weight = Tensor::from_floats({N, K}, w);
  std::vector<float> av = random_tensor({M, K}, 1.0f, 10, DType::BF16).to_floats();
  for (int64_t m = 0; m < M; ++m) av[static_cast<size_t>(m * K + outlier_column)] = 0.0f;
  const Tensor a = Tensor::from_floats({M, K}, av).to(DType::BF16);
  double rms[2] = {0, 0};
  for (int s = 0; s < 2; ++s) {
    const Fp8WeightScaling scaling =
        s == 0 ? Fp8WeightScaling::PerChannel : Fp8WeightScaling::Block128;
    Tensor c = Tensor::empty({M, N}, DType::F32);
    gemm(a, quantize_weight_fp8(weight, scaling), c);
    double err = 0, norm = 0;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0;
        for (int64_t k = 0; k < K; ++k) {
          exact += static_cast<double>(av[static_cast<size_t>(m * K + k)]) *
                   w[static_cast<size_t>(n * K + k)];
        }
        const double got = c.data<float>()[m * N + n];
        err += (got - exact) * (got - exact);
        norm += exact * exact;
      }
    }
    rms[s] = std::sqrt(err / norm);
  }
  std::printf("relative RMS error of the product: per-channel %.4f, 128 x 128 blocks %.4f\n",
              rms[0], rms[1]);
  // Measured: 0.121 and 0.039 (E4M3's own rounding gives ~0.03 on this product).
  EXPECT_GT(rms[0], 0.08);
  EXPECT_LT(rms[1], 0.05);
  EXPECT_LT(rms[1], rms[0] / 2.5);
}

TEST(Fp8WeightOnly, RefusesScalesOfTheWrongShape) {
  Fp8WeightOnly q =
      quantize_weight_fp8(random_tensor({200, 300}, 0.05f, 11), Fp8WeightScaling::Block128);
  q.scale_inv = Tensor::zeros({200}, DType::F32);  // per-channel scales under Block128
  Tensor a = random_tensor({1, 300}, 1.0f, 12, DType::BF16);
  Tensor c = Tensor::empty({1, 200}, DType::F32);
  try {
    gemm(a, q, c);
    ADD_FAILURE() << "gemm took per-channel scales as block scales";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("B's scales (block128) expected [2,3] f32 for codes "
                                         "[200,300], got [200] f32"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(dequantize_weight_fp8(q, DType::F32), Error);
  EXPECT_EQ(parse_fp8_weight_scaling("block128"), Fp8WeightScaling::Block128);
  EXPECT_EQ(parse_fp8_weight_scaling("channel"), Fp8WeightScaling::PerChannel);
  EXPECT_THROW(parse_fp8_weight_scaling("block64"), Error);
}

TEST(Fp8WeightOnly, ZeroExponentCodesWidenExactly) {
  const int64_t N = 6, K = 2100;  // a tail of 52 codes
  std::vector<float> w(static_cast<size_t>(N * K));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(0.5f, 1.0f);
  for (float& v : w) v = (rng() % 2 ? 1.0f : -1.0f) * uniform(rng);          // all normal codes
  for (int64_t n = 0; n < N; ++n) w[static_cast<size_t>(n * K + 7)] = 1.0f;  // scale 448
  const std::vector<std::pair<int64_t, int64_t>> irregular = {
      {0, 0}, {0, 2099}, {1, 31}, {1, 32}, {2, 2048 + 5}, {4, 1000}, {5, 64 * 32 - 1}};
  for (size_t i = 0; i < irregular.size(); ++i) {
    const auto [n, k] = irregular[i];
    // Zero, or -3 * 2^-9 once scaled: the subnormal code with m = 3.
    w[static_cast<size_t>(n * K + k)] = i % 2 ? 0.0f : -3.0f / 512.0f / 448.0f;
  }
  Fp8WeightOnly q = quantize_weight_fp8(Tensor::from_floats({N, K}, w));
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes.raw());
  int64_t zero_exponent_codes = 0;
  for (int64_t i = 0; i < N * K; ++i) zero_exponent_codes += (codes[i] & 0x78) == 0;
  EXPECT_EQ(zero_exponent_codes, 7);  // exactly the chosen codes
  EXPECT_EQ(codes[0], 0x83);          // -3 * 2^-9
  EXPECT_EQ(codes[K + 32], 0x00);
  const Tensor deq = dequantize_weight_fp8(q, DType::F32);
  const float* d = deq.data<float>();
  for (int64_t M : {1, 2, 3, 5, 9}) {
    // Column k of A ones, the rest zeros: C[m, n] is W[n, k] exactly.
    for (const auto& [n_irregular, k] : irregular) {
      std::vector<float> ones(static_cast<size_t>(M * K), 0.0f);
      for (int64_t m = 0; m < M; ++m) ones[static_cast<size_t>(m * K + k)] = 1.0f;
      Tensor c = Tensor::empty({M, N}, DType::F32);
      gemm(Tensor::from_floats({M, K}, ones).to(DType::BF16), q, c);
      // (OCTET_ISA=scalar: past 8 rows the weight is widened to BF16 for the BF16 GEMM.)
      const bool rounded = active_isa() == Isa::Scalar && M > 8;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          ASSERT_EQ(c.data<float>()[m * N + n],
                    rounded ? bf16_to_float(float_to_bf16(d[n * K + k])) : d[n * K + k])
              << "M " << M << " row " << m << " column " << n << " k " << k;
        }
      }
    }
    Tensor a = random_tensor({M, K}, 1.0f, 40 + static_cast<uint32_t>(M), DType::BF16);
    Tensor c = Tensor::empty({M, N}, DType::F32);
    gemm(a, q, c);
    Tensor expected = Tensor::empty({M, N}, DType::F32);
    gemm_reference(a, deq, expected, false, true);
    const std::vector<float> got = c.to_floats(), want = expected.to_floats();
    // FP32 sums in any order: within 2 (K + 2) u sum |a| |w| of the FP64 reference.
    std::vector<float> abs_a = a.to_floats(), abs_w = deq.to_floats();
    for (float& v : abs_a) v = std::fabs(v);
    for (float& v : abs_w) v = std::fabs(v);
    Tensor bound = Tensor::empty({M, N}, DType::F32);
    gemm_reference(Tensor::from_floats({M, K}, abs_a), Tensor::from_floats({N, K}, abs_w), bound,
                   false, true);
    const std::vector<float> bounds = bound.to_floats();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 2.0 * (K + 2) * std::ldexp(1.0, -24) * bounds[i])
          << "M " << M << " element " << i;
    }
  }
}

TEST(Fp8WeightOnly, GptWithFp8WeightsStaysCloseToBf16) {
  GPTConfig config = GPTConfig::from_json({{"name", "tiny"},
                                           {"vocab_size", 97},
                                           {"max_seq_len", 48},
                                           {"num_layers", 2},
                                           {"hidden", 64},
                                           {"num_heads", 4},
                                           {"init_std", 0.2}});
  GPT model(config, 11);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 12; ++p) {
    std::vector<int32_t> ids(static_cast<size_t>(4 + p));
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 97);
    prompts.push_back(ids);
  }
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  auto run = [&] {
    EngineOptions options;
    options.block_size = 8;
    options.num_blocks = 128;
    options.dtype = DType::BF16;
    Engine engine(model, options);
    return generate_batch(engine, prompts, 12, greedy);
  };
  Tensor ids = Tensor::empty({1, 10}, DType::I32);
  std::copy(prompts[6].begin(), prompts[6].end(), ids.data<int32_t>());
  const std::vector<float> bf16_logits = model.last_logits(ids, DType::BF16).to_floats();
  const std::vector<std::vector<int32_t>> bf16 = run();
  for (Fp8WeightScaling scaling : {Fp8WeightScaling::PerChannel, Fp8WeightScaling::Block128}) {
    const size_t fp8_bytes = model.set_inference_fp8_weights(true, scaling);
    EXPECT_EQ(model.inference_fp8_scaling(), scaling);
    EXPECT_LT(fp8_bytes, model.inference_weight_bytes(DType::BF16) + 1);
    const std::vector<float> fp8_logits = model.last_logits(ids, DType::BF16).to_floats();
    const std::vector<std::vector<int32_t>> fp8 = run();
    // Logits: E4M3 keeps 3 mantissa bits, ~3% RMS relative rounding per weight; through the
    // six GEMMs of this random model (large weights: std 0.2) that gives ~7% RMS on the logits.
    double err = 0, norm = 0;
    for (size_t i = 0; i < fp8_logits.size(); ++i) {
      err += (fp8_logits[i] - bf16_logits[i]) * (fp8_logits[i] - bf16_logits[i]);
      norm += bf16_logits[i] * bf16_logits[i];
    }
    const double relative = std::sqrt(err / norm);
    EXPECT_LT(relative, 0.1) << "relative RMS logit error, " << fp8_weight_scaling_name(scaling);
    size_t agree = 0, total = 0;
    for (size_t p = 0; p < prompts.size(); ++p) {
      for (size_t t = 0; t < bf16[p].size(); ++t) {
        if (fp8[p][t] != bf16[p][t]) break;  // after a divergence the texts differ anyway
        ++agree;
      }
      total += bf16[p].size();
    }
    std::printf(
        "fp8 weights (%s): relative RMS logit error %.4f, greedy tokens agreeing before the "
        "first divergence %zu/%zu\n",
        fp8_weight_scaling_name(scaling), relative, agree, total);
    EXPECT_GE(agree * 2, total);
    Tensor targets = Tensor::zeros({1, 10}, DType::I32);
    EXPECT_THROW(model.train_step(ids, targets, DType::BF16, 1.0f), Error);  // inference only
    model.set_inference_fp8_weights(false);
    EXPECT_EQ(model.last_logits(ids, DType::BF16).to_floats(), bf16_logits);
  }
}

TEST(Fp8KvCache, StaysCloseToBf16AndLeaksNothing) {
  // The same greedy requests with a BF16 and an E4M3 KV cache (per-(token, head) scales):
  // most greedy tokens agree until a near-tie flips (this random model has small margins), the
  // cache takes about half the bytes, and every block comes back.
  GPTConfig config = GPTConfig::from_json({{"name", "tiny"},
                                           {"vocab_size", 97},
                                           {"max_seq_len", 64},
                                           {"num_layers", 2},
                                           {"hidden", 64},
                                           {"num_heads", 4},
                                           {"init_std", 0.2}});
  GPT model(config, 13);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 10; ++p) {
    std::vector<int32_t> ids(static_cast<size_t>(3 + 3 * p));
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 97);
    prompts.push_back(ids);
  }
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  std::vector<std::vector<int32_t>> outputs[2];
  size_t bytes_per_token[2] = {0, 0};
  for (int fp8 = 0; fp8 < 2; ++fp8) {
    EngineOptions options;
    options.block_size = 4;
    options.num_blocks = 200;
    options.max_num_batched_tokens = 16;  // chunked prefill: FP8 pages read back by later chunks
    options.dtype = DType::BF16;
    options.fp8_kv = fp8 == 1;
    Engine engine(model, options);
    outputs[fp8] = generate_batch(engine, prompts, 10, greedy);
    EXPECT_EQ(engine.stats().blocks_in_use, 0);
    bytes_per_token[fp8] = engine.stats().kv_bytes_per_token;
  }
  EXPECT_EQ(bytes_per_token[0], 2u * 2 * 4 * 16 * 2);    // BF16: 2 layers x K,V x 4 heads x 16
  EXPECT_EQ(bytes_per_token[1], 2u * 2 * 4 * (16 + 4));  // E4M3 codes + an F32 scale per head
  size_t agree = 0, total = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (size_t t = 0; t < outputs[0][p].size() && outputs[1][p][t] == outputs[0][p][t]; ++t)
      ++agree;
    total += outputs[0][p].size();
  }
  std::printf("fp8 KV cache: greedy tokens agreeing before the first divergence %zu/%zu\n", agree,
              total);
  EXPECT_GE(agree * 2, total);
}

}  // namespace
}  // namespace octet
