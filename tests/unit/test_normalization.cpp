// LayerNorm / RMSNorm: fast path against the reference on every ISA, both against PyTorch,
// fused FP8 output against the unfused composition, finite differences, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/fp8.h"
#include "octet/ops/normalization.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::max_abs;
using octet::testing::random_tensor;
using octet::testing::relative_rms;
using octet::testing::worst;

struct NormCase {
  bool rms;
  int64_t rows, cols;
  DType dtype;
  bool zero_centered;
  bool with_beta;
};

struct NormResult {
  Tensor y, mean, rstd, dx, dgamma, dbeta;
};

NormResult run_norm(const NormCase& c, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    const Tensor& dy, bool reference) {
  NormResult r;
  r.y = Tensor::empty(x.shape(), c.dtype);
  r.mean = Tensor::empty({c.rows}, DType::F32);
  r.rstd = Tensor::empty({c.rows}, DType::F32);
  r.dx = Tensor::empty(x.shape(), c.dtype);
  r.dgamma = Tensor::empty({c.cols}, DType::F32);
  r.dbeta = Tensor::empty({c.cols}, DType::F32);
  const Tensor* b = c.with_beta ? &beta : nullptr;
  Tensor* db = c.with_beta ? &r.dbeta : nullptr;
  const float eps = 1e-5f;
  if (reference && c.rms) {
    ops::reference::rmsnorm_forward(x, gamma, eps, c.zero_centered, r.y, r.rstd);
    ops::reference::rmsnorm_backward(dy, x, r.rstd, gamma, c.zero_centered, r.dx, r.dgamma);
  } else if (reference) {
    ops::reference::layernorm_forward(x, gamma, b, eps, c.zero_centered, r.y, r.mean, r.rstd);
    ops::reference::layernorm_backward(dy, x, r.mean, r.rstd, gamma, c.zero_centered, r.dx,
                                       r.dgamma, db);
  } else if (c.rms) {
    ops::rmsnorm_forward(x, gamma, eps, c.zero_centered, r.y, r.rstd);
    ops::rmsnorm_backward(dy, x, r.rstd, gamma, c.zero_centered, r.dx, r.dgamma);
  } else {
    ops::layernorm_forward(x, gamma, b, eps, c.zero_centered, r.y, r.mean, r.rstd);
    ops::layernorm_backward(dy, x, r.mean, r.rstd, gamma, c.zero_centered, r.dx, r.dgamma, db);
  }
  return r;
}

class Norm : public ::testing::TestWithParam<NormCase> {};

// |got - expected| <= bound elementwise.
void expect_within(const Tensor& got, const Tensor& expected, const std::vector<double>& bound,
                   const std::string& what) {
  const std::vector<float> g = got.to_floats(), e = expected.to_floats();
  ASSERT_EQ(g.size(), bound.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double error = std::fabs(double(g[i]) - e[i]);
    if (!(error <= bound[i]) && failures++ < 3) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g[i] << ", reference " << e[i] << " (error "
                    << error << " > bound " << bound[i] << ")";
    }
  }
  EXPECT_EQ(failures, 0) << what;
}

