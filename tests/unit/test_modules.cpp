// Modules: Linear, LayerNormLinear, LayerNormMLP forward and backward against PyTorch; FP8
// under fp8_autocast against explicitly quantized-dequantized GEMM inputs, and the delayed
// scaling state over several steps; fused against unfused; activation recomputation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/modules.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::max_abs;
using octet::testing::random_tensor;
using octet::testing::relative_rms;
using octet::testing::worst;

void randomize(Module& m, uint32_t seed) {
  for (Parameter* p : m.parameters()) {
    Tensor r = random_tensor(p->value.shape(), DType::F32, seed++, 0.0f, 0.3f);
    p->value.copy_from(r);
  }
  m.on_parameters_updated();
}

TensorMap parameter_map(Module& m, const std::string& strip_prefix) {
  TensorMap out;
  for (Parameter* p : m.parameters()) {
    std::string name = p->name.substr(strip_prefix.size());
    out[name] = p->value;
  }
  return out;
}

void expect_grads(Module& m, const std::string& strip_prefix, const TensorMap& torch, double atol,
                  double rtol) {
  for (Parameter* p : m.parameters()) {
    std::string name = p->name.substr(strip_prefix.size()) + ".grad";
    SCOPED_TRACE(name);
    ASSERT_TRUE(torch.count(name));
    EXPECT_LE(worst(p->grad, torch.at(name), atol, rtol), 1.0);
  }
}

// F32: GEMMs accumulate in F32 over K <= 192 terms of O(1) values: ~K * 2^-24 relative.
// BF16: inputs, weights and outputs are rounded to BF16 (2^-8), errors add over layers.
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{2e-5, 2e-4} : Tolerance{6e-2, 4e-2};
}

TEST(Linear, ForwardBackwardMatchTorch) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    LinearOptions o;
    o.in_features = 33;
    o.out_features = 65;
    o.name = "l";
    Linear linear(o);
    randomize(linear, 1);
    Tensor x = random_tensor({3, 7, 33}, dtype, 10);
    Tensor dy = random_tensor({3, 7, 65}, dtype, 11);
    Linear::Context ctx;
    Tensor y = linear.forward(x, ctx);
    EXPECT_EQ(y.shape(), (Shape{3, 7, 65}));
    Tensor dx = linear.backward(dy, ctx);
    EXPECT_EQ(dx.shape(), (Shape{3, 7, 33}));
    TensorMap in = parameter_map(linear, "l.");
    in["x"] = x;
    in["dy"] = dy;
    TensorMap torch = octet::testing::run_torch("linear", in);
    Tolerance t = tolerance(dtype);
    EXPECT_LE(worst(y, torch.at("y"), t.atol, t.rtol), 1.0);
    EXPECT_LE(worst(dx, torch.at("x.grad"), t.atol, t.rtol), 1.0);
    expect_grads(linear, "l.", torch, t.atol * 20, t.rtol);
  }
}

TEST(LayerNormLinear, ForwardBackwardMatchTorch) {
  for (NormKind kind : {NormKind::LayerNorm, NormKind::RMSNorm}) {
    LayerNormLinearOptions o;
    o.norm.hidden = 48;
    o.norm.kind = kind;
    o.norm.name = "m.norm";
    o.linear.in_features = 48;
    o.linear.out_features = 144;
    o.linear.name = "m";
    LayerNormLinear module(o);
    randomize(module, 3);
    Tensor x = random_tensor({13, 48}, DType::F32, 12);
    Tensor dy = random_tensor({13, 144}, DType::F32, 13);
    LayerNormLinear::Context ctx;
    Tensor y = module.forward(x, ctx);
    Tensor dx = module.backward(dy, ctx);
    TensorMap in = parameter_map(module, "m.");
    in["x"] = x;
    in["dy"] = dy;
    std::string args = std::string("{\"eps\": 1e-5, \"norm\": \"") +
                       (kind == NormKind::LayerNorm ? "layernorm" : "rmsnorm") + "\"}";
    TensorMap torch = octet::testing::run_torch("layernorm_linear", in, args);
    EXPECT_LE(worst(y, torch.at("y"), 2e-5, 2e-4), 1.0);
    EXPECT_LE(worst(dx, torch.at("x.grad"), 2e-5, 2e-4), 1.0);
    expect_grads(module, "m.", torch, 4e-4, 2e-4);
  }
}

