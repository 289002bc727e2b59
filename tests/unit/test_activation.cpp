// Activations: element functions against <cmath>, fast path against the reference on every
// ISA, both against PyTorch (forward and backward), fused FP8 against the unfused cast,
// finite differences, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/cpu_features.h"
#include "octet/fp8.h"
#include "octet/ops/activation.h"
#include "ops/activation/math.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::max_abs;
using octet::testing::random_tensor;
using octet::testing::relative_rms;
using octet::testing::worst;

using ops::ActivationKind;

TEST(ActivationMath, ElementFunctionsAgreeWithCmath) {
  double exp_worst = 0, tanh_worst = 0, erf_worst = 0;
  for (float x = -80.0f; x <= 80.0f; x += 0.01173f) {
    exp_worst = std::max(exp_worst,
                         std::fabs(ops::math::exp(x) - std::exp(double(x))) / std::exp(double(x)));
  }
  for (float x = -12.0f; x <= 12.0f; x += 0.000731f) {
    tanh_worst = std::max(tanh_worst, std::fabs(ops::math::tanh(x) - std::tanh(double(x))));
    erf_worst = std::max(erf_worst, std::fabs(ops::math::erf(x) - std::erf(double(x))));
  }
  EXPECT_LT(exp_worst, 4e-7);   // a few F32 ulps (2^-23 = 1.2e-7)
  EXPECT_LT(tanh_worst, 3e-7);  // absolute: 1 - 2/(e^2x + 1) loses relative accuracy near 0
  // Abramowitz & Stegun 7.1.26 bounds the formula by 1.5e-7; evaluating it in F32 (the
  // polynomial, the exp, 1 - p) adds a few 2^-24 roundings: 4.6e-7 measured.
  EXPECT_LT(erf_worst, 6e-7);
}

struct ActCase {
  ActivationKind kind;
  int64_t rows, cols;  // cols = F_in
  DType dtype;
  bool with_bias;
};

struct ActResult {
  Tensor y, dx, dbias;
};

ActResult run_act(const ActCase& c, const Tensor& x, const Tensor& bias, const Tensor& dy,
                  bool reference) {
  int64_t out_cols = ops::is_gated(c.kind) ? c.cols / 2 : c.cols;
  ActResult r{Tensor::empty({c.rows, out_cols}, c.dtype), Tensor::empty({c.rows, c.cols}, c.dtype),
              Tensor::empty({c.cols}, DType::F32)};
  const Tensor* b = c.with_bias ? &bias : nullptr;
  if (reference) {
    ops::reference::activation_forward(c.kind, x, b, r.y);
    ops::reference::activation_backward(c.kind, dy, x, b, r.dx, &r.dbias);
  } else {
    ops::activation_forward(c.kind, x, b, r.y);
    ops::activation_backward(c.kind, dy, x, b, r.dx, &r.dbias);
  }
  return r;
}

class Activation : public ::testing::TestWithParam<ActCase> {};

