// AdamW and gradient clipping: fast path against the reference bit for bit on every ISA path
// (master weights, moments, BF16 / FP8 model copies and their amax), both against PyTorch
// (torch.optim.AdamW over 5 steps with per-tensor weight decay, clip_grad_norm_), NaN / Inf
// propagation and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/fp8.h"
#include "octet/ops/optimizer.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::run_torch;
using ops::AdamWHyper;
using ops::AdamWTensor;

struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

Tensor random_tensor(Shape shape, DType dtype, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = normal(rng);
  Tensor t = Tensor::from_floats(std::move(shape), values);
  return dtype == DType::F32 ? t : t.to(dtype);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct TensorSpec {
  Shape shape;
  DType grad_dtype;
  DType model_dtype;  // F32 = no model copy
  float weight_decay;
};

// Odd sizes: 1 element, one past a 2048 block, one past two 16384-element chunks.
const std::vector<TensorSpec> kSpecs = {
    {{1}, DType::F32, DType::F32, 0.0f},
    {{17, 241}, DType::BF16, DType::BF16, 0.1f},
    {{2 * 16384 + 1}, DType::F32, DType::E4M3, 0.01f},
    {{33, 65}, DType::BF16, DType::E5M2, 0.0f},
};

std::vector<AdamWTensor> make_state(const std::vector<TensorSpec>& specs) {
  std::vector<AdamWTensor> state;
  uint32_t seed = 100;
  for (const TensorSpec& spec : specs) {
    AdamWTensor t;
    t.param = random_tensor(spec.shape, DType::F32, seed++);
    t.exp_avg = Tensor::zeros(spec.shape, DType::F32);
    t.exp_avg_sq = Tensor::zeros(spec.shape, DType::F32);
    if (spec.model_dtype != DType::F32) t.model = Tensor::zeros(spec.shape, spec.model_dtype);
    t.model_scale = 128.0f;  // |param| > 3.5 (a few of 32769 normals) saturates E4M3 at 448
    t.weight_decay = spec.weight_decay;
    state.push_back(t);
  }
  return state;
}

std::vector<AdamWTensor> clone_state(const std::vector<AdamWTensor>& state) {
  std::vector<AdamWTensor> copy = state;
  for (AdamWTensor& t : copy) {
    t.param = t.param.clone();
    t.exp_avg = t.exp_avg.clone();
    t.exp_avg_sq = t.exp_avg_sq.clone();
    if (t.model.defined()) t.model = t.model.clone();
  }
  return copy;
}

void set_grads(std::vector<AdamWTensor>& state, const std::vector<TensorSpec>& specs, int step) {
  for (size_t i = 0; i < state.size(); ++i) {
    state[i].grad = random_tensor(specs[i].shape, specs[i].grad_dtype,
                                  static_cast<uint32_t>(1000 * step + i), 0.5f);
  }
}

// |a - b| <= rtol * (|b| + floor) elementwise.
void expect_close(const Tensor& actual, const Tensor& expected, double rtol, double floor,
                  const std::string& what) {
  const std::vector<float> a = actual.to_floats();
  const std::vector<float> b = expected.to_floats();
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t j = 0; j < a.size(); ++j) {
    ASSERT_NEAR(a[j], b[j], rtol * (std::fabs(b[j]) + floor)) << what << "[" << j << "]";
  }
}

// Every model code is the scalar conversion of the updated master weight, amax its max |.|.
void expect_model_is_conversion(const AdamWTensor& t) {
  SCOPED_TRACE(dtype_name(t.model.dtype()));
  const float* param = t.param.data<float>();
  float amax = 0.0f;
  int mismatches = 0;
  for (int64_t j = 0; j < t.param.numel(); ++j) {
    amax = std::max(amax, std::fabs(param[j]));
    if (t.model.dtype() == DType::BF16) {
      mismatches += t.model.data<bfloat16>()[j].bits != float_to_bf16(param[j]);
    } else {
      const uint8_t code = static_cast<const uint8_t*>(t.model.raw())[j];
      mismatches += code != float_to_fp8(param[j] * t.model_scale, t.model.dtype(), true);
    }
  }
  EXPECT_EQ(mismatches, 0);
  if (is_fp8(t.model.dtype())) {
    EXPECT_EQ(t.model_amax, amax);
  }
}

