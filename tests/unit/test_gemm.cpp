// GEMM against gemm_reference (FP64 accumulation over the same, already rounded inputs).
//
// Tolerance: with FP32 accumulation, any summation order satisfies
//   |C - C_exact| <= gamma_K * sum_k |a_ik| |b_kj|,  gamma_K = K u / (1 - K u), u = 2^-24,
// and products of BF16 (or FP8 widened to BF16) operands are exact in FP32; F32 products add
// one more rounding (K+1). We assert 2 * (K + 2) * u * sum|a||b| (+ a BF16 output's own
// rounding, 2^-8 |C|), a bound a wrong transpose, scale or epilogue order breaks by orders of
// magnitude while no correct kernel can. Epilogues add terms of their own magnitude.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gemm/matmul.h"
#include "gemm/packed_weight.h"
#include "gemm/small_m.h"
#include "octet/gemm.h"
#include "octet/recipe.h"
#include "test_util.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

constexpr double kUnitRoundoff = 1.0 / (1 << 24);

Tensor random_tensor(const Shape& shape, uint32_t seed, float spread = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = normal(rng);
  return Tensor::from_floats(shape, values);
}

// Rows scaled by 2^-3 .. 2^3 so that block scales differ from block to block.
Tensor ranged_tensor(const Shape& shape, uint32_t seed) {
  Tensor t = random_tensor(shape, seed);
  const int64_t cols = t.cols();
  float* v = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    v[i] = std::ldexp(v[i], static_cast<int>((i / cols) % 7) - 3 + static_cast<int>(i % 5));
  }
  return t;
}

Tensor abs_of(const Tensor& t) {
  std::vector<float> values = t.to_floats();
  for (float& v : values) v = std::fabs(v);
  return Tensor::from_floats(t.shape(), values);
}

// sum_k |a_ik||b_kj| over the operands as given.
Tensor magnitude(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t m,
                 int64_t n) {
  Tensor out = Tensor::zeros({m, n}, DType::F32);
  gemm_reference(abs_of(a), abs_of(b), out, trans_a, trans_b);
  return out;
}

// |got - expected| <= bound_scale * bound + rel * |expected| + abs, elementwise.
void expect_close(const Tensor& got, const Tensor& expected, const Tensor& bound,
                  double bound_scale, double rel, double abs, const std::string& context) {
  const std::vector<float> g = got.to_floats();
  const std::vector<float> e = expected.to_floats();
  const std::vector<float> b = bound.to_floats();
  ASSERT_EQ(g.size(), e.size()) << context;
  int failures = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double tolerance = bound_scale * b[i] + rel * std::fabs(static_cast<double>(e[i])) + abs;
    const double error = std::fabs(static_cast<double>(g[i]) - e[i]);
    if (!(error <= tolerance) && failures++ < 5) {
      ADD_FAILURE() << context << ": element " << i << " got " << g[i] << " expected " << e[i]
                    << " (error " << error << " > tolerance " << tolerance << ")";
    }
  }
  EXPECT_EQ(failures, 0) << context;
}

Shape a_shape(int64_t m, int64_t k, bool trans_a) {
  return trans_a ? Shape{k, m} : Shape{m, k};
}
Shape b_shape(int64_t k, int64_t n, bool trans_b) {
  return trans_b ? Shape{n, k} : Shape{k, n};
}

enum class Kind { F32, BF16ToF32, BF16ToBF16 };
const char* kind_name(Kind kind) {
  return kind == Kind::F32 ? "f32" : kind == Kind::BF16ToF32 ? "bf16->f32" : "bf16->bf16";
}

// One GEMM of the given kind and shape, checked against the reference.
void check_plain_gemm(Kind kind, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b,
                      uint32_t seed) {
  const DType in = kind == Kind::F32 ? DType::F32 : DType::BF16;
  const DType out = kind == Kind::BF16ToBF16 ? DType::BF16 : DType::F32;
  const Tensor a = random_tensor(a_shape(m, k, trans_a), seed).to(in);
  const Tensor b = random_tensor(b_shape(k, n, trans_b), seed + 1).to(in);
  Tensor c = Tensor::empty({m, n}, out);
  gemm(a, b, c, trans_a, trans_b);
  Tensor expected = Tensor::empty({m, n}, DType::F32);
  gemm_reference(a, b, expected, trans_a, trans_b);
  const double products = kind == Kind::F32 ? 1.0 : 0.0;
  const std::string context = std::string(kind_name(kind)) + " " + std::to_string(m) + "x" +
                              std::to_string(n) + "x" + std::to_string(k) + (trans_a ? " tA" : "") +
                              (trans_b ? " tB" : "");
  expect_close(c, expected, magnitude(a, b, trans_a, trans_b, m, n),
               2.0 * (static_cast<double>(k) + 2.0 + products) * kUnitRoundoff,
               out == DType::BF16 ? 1.0 / 256 : 0.0, 0.0, context);
}

class GemmShapes : public ::testing::TestWithParam<std::tuple<Kind, bool, bool>> {};

TEST_P(GemmShapes, OddShapesMatchReference) {
  const auto [kind, trans_a, trans_b] = GetParam();
  const int64_t sizes[] = {1, 7, 33, 129};
  uint32_t seed = 1;
  for (int64_t m : sizes) {
    for (int64_t n : sizes) {
      for (int64_t k : sizes) check_plain_gemm(kind, m, n, k, trans_a, trans_b, seed += 2);
    }
  }
}

TEST_P(GemmShapes, LargeShapeMatchesReference) {
  const auto [kind, trans_a, trans_b] = GetParam();
  check_plain_gemm(kind, 512, 384, 1024, trans_a, trans_b, 7);
}