LayerNormMLPOptions mlp_options(ops::ActivationKind activation, bool checkpoint) {
  LayerNormMLPOptions o;
  o.hidden = 32;
  o.ffn_hidden = 80;
  o.activation = activation;
  o.norm.hidden = 32;
  o.norm.name = "mlp.norm";
  o.checkpoint = checkpoint;
  o.name = "mlp";
  return o;
}

TEST(LayerNormMLP, ForwardBackwardMatchTorch) {
  for (ops::ActivationKind act : {ops::ActivationKind::GeluTanh, ops::ActivationKind::SwiGlu}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(ops::activation_name(act)) + " " + std::string(dtype_name(dtype)));
      LayerNormMLP mlp(mlp_options(act, false));
      randomize(mlp, 5);
      Tensor x = random_tensor({2, 9, 32}, dtype, 14);
      Tensor dy = random_tensor({2, 9, 32}, dtype, 15);
      LayerNormMLP::Context ctx;
      Tensor y = mlp.forward(x, ctx);
      Tensor dx = mlp.backward(dy, ctx);
      TensorMap in = parameter_map(mlp, "mlp.");
      in["x"] = x;
      in["dy"] = dy;
      std::string args =
          "{\"eps\": 1e-5, \"activation\": \"" + std::string(ops::activation_name(act)) + "\"}";
      TensorMap torch = octet::testing::run_torch("layernorm_mlp", in, args);
      Tolerance t = tolerance(dtype);
      EXPECT_LE(worst(y, torch.at("y"), t.atol, t.rtol), 1.0);
      EXPECT_LE(worst(dx, torch.at("x.grad"), t.atol, t.rtol), 1.0);
      expect_grads(mlp, "mlp.", torch, t.atol * 20, t.rtol * 2);
    }
  }
}

// Zero-bubble's split backward: under defer_weight_gradients a Linear's backward gives dx and
// the bias gradient at once and queues the weight-gradient GEMM; running the queue later
// accumulates exactly what the immediate backward does (F32, BF16, FP8 delayed scaling).
TEST(Linear, DeferredWeightGradientEqualsImmediate) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool fp8 : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (fp8 ? " fp8" : ""));
      LinearOptions o;
      o.in_features = 48;
      o.out_features = 32;
      o.name = "linear";
      Linear immediate(o), deferred(o);
      randomize(immediate, 3);
      randomize(deferred, 3);
      for (int step = 0; step < 2; ++step) {
        Tensor x = random_tensor({2, 5, 48}, dtype, 60 + step);
        Tensor dy = random_tensor({2, 5, 32}, dtype, 70 + step);
        Linear::Context a, b;
        {
          fp8_autocast scope(fp8, recipe::DelayedScaling{});
          immediate.forward(x, a);
          deferred.forward(x, b);
        }
        const Tensor dxa = immediate.backward(dy, a);
        const std::vector<float> weight_grad_before = deferred.weight.grad.to_floats();
        WeightGradientQueue queue;
        Tensor dxb;
        {
          defer_weight_gradients scope(queue);
          dxb = deferred.backward(dy, b);
        }
        EXPECT_EQ(deferred_weight_gradients(), nullptr);  // the scope is closed
        EXPECT_EQ(queue.size(), 1u);
        EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
        EXPECT_EQ(immediate.bias.grad.to_floats(), deferred.bias.grad.to_floats());
        EXPECT_EQ(deferred.weight.grad.to_floats(), weight_grad_before);  // not yet
        queue.run();
        EXPECT_TRUE(queue.empty());
        EXPECT_EQ(immediate.weight.grad.to_floats(), deferred.weight.grad.to_floats());
      }
    }
  }
}

TEST(LayerNormMLP, CheckpointRecomputesExactly) {
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    LayerNormMLP plain(mlp_options(ops::ActivationKind::GeluTanh, false));
    LayerNormMLP recomputed(mlp_options(ops::ActivationKind::GeluTanh, true));
    randomize(plain, 7);
    randomize(recomputed, 7);
    for (int step = 0; step < 3; ++step) {
      Tensor x = random_tensor({16, 32}, DType::BF16, 20 + step);
      Tensor dy = random_tensor({16, 32}, DType::BF16, 30 + step);
      LayerNormMLP::Context a, b;
      Tensor ya, yb;
      {
        fp8_autocast scope(fp8, recipe::DelayedScaling{});
        ya = plain.forward(x, a);
        yb = recomputed.forward(x, b);
      }
      EXPECT_FALSE(b.activation.defined());  // nothing but the input was kept
      Tensor dxa = plain.backward(dy, a);
      Tensor dxb = recomputed.backward(dy, b);
      EXPECT_EQ(ya.to_floats(), yb.to_floats());
      EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
      EXPECT_EQ(plain.fc1.weight.grad.to_floats(), recomputed.fc1.weight.grad.to_floats());
    }
  }
}

