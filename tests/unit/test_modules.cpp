// Modules: Linear, LayerNormLinear, LayerNormMLP forward and backward against PyTorch; FP8
// under fp8_autocast against explicitly quantized-dequantized GEMM inputs, and the delayed
// scaling state over several steps; fused against unfused; activation recomputation.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

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

constexpr double kUnitRoundoff = 1.0 / (1 << 24);

std::vector<float> transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = x[r * cols + c];
  }
  return out;
}

// A reference result in FP64 and, per element, sum |terms|: the scale of its rounding error.
struct Reference {
  std::vector<double> value, magnitude;
};

std::vector<double> as_doubles(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// PyTorch's FP64 result, with the sums of |terms| of `ours` as its rounding scale.
Reference torch_with_magnitude(const Tensor& torch, Reference terms) {
  terms.value = as_doubles(torch.to_floats());
  return terms;
}

// c [m, n] = a [m, k] b [n, k]^T (+ bias [n]).
Reference matmul_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                    int64_t n, int64_t k, const std::vector<float>& bias = {}) {
  Reference c{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = bias.empty() ? 0.0 : bias[j], magnitude = 0;
      for (int64_t l = 0; l < k; ++l) {
        sum += a[i * k + l] * b[j * k + l];
        magnitude += std::fabs(a[i * k + l] * b[j * k + l]);
      }
      c.value[i * n + j] = sum;
      c.magnitude[i * n + j] = magnitude;
    }
  }
  return c;
}

// A GEMM (or column sum) of K products accumulated in F32, against an FP64 reference on the
// same operand values. As in test_gemm.cpp: |error| <= 2 (K + 4) u sum|a||b| covers the
// accumulation, F32 products and one F32 rounding per operand (FP8 codes times non-power-of-
// two block scales); the output's own roundings (scale, bias add, F32 store) add <= 2 u |c|.
void expect_within_rounding(const Tensor& got, const Reference& expected, int64_t k,
                            const std::string& what) {
  const std::vector<float> g = got.to_floats();
  ASSERT_EQ(g.size(), expected.value.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double e = expected.value[i];
    const double bound =
        2.0 * (k + 4) * kUnitRoundoff * expected.magnitude[i] + 2.0 * kUnitRoundoff * std::fabs(e);
    if (!(std::fabs(g[i] - e) <= bound) && failures++ < 3) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g[i] << ", reference " << e << " (error "
                    << std::fabs(g[i] - e) << " > bound " << bound << ")";
    }
  }
  EXPECT_EQ(failures, 0) << what << ": elements outside the FP32 rounding bound";
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
    // dW = dy^T x and db = column sums of dy take x and dy as given (torch gets the same BF16
    // or F32 values) and no weight: only the F32 sum over N = 21 tokens rounds, within
    // 2 (N + 4) u sum|dy||x| (expect_within_rounding).
    const int64_t tokens = 21;
    const std::vector<float> xv = x.to_floats(), dyv = dy.to_floats();
    const std::vector<double> x_columns = as_doubles(transposed(xv, tokens, 33));
    const std::vector<double> dy_columns = as_doubles(transposed(dyv, tokens, 65));
    const std::vector<double> ones(tokens, 1.0);
    expect_within_rounding(linear.weight.grad,
                           torch_with_magnitude(torch.at("weight.grad"),
                                                matmul_nt(dy_columns, x_columns, 65, 33, tokens)),
                           tokens, "weight.grad");
    expect_within_rounding(
        linear.bias.grad,
        torch_with_magnitude(torch.at("bias.grad"), matmul_nt(ones, dy_columns, 1, 65, tokens)),
        tokens, "bias.grad");
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

// ---- FP8 Linear against a quantize-dequantize reference, weight gradients included ----

// How a recipe scales one GEMM operand, in the orientation that GEMM reads it (blocks along
// its reduction dimension K, the operand's last dimension): one scale for the whole tensor,
// one FP32 scale per block_rows x block_cols block, or one E8M0 scale per 1x32 block.
struct OperandScaling {
  ScalingMode mode = ScalingMode::PerTensor;
  DType format = DType::E4M3;
  float scale = 1.0f;  // per tensor: the scale applied before the cast
  int64_t block_rows = 1, block_cols = 1;
  bool power_2_scale = false;
};