INSTANTIATE_TEST_SUITE_P(AllKindsAndTransposes, GemmShapes,
                         ::testing::Combine(::testing::Values(Kind::F32, Kind::BF16ToF32,
                                                              Kind::BF16ToBF16),
                                            ::testing::Bool(), ::testing::Bool()));

// ---- epilogues ------------------------------------------------------------------------------

struct EpilogueCase {
  float alpha;
  float beta;
  DType bias_dtype;  // U8 = no bias
  Activation activation;
};

void check_epilogue(DType in, DType out, const EpilogueCase& e, const std::string& context,
                    int64_t m = 33, bool packed = false) {
  const int64_t n = 65, k = 129;
  const Tensor a = random_tensor({m, k}, 11).to(in);
  const Tensor b = random_tensor({n, k}, 12).to(in);
  const Tensor c_old = random_tensor({m, n}, 13).to(out);
  Tensor bias;
  Epilogue epilogue;
  epilogue.activation = e.activation;
  if (e.bias_dtype != DType::U8) {
    bias = random_tensor({n}, 14).to(e.bias_dtype);
    epilogue.bias = &bias;
  }
  Tensor c = c_old.clone();
  if (packed) {
    PackedWeight w(b, /*trans=*/true);
    gemm(a, w, c, false, e.alpha, e.beta, epilogue);
  } else {
    gemm(a, b, c, false, true, e.alpha, e.beta, epilogue);
  }
  Tensor expected = c_old.to(DType::F32);
  gemm_reference(a, b, expected, false, true, e.alpha, e.beta, epilogue);

  // Magnitude of every term before the activation (GELU's slope is below 1.13).
  Tensor bound = magnitude(a, b, false, true, m, n);
  std::vector<float> values = bound.to_floats();
  const std::vector<float> old = c_old.to_floats();
  const std::vector<float> bias_values =
      bias.defined() ? bias.to_floats() : std::vector<float>(static_cast<size_t>(n), 0.0f);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = std::fabs(e.alpha) * values[i] + std::fabs(e.beta * old[i]) +
                std::fabs(bias_values[i % static_cast<size_t>(n)]);
  }
  bound = Tensor::from_floats({m, n}, values);
  // 1e-6 relative and 1e-6 absolute cover oneDNN's GELU approximations (a few ulps).
  expect_close(c, expected, bound, 2.5 * (k + 6) * kUnitRoundoff,
               out == DType::BF16 ? 1.0 / 256 : 1e-6, 1e-6, context);
}

TEST(GemmEpilogue, AllCombinationsMatchReference) {
  const float alphas[] = {1.0f, 0.5f};
  const float betas[] = {0.0f, 1.0f, 0.75f};
  const DType biases[] = {DType::U8, DType::F32, DType::BF16};
  const Activation activations[] = {Activation::None, Activation::GeluTanh, Activation::GeluErf,
                                    Activation::Relu};
  const std::pair<DType, DType> kinds[] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::F32}, {DType::BF16, DType::BF16}};
  for (auto [in, out] : kinds) {
    for (float alpha : alphas) {
      for (float beta : betas) {
        for (DType bias : biases) {
          for (Activation activation : activations) {
            const std::string context =
                std::string(dtype_name(in)) + "->" + std::string(dtype_name(out)) +
                " alpha=" + std::to_string(alpha) + " beta=" + std::to_string(beta) +
                " bias=" + (bias == DType::U8 ? "none" : std::string(dtype_name(bias))) +
                " act=" + std::to_string(static_cast<int>(activation));
            check_epilogue(in, out, {alpha, beta, bias, activation}, context);
          }
        }
      }
    }
  }
}

// One to eight rows of BF16 take the weight-streaming kernel (gemm/small_m.h) where the
// processor has AVX-512 BF16: every epilogue, plain and packed weights, K with a tail of 1,
// N with a remainder past the blocks of 4 columns.
TEST(GemmSmallRows, EveryEpilogueMatchesReference) {
  for (int64_t m : {1, 2, 8}) {
    for (bool packed : {false, true}) {
      for (DType out : {DType::F32, DType::BF16}) {
        for (float beta : {0.0f, 0.75f}) {
          for (Activation activation : {Activation::None, Activation::GeluTanh}) {
            const std::string context = "m=" + std::to_string(m) + (packed ? " packed" : "") +
                                        " ->" + std::string(dtype_name(out)) +
                                        " beta=" + std::to_string(beta) +
                                        " act=" + std::to_string(static_cast<int>(activation));
            check_epilogue(DType::BF16, out, {0.5f, beta, DType::BF16, activation}, context, m,
                           packed);
          }
        }
      }
    }
  }
}

// The kernel's column blocks: 8 at a time up to 2 rows (4 up to 4 rows, 2 past), then 4, then
// one by one; N = 77 leaves 4 + 1 after the eights, and N = 333 at K = 1000 is split between the
// threads (166 and 167 columns: 4 + 2 and 4 + 3 after the eights). Up to 8 rows take the kernel
// by default where it runs.
TEST(GemmSmallRows, ColumnBlocksOfEightFourAndOne) {
  for (int64_t m : {1, 2, 3, 5, 8}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{77, 96}, {333, 1000}}) {
      Tensor a = random_tensor({m, k}, 41, 1.0f).to(DType::BF16);
      Tensor b = random_tensor({n, k}, 42, 1.0f).to(DType::BF16);
      Tensor c = Tensor::empty({m, n}, DType::F32);
      gemm(a, b, c, false, true);
      Tensor expected = Tensor::empty({m, n}, DType::F32);
      gemm_reference(a, b, expected, false, true);
      expect_close(c, expected, magnitude(a, b, false, true, m, n),
                   2.0 * (static_cast<double>(k) + 2.0) * kUnitRoundoff, 0.0, 0.0,
                   "m=" + std::to_string(m) + " n=" + std::to_string(n));
    }
  }
}