TEST(Fp8LayerNormMLP, FusedActivationCastsEqualUnfused) {
  // Delayed scaling: the activation kernel writes FC2's FP8 input and the activation's
  // backward FC1's FP8 gradient. Under fp8_stats_scope the module takes the unfused path
  // (high-precision tensors, then the quantizers). In F32 both round each value once.
  for (ops::ActivationKind act : {ops::ActivationKind::GeluTanh, ops::ActivationKind::SwiGlu}) {
    SCOPED_TRACE(std::string(ops::activation_name(act)));
    LayerNormMLP fused(mlp_options(act, false));
    LayerNormMLP unfused(mlp_options(act, false));
    randomize(fused, 21);
    randomize(unfused, 21);
    for (int step = 0; step < 3; ++step) {  // later steps: real delayed scales
      Tensor x = random_tensor({2, 9, 32}, DType::F32, 100 + step);
      Tensor dy = random_tensor({2, 9, 32}, DType::F32, 110 + step, 0.0f, 1e-2f);
      LayerNormMLP::Context a, b;
      Tensor ya, yb, dxa, dxb;
      {
        fp8_autocast scope(true, recipe::DelayedScaling{});
        ya = fused.forward(x, a);
        EXPECT_GT(a.activation_fp8_scale, 0.0f);  // the kernel wrote the codes
        dxa = fused.backward(dy, a);
        fp8_stats_scope stats;
        yb = unfused.forward(x, b);
        EXPECT_EQ(b.activation_fp8_scale, 0.0f);
        dxb = unfused.backward(dy, b);
      }
      EXPECT_EQ(ya.to_floats(), yb.to_floats());
      EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
      std::vector<Parameter*> pa = fused.parameters(), pb = unfused.parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        SCOPED_TRACE(pa[i]->name);
        EXPECT_EQ(pa[i]->grad.to_floats(), pb[i]->grad.to_floats());
      }
    }
  }
}

// Dequantized copy of what a quantizer produces: the explicit quantize-dequantize reference.
Tensor fake_quantize(const Tensor& x, DType format, float scale) {
  Float8Tensor q = Quantizer::fixed(format, scale).quantize(x.reshape({x.rows(), x.cols()}));
  return q.dequantize();
}

TEST(Fp8Linear, DelayedScalingMatchesQuantizedReferenceAndEvolves) {
  LinearOptions o;
  o.in_features = 64;
  o.out_features = 96;
  o.name = "l";
  Linear linear(o);
  randomize(linear, 9);
  recipe::DelayedScaling recipe;  // HYBRID, history 1024, max
  recipe.amax_history_len = 4;
  std::vector<float> input_amaxes;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    float spread = 1.0f + step;  // growing inputs: the scale must follow
    Tensor x = random_tensor({24, 64}, DType::F32, 40 + step, 0.0f, spread);
    Tensor dy = random_tensor({24, 96}, DType::F32, 50 + step, 0.0f, 1e-3f);
    // The scales this step will use: from the history of the previous steps.
    float expected_input_scale = 1.0f;
    if (!input_amaxes.empty()) {
      float window = 0.0f;
      for (size_t i = input_amaxes.size() >= 4 ? input_amaxes.size() - 4 : 0;
           i < input_amaxes.size(); ++i) {
        window = std::max(window, input_amaxes[i]);
      }
      expected_input_scale = 448.0f / window;
    }
    Linear::Context ctx;
    Tensor y;
    {
      fp8_autocast scope(true, recipe);
      y = linear.forward(x, ctx);
    }
    const FP8Meta& meta = linear.fp8_state().forward_meta();
    EXPECT_FLOAT_EQ(meta.scale(0), expected_input_scale);
    float amax = 0;
    for (float v : x.to_floats()) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(meta.amax_history(0, 0), amax);  // this step's amax, recorded in row 0
    input_amaxes.push_back(amax);

    // Reference: y = Q(x) Q(W)^T + b with the same scales, in FP64.
    Tensor xq = fake_quantize(x, DType::E4M3, meta.scale(0));
    Tensor wq = fake_quantize(linear.weight.value, DType::E4M3, meta.scale(1));
    Tensor expected = Tensor::empty({24, 96}, DType::F32);
    Epilogue bias{&linear.bias.value, Activation::None};
    gemm_reference(xq, wq, expected, false, true, 1.0f, 0.0f, bias);
    EXPECT_LE(worst(y, expected, 1e-5, 1e-5), 1.0);  // equal to FP32 rounding

    // Backward: gradients quantized as E5M2 (HYBRID) with the backward meta's scale.
    linear.zero_grad();
    float grad_scale_used = 1.0f;
    Tensor dx = linear.backward(dy, ctx);
    grad_scale_used = linear.fp8_state().backward_meta().scale(0);
    Tensor dyq = fake_quantize(dy, DType::E5M2, grad_scale_used);
    Tensor expected_dx = Tensor::empty({24, 64}, DType::F32);
    gemm_reference(dyq, wq, expected_dx, false, false);
    // FP32 accumulation over K terms: error <= K * 2^-24 * sum|a||b|, bounded here by a
    // fraction of the largest result (sums of mixed signs make relative error meaningless).
    EXPECT_LE(worst(dx, expected_dx, 1e-5 * max_abs(expected_dx), 1e-5), 1.0);
    Tensor expected_dw = Tensor::empty({96, 64}, DType::F32);
    gemm_reference(dyq, xq, expected_dw, true, false);
    EXPECT_LE(worst(linear.weight.grad, expected_dw, 1e-5 * max_abs(expected_dw), 1e-5), 1.0);
    if (step >= 2) {
      // After a step with real gradients the E5M2 scale is 57344 / amax(dy) of the history.
      EXPECT_GT(grad_scale_used, 1e6f);
    }
  }
}