// The scalar path repeats the reference's F32 operations exactly; the vector paths may fuse
// multiply-adds, a last-bit difference per operation: after 5 steps, 1e-6 relative to the
// weights' (~1) and gradients' (~0.5) sizes covers it. Model copies are checked exactly
// against the path's own master weights.
TEST(AdamW, FastMatchesReferenceOnEveryIsa) {
  IsaGuard guard;
  const AdamWHyper hyper{3e-2f, 0.9f, 0.95f, 1e-8f, 1};
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    SCOPED_TRACE(isa_name(active_isa()));
    std::vector<AdamWTensor> ref = make_state(kSpecs);
    std::vector<AdamWTensor> fast = clone_state(ref);
    for (int step = 1; step <= 5; ++step) {
      set_grads(ref, kSpecs, step);
      set_grads(fast, kSpecs, step);
      AdamWHyper h = hyper;
      h.step = step;
      ops::reference::adamw_step(ref, h);
      ops::adamw_step(fast, h);
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      SCOPED_TRACE(i);
      if (active_isa() == Isa::Scalar) {
        EXPECT_TRUE(same_bytes(fast[i].param, ref[i].param));
        EXPECT_TRUE(same_bytes(fast[i].exp_avg, ref[i].exp_avg));
        EXPECT_TRUE(same_bytes(fast[i].exp_avg_sq, ref[i].exp_avg_sq));
      }
      expect_close(fast[i].param, ref[i].param, 1e-6, 1.0, "param");
      expect_close(fast[i].exp_avg, ref[i].exp_avg, 1e-6, 1.0, "exp_avg");
      expect_close(fast[i].exp_avg_sq, ref[i].exp_avg_sq, 1e-6, 1e-12, "exp_avg_sq");
      if (fast[i].model.defined()) expect_model_is_conversion(fast[i]);
      if (ref[i].model.defined()) expect_model_is_conversion(ref[i]);
    }
  }
}

// The model copies are exactly the scalar conversions of the updated master weights.
TEST(AdamW, ModelCopiesAreConversionsOfTheMasterWeights) {
  std::vector<AdamWTensor> state = make_state(kSpecs);
  set_grads(state, kSpecs, 1);
  ops::adamw_step(state, {1e-2f, 0.9f, 0.999f, 1e-8f, 1});
  int saturated = 0;  // the E4M3 copy must exercise saturation at 448
  for (const AdamWTensor& t : state) {
    if (!t.model.defined()) continue;
    expect_model_is_conversion(t);
    if (t.model.dtype() != DType::E4M3) continue;
    for (int64_t j = 0; j < t.model.numel(); ++j) {
      saturated += (static_cast<const uint8_t*>(t.model.raw())[j] & 0x7F) == 0x7E;
    }
  }
  EXPECT_GT(saturated, 0);
}