// Large and tiny magnitudes and a long K through the kernel. VDPBF16PS (here as in oneDNN's
// BF16 kernels) flushes subnormal products and sums to zero: at most FLT_MIN per term.
TEST(GemmSmallRows, LargeAndTinyMagnitudes) {
  for (float scale : {1e-18f, 1.0f, 1e18f}) {
    for (int64_t k : {32, 3000}) {
      const int64_t n = 67;
      Tensor a = random_tensor({1, k}, 31, scale).to(DType::BF16);
      Tensor b = random_tensor({n, k}, 32, scale).to(DType::BF16);
      Tensor c = Tensor::empty({1, n}, DType::F32);
      gemm(a, b, c, false, true);
      Tensor expected = Tensor::empty({1, n}, DType::F32);
      gemm_reference(a, b, expected, false, true);
      expect_close(c, expected, magnitude(a, b, false, true, 1, n),
                   2.0 * (static_cast<double>(k) + 2.0) * kUnitRoundoff, 0.0,
                   static_cast<double>(k) * std::numeric_limits<float>::min(),
                   "scale " + std::to_string(scale) + " k=" + std::to_string(k));
    }
  }
}

// The pair-blocked kernel on oneDNN's layout BA16a{W}b2a, packed here by hand from the layout's
// definition (column n, K index k of [K, N] at block n / W, then K pairs: offset
// (n / W) * Kp * W + (k / 2) * 2W + (n % W) * 2 + k % 2, Kp = K rounded up to 32, zero padding):
// every width, odd K, N past the last whole block, 1 to 16 rows (passes of 4).
TEST(GemmSmallRows, PairBlockedLayoutOfEveryWidth) {
  if (!gemm_detail::small_m_avx512()) GTEST_SKIP() << "no AVX-512 BF16";
  for (int64_t width : {16, 32, 48, 64}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{50, 31}, {130, 200}}) {
      const Tensor b = random_tensor({n, k}, 61, 1.0f).to(DType::BF16);  // [N, K]
      const int64_t padded_k = (k + 31) / 32 * 32, blocks = (n + width - 1) / width;
      std::vector<uint16_t> packed(static_cast<size_t>(blocks * padded_k * width), 0);
      const auto* source = static_cast<const uint16_t*>(b.raw());
      for (int64_t col = 0; col < n; ++col) {
        for (int64_t kk = 0; kk < k; ++kk) {
          packed[static_cast<size_t>((col / width) * padded_k * width + (kk / 2) * 2 * width +
                                     (col % width) * 2 + kk % 2)] = source[col * k + kk];
        }
      }
      for (int64_t m : {1, 3, 4, 5, 8, 16}) {
        const Tensor a = random_tensor({m, k}, 62, 1.0f).to(DType::BF16);
        Tensor c = Tensor::empty({m, n}, DType::F32);
        gemm_detail::SmallM p;
        p.a = static_cast<const uint16_t*>(a.raw());
        p.m = m;
        p.n = n;
        p.k = k;
        p.c = c.raw();
        gemm_detail::run_small_m_pairs(p, packed.data(), width);
        Tensor expected = Tensor::empty({m, n}, DType::F32);
        gemm_reference(a, b, expected, false, true);
        expect_close(c, expected, magnitude(a, b, false, true, m, n),
                     2.0 * (static_cast<double>(k) + 2.0) * kUnitRoundoff, 0.0, 0.0,
                     "width=" + std::to_string(width) + " m=" + std::to_string(m) +
                         " n=" + std::to_string(n));
      }
    }
  }
}

// A packed BF16 weight: decode's few rows read the copy prefill's oneDNN matmul reads, packed
// once, in either orientation of the source; up to 16 rows there, 17 through oneDNN. On every
// instruction set: below AVX-512 BF16 the AVX2 kernel reads the source (OCTET_ISA lowered on a
// processor that has it must not reach the packed-pairs kernel).
TEST(GemmSmallRows, PackedWeightSharesThePrefillCopy) {
  const int64_t n = 200, k = 96;
  for (Isa isa : testing::available_isas()) {
    testing::IsaGuard guard;
    set_active_isa(isa);
    for (bool trans : {false, true}) {
      const Tensor w = random_tensor(b_shape(k, n, trans), 71).to(DType::BF16);
      PackedWeight packed(w, trans);
      for (int64_t m : {1, 16, 17, 128, 2}) {
        const Tensor a = random_tensor({m, k}, 72).to(DType::BF16);
        Tensor c = Tensor::empty({m, n}, DType::F32);
        gemm(a, packed, c, false);
        Tensor expected = Tensor::empty({m, n}, DType::F32);
        gemm_reference(a, w, expected, false, trans);
        expect_close(
            c, expected, magnitude(a, w, false, trans, m, n),
            2.0 * (static_cast<double>(k) + 2.0) * kUnitRoundoff, 0.0, 0.0,
            std::string(isa_name(isa)) + " m=" + std::to_string(m) + (trans ? " [N,K]" : " [K,N]"));
      }
      if (gemm_detail::small_m_avx512() && gemm_bf16_native()) {
        int64_t width = 0;
        EXPECT_NE(PackedWeightAccess::state(packed).pair_blocked(width).get_data_handle(), nullptr);
        EXPECT_GT(width, 0);
      }
      EXPECT_EQ(PackedWeightAccess::pack_count(packed), 1) << isa_name(isa);
      EXPECT_EQ(PackedWeightAccess::packed_layouts(packed), 1u) << isa_name(isa);
    }
  }
}