TEST(Fp8LayerNormLinear, FusedNormCastEqualsUnfused) {
  // Delayed scaling: the norm kernel writes FP8 directly. Current scaling: the norm writes
  // BF16 and the quantizer casts it. With the same scale both must give the same output.
  LayerNormLinearOptions o;
  o.norm.hidden = 64;
  o.norm.name = "m.norm";
  o.linear.in_features = 64;
  o.linear.out_features = 32;
  o.linear.name = "m";
  LayerNormLinear fused(o);
  randomize(fused, 11);
  Tensor x = random_tensor({20, 64}, DType::F32, 60);
  LayerNormLinear::Context ctx;
  Tensor y_fused;
  {
    fp8_autocast scope(true, recipe::DelayedScaling{});
    y_fused = fused.forward(x, ctx);  // first step: scale 1
  }
  Norm::Context nctx;
  Tensor normalized = fused.norm.forward(x, nctx);
  Tensor xq = fake_quantize(normalized, DType::E4M3, 1.0f);
  Tensor wq = fake_quantize(fused.linear.weight.value, DType::E4M3, 1.0f);
  Tensor expected = Tensor::empty({20, 32}, DType::F32);
  Epilogue bias{&fused.linear.bias.value, Activation::None};
  gemm_reference(xq, wq, expected, false, true, 1.0f, 0.0f, bias);
  EXPECT_LE(worst(y_fused, expected, 1e-5, 1e-5), 1.0);
  float amax = 0;
  for (float v : normalized.to_floats()) amax = std::max(amax, std::fabs(v));
  EXPECT_FLOAT_EQ(fused.linear.fp8_state().forward_meta().amax_history(0, 0), amax);
}

TEST(Fp8Linear, EveryRecipeRunsAndStaysClose) {
  const recipe::Recipe recipes[] = {recipe::DelayedScaling{}, recipe::Float8CurrentScaling{},
                                    recipe::MXFP8BlockScaling{}, recipe::Float8BlockScaling{}};
  LinearOptions o;
  o.in_features = 128;
  o.out_features = 64;
  Linear linear(o);
  randomize(linear, 13);
  Tensor x = random_tensor({32, 128}, DType::BF16, 70);
  Tensor dy = random_tensor({32, 64}, DType::BF16, 71);
  Linear::Context ctx;
  Tensor y_ref = linear.forward(x, ctx);
  Tensor dx_ref = linear.backward(dy, ctx);
  for (const recipe::Recipe& r : recipes) {
    SCOPED_TRACE(recipe::describe(r));
    Tensor y, dx;
    for (int step = 0; step < 2; ++step) {  // step 2: delayed scaling has a real scale
      fp8_autocast scope(true, r);
      y = linear.forward(x, ctx);
      dx = linear.backward(dy, ctx);
    }
    // E4M3 rounds each input with relative error up to 2^-4 (RMS ~1.8%), E5M2 up to 2^-3
    // (RMS ~3.6%): products of two such inputs give ~2.5% (forward) and ~4% (dgrad) RMS.
    EXPECT_LT(relative_rms(y, y_ref), 0.05);
    EXPECT_LT(relative_rms(dx, dx_ref), 0.08);
    EXPECT_GT(relative_rms(y, y_ref), 1e-3);  // it really ran in FP8
  }
}