// torch.optim.AdamW in FP64 on the same inputs, one param group per tensor. Ours runs in F32:
// after 5 steps the master weights differ by a few F32 ulps (1e-6 of the weight's size
// allowed), exp_avg by a few ulps of the gradients' size (sums of +-g may cancel),
// exp_avg_sq (positive terms) by a few ulps of itself.
TEST(AdamW, MatchesTorchOverFiveSteps) {
  const std::vector<TensorSpec> specs = {
      {{7, 13}, DType::F32, DType::F32, 0.0f},
      {{301}, DType::BF16, DType::F32, 0.1f},
      {{5, 3, 2}, DType::F32, DType::F32, 0.5f},
  };
  std::vector<AdamWTensor> initial = make_state(specs);
  TensorMap inputs;
  for (size_t i = 0; i < initial.size(); ++i) {
    inputs["param" + std::to_string(i)] = initial[i].param.clone();
  }
  const int steps = 5;
  std::vector<std::vector<Tensor>> grads(steps);
  for (int step = 0; step < steps; ++step) {
    set_grads(initial, specs, step);
    for (size_t i = 0; i < initial.size(); ++i) {
      grads[step].push_back(initial[i].grad);
      inputs["grad" + std::to_string(i) + "_" + std::to_string(step)] = initial[i].grad;
    }
  }
  const TensorMap torch = run_torch("adamw", inputs,
                                    "{\"lr\": 0.01, \"betas\": [0.9, 0.99], \"eps\": 1e-08, "
                                    "\"weight_decays\": [0.0, 0.1, 0.5], \"steps\": 5}");
  for (bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    std::vector<AdamWTensor> state = clone_state(initial);
    for (int step = 0; step < steps; ++step) {
      for (size_t i = 0; i < state.size(); ++i) state[i].grad = grads[step][i];
      const AdamWHyper hyper{1e-2f, 0.9f, 0.99f, 1e-8f, step + 1};
      fast ? ops::adamw_step(state, hyper) : ops::reference::adamw_step(state, hyper);
    }
    for (size_t i = 0; i < state.size(); ++i) {
      const std::string index = std::to_string(i);
      auto compare = [&](const Tensor& ours, const std::string& name, double rtol, double floor) {
        const std::vector<float> a = ours.to_floats();
        const std::vector<float> b = torch.at(name + index).to_floats();
        ASSERT_EQ(a.size(), b.size());
        for (size_t j = 0; j < a.size(); ++j) {
          ASSERT_NEAR(a[j], b[j], rtol * (std::fabs(b[j]) + floor))
              << name << index << "[" << j << "]";
        }
      };
      compare(state[i].param, "param", 1e-6, 1.0);
      compare(state[i].exp_avg, "exp_avg", 1e-6, 1.0);  // may cancel: relative to |g|
      compare(state[i].exp_avg_sq, "exp_avg_sq", 1e-5, 1e-12);
    }
  }
}

std::vector<Tensor> clone_all(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> copy;
  for (const Tensor& t : tensors) copy.push_back(t.clone());
  return copy;
}

// Norms: FP64 sums of the same values in another order: 1e-12 relative. Clipped F32 grads are
// multiplied by an F32 coefficient (1e-6 relative); BF16 ones are rounded again (2^-8).
TEST(GradNorm, MatchesTorchClipGradNorm) {
  const std::vector<Tensor> grads = {random_tensor({40000}, DType::F32, 1, 0.1f),
                                     random_tensor({3, 7}, DType::BF16, 2),
                                     random_tensor({1}, DType::F32, 3)};
  TensorMap inputs;
  for (size_t i = 0; i < grads.size(); ++i) inputs["grad" + std::to_string(i)] = grads[i];
  for (double max_norm : {1.0, 1000.0}) {  // clipping, then not
    SCOPED_TRACE(max_norm);
    const TensorMap torch =
        run_torch("clip_grad_norm", inputs, "{\"max_norm\": " + std::to_string(max_norm) + "}");
    const double torch_norm = torch.at("norm").to_floats()[0];
    for (bool fast : {false, true}) {
      SCOPED_TRACE(fast ? "fast" : "reference");
      const double norm =
          fast ? ops::global_grad_norm(grads) : ops::reference::global_grad_norm(grads);
      EXPECT_NEAR(norm, torch_norm, 1e-6 * torch_norm);  // torch's norm comes back as F32
      std::vector<Tensor> clipped = clone_all(grads);
      const double returned = fast ? ops::clip_grad_norm(clipped, max_norm)
                                   : ops::reference::clip_grad_norm(clipped, max_norm);
      EXPECT_EQ(returned, norm);
      for (size_t i = 0; i < grads.size(); ++i) {
        const std::vector<float> a = clipped[i].to_floats();
        const std::vector<float> b = torch.at("grad" + std::to_string(i)).to_floats();
        const double rtol = grads[i].dtype() == DType::F32 ? 1e-6 : 1.0 / 256;
        for (size_t j = 0; j < a.size(); ++j) {
          ASSERT_NEAR(a[j], b[j], rtol * std::fabs(b[j]) + 1e-30) << i << "[" << j << "]";
        }
        if (max_norm == 1000.0) {
          EXPECT_TRUE(same_bytes(clipped[i], grads[i]));
        }
      }
    }
  }
}