// x [rows, cols] row-major quantized and dequantized by the scalar rules of src/fp8 (not the
// bulk quantizer under test): code = fp8(x * scale) saturating, value = code * scale_inv of
// its block, in FP64.
std::vector<double> quantize_dequantize(const std::vector<float>& x, int64_t rows, int64_t cols,
                                        const OperandScaling& s) {
  const bool per_tensor = s.mode == ScalingMode::PerTensor;
  const int64_t block_rows = per_tensor ? rows : s.block_rows;
  const int64_t block_cols = per_tensor ? cols : s.mode == ScalingMode::MXFP8 ? 32 : s.block_cols;
  const float max_value = fp8_max(s.format);
  std::vector<double> out(x.size());
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
      const int64_t r1 = std::min(rows, r0 + block_rows), c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      }
      float scale = s.scale, scale_inv = 1.0f / s.scale;
      if (s.mode == ScalingMode::Block) {
        scale = compute_scale_from_amax(amax, max_value, s.power_2_scale, 0.0f);
        scale_inv = 1.0f / scale;
      } else if (s.mode == ScalingMode::MXFP8) {
        scale_inv = e8m0_to_float(float_to_e8m0_ceil(amax / max_value));
        scale = 1.0f / scale_inv;
      }
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const uint8_t code = float_to_fp8(x[r * cols + c] * scale, s.format, true);
          out[r * cols + c] = double(fp8_to_float(code, s.format)) * scale_inv;
        }
      }
    }
  }
  return out;
}

// Normal values times 2^((row % 4) - 2 + (col / 32) % 3) * stddev: every 1x32, 1x128 and
// 128x128 block, in either orientation, gets its own amax and scale.
Tensor block_varied(int64_t rows, int64_t cols, uint32_t seed, float stddev) {
  std::vector<float> v = random_tensor({rows, cols}, DType::F32, seed).to_floats();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      v[r * cols + c] *= stddev * std::ldexp(1.0f, int(r % 4) - 2 + int((c / 32) % 3));
    }
  }
  return Tensor::from_floats({rows, cols}, v);
}

float amax_of(const std::vector<float>& v) {
  float amax = 0.0f;
  for (float value : v) amax = std::max(amax, std::fabs(value));
  return amax;
}

// The three GEMM operands of a Linear under a recipe: input and weight (forward), output
// gradient; formats per the recipe's Format (HYBRID: E5M2 gradients). Per-tensor scales come
// from `tensor_amax` (the amax the recipe scales by: this tensor's under current scaling, the
// previous step's under delayed scaling).
struct LinearScalings {
  OperandScaling input, weight, grad_output;
};

LinearScalings scalings_of(const recipe::Recipe& r, const std::array<float, 3>& tensor_amax) {
  LinearScalings s;
  std::visit(
      [&](const auto& rr) {
        using R = std::decay_t<decltype(rr)>;
        const bool hybrid = rr.fp8_format == recipe::Format::HYBRID;
        s.input.format = s.weight.format = DType::E4M3;
        s.grad_output.format = hybrid ? DType::E5M2 : DType::E4M3;
        OperandScaling* operands[3] = {&s.input, &s.weight, &s.grad_output};
        for (int i = 0; i < 3; ++i) {
          OperandScaling& o = *operands[i];
          if constexpr (std::is_same_v<R, recipe::DelayedScaling>) {
            o.scale = fp8_max(o.format) / tensor_amax[i];  // margin 0, window max
          } else if constexpr (std::is_same_v<R, recipe::Float8CurrentScaling>) {
            o.scale = compute_scale_from_amax(tensor_amax[i], fp8_max(o.format), rr.power_2_scale,
                                              rr.amax_epsilon);
          } else if constexpr (std::is_same_v<R, recipe::MXFP8BlockScaling>) {
            o.mode = ScalingMode::MXFP8;
          } else {
            o.mode = ScalingMode::Block;
            o.power_2_scale = rr.power_2_scale;
            const bool weight = i == 1;
            o.block_rows = weight ? rr.weight_block : 1;
            o.block_cols = weight ? rr.weight_block : rr.activation_block;
          }
        }
      },
      r);
  return s;
}