TEST_P(Norm, FastMatchesReferenceAndTorch) {
  const NormCase c = GetParam();
  // Inputs with a nonzero mean exercise the two-pass variance.
  Tensor x = random_tensor({c.rows, c.cols}, c.dtype, 1, 3.0f, 2.0f);
  Tensor gamma = random_tensor({c.cols}, DType::F32, 2, c.zero_centered ? 0.0f : 1.0f, 0.3f);
  Tensor beta = random_tensor({c.cols}, DType::F32, 3);
  Tensor dy = random_tensor({c.rows, c.cols}, c.dtype, 4);
  NormResult ref = run_norm(c, x, gamma, beta, dy, true);

  // F32: the fast path sums in F32 (vectorized, reordered) vs the FP64 oracle, so errors grow
  // like C * 2^-24; 2e-4 relative covers C up to ~1000 with margin. BF16 outputs: one BF16
  // rounding (2^-8 relative) may land on either side of the oracle's.
  const bool bf16 = c.dtype == DType::BF16;
  const double rtol = bf16 ? 1.0 / 64 : 2e-4, atol = bf16 ? 1e-2 : 1e-4;
  // dgamma_c = sum_r dy xhat and dbeta_c = sum_r dy, in F32 on both paths' inputs (x, dy,
  // gamma are the same F32 or BF16 values). Per-element bounds from the rounding each step does:
  // xhat = (x - mean) rstd takes the forward's F32 mean, off by <= (C + 2) u mean|x_r|, and
  // rstd, off by <= (C/2 + 6) u relative (sum of C squares, divide, add eps, sqrt, invert),
  // then rounds 3u (subtract, multiply, product with dy); the sum over R rows in per-thread
  // partials (T threads) adds <= 2 (R + T + 2) u sum_r |term|. u = 2^-24.
  const double u = std::ldexp(1.0, -24);
  const int64_t threads = num_threads();
  std::vector<float> xs = x.to_floats(), dys = dy.to_floats();
  std::vector<float> means = ref.mean.to_floats(), rstds = ref.rstd.to_floats();
  std::vector<double> mean_bound(c.rows), dgamma_bound(c.cols, 0.0), dbeta_bound(c.cols, 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    double mean_abs = 0;
    for (int64_t j = 0; j < c.cols; ++j) mean_abs += std::fabs(xs[r * c.cols + j]) / c.cols;
    mean_bound[r] = (c.cols + 2) * u * mean_abs;
    const double mean = c.rms ? 0.0 : means[r];
    for (int64_t j = 0; j < c.cols; ++j) {
      const double d = std::fabs(dys[r * c.cols + j]);
      const double xhat = std::fabs((xs[r * c.cols + j] - mean) * rstds[r]);
      dgamma_bound[j] += d * ((c.rms ? 0.0 : mean_bound[r] * rstds[r]) +
                              xhat * u * (c.cols / 2.0 + 9 + 2.0 * (c.rows + threads + 2)));
      dbeta_bound[j] += d * 2.0 * (c.rows + threads + 2) * u;
    }
  }
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(isa_name(isa));
    Isa original = active_isa();
    set_active_isa(isa);
    NormResult fast = run_norm(c, x, gamma, beta, dy, false);
    set_active_isa(original);
    EXPECT_LE(worst(fast.y, ref.y, atol, rtol), 1.0);
    EXPECT_LE(worst(fast.rstd, ref.rstd, 1e-6, 1e-5), 1.0);
    EXPECT_LE(worst(fast.dx, ref.dx, atol, rtol), 1.0);
    // The forward's mean: an F32 sum of C terms, <= (C + 2) u mean|x_r| off the oracle's.
    if (!c.rms) expect_within(fast.mean, ref.mean, mean_bound, "mean");
    expect_within(fast.dgamma, ref.dgamma, dgamma_bound, "dgamma");
    if (c.with_beta && !c.rms) expect_within(fast.dbeta, ref.dbeta, dbeta_bound, "dbeta");
  }

  TensorMap inputs{{"x", x}, {"gamma", gamma}, {"dy", dy}};
  if (c.with_beta && !c.rms) inputs["beta"] = beta;
  std::string args = std::string("{\"eps\": 1e-5, \"zero_centered_gamma\": ") +
                     (c.zero_centered ? "true" : "false") + "}";
  TensorMap torch = octet::testing::run_torch(c.rms ? "rmsnorm" : "layernorm", inputs, args);
  // The oracle computes in FP64 like torch does here; only its final F32/BF16 store differs.
  const double torch_rtol = bf16 ? 1.0 / 128 : 1e-5, torch_atol = bf16 ? 1e-2 : 1e-5;
  EXPECT_LE(worst(ref.y, torch.at("y"), torch_atol, torch_rtol), 1.0);
  EXPECT_LE(worst(ref.dx, torch.at("dx"), torch_atol, torch_rtol), 1.0);
  EXPECT_LE(worst(ref.dgamma, torch.at("dgamma"), 1e-4, 1e-5), 1.0);
  if (c.with_beta && !c.rms) {
    EXPECT_LE(worst(ref.dbeta, torch.at("dbeta"), 1e-4, 1e-5), 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Norm,
                         ::testing::Values(NormCase{false, 1, 1, DType::F32, false, true},
                                           NormCase{false, 7, 33, DType::F32, false, true},
                                           NormCase{false, 65, 384, DType::F32, true, true},
                                           NormCase{false, 130, 768, DType::BF16, false, true},
                                           NormCase{false, 33, 129, DType::F32, false, false},
                                           NormCase{true, 7, 33, DType::F32, false, false},
                                           NormCase{true, 65, 384, DType::BF16, true, false},
                                           NormCase{true, 130, 768, DType::F32, false, false}));

TEST(Normalization, FusedFp8OutputEqualsUnfusedCast) {
  Tensor x = random_tensor({37, 384}, DType::BF16, 5);
  Tensor gamma = random_tensor({384}, DType::F32, 6, 1.0f, 0.2f);
  Tensor beta = random_tensor({384}, DType::F32, 7);
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(isa_name(isa));
    Isa original = active_isa();
    set_active_isa(isa);
    Tensor y = Tensor::empty({37, 384}, DType::F32), mean = Tensor::empty({37}, DType::F32);
    Tensor rstd = Tensor::empty({37}, DType::F32);
    ops::layernorm_forward(x, gamma, &beta, 1e-5f, false, y, mean, rstd);
    std::vector<uint8_t> unfused(y.numel()), fused(y.numel());
    float unfused_amax =
        quantize_fp8(y.data<float>(), y.numel(), 7.5f, DType::E4M3, unfused.data());
    ops::Fp8Store store{DType::E4M3, 7.5f, fused.data(), 0.0f};
    Tensor none;
    ops::layernorm_forward(x, gamma, &beta, 1e-5f, false, none, mean, rstd, &store);
    set_active_isa(original);
    EXPECT_EQ(fused, unfused);
    EXPECT_EQ(store.amax, unfused_amax);
  }
  // NaN in the input reaches amax, so delayed scaling can keep its previous scale.
  Tensor bad = random_tensor({4, 16}, DType::F32, 8);
  bad.data<float>()[17] = NAN;
  std::vector<uint8_t> codes(64);
  ops::Fp8Store store{DType::E4M3, 1.0f, codes.data(), 0.0f};
  Tensor none, mean = Tensor::empty({4}, DType::F32), rstd = Tensor::empty({4}, DType::F32);
  Tensor g16 = random_tensor({16}, DType::F32, 9);
  ops::rmsnorm_forward(bad, g16, 1e-5f, false, none, rstd, &store);
  EXPECT_TRUE(std::isnan(store.amax));
}