TEST(GradNorm, FastMatchesReferenceOnEveryIsa) {
  IsaGuard guard;
  const std::vector<Tensor> grads = {random_tensor({70001}, DType::F32, 4),
                                     random_tensor({129, 3}, DType::BF16, 5)};
  const double ref_norm = ops::reference::global_grad_norm(grads);
  std::vector<Tensor> ref_clipped = clone_all(grads);
  ops::reference::clip_grad_norm(ref_clipped, 0.5);
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    SCOPED_TRACE(isa_name(active_isa()));
    EXPECT_NEAR(ops::global_grad_norm(grads), ref_norm, 1e-12 * ref_norm);
    EXPECT_EQ(ops::global_grad_norm(grads), ops::global_grad_norm(grads));
    std::vector<Tensor> clipped = clone_all(grads);
    ops::clip_grad_norm(clipped, 0.5);
    // The same F32 coefficient unless the norms differ in their last bits: compare as values.
    for (size_t i = 0; i < grads.size(); ++i) {
      const std::vector<float> a = clipped[i].to_floats();
      const std::vector<float> b = ref_clipped[i].to_floats();
      for (size_t j = 0; j < a.size(); ++j) ASSERT_NEAR(a[j], b[j], 1e-6 * std::fabs(b[j]));
    }
  }
}

TEST(GradNorm, NanAndInfPropagateLikeTorch) {
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    std::vector<Tensor> grads = {random_tensor({100}, DType::F32, 6),
                                 random_tensor({50}, DType::BF16, 7)};
    grads[0].data<float>()[42] = bad;
    const double norm = ops::global_grad_norm(grads);
    EXPECT_EQ(std::isnan(norm), std::isnan(bad));
    EXPECT_EQ(std::isinf(norm), std::isinf(bad));
    EXPECT_EQ(std::isnan(ops::reference::global_grad_norm(grads)), std::isnan(bad));
    // torch: coefficient NaN (NaN norm) or 0 (Inf norm) multiplies every grad.
    ops::clip_grad_norm(grads, 1.0);
    const float other = grads[1].to_floats()[3];
    EXPECT_TRUE(std::isnan(bad) ? std::isnan(other) : other == 0.0f) << other;
  }
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(AdamW, BadInputsGetClearErrors) {
  for (bool fast : {false, true}) {
    auto step = [&](std::vector<AdamWTensor>& s, const AdamWHyper& h) {
      fast ? ops::adamw_step(s, h) : ops::reference::adamw_step(s, h);
    };
    std::vector<AdamWTensor> state = make_state({{{4, 5}, DType::F32, DType::BF16, 0.0f}});
    state[0].grad = Tensor::zeros({21}, DType::F32);
    std::string message = error_of([&] { step(state, {}); });
    EXPECT_NE(message.find("tensor 0 expected grad, exp_avg, exp_avg_sq of 20 elements"),
              std::string::npos)
        << message;
    state[0].grad = Tensor::zeros({4, 5}, DType::F32);
    state[0].model = Tensor::zeros({4, 5}, DType::F16);
    message = error_of([&] { step(state, {}); });
    EXPECT_NE(message.find("model"), std::string::npos) << message;
    state[0].model = Tensor::zeros({4, 5}, DType::E4M3);
    state[0].model_scale = 0.0f;
    message = error_of([&] { step(state, {}); });
    EXPECT_NE(message.find("model_scale"), std::string::npos) << message;
    state[0].model = Tensor();
    state[0].param = state[0].param.to(DType::BF16);
    message = error_of([&] { step(state, {}); });
    EXPECT_NE(message.find("tensor 0 param"), std::string::npos) << message;
    state = make_state({{{3}, DType::F32, DType::F32, 0.0f}});
    state[0].grad = Tensor::zeros({3}, DType::F32);
    message = error_of([&] { step(state, {1e-3f, 0.9f, 0.999f, 1e-8f, 0}); });
    EXPECT_NE(message.find("step expected >= 1, got 0"), std::string::npos) << message;
    std::vector<Tensor> grads = {Tensor::zeros({3}, DType::F32)};
    message = error_of([&] {
      fast ? ops::clip_grad_norm(grads, 0.0) : ops::reference::clip_grad_norm(grads, 0.0);
    });
    EXPECT_NE(message.find("max_norm"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace octet