// y = x W^T + b, dx = dy W, dW = dy^T x, db = column sums of dy, each GEMM on the operands
// quantized the way the recipe prescribes for it: forward rowwise x and W (blocks along
// in_features); dgrad rowwise dy and W's transpose (blocks along out_features); wgrad the
// columnwise copies of dy and x (blocks along the tokens). Compared on the second step, when
// delayed scaling has real scales (from the first step's amaxes, which differ from this one's).
TEST(Fp8Linear, EveryRecipeMatchesQuantizedReferenceWeightGradientsIncluded) {
  recipe::DelayedScaling delayed_e4m3;
  delayed_e4m3.fp8_format = recipe::Format::E4M3;
  recipe::Float8CurrentScaling current_e4m3;
  current_e4m3.fp8_format = recipe::Format::E4M3;
  recipe::MXFP8BlockScaling mxfp8_hybrid;
  mxfp8_hybrid.fp8_format = recipe::Format::HYBRID;
  recipe::Float8BlockScaling block_hybrid_fp32_scales;
  block_hybrid_fp32_scales.fp8_format = recipe::Format::HYBRID;
  block_hybrid_fp32_scales.power_2_scale = false;  // the GEMM widens to F32
  const recipe::Recipe recipes[] = {recipe::DelayedScaling{},       delayed_e4m3,
                                    recipe::Float8CurrentScaling{}, current_e4m3,
                                    recipe::MXFP8BlockScaling{},    mxfp8_hybrid,
                                    recipe::Float8BlockScaling{},   block_hybrid_fp32_scales};
  // Not multiples of 32 or 128 along any reduction: partial blocks everywhere.
  const int64_t tokens = 48, in = 160, out = 96;
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  const Tensor x_before = block_varied(tokens, in, 120, 2.0f);
  const Tensor dy_before = block_varied(tokens, out, 121, 3e-3f);
  const Tensor x = block_varied(tokens, in, 122, 1.0f);
  const Tensor dy = block_varied(tokens, out, 123, 1e-3f);
  const std::vector<float> xv = x.to_floats(), dyv = dy.to_floats();
  for (const recipe::Recipe& r : recipes) {
    SCOPED_TRACE(recipe::describe(r));
    Linear linear(o);
    randomize(linear, 25);
    const std::vector<float> wv = linear.weight.value.to_floats();
    const std::vector<float> bv = linear.bias.value.to_floats();
    {  // a first step: delayed scaling records the amaxes this step's scales come from
      Linear::Context ctx;
      fp8_autocast scope(true, r);
      linear.forward(x_before, ctx);
      linear.backward(dy_before, ctx);
    }
    linear.zero_grad();
    Linear::Context ctx;
    Tensor y, dx;
    {
      fp8_autocast scope(true, r);
      y = linear.forward(x, ctx);
      dx = linear.backward(dy, ctx);
    }
    // Current and block scaling scale by this step's tensors, delayed scaling by the amaxes
    // of the step before (margin 0; the window holds that one step).
    const bool delayed = std::holds_alternative<recipe::DelayedScaling>(r);
    const LinearScalings s =
        scalings_of(r, {amax_of((delayed ? x_before : x).to_floats()), amax_of(wv),
                        amax_of((delayed ? dy_before : dy).to_floats())});
    const std::vector<float> xt = transposed(xv, tokens, in), dyt = transposed(dyv, tokens, out);
    const std::vector<double> x_rows = quantize_dequantize(xv, tokens, in, s.input);
    const std::vector<double> w_rows = quantize_dequantize(wv, out, in, s.weight);
    const std::vector<double> w_columns =
        quantize_dequantize(transposed(wv, out, in), in, out, s.weight);
    const std::vector<double> dy_rows = quantize_dequantize(dyv, tokens, out, s.grad_output);
    const std::vector<double> x_columns = quantize_dequantize(xt, in, tokens, s.input);
    const std::vector<double> dy_columns = quantize_dequantize(dyt, out, tokens, s.grad_output);

    expect_within_rounding(y, matmul_nt(x_rows, w_rows, tokens, out, in, bv), in, "y");
    expect_within_rounding(dx, matmul_nt(dy_rows, w_columns, tokens, in, out), out, "dx");
    expect_within_rounding(linear.weight.grad, matmul_nt(dy_columns, x_columns, out, in, tokens),
                           tokens, "dW");
    const std::vector<double> ones(tokens, 1.0);
    expect_within_rounding(linear.bias.grad, matmul_nt(ones, as_doubles(dyt), 1, out, tokens),
                           tokens, "db");
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

// Under fp4_autocast the Linear's forward is the FP4 GEMM of its quantized input (1x16 or 1x32)
// and weight (16x16 under NVFP4); its gradients stay at FP4's distance from the exact ones, and
// the input gradient's stochastic rounding averages out over backward calls.
// FP4 health (--fp8-stats under --precision fp4): underflow and saturation counted
// independently here from the dequantized tensor and the block scales; the Linear records its
// input, weight and output gradient under fp8_stats_scope.
TEST(Fp4Linear, StatsCountUnderflowAndSaturation) {
  for (Fp4Recipe recipe : {Fp4Recipe::NVFP4, Fp4Recipe::MXFP4}) {
    SCOPED_TRACE(fp4_recipe_name(recipe));
    std::vector<float> values(8 * 64);
    std::mt19937 gen(4);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = normal(gen) * (i % 7 == 0 ? 1e-3f : 1.0f);  // some far below their block
    }
    const Tensor x = Tensor::from_floats({8, 64}, values);
    Fp4Options options;
    options.recipe = recipe;
    const Float4Tensor q = quantize_fp4(x, options);
    const Fp8TensorStats stats = measure_fp4(x, q);
    const std::vector<float> dq = q.dequantize().to_floats();
    int64_t underflow = 0, saturated = 0;
    float amax = 0, min_scale = std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < 8; ++r) {
      for (int64_t c = 0; c < 64; ++c) {
        const float v = values[static_cast<size_t>(r * 64 + c)];
        amax = std::max(amax, std::fabs(v));
        if (v != 0.0f && dq[static_cast<size_t>(r * 64 + c)] == 0.0f) ++underflow;
        const float block = q.block_scale(r, c) * q.global_scale_inv;
        min_scale = std::min(min_scale, 1.0f / block);
        if (std::fabs(v) / block >= 7.0f) ++saturated;
      }
    }
    EXPECT_GT(underflow, 0);
    EXPECT_EQ(stats.numel, 512);
    EXPECT_FLOAT_EQ(stats.amax, amax);
    EXPECT_FLOAT_EQ(stats.scale, min_scale);
    EXPECT_DOUBLE_EQ(stats.underflow, static_cast<double>(underflow) / 512);
    EXPECT_DOUBLE_EQ(stats.saturated, static_cast<double>(saturated) / 512);

    LinearOptions o;
    o.in_features = 64;
    o.out_features = 32;
    o.name = "fp4_linear";
    Linear linear(o);
    randomize(linear, 6);
    Linear::Context ctx;
    {
      fp8_stats_scope stats_on;
      fp4_autocast scope(true, options);
      const Tensor y = linear.forward(x, ctx);
      linear.backward(random_tensor({8, 32}, DType::F32, 7), ctx);
    }
    std::vector<std::string> names;
    for (const auto& [name, s] : linear.fp8_state().stats()) names.push_back(name);
    EXPECT_EQ(names, (std::vector<std::string>{"fp4_linear.input", "fp4_linear.weight",
                                               "fp4_linear.grad_output"}));
    EXPECT_DOUBLE_EQ(linear.fp8_state().stats()[0].second.underflow, stats.underflow);
  }
}