TEST(Normalization, FiniteDifferenceGradients) {
  // Loss L = sum(y * w_out) on a small shape; central differences in the FP64 oracle's
  // inputs (F32 storage, step 1e-2: truncation error ~1e-4, rounding ~1e-5).
  const int64_t rows = 3, cols = 8;
  for (bool rms : {false, true}) {
    Tensor x = random_tensor({rows, cols}, DType::F32, 10);
    Tensor gamma = random_tensor({cols}, DType::F32, 11, 1.0f, 0.5f);
    Tensor beta = random_tensor({cols}, DType::F32, 12);
    Tensor w = random_tensor({rows, cols}, DType::F32, 13);
    NormCase c{rms, rows, cols, DType::F32, false, !rms};
    auto loss = [&](const Tensor& xx, const Tensor& gg) {
      NormResult r = run_norm(c, xx, gg, beta, w, true);
      double l = 0;
      for (int64_t i = 0; i < r.y.numel(); ++i)
        l += double(r.y.data<float>()[i]) * w.data<float>()[i];
      return l;
    };
    NormResult analytic = run_norm(c, x, gamma, beta, w, false);
    const float h = 1e-2f;
    for (int64_t i = 0; i < x.numel(); ++i) {
      Tensor plus = x.clone(), minus = x.clone();
      plus.data<float>()[i] += h;
      minus.data<float>()[i] -= h;
      double numeric = (loss(plus, gamma) - loss(minus, gamma)) / (2 * h);
      EXPECT_NEAR(analytic.dx.data<float>()[i], numeric, 2e-3 + 2e-3 * std::fabs(numeric));
    }
    for (int64_t i = 0; i < cols; ++i) {
      Tensor plus = gamma.clone(), minus = gamma.clone();
      plus.data<float>()[i] += h;
      minus.data<float>()[i] -= h;
      double numeric = (loss(x, plus) - loss(x, minus)) / (2 * h);
      EXPECT_NEAR(analytic.dgamma.data<float>()[i], numeric, 2e-3 + 2e-3 * std::fabs(numeric));
    }
  }
}

TEST(Normalization, BadInputIsNamed) {
  Tensor x = Tensor::zeros({4, 8}, DType::F32);
  Tensor gamma = Tensor::zeros({7}, DType::F32);
  Tensor y = Tensor::empty({4, 8}, DType::F32), mean = Tensor::empty({4}, DType::F32);
  Tensor rstd = Tensor::empty({4}, DType::F32);
  try {
    ops::layernorm_forward(x, gamma, nullptr, 1e-5f, false, y, mean, rstd);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "layernorm_forward: gamma expected [C]=[8], got [7]");
  }
  Tensor gamma8 = Tensor::zeros({8}, DType::F32);
  Tensor wrong_rstd = Tensor::empty({5}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_forward(x, gamma8, 1e-5f, false, y, wrong_rstd), Error);
  Tensor ints = Tensor::zeros({4, 8}, DType::I32);
  EXPECT_THROW(ops::layernorm_forward(ints, gamma8, nullptr, 1e-5f, false, y, mean, rstd), Error);
}

}  // namespace
}  // namespace octet