TEST_P(Activation, FastMatchesReferenceAndTorch) {
  const ActCase c = GetParam();
  int64_t out_cols = ops::is_gated(c.kind) ? c.cols / 2 : c.cols;
  Tensor x = random_tensor({c.rows, c.cols}, c.dtype, 1, 0.0f, 1.5f);
  Tensor bias = random_tensor({c.cols}, DType::F32, 2, 0.0f, 0.5f);
  Tensor dy = random_tensor({c.rows, out_cols}, c.dtype, 3, 0.0f, 1.0f);
  ActResult ref = run_act(c, x, bias, dy, true);
  // F32: the fast element functions are within ~3e-7 absolute / few ulps of <cmath>, so
  // 1e-5 covers them after the products; BF16 outputs: one BF16 rounding (2^-8) either side.
  const bool bf16 = c.dtype == DType::BF16;
  const double rtol = bf16 ? 1.0 / 64 : 1e-5, atol = bf16 ? 1e-2 : 1e-5;
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(isa_name(isa));
    Isa original = active_isa();
    set_active_isa(isa);
    ActResult fast = run_act(c, x, bias, dy, false);
    set_active_isa(original);
    EXPECT_LE(worst(fast.y, ref.y, atol, rtol), 1.0);
    EXPECT_LE(worst(fast.dx, ref.dx, atol, rtol), 1.0);
    // dbias sums `rows` gradient terms in F32 (fast) vs FP64 (reference).
    EXPECT_LE(worst(fast.dbias, ref.dbias, 1e-4 * c.rows, 1e-4), 1.0);
  }
  TensorMap inputs{{"x", x}, {"dy", dy}};
  if (c.with_bias) inputs["bias"] = bias;
  std::string args = "{\"kind\": \"" + std::string(ops::activation_name(c.kind)) + "\"}";
  TensorMap torch = octet::testing::run_torch("activation", inputs, args);
  const double torch_rtol = bf16 ? 1.0 / 128 : 1e-6, torch_atol = bf16 ? 1e-2 : 1e-6;
  EXPECT_LE(worst(ref.y, torch.at("y"), torch_atol, torch_rtol), 1.0);
  EXPECT_LE(worst(ref.dx, torch.at("dx"), torch_atol, torch_rtol), 1.0);
  if (c.with_bias) {
    EXPECT_LE(worst(ref.dbias, torch.at("dbias"), bf16 ? 1e-2 * c.rows : 1e-5, torch_rtol), 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, Activation,
    ::testing::Values(ActCase{ActivationKind::GeluTanh, 7, 33, DType::F32, true},
                      ActCase{ActivationKind::GeluTanh, 65, 1536, DType::BF16, true},
                      ActCase{ActivationKind::GeluErf, 7, 33, DType::F32, true},
                      ActCase{ActivationKind::GeluErf, 33, 129, DType::BF16, false},
                      ActCase{ActivationKind::Relu, 1, 1, DType::F32, false},
                      ActCase{ActivationKind::Relu, 33, 129, DType::F32, true},
                      ActCase{ActivationKind::Silu, 7, 33, DType::F32, true},
                      ActCase{ActivationKind::Silu, 65, 384, DType::BF16, true},
                      ActCase{ActivationKind::SwiGlu, 7, 66, DType::F32, true},
                      ActCase{ActivationKind::SwiGlu, 65, 768, DType::BF16, false},
                      ActCase{ActivationKind::GeGlu, 1, 2, DType::F32, true},
                      ActCase{ActivationKind::GeGlu, 33, 258, DType::F32, false}),
    [](const ::testing::TestParamInfo<ActCase>& param_info) {
      const ActCase& c = param_info.param;
      return std::string(ops::activation_name(c.kind)) + "_" + std::to_string(c.rows) + "x" +
             std::to_string(c.cols) + "_" + std::string(dtype_name(c.dtype)) +
             (c.with_bias ? "_bias" : "");
    });

TEST(ActivationFp8, FusedCastEqualsUnfused) {
  for (ActivationKind kind : {ActivationKind::GeluTanh, ActivationKind::SwiGlu}) {
    int64_t cols = 384, out_cols = ops::is_gated(kind) ? cols / 2 : cols;
    Tensor x = random_tensor({29, cols}, DType::BF16, 4, 0.0f, 1.5f);
    Tensor bias = random_tensor({cols}, DType::F32, 5, 0.0f, 1.5f);
    Tensor dy = random_tensor({29, out_cols}, DType::BF16, 6, 0.0f, 1.5f);
    for (Isa isa : available_isas()) {
      SCOPED_TRACE(isa_name(isa));
      Isa original = active_isa();
      set_active_isa(isa);
      // forward: y in F32, then cast; versus codes written by the kernel
      Tensor y = Tensor::empty({29, out_cols}, DType::F32);
      ops::activation_forward(kind, x, &bias, y);
      std::vector<uint8_t> unfused(y.numel()), fused(y.numel());
      float amax = quantize_fp8(y.data<float>(), y.numel(), 3.0f, DType::E4M3, unfused.data());
      ops::Fp8Store store{DType::E4M3, 3.0f, fused.data(), 0.0f};
      Tensor none;
      ops::activation_forward(kind, x, &bias, none, &store);
      EXPECT_EQ(fused, unfused);
      EXPECT_EQ(store.amax, amax);
      // backward: dx cast to E5M2 as a gradient, and dbias computed in the same pass
      Tensor dx = Tensor::empty({29, cols}, DType::F32), dbias = Tensor::empty({cols}, DType::F32);
      ops::activation_backward(kind, dy, x, &bias, dx, &dbias);
      std::vector<uint8_t> dx_unfused(dx.numel()), dx_fused(dx.numel());
      float dx_amax =
          quantize_fp8(dx.data<float>(), dx.numel(), 64.0f, DType::E5M2, dx_unfused.data());
      ops::Fp8Store dx_store{DType::E5M2, 64.0f, dx_fused.data(), 0.0f};
      Tensor dbias_fused = Tensor::empty({cols}, DType::F32);
      ops::activation_backward(kind, dy, x, &bias, none, &dbias_fused, &dx_store);
      set_active_isa(original);
      EXPECT_EQ(dx_fused, dx_unfused);
      EXPECT_EQ(dx_store.amax, dx_amax);
      EXPECT_EQ(dbias_fused.to_floats(), dbias.to_floats());
    }
  }
}

TEST(ActivationGrad, FiniteDifferences) {
  // L = sum(y * w): central differences on the FP64 reference (F32 storage, step 1e-2).
  for (ActivationKind kind :
       {ActivationKind::GeluTanh, ActivationKind::GeluErf, ActivationKind::Silu,
        ActivationKind::SwiGlu, ActivationKind::GeGlu}) {
    SCOPED_TRACE(std::string(ops::activation_name(kind)));
    int64_t cols = 6, out_cols = ops::is_gated(kind) ? 3 : 6;
    Tensor x = random_tensor({2, cols}, DType::F32, 7, 0.0f, 1.5f);
    Tensor bias = random_tensor({cols}, DType::F32, 8, 0.0f, 0.3f);
    Tensor w = random_tensor({2, out_cols}, DType::F32, 9, 0.0f, 1.5f);
    auto loss = [&](const Tensor& xx) {
      Tensor y = Tensor::empty({2, out_cols}, DType::F32);
      ops::reference::activation_forward(kind, xx, &bias, y);
      double l = 0;
      for (int64_t i = 0; i < y.numel(); ++i) l += double(y.data<float>()[i]) * w.data<float>()[i];
      return l;
    };
    Tensor dx = Tensor::empty({2, cols}, DType::F32), dbias = Tensor::empty({cols}, DType::F32);
    ops::activation_backward(kind, w, x, &bias, dx, &dbias);
    for (int64_t i = 0; i < x.numel(); ++i) {
      Tensor plus = x.clone(), minus = x.clone();
      plus.data<float>()[i] += 1e-2f;
      minus.data<float>()[i] -= 1e-2f;
      double numeric = (loss(plus) - loss(minus)) / 2e-2;
      EXPECT_NEAR(dx.data<float>()[i], numeric, 1e-3 + 1e-3 * std::fabs(numeric));
    }
  }
}

TEST(ActivationErrors, BadShapesAreNamed) {
  Tensor x = Tensor::zeros({4, 7}, DType::F32);
  Tensor y = Tensor::empty({4, 3}, DType::F32);
  try {
    ops::activation_forward(ActivationKind::SwiGlu, x, nullptr, y);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("swiglu expects an even last dimension"),
              std::string::npos);
  }
  Tensor x8 = Tensor::zeros({4, 8}, DType::F32), y8 = Tensor::empty({4, 8}, DType::F32);
  EXPECT_THROW(ops::activation_forward(ActivationKind::SwiGlu, x8, nullptr, y8), Error);
  Tensor bias = Tensor::zeros({7}, DType::F32);
  EXPECT_THROW(ops::activation_forward(ActivationKind::Relu, x8, &bias, y8), Error);
  EXPECT_THROW(ops::parse_activation("gleu"), Error);
  EXPECT_EQ(ops::parse_activation("geglu"), ActivationKind::GeGlu);
}

}  // namespace
}  // namespace octet