// The order act(alpha * AB + beta * C + bias), checked on exact small integers: the bias is
// not scaled by alpha, C is scaled by beta only, the activation comes last.
TEST(GemmEpilogue, OrderIsAlphaThenSumThenBiasThenActivation) {
  const Tensor a = Tensor::from_floats({1, 2}, {1.0f, 2.0f});
  const Tensor b = Tensor::from_floats({2, 2}, {3.0f, -4.0f, 1.0f, 1.0f});  // AB = [5, -2]
  const Tensor bias = Tensor::from_floats({2}, {10.0f, 1.0f});
  Tensor c = Tensor::from_floats({1, 2}, {100.0f, 2.0f});
  Epilogue epilogue{&bias, Activation::Relu};
  gemm(a, b, c, false, false, 2.0f, 0.5f, epilogue);
  // [2*5 + 0.5*100 + 10, relu(2*-2 + 0.5*2 + 1)] = [70, relu(-2)] = [70, 0]
  EXPECT_EQ(c.to_floats(), (std::vector<float>{70.0f, 0.0f}));
  c = Tensor::from_floats({1, 2}, {100.0f, 2.0f});
  epilogue.activation = Activation::None;
  gemm(a, b, c, false, false, 2.0f, 0.5f, epilogue);
  EXPECT_EQ(c.to_floats(), (std::vector<float>{70.0f, -2.0f}));
}

TEST(GemmEpilogue, AccumulateTwiceEqualsTwice) {
  const Tensor a = random_tensor({33, 129}, 21).to(DType::BF16);
  const Tensor b = random_tensor({129, 7}, 22).to(DType::BF16);
  Tensor once = Tensor::empty({33, 7}, DType::F32);
  gemm(a, b, once, false, false);
  Tensor twice = Tensor::zeros({33, 7}, DType::F32);
  gemm(a, b, twice, false, false, 1.0f, 1.0f);
  gemm(a, b, twice, false, false, 1.0f, 1.0f);
  const std::vector<float> x = once.to_floats();
  const std::vector<float> y = twice.to_floats();
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], 2.0f * x[i]) << i;  // x + x is exact
}

TEST(Gemm, PrimitivesAreCachedPerShape) {
  const Tensor a = random_tensor({17, 19}, 25);
  const Tensor b = random_tensor({19, 23}, 26);
  Tensor c = Tensor::empty({17, 23}, DType::F32);
  gemm(a, b, c, false, false, 0.5f);
  const size_t primitives = gemm_detail::matmul_cache_size();
  gemm(a, b, c, false, false, 0.25f);  // alpha is a runtime argument: same primitive
  gemm(a, b, c, false, false, 0.5f);
  EXPECT_EQ(gemm_detail::matmul_cache_size(), primitives);
  gemm(a, b, c, false, false, 0.5f, 1.0f);  // beta changes the primitive
  EXPECT_EQ(gemm_detail::matmul_cache_size(), primitives + 1);
}

// Every transpose with a scale, a sum and a bias (none, F32, BF16): the weight gradients' form
// (dW += alpha X^T dY). oneDNN 2.6 without AVX-512 has no fast kernel for a scale as a binary
// post-op with a transposed A and a sum, nor for a BF16 bias on an F32 GEMM, and sent them to
// its reference matmul (~100x slower); the scale then goes as its runtime output scale and the
// bias widened. Each must match the reference, and none run there; outside brgemm the scale is
// always the runtime output scale (gemm:jit folds it into alpha).
TEST(GemmEpilogue, ScaledTransposedAccumulationNeverTakesTheReferenceKernel) {
  const int64_t m = 48, n = 40, k = 72;
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (DType bias_dtype : {DType::U8, DType::F32, DType::BF16}) {  // U8: none
        const Tensor a = random_tensor(trans_a ? Shape{k, m} : Shape{m, k}, 31);
        const Tensor b = random_tensor(trans_b ? Shape{n, k} : Shape{k, n}, 32);
        const Tensor c_old = random_tensor({m, n}, 33);
        const Tensor bias =
            random_tensor({n}, 34).to(bias_dtype == DType::BF16 ? DType::BF16 : DType::F32);
        Epilogue epilogue;
        if (bias_dtype != DType::U8) epilogue.bias = &bias;
        Tensor c = c_old.clone();
        gemm(a, b, c, trans_a, trans_b, 0.375f, 1.0f, epilogue);
        const std::string kernel = gemm_detail::last_matmul_kernel();
        EXPECT_FALSE(kernel.starts_with("ref")) << kernel << ": trans_a " << trans_a << " trans_b "
                                                << trans_b << " bias " << dtype_name(bias_dtype);
        // Outside brgemm, alpha goes into the GEMM itself (no pass over C for a binary_mul).
        if (!kernel.starts_with("brg")) {
          EXPECT_TRUE(gemm_detail::last_matmul_scale_in_output_scale())
              << kernel << ": trans_a " << trans_a << " trans_b " << trans_b;
        }
        Tensor expected = c_old.clone();
        gemm_reference(a, b, expected, trans_a, trans_b, 0.375f, 1.0f, epilogue);
        const std::vector<float> got = c.to_floats(), want = expected.to_floats();
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], want[i], 1e-4f * (1.0f + std::fabs(want[i])))
              << "trans_a " << trans_a << " trans_b " << trans_b << " bias "
              << dtype_name(bias_dtype) << " at " << i;
        }
      }
    }
  }
}

