// LayerNormMLP: norm -> FC1 -> activation (FC1's bias fused into it) -> FC2 (bias in the GEMM
// epilogue). With `checkpoint`, FC1's output and the activation are recomputed in backward
// from the saved block input instead of being kept. Under FP8 the norm writes FC1's FP8 input
// itself, and the activation (FC2's input) is not kept: backward recomputes it from FC1's
// output, which the activation's backward needs anyway (TransformerEngine keeps both).
#include "modules/common.h"
#include "octet/ops/elementwise.h"

namespace octet {

LinearOptions LayerNormMLP::fc_options(const LayerNormMLPOptions& o, bool first) {
  LinearOptions l;
  const bool gated = ops::is_gated(o.activation);
  int64_t fc1_out = gated ? 2 * o.ffn_hidden : o.ffn_hidden;
  l.in_features = first ? o.hidden : o.ffn_hidden;
  l.out_features = first ? fc1_out : o.hidden;
  l.bias = o.bias;
  l.return_bias = first;  // FC1's bias is added inside the activation kernel
  l.init_std = first ? o.init_std : o.output_init_std;
  l.seed = o.seed * 2 + (first ? 1 : 2);
  l.name = o.name + (first ? ".fc1" : ".fc2");
  // Under a tensor-parallel group: FC1 by output columns (both halves [a | b] of a gated
  // activation split alike), FC2 by input columns.
  l.parallel_mode = first ? ParallelMode::Column : ParallelMode::Row;
  l.sequence_parallel = o.sequence_parallel;
  if (first && gated) l.output_blocks = {o.ffn_hidden, o.ffn_hidden};
  return l;
}

namespace {

// act(h + bias) [N, F] written as per-tensor FP8 codes by the activation kernel (no
// high-precision copy); h [N, F_in].
Float8Tensor activation_fp8(ops::ActivationKind kind, const Tensor& h, const Tensor* bias,
                            int64_t ffn_hidden, DType format, float scale) {
  Float8Tensor out;
  out.format = format;
  out.mode = ScalingMode::PerTensor;
  out.rows = h.rows();
  out.cols = ffn_hidden;
  out.scale = scale;
  out.data = Tensor::empty({out.rows, out.cols}, format);
  ops::Fp8Store store{format, scale, static_cast<uint8_t*>(out.data.raw()), 0.0f};
  Tensor none;
  ops::activation_forward(kind, h.reshape({h.rows(), h.cols()}), bias, none, &store);
  out.amax = store.amax;
  out.scale_inv = Tensor::from_floats({1}, {1.0f / scale});
  return out;
}

}  // namespace

LayerNormMLP::LayerNormMLP(const LayerNormMLPOptions& options, Communicator* tp)
    : norm(options.norm),
      fc1(fc_options(options, true), tp),
      fc2(fc_options(options, false), tp),
      options_(options),
      local_ffn_(options.ffn_hidden / (tp ? tp->size() : 1)) {
  OCTET_CHECK(options.norm.hidden == options.hidden, options.name, ": norm hidden (",
              options.norm.hidden, ") must equal hidden (", options.hidden, ")");
  for (Parameter* p : norm.parameters()) {
    p->shard.sequence_parallel = fc1.parallel() && options.sequence_parallel;
  }
}

void LayerNormMLP::collect_parameters(std::vector<Parameter*>& out) {
  norm.collect_parameters(out);
  fc1.collect_parameters(out);
  fc2.collect_parameters(out);
}

void LayerNormMLP::on_parameters_updated() {
  fc1.on_parameters_updated();
  fc2.on_parameters_updated();
}

void LayerNormMLP::run_forward(const Tensor& x, Context& ctx, Tensor& out) {
  Tensor h;
  // A parallel FC1 / FC2 quantizes its input after the collective: no kernel writes the codes.
  const bool parallel = fc1.parallel();
  if (fp8_enabled() && !parallel) {
    // The norm writes FC1's FP8 input directly (delayed scaling), as in LayerNormLinear.
    Fp8State& fp8 = fc1.fp8_state();
    fp8.begin_forward(fp8_recipe());
    const Float8Tensor xq = modules_detail::norm_to_fp8(norm, fp8, x, ctx.norm, fc1.options().name);
    Shape h_shape = x.shape();
    h_shape.back() = fc1.options().out_features;
    h = fc1.forward_fp8_input(xq, fp8.input_quantizer(0), x.dtype(), ctx.fc1).reshape(h_shape);
  } else {
    h = fc1.forward(norm.forward(x, ctx.norm), ctx.fc1);
  }
  ctx.fc1_output = h;
  const Tensor* fc1_bias = options_.bias ? &fc1.bias.value : nullptr;
  Shape out_shape = x.shape();
  out_shape.back() = options_.hidden;
  Fp8State& fc2_fp8 = fc2.fp8_state();
  if (fp8_enabled() && !parallel && std::holds_alternative<recipe::DelayedScaling>(fp8_recipe()) &&
      !fp8_stats_enabled()) {
    // Delayed scaling: the activation kernel writes FC2's FP8 input; FC2 keeps none of it.
    fc2_fp8.begin_forward(fp8_recipe());
    const Quantizer quantizer = fc2_fp8.input_quantizer(0);
    ctx.activation_fp8_scale = fc2_fp8.input_scale(0);
    const Float8Tensor aq = activation_fp8(options_.activation, h, fc1_bias, local_ffn_,
                                           quantizer.format(), ctx.activation_fp8_scale);
    fc2_fp8.record_input_amax(0, aq.amax);
    out = fc2.forward_fp8_input(aq, quantizer, x.dtype(), ctx.fc2, SavedInput::None)
              .reshape(out_shape);
    return;
  }
  Shape act_shape = h.shape();
  act_shape.back() = local_ffn_;
  Tensor a = Tensor::empty(act_shape, x.dtype());
  ops::activation_forward(options_.activation, h, fc1_bias, a);
  // FP8: FC2 keeps no copy of its input; backward recomputes it from fc1_output (a parallel
  // FC2 keeps its codes).
  const bool fp8 = fp8_enabled();
  out = fc2.forward(a, ctx.fc2, fp8 ? SavedInput::None : SavedInput::Fp8);
  if (!fp8) ctx.activation = a;
  // A row-parallel FC2 returns rows of x's count, [N(/TP), hidden]: x's leading shape.
  out = out.reshape(out_shape);
}

Tensor LayerNormMLP::forward(const Tensor& x, Context& ctx) {
  ctx = Context{};
  Tensor out;
  run_forward(x, ctx, out);
  ctx.input = x;
  if (fp8_enabled()) ctx.fp8_recipe = fp8_recipe();
  if (options_.checkpoint) {
    // Keep only the block input; FC1/FC2 contexts (their saved inputs) are recomputed too.
    ctx.norm = Norm::Context{};
    ctx.fc1 = Linear::Context{};
    ctx.fc2 = Linear::Context{};
    ctx.fc1_output = Tensor();
    ctx.activation = Tensor();
  }
  return out;
}

Tensor LayerNormMLP::backward(const Tensor& dy, Context& ctx) {
  if (options_.checkpoint) {
    // Recompute the forward under the forward's own FP8 recipe and scales: the FP8 state
    // must not advance a second time for one step.
    Tensor input = ctx.input;
    std::optional<recipe::Recipe> recipe = ctx.fp8_recipe;
    fp8_autocast scope(recipe.has_value(), recipe.value_or(recipe::DelayedScaling{}));
    fc1.fp8_state().set_recomputing(true);
    fc2.fp8_state().set_recomputing(true);
    Tensor unused;
    run_forward(input, ctx, unused);
    fc1.fp8_state().set_recomputing(false);
    fc2.fp8_state().set_recomputing(false);
  }
  const Tensor* fc1_bias = options_.bias ? &fc1.bias.value : nullptr;
  if (ctx.fc2.input_requantizer) {
    // The activation's FP8 codes again, bit for bit, with the forward's scale.
    if (ctx.activation_fp8_scale > 0.0f) {
      fc2.restore_input(
          activation_fp8(options_.activation, ctx.fc1_output, fc1_bias, local_ffn_,
                         ctx.fc2.input_requantizer->format(), ctx.activation_fp8_scale),
          ctx.fc2);
    } else {
      Shape act_shape = ctx.fc1_output.shape();
      act_shape.back() = local_ffn_;
      Tensor a = Tensor::empty(act_shape, ctx.fc1_output.dtype());
      ops::activation_forward(options_.activation, ctx.fc1_output, fc1_bias, a);
      fc2.restore_input(a, ctx.fc2);
    }
  }
  Tensor da = fc2.backward(dy, ctx.fc2);
  Tensor dbias = Tensor::empty({fc1.options().out_features}, DType::F32);
  Fp8State& fc1_fp8 = fc1.fp8_state();
  Tensor dnorm;
  if (ctx.fc1.fp8 && !fc1.parallel() && fc1_fp8.input_scale_known() && !fp8_stats_enabled()) {
    // Delayed scaling: the activation's backward writes FC1's FP8 output gradient itself.
    fc1_fp8.begin_backward(fc1_fp8.recipe());
    Float8Tensor dhq;
    dhq.format = fc1_fp8.grad_output_quantizer(0).format();
    dhq.mode = ScalingMode::PerTensor;
    dhq.rows = ctx.fc1_output.rows();
    dhq.cols = ctx.fc1_output.cols();
    dhq.scale = fc1_fp8.grad_output_scale(0);
    dhq.data = Tensor::empty({dhq.rows, dhq.cols}, dhq.format);
    ops::Fp8Store store{dhq.format, dhq.scale, static_cast<uint8_t*>(dhq.data.raw()), 0.0f};
    Tensor none;
    ops::activation_backward(options_.activation, da.reshape({da.rows(), da.cols()}),
                             ctx.fc1_output.reshape({dhq.rows, dhq.cols}), fc1_bias, none,
                             options_.bias ? &dbias : nullptr, &store);
    dhq.amax = store.amax;
    dhq.scale_inv = Tensor::from_floats({1}, {1.0f / dhq.scale});
    fc1_fp8.record_grad_output_amax(0, store.amax);
    Shape dnorm_shape = ctx.fc1_output.shape();
    dnorm_shape.back() = options_.hidden;
    dnorm = fc1.backward_fp8_grad(dhq, ctx.fc1).reshape(dnorm_shape);
  } else {
    Tensor dh = Tensor::empty(ctx.fc1_output.shape(), da.dtype());
    ops::activation_backward(options_.activation, da, ctx.fc1_output, fc1_bias, dh,
                             options_.bias ? &dbias : nullptr);
    dnorm = fc1.backward(dh, ctx.fc1);
  }
  if (options_.bias) ops::add_scaled(dbias, 1.0f, fc1.bias.grad);
  Tensor dx = norm.backward(dnorm, ctx.norm);
  ctx = Context{};
  return dx;
}

}  // namespace octet