std::vector<uint8_t> codes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

TEST(Fp8Linear, WeightQuantizedOncePerStepAndScale) {
  LinearOptions o;
  o.in_features = 64;
  o.out_features = 32;
  Linear linear(o);
  randomize(linear, 15);
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 2;
  Tensor x = random_tensor({16, 64}, DType::BF16, 80);
  float weight_amax = 0;
  for (float v : linear.weight.value.to_floats()) weight_amax = std::max(weight_amax, std::fabs(v));
  auto forward = [&](Linear::Context& ctx) {
    fp8_autocast scope(true, recipe);
    return linear.forward(x, ctx);
  };
  Linear::Context first, second, third, updated;
  forward(first);   // scale 1
  forward(second);  // scale 448 / amax: quantized again
  forward(third);   // the same scale: reused
  EXPECT_NE(first.weight_fp8.data.raw(), second.weight_fp8.data.raw());
  EXPECT_EQ(second.weight_fp8.data.raw(), third.weight_fp8.data.raw());
  // A reuse records the weight's amax as a fresh quantization would.
  EXPECT_EQ(linear.fp8_state().forward_meta().amax_history(0, 1), weight_amax);
  linear.on_parameters_updated();
  forward(updated);
  EXPECT_NE(third.weight_fp8.data.raw(), updated.weight_fp8.data.raw());
  EXPECT_EQ(codes_of(third.weight_fp8.data), codes_of(updated.weight_fp8.data));
}

TEST(Fp8Linear, ReplayAndRestoredInputEqualTheForward) {
  const recipe::Recipe recipes[] = {recipe::DelayedScaling{}, recipe::Float8CurrentScaling{},
                                    recipe::MXFP8BlockScaling{}, recipe::Float8BlockScaling{}};
  LinearOptions o;
  o.in_features = 128;
  o.out_features = 64;
  Linear kept(o), restored(o);
  randomize(kept, 17);
  randomize(restored, 17);
  Tensor x = random_tensor({32, 128}, DType::BF16, 90);
  Tensor dy = random_tensor({32, 64}, DType::BF16, 91);
  for (const recipe::Recipe& r : recipes) {
    SCOPED_TRACE(recipe::describe(r));
    for (int step = 0; step < 2; ++step) {  // step 2: delayed scaling has a real scale
      Linear::Context a, b;
      Tensor ya, yb;
      {
        fp8_autocast scope(true, r);
        ya = kept.forward(x, a);
        yb = restored.forward(x, b, SavedInput::None);
      }
      EXPECT_EQ(ya.to_floats(), yb.to_floats());
      // Per-tensor scaling keeps the rowwise codes, from which the forward can be replayed.
      const bool per_tensor = a.input_fp8.mode == ScalingMode::PerTensor;
      EXPECT_EQ(kept.can_replay(a), per_tensor);
      if (per_tensor) {
        EXPECT_EQ(kept.replay_forward(a).to_floats(), ya.to_floats());
      }
      EXPECT_FALSE(b.input_fp8.has_rowwise() || b.input_fp8.has_columnwise());
      EXPECT_THROW(restored.backward(dy, b), Error);
      restored.restore_input(x, b);
      const Tensor& codes = per_tensor ? a.input_fp8.data : a.input_fp8.data_t;
      const Tensor& restored_codes = per_tensor ? b.input_fp8.data : b.input_fp8.data_t;
      EXPECT_EQ(codes_of(codes), codes_of(restored_codes));
      kept.zero_grad();
      restored.zero_grad();
      EXPECT_EQ(kept.backward(dy, a).to_floats(), restored.backward(dy, b).to_floats());
      EXPECT_EQ(kept.weight.grad.to_floats(), restored.weight.grad.to_floats());
    }
  }
}

TEST(Modules, BadInputIsNamed) {
  LinearOptions o;
  o.in_features = 8;
  o.out_features = 4;
  o.name = "proj";
  Linear linear(o);
  Linear::Context ctx;
  Tensor x = Tensor::zeros({3, 9}, DType::F32);
  try {
    linear.forward(x, ctx);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "proj: input expected [..., in_features=8], got [3,9]");
  }
  LinearOptions bad = o;
  bad.in_features = 0;
  EXPECT_THROW(Linear{bad}, Error);
}

}  // namespace
}  // namespace octet