TEST(GemmEpilogue, BetaZeroIgnoresNaNInC) {
  const Tensor a = random_tensor({7, 33}, 23);
  const Tensor b = random_tensor({33, 7}, 24);
  Tensor c = Tensor::from_floats({7, 7}, std::vector<float>(49, std::nanf("")));
  gemm(a, b, c, false, false);
  for (float v : c.to_floats()) EXPECT_FALSE(std::isnan(v));
}

// ---- PackedWeight ---------------------------------------------------------------------------

TEST(PackedWeight, EqualsUnpackedAndIsReused) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool trans : {false, true}) {
      const int64_t m = 129, n = 96, k = 200;
      const Tensor a = random_tensor({m, k}, 31).to(dtype);
      const Tensor w = random_tensor(b_shape(k, n, trans), 32).to(dtype);
      PackedWeight packed(w, trans);
      EXPECT_EQ(packed.k(), k);
      EXPECT_EQ(packed.n(), n);
      EXPECT_EQ(packed.trans(), trans);
      Tensor expected = Tensor::empty({m, n}, DType::F32);
      gemm(a, w, expected, false, trans);
      const Tensor bound = magnitude(a, w, false, trans, m, n);
      for (int call = 0; call < 3; ++call) {
        Tensor c = Tensor::empty({m, n}, DType::F32);
        gemm(a, packed, c, false);
        expect_close(c, expected, bound, 4.0 * (k + 3) * kUnitRoundoff, 0.0, 0.0,
                     std::string("packed ") + std::string(dtype_name(dtype)));
      }
      EXPECT_EQ(PackedWeightAccess::pack_count(packed), 1);
      // A transposed A reuses the packed copy when oneDNN picks the same weight layout.
      const Tensor a_t = random_tensor({k, m}, 33).to(dtype);
      Tensor c_t = Tensor::empty({m, n}, DType::F32);
      gemm(a_t, packed, c_t, true);
      Tensor expected_t = Tensor::empty({m, n}, DType::F32);
      gemm_reference(a_t, w, expected_t, true, trans);
      expect_close(c_t, expected_t, magnitude(a_t, w, true, trans, m, n),
                   4.0 * (k + 3) * kUnitRoundoff, 0.0, 0.0, "packed with trans_a");
      EXPECT_EQ(PackedWeightAccess::pack_count(packed),
                static_cast<int64_t>(PackedWeightAccess::packed_layouts(packed)));
    }
  }
}

TEST(PackedWeight, MarkUpdatedPicksUpNewValues) {
  const int64_t m = 33, n = 64, k = 128;
  const Tensor a = random_tensor({m, k}, 41).to(DType::BF16);
  Tensor w = random_tensor({n, k}, 42).to(DType::BF16);
  PackedWeight packed(w, true);
  Tensor c = Tensor::empty({m, n}, DType::F32);
  gemm(a, packed, c, false);
  w.copy_from(random_tensor({n, k}, 43).to(DType::BF16));  // the optimizer step, in place
  Tensor stale = Tensor::empty({m, n}, DType::F32);
  gemm(a, packed, stale, false);
  EXPECT_EQ(stale.to_floats(), c.to_floats()) << "packed copy is reused until mark_updated";
  packed.mark_updated();
  gemm(a, packed, c, false);
  Tensor expected = Tensor::empty({m, n}, DType::F32);
  gemm_reference(a, w, expected, false, true);
  expect_close(c, expected, magnitude(a, w, false, true, m, n), 2.0 * (k + 2) * kUnitRoundoff, 0.0,
               0.0, "after mark_updated");
  EXPECT_EQ(PackedWeightAccess::pack_count(packed), 2);
}

TEST(PackedWeight, EpilogueAndBf16Output) {
  const int64_t m = 7, n = 33, k = 65;
  const Tensor a = random_tensor({m, k}, 51).to(DType::BF16);
  const Tensor w = random_tensor({n, k}, 52).to(DType::BF16);
  const Tensor bias = random_tensor({n}, 53);
  PackedWeight packed(w, true);
  const Epilogue epilogue{&bias, Activation::GeluTanh};
  Tensor c = Tensor::empty({m, n}, DType::BF16);
  gemm(a, packed, c, false, 0.5f, 0.0f, epilogue);
  Tensor expected = Tensor::empty({m, n}, DType::BF16);
  gemm(a, w, expected, false, true, 0.5f, 0.0f, epilogue);
  expect_close(c, expected, Tensor::zeros({m, n}, DType::F32), 0.0, 1.0 / 128, 1e-6,
               "packed epilogue");
}

// ---- FP8 ------------------------------------------------------------------------------------

// The dequantized operand the FP8 GEMM reads: A_eff [M,K] and B_eff [N,K] from the usage that
// has blocks along K (rowwise and columnwise copies of 1x128 / MXFP8 data differ).
Tensor a_effective(const Float8Tensor& a, bool trans_a) {
  return trans_a ? a.dequantize_t() : a.dequantize();
}
Tensor b_effective(const Float8Tensor& b, bool trans_b) {
  return trans_b ? b.dequantize() : b.dequantize_t();
}

void check_fp8_gemm(const Float8Tensor& a, const Float8Tensor& b, bool trans_a, bool trans_b,
                    DType out, const std::string& context, float alpha = 1.0f) {
  const int64_t m = trans_a ? a.cols : a.rows;
  const int64_t k = trans_a ? a.rows : a.cols;
  const int64_t n = trans_b ? b.rows : b.cols;
  Tensor c = Tensor::empty({m, n}, out);
  gemm(a, b, c, trans_a, trans_b, alpha);
  const Tensor a_eff = a_effective(a, trans_a);
  const Tensor b_eff = b_effective(b, trans_b);
  Tensor expected = Tensor::empty({m, n}, DType::F32);
  gemm_reference(a_eff, b_eff, expected, false, true, alpha);
  // Dequantized operands carry one FP32 rounding each (code * non-power-of-two scale).
  expect_close(c, expected, magnitude(a_eff, b_eff, false, true, m, n),
               std::fabs(alpha) * 2.0 * (k + 4) * kUnitRoundoff,
               out == DType::BF16 ? 1.0 / 256 : 2 * kUnitRoundoff, 0.0, context);
}