TEST(Fp4Linear, ForwardIsTheFp4GemmAndGradientsAreUnbiased) {
  for (Fp4Recipe recipe : {Fp4Recipe::NVFP4, Fp4Recipe::MXFP4}) {
    SCOPED_TRACE(fp4_recipe_name(recipe));
    LinearOptions o;
    o.in_features = 64;
    o.out_features = 48;
    o.name = "fp4_linear";
    Linear linear(o);
    randomize(linear, 5);
    const Tensor x = random_tensor({2, 16, 64}, DType::F32, 80);
    const Tensor dy = random_tensor({2, 16, 48}, DType::F32, 81);
    Fp4Options options;
    options.recipe = recipe;
    Fp4Options weight_options = options;
    weight_options.block_2d = recipe == Fp4Recipe::NVFP4;
    const Tensor xq = quantize_fp4(x, options).dequantize();
    const Tensor wq = quantize_fp4(linear.weight.value, weight_options).dequantize();

    Linear::Context ctx;
    Tensor y;
    {
      fp4_autocast scope(true, options);
      y = linear.forward(x, ctx);
    }
    Tensor expected = Tensor::empty({32, 48}, DType::F32);
    Epilogue bias;
    bias.bias = &linear.bias.value;
    gemm_reference(xq.reshape({32, 64}), wq, expected, false, true, 1.0f, 0.0f, bias);
    EXPECT_LT(worst(y.reshape({32, 48}), expected, 1e-5, 1e-5), 1.0);

    // One backward: dx and dW near the exact gradients; the bias gradient exact.
    Tensor exact_dx = Tensor::empty({32, 64}, DType::F32);
    gemm_reference(dy.reshape({32, 48}), linear.weight.value, exact_dx, false, false);
    Tensor exact_dw = Tensor::empty({48, 64}, DType::F32);
    gemm_reference(dy.reshape({32, 48}), x.reshape({32, 64}), exact_dw, true, false);
    const Tensor dx = linear.backward(dy, ctx);
    EXPECT_LT(relative_rms(dx.reshape({32, 64}), exact_dx), 0.2);
    EXPECT_LT(relative_rms(linear.weight.grad, exact_dw), 0.3);  // both operands quantized
    Tensor column_sums = Tensor::zeros({48}, DType::F32);
    for (int64_t i = 0; i < 32 * 48; ++i) column_sums.data<float>()[i % 48] += dy.data<float>()[i];
    EXPECT_LT(worst(linear.bias.grad, column_sums, 1e-5, 1e-5), 1.0);

    // dx = Q(dy) Q(W): Q(dy) rounds stochastically, so the mean over calls approaches dy Q(W).
    Tensor dy_wq = Tensor::empty({32, 64}, DType::F32);
    gemm_reference(
        dy.reshape({32, 48}),
        recipe == Fp4Recipe::NVFP4 ? wq : quantize_fp4(linear.weight.value, options).dequantize(),
        dy_wq, false, false);
    if (recipe == Fp4Recipe::NVFP4) {
      const double one_call = relative_rms(dx.reshape({32, 64}), dy_wq);
      Tensor mean = Tensor::zeros({32, 64}, DType::F32);
      const int calls = 64;
      for (int c = 0; c < calls; ++c) {
        {
          fp4_autocast scope(true, options);
          linear.forward(x, ctx);
        }
        const Tensor d = linear.backward(dy, ctx);
        for (int64_t i = 0; i < mean.numel(); ++i)
          mean.data<float>()[i] += d.data<float>()[i] / calls;
      }
      const double averaged = relative_rms(mean, dy_wq);
      std::printf("[ measured ] nvfp4 dx vs dy Q(W): one call %.4f, mean of %d calls %.4f\n",
                  one_call, calls, averaged);
      EXPECT_LT(averaged, one_call / 4);
    }

    // The quantized weight (and MXFP4's transposed one) is cached for one optimizer step:
    // after new weights and on_parameters_updated, forward and dx follow the new weights.
    randomize(linear, 9);
    linear.on_parameters_updated();
    {
      fp4_autocast scope(true, options);
      y = linear.forward(x, ctx);
    }
    const Tensor wq2 = quantize_fp4(linear.weight.value, weight_options).dequantize();
    gemm_reference(xq.reshape({32, 64}), wq2, expected, false, true, 1.0f, 0.0f, bias);
    EXPECT_LT(worst(y.reshape({32, 48}), expected, 1e-5, 1e-5), 1.0);
    gemm_reference(dy.reshape({32, 48}), linear.weight.value, exact_dx, false, false);
    // (FP4 noise: 0.1-0.21 measured; the previous weights' dx would be ~1.4 off.)
    EXPECT_LT(relative_rms(linear.backward(dy, ctx).reshape({32, 64}), exact_dx), 0.3);
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
