// LayerNormLinear: norm then Linear. Under delayed scaling the GEMM's input scale is known
// before the norm runs, so the norm kernel writes FP8 codes directly (no high-precision copy
// of its output) and reports their amax to the Linear's FP8 metadata. LayerNormMLP's norm and
// FC1 share the same path (norm_to_fp8).
#include "modules/common.h"

namespace octet {

LayerNormLinear::LayerNormLinear(const LayerNormLinearOptions& options, Communicator* tp)
    : norm(options.norm), linear(options.linear, tp), options_(options) {
  OCTET_CHECK(options.norm.hidden == options.linear.in_features, options.linear.name,
              ": norm hidden (", options.norm.hidden, ") must equal in_features (",
              options.linear.in_features, ")");
  OCTET_CHECK(!linear.parallel() || options.linear.parallel_mode == ParallelMode::Column,
              options.linear.name, ": a norm before a row-parallel Linear would see split inputs");
  // Applied to this rank's token rows under sequence parallelism: partial gradients.
  for (Parameter* p : norm.parameters()) {
    p->shard.sequence_parallel = linear.parallel() && options.linear.sequence_parallel;
  }
}

void LayerNormLinear::collect_parameters(std::vector<Parameter*>& out) {
  norm.collect_parameters(out);
  linear.collect_parameters(out);
}

namespace {

// The norm output written as per-tensor FP8 codes by the norm kernel itself (rowwise only:
// per-tensor codes serve every GEMM).
Float8Tensor fused_norm_fp8(Norm& norm, Fp8State& fp8, int gemm, const Tensor& x,
                            Norm::Context& ctx) {
  const int64_t rows = x.rows(), cols = x.cols();
  Quantizer quantizer = fp8.input_quantizer(gemm);
  Float8Tensor out;
  out.format = quantizer.format();
  out.mode = ScalingMode::PerTensor;
  out.rows = rows;
  out.cols = cols;
  out.scale = fp8.input_scale(gemm);
  out.data = Tensor::empty({rows, cols}, out.format);
  ops::Fp8Store store{out.format, out.scale, static_cast<uint8_t*>(out.data.raw()), 0.0f};
  norm.forward_fp8(x, ctx, store);
  out.amax = store.amax;
  out.scale_inv = Tensor::from_floats({1}, {1.0f / out.scale});
  fp8.record_input_amax(gemm, store.amax);
  return out;
}

}  // namespace

namespace modules_detail {

Float8Tensor norm_to_fp8(Norm& norm, Fp8State& fp8, const Tensor& x, Norm::Context& ctx,
                         const std::string& name) {
  if (fp8.input_scale_known()) {
    Float8Tensor xq = fused_norm_fp8(norm, fp8, 0, x, ctx);
    if (fp8_stats_enabled()) {
      // The fused kernel kept no high-precision output: recompute it (in F32, as the
      // kernel computes before scaling) to measure the codes against.
      Norm::Context scratch;
      const Tensor x32 = x.dtype() == DType::F32 ? x : x.to(DType::F32);
      fp8.record_stats(name, "input", norm.forward(x32, scratch), xq);
    }
    return xq;
  }
  const Tensor normalized = norm.forward(x, ctx).reshape({x.rows(), x.cols()});
  const Quantizer quantizer = fp8.input_quantizer(0);
  Float8Tensor xq = quantizer.quantize(normalized, true, needs_columnwise(quantizer));
  if (fp8_stats_enabled()) fp8.record_stats(name, "input", normalized, xq);
  return xq;
}

}  // namespace modules_detail

Tensor LayerNormLinear::forward(const Tensor& x, Context& ctx) {
  ctx = Context{};
  Shape out_shape = x.shape();
  out_shape.back() = options_.linear.out_features;
  // A parallel Linear quantizes its input after the gather: the norm cannot write its codes.
  if (fp8_enabled() && !options_.return_layernorm_output && !linear.parallel()) {
    Fp8State& fp8 = linear.fp8_state();
    fp8.begin_forward(fp8_recipe());
    const Float8Tensor xq =
        modules_detail::norm_to_fp8(norm, fp8, x, ctx.norm, linear.options().name);
    return linear.forward_fp8_input(xq, fp8.input_quantizer(0), x.dtype(), ctx.linear)
        .reshape(out_shape);
  }
  ctx.norm_output = norm.forward(x, ctx.norm);
  return linear.forward(ctx.norm_output, ctx.linear);
}

Tensor LayerNormLinear::backward(const Tensor& dy, Context& ctx) {
  Tensor dnorm = linear.backward(dy, ctx.linear);
  Tensor dx = norm.backward(dnorm, ctx.norm);
  ctx = Context{};
  return dx;
}

}  // namespace octet