std::string trans_name(bool trans_a, bool trans_b) {
  return std::string(trans_a ? " tA" : "") + (trans_b ? " tB" : "");
}

TEST(Fp8Gemm, PerTensorEveryTransposeAndFormat) {
  const int64_t m = 65, n = 33, k = 200;
  const std::pair<DType, DType> formats[] = {
      {DType::E4M3, DType::E4M3}, {DType::E4M3, DType::E5M2}, {DType::E5M2, DType::E4M3}};
  for (auto [fa, fb] : formats) {
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) {
        const Tensor x = random_tensor(a_shape(m, k, trans_a), 61);
        const Tensor w = random_tensor(b_shape(k, n, trans_b), 62, 0.05f);
        // Delayed-style fixed scales (not powers of two) and current scaling.
        const Float8Tensor a = Quantizer::fixed(fa, 37.3f).quantize(x, true, true);
        const Float8Tensor b = Quantizer::current(fb).quantize(w, true, false);
        const std::string context = std::string("per-tensor ") + std::string(dtype_name(fa)) + "x" +
                                    std::string(dtype_name(fb)) + trans_name(trans_a, trans_b);
        check_fp8_gemm(a, b, trans_a, trans_b, DType::F32, context, 0.75f);
      }
    }
  }
}

TEST(Fp8Gemm, PerTensorBf16Output) {
  const Tensor x = random_tensor({33, 64}, 63);
  const Tensor w = random_tensor({7, 64}, 64);
  const Float8Tensor a = Quantizer::current(DType::E4M3).quantize(x);
  const Float8Tensor b = Quantizer::current(DType::E4M3).quantize(w);
  check_fp8_gemm(a, b, false, true, DType::BF16, "per-tensor bf16 out");
}

TEST(Fp8Gemm, Mxfp8EveryTranspose) {
  const int64_t m = 33, n = 65, k = 160;
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      const Tensor x = ranged_tensor(a_shape(m, k, trans_a), 71);
      const Tensor w = ranged_tensor(b_shape(k, n, trans_b), 72);
      const Float8Tensor a = Quantizer::mxfp8(DType::E4M3).quantize(x, !trans_a, trans_a);
      const Float8Tensor b = Quantizer::mxfp8(DType::E5M2).quantize(w, trans_b, !trans_b);
      check_fp8_gemm(a, b, trans_a, trans_b, DType::F32, "mxfp8" + trans_name(trans_a, trans_b));
    }
  }
}

// DeepSeek-V3 style: 1x128 activations x 128x128 weights, power-of-two scales (folded into
// the BF16 widening) and FP32 scales (the F32 path), K not a multiple of 128.
TEST(Fp8Gemm, BlockScaledEveryTranspose) {
  const int64_t m = 33, n = 129, k = 300;
  for (bool power_2 : {true, false}) {
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) {
        const Tensor x = ranged_tensor(a_shape(m, k, trans_a), 81);
        const Tensor w = ranged_tensor(b_shape(k, n, trans_b), 82);
        const Float8Tensor a =
            Quantizer::block(DType::E4M3, 1, 128, power_2).quantize(x, true, true);
        // 128x128 weights carry one usage: either orientation has blocks along K.
        const Float8Tensor b = Quantizer::block(DType::E4M3, 128, 128, power_2).quantize(w);
        check_fp8_gemm(
            a, b, trans_a, trans_b, DType::F32,
            std::string("block pow2=") + (power_2 ? "1" : "0") + trans_name(trans_a, trans_b));
      }
    }
  }
}

// Power-of-two scales whose products with FP8 values would be subnormal in BF16 (which the
// BF16 dot-product instructions flush to zero) must take the F32 path instead.
TEST(Fp8Gemm, ScalesOutsideBf16NormalRangeStayExact) {
  const int64_t m = 7, n = 9, k = 256;
  const Tensor x = random_tensor({m, k}, 97);
  const Tensor w = random_tensor({n, k}, 98);
  Float8Tensor a = Quantizer::block(DType::E4M3, 1, 128).quantize(x);
  const Float8Tensor b = Quantizer::block(DType::E4M3, 128, 128).quantize(w);
  a.scale_inv = a.scale_inv.clone();
  float* scales = a.scale_inv.data<float>();
  for (int64_t i = 0; i < a.scale_inv.numel(); ++i) scales[i] = std::ldexp(1.0f, -125);
  Tensor c = Tensor::empty({m, n}, DType::F32);
  gemm(a, b, c, false, true);
  Tensor expected = Tensor::empty({m, n}, DType::F32);
  gemm_reference(a.dequantize(), b.dequantize(), expected, false, true);
  int nonzero = 0;
  for (float v : expected.to_floats()) nonzero += v != 0.0f;
  EXPECT_GT(nonzero, m * n / 2);
  expect_close(c, expected, magnitude(a.dequantize(), b.dequantize(), false, true, m, n),
               2.0 * (k + 4) * kUnitRoundoff, 0.0, k * std::ldexp(1.0, -149), "tiny scales");
}

TEST(Fp8Gemm, MissingColumnwiseUsageThrows) {
  const Tensor x = random_tensor({64, 33}, 91);  // A stored [K,M] for trans_a
  const Tensor w = random_tensor({64, 7}, 92);   // B stored [K,N]
  const Float8Tensor a_block = Quantizer::block(DType::E4M3, 1, 128).quantize(x, true, false);
  const Float8Tensor a_mx = Quantizer::mxfp8(DType::E4M3).quantize(x, true, false);
  const Float8Tensor b_mx = Quantizer::mxfp8(DType::E4M3).quantize(w, true, false);
  const Float8Tensor b_ok = Quantizer::mxfp8(DType::E4M3).quantize(w, false, true);
  Tensor c = Tensor::empty({33, 7}, DType::F32);
  for (const Float8Tensor* a : {&a_block, &a_mx}) {
    try {
      gemm(*a, b_ok, c, true, false);
      ADD_FAILURE() << "expected an error for A without columnwise data";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("columnwise=true"), std::string::npos)
          << error.what();
    }
  }
  const Tensor a_rows = random_tensor({33, 64}, 93);
  const Float8Tensor a_ok = Quantizer::mxfp8(DType::E4M3).quantize(a_rows);
  EXPECT_THROW(gemm(a_ok, b_mx, c, false, false), Error);
  EXPECT_THROW(PackedWeight(b_mx, false), Error);
  // Per-tensor scaling reads the other usage through strides instead.
  const Float8Tensor a_tensor = Quantizer::current(DType::E4M3).quantize(x, true, false);
  const Float8Tensor b_tensor = Quantizer::current(DType::E4M3).quantize(w, true, false);
  check_fp8_gemm(a_tensor, b_tensor, true, false, DType::F32, "per-tensor fallback");
}

TEST(Fp8Gemm, UnsupportedCombinationsThrow) {
  const Tensor x = random_tensor({8, 32}, 95);
  const Float8Tensor a = Quantizer::current(DType::E5M2).quantize(x);
  const Float8Tensor b = Quantizer::current(DType::E5M2).quantize(x);
  Tensor c = Tensor::empty({8, 8}, DType::F32);
  EXPECT_THROW(gemm(a, b, c, false, true), Error);
  const Float8Tensor e4 = Quantizer::current(DType::E4M3).quantize(x);
  Tensor wrong = Tensor::empty({8, 9}, DType::F32);
  EXPECT_THROW(gemm(e4, e4, wrong, false, true), Error);
  Tensor int_c = Tensor::empty({8, 8}, DType::I32);
  EXPECT_THROW(gemm(e4, e4, int_c, false, true), Error);
}

TEST(Fp8Gemm, PackedWeightMatchesUnpacked) {
  const int64_t m = 65, n = 96, k = 256;
  const Tensor x = ranged_tensor({m, k}, 101);
  const Tensor w = ranged_tensor({n, k}, 102);
  struct Recipe {
    std::string name;
    Quantizer activation;
    Quantizer weight;
  };
  const Recipe recipes[] = {
      {"delayed", Quantizer::fixed(DType::E4M3, 20.5f), Quantizer::fixed(DType::E4M3, 3.7f)},
      {"mxfp8", Quantizer::mxfp8(DType::E4M3), Quantizer::mxfp8(DType::E4M3)},
      {"block pow2", Quantizer::block(DType::E4M3, 1, 128),
       Quantizer::block(DType::E4M3, 128, 128)},
      {"block fp32", Quantizer::block(DType::E4M3, 1, 128, false),
       Quantizer::block(DType::E4M3, 128, 128, false)},
  };
  for (const Recipe& recipe : recipes) {
    const Float8Tensor a = recipe.activation.quantize(x);
    const Float8Tensor b = recipe.weight.quantize(w);
    PackedWeight packed(b, true);
    Tensor c = Tensor::empty({m, n}, DType::F32);
    for (int call = 0; call < 2; ++call) gemm(a, packed, c, false, 1.5f);
    EXPECT_EQ(PackedWeightAccess::pack_count(packed), 1) << recipe.name;
    Tensor expected = Tensor::empty({m, n}, DType::F32);
    gemm_reference(a.dequantize(), b.dequantize(), expected, false, true, 1.5f);
    expect_close(c, expected, magnitude(a.dequantize(), b.dequantize(), false, true, m, n),
                 1.5 * 2.0 * (k + 4) * kUnitRoundoff, 2 * kUnitRoundoff, 0.0,
                 "fp8 packed " + recipe.name);
  }
}

TEST(Fp8Gemm, PackedWeightNeedsFp8ActivationAndViceVersa) {
  const Tensor w = random_tensor({16, 32}, 111);
  PackedWeight fp8_weight(Quantizer::current(DType::E4M3).quantize(w), true);
  PackedWeight bf16_weight(w.to(DType::BF16), true);
  const Tensor a = random_tensor({4, 32}, 112).to(DType::BF16);
  Tensor c = Tensor::empty({4, 16}, DType::F32);
  EXPECT_THROW(gemm(a, fp8_weight, c, false), Error);
  EXPECT_THROW(gemm(Quantizer::current(DType::E4M3).quantize(a), bf16_weight, c, false), Error);
  PackedWeight empty;
  EXPECT_THROW(gemm(a, empty, c, false), Error);
}

// ---- errors ---------------------------------------------------------------------------------

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(GemmErrors, ShapesAndDtypesNameWhatWasExpected) {
  const Tensor a = random_tensor({5, 33}, 121);
  const Tensor b_bad = random_tensor({32, 7}, 122);
  const Tensor b = random_tensor({33, 7}, 123);
  Tensor c = Tensor::empty({5, 7}, DType::F32);
  EXPECT_EQ(error_of([&] { gemm(a, b_bad, c, false, false); }),
            "gemm: B expected [K,N]=[33,7], got [32,7]");
  EXPECT_EQ(error_of([&] {
              gemm(a, b_bad.reshape({7, 32}), c, false, true);
            }),
            "gemm: B expected [N,K]=[7,33], got [7,32]");
  Tensor c_bad = Tensor::empty({5, 8}, DType::F32);
  EXPECT_EQ(error_of([&] { gemm(a, b, c_bad, false, false); }),
            "gemm: C expected [M,N]=[5,7], got [5,8]");
  const Tensor bias_bad = random_tensor({8}, 124);
  EXPECT_EQ(error_of([&] { gemm(a, b, c, false, false, 1.0f, 0.0f, {&bias_bad}); }),
            "gemm: bias expected [N]=[7], got [8]");
  EXPECT_NE(error_of([&] { gemm(a, b.to(DType::BF16), c, false, false); }).find("dtype"),
            std::string::npos);
  Tensor c_bf16 = Tensor::empty({5, 7}, DType::BF16);
  EXPECT_EQ(error_of([&] { gemm(a, b, c_bf16, false, false); }),
            "gemm: C expected dtype f32 for f32 operands, got bf16");
  const Tensor vector = random_tensor({33}, 125);
  EXPECT_THROW(gemm(vector, b, c, false, false), Error);
  PackedWeight packed(b, false);
  const Tensor a_wrong_k = random_tensor({5, 34}, 126);
  EXPECT_THROW(gemm(a_wrong_k, packed, c, false), Error);
}

TEST(GemmReference, NaiveMatchesReference) {
  const int64_t m = 33, n = 7, k = 129;
  const Tensor a = random_tensor({m, k}, 131);
  const Tensor b = random_tensor({k, n}, 132);
  Tensor c = Tensor::empty({m, n}, DType::F32);
  gemm_naive_f32(a.data<float>(), b.data<float>(), c.data<float>(), m, n, k);
  Tensor expected = Tensor::empty({m, n}, DType::F32);
  gemm_reference(a, b, expected, false, false);
  expect_close(c, expected, magnitude(a, b, false, false, m, n), 2.0 * (k + 2) * kUnitRoundoff, 0.0,
               0.0, "naive");
}

TEST(GemmReference, Activations) {
  EXPECT_EQ(apply_activation(Activation::None, -1.5f), -1.5f);
  EXPECT_EQ(apply_activation(Activation::Relu, -1.5f), 0.0f);
  EXPECT_EQ(apply_activation(Activation::Relu, 2.0f), 2.0f);
  // Values from PyTorch: F.gelu(x, approximate='tanh') and F.gelu(x) at x = 1 and -0.5.
  EXPECT_NEAR(apply_activation(Activation::GeluTanh, 1.0f), 0.8411919906082768, 1e-6);
  EXPECT_NEAR(apply_activation(Activation::GeluErf, 1.0f), 0.841344746068543, 1e-6);
  EXPECT_NEAR(apply_activation(Activation::GeluTanh, -0.5f), -0.15428599017485606, 1e-6);
  EXPECT_NEAR(apply_activation(Activation::GeluErf, -0.5f), -0.15426876936299344, 1e-6);
}

TEST(Gemm, ZeroKAppliesEpilogueOnly) {
  const Tensor a = Tensor::empty({3, 0}, DType::F32);
  const Tensor b = Tensor::empty({0, 2}, DType::F32);
  const Tensor bias = Tensor::from_floats({2}, {1.0f, -3.0f});
  Tensor c = Tensor::from_floats({3, 2}, {1, 2, 3, 4, 5, 6});
  gemm(a, b, c, false, false, 1.0f, 1.0f, {&bias, Activation::Relu});
  EXPECT_EQ(c.to_floats(), (std::vector<float>{2, 0, 4, 1, 6, 3}));
}

// An all-zero MXFP8 block gets the E8M0 scale 2^-127, which cannot fold into BF16: the GEMM
// widens to F32 and must still write a BF16 C (oneDNN has no F32 x F32 -> BF16 matmul).
TEST(GemmFp8, UnfoldableScalesStillWriteBf16Output) {
  Tensor zeros = Tensor::zeros({4, 64}, DType::BF16);
  Tensor w = random_tensor({8, 64}, 21).to(DType::BF16);
  Float8Tensor a = Quantizer::mxfp8(DType::E5M2).quantize(zeros);
  Float8Tensor b = Quantizer::mxfp8(DType::E4M3).quantize(w);
  Tensor c = Tensor::empty({4, 8}, DType::BF16);
  gemm(a, b, c, false, true);
  for (float v : c.to_floats()) EXPECT_EQ(v, 0.0f);
  Tensor x = random_tensor({4, 64}, 22).to(DType::BF16);
  for (int i = 0; i < 32; ++i) x.data<bfloat16>()[i].bits = 0;  // one all-zero block
  Float8Tensor xq = Quantizer::mxfp8(DType::E4M3).quantize(x);
  Tensor expected = Tensor::empty({4, 8}, DType::F32);
  gemm_reference(xq.dequantize(), b.dequantize(), expected, false, true);
  PackedWeight packed(b, true);
  Tensor c_bf16 = Tensor::from_floats({4, 8}, std::vector<float>(32, 1.0f)).to(DType::BF16);
  gemm(xq, packed, c_bf16, false, 1.0f, 1.0f);  // accumulate onto ones
  std::vector<float> got = c_bf16.to_floats(), want = expected.to_floats();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i] + 1.0f, 1e-2 * (1.0 + std::fabs(want[i])));  // BF16 rounding
  }
}

}  // namespace
}  // namespace octet
