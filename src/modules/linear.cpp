// Linear: y = x W^T + b. BF16 / F32 GEMMs on a weight packed once per optimizer step; under
// fp8_autocast the input, weight and output gradient are quantized per the active recipe
// (the weight once per optimizer step and scale, see Fp8State::quantized_weight), and only
// the FP8 codes the backward GEMMs need are kept.
#include "modules/common.h"
#include "octet/ops/elementwise.h"

namespace octet {

namespace {
thread_local WeightGradientQueue* active_weight_gradient_queue = nullptr;
}  // namespace

void WeightGradientQueue::run() {
  // Taken first: a failing GEMM leaves an empty queue, not half-run work to repeat.
  std::vector<std::function<void()>> work = std::move(work_);
  work_.clear();
  for (auto& gemm_work : work) gemm_work();
}

defer_weight_gradients::defer_weight_gradients(WeightGradientQueue& queue)
    : previous_(active_weight_gradient_queue) {
  active_weight_gradient_queue = &queue;
}

defer_weight_gradients::~defer_weight_gradients() {
  active_weight_gradient_queue = previous_;
}

WeightGradientQueue* deferred_weight_gradients() {
  return active_weight_gradient_queue;
}

namespace {
thread_local WeightGradientQueue* active_shared_gradient_queue = nullptr;
}  // namespace

defer_shared_gradients::defer_shared_gradients(WeightGradientQueue& queue)
    : previous_(active_shared_gradient_queue) {
  active_shared_gradient_queue = &queue;
}

defer_shared_gradients::~defer_shared_gradients() {
  active_shared_gradient_queue = previous_;
}

WeightGradientQueue* deferred_shared_gradients() {
  return active_shared_gradient_queue;
}

namespace {

// A weight-gradient GEMM: queued inside a defer_weight_gradients scope, else run now.
void run_or_defer(std::function<void()> weight_gradient) {
  if (WeightGradientQueue* queue = deferred_weight_gradients()) {
    queue->push(std::move(weight_gradient));
  } else {
    weight_gradient();
  }
}

}  // namespace

using modules_detail::kept_for_backward;
using modules_detail::needs_columnwise;
using modules_detail::requantizer_for;

void Linear::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);  // a row layer's replicated bias too
}

void Linear::on_parameters_updated() {
  packed_.reset();
  weight_bf16_ = Tensor();
  fp8_.drop_weight_cache();
  fp4_weight_.reset();
  fp4_weight_t_.reset();
}

const Tensor& Linear::weight_as(DType dtype) {
  if (dtype == DType::F32) return weight.value;
  if (!weight_bf16_.defined()) weight_bf16_ = weight.value.to(DType::BF16);
  return weight_bf16_;
}

PackedWeight& Linear::packed_weight(DType dtype) {
  if (!packed_ || packed_dtype_ != dtype) {
    packed_.emplace(weight_as(dtype), /*trans=*/true);
    packed_dtype_ = dtype;
  }
  return *packed_;
}

namespace {

Shape with_last(const Shape& shape, int64_t last) {
  Shape out = shape;
  out.back() = last;
  return out;
}

// x [rows, cols] F32|BF16 -> F32 [cols, rows].
Tensor transposed_f32(const Tensor& x) {
  const std::vector<float> v = x.to_floats();
  const int64_t rows = x.rows(), cols = x.cols();
  Tensor out = Tensor::empty({cols, rows}, DType::F32);
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) o[c * rows + r] = v[static_cast<size_t>(r * cols + c)];
  }
  return out;
}

}  // namespace

Epilogue Linear::forward_epilogue() const {
  Epilogue epilogue;
  if (options_.bias && !options_.return_bias) epilogue.bias = &bias.value;
  return epilogue;
}

Tensor Linear::forward(const Tensor& x, Context& ctx, SavedInput saved) {
  return tp_ ? parallel_forward(x, ctx) : local_forward(x, ctx, saved);
}

Tensor Linear::backward(const Tensor& dy, Context& ctx) {
  return tp_ ? parallel_backward(dy, ctx) : local_backward(dy, ctx);
}

Tensor Linear::local_forward(const Tensor& x, Context& ctx, SavedInput saved) {
  check_dtype_in(x, {DType::F32, DType::BF16}, options_.name + ": input");
  OCTET_CHECK(x.ndim() >= 1 && x.cols() == options_.in_features, options_.name,
              ": input expected [..., in_features=", options_.in_features, "], got ",
              shape_str(x.shape()));
  const Tensor flat = x.reshape({x.rows(), options_.in_features});
  if (fp8_enabled()) {
    fp8_.begin_forward(fp8_recipe());
    const Quantizer quantizer = fp8_.input_quantizer(0);
    // Without a saved input the weight gradient gets its codes from restore_input().
    const bool columnwise = saved == SavedInput::Fp8 && needs_columnwise(quantizer);
    Float8Tensor xq = quantizer.quantize(flat, true, columnwise);
    if (fp8_stats_enabled()) fp8_.record_stats(options_.name, "input", flat, xq);
    return forward_fp8_input(xq, quantizer, x.dtype(), ctx, saved)
        .reshape(with_last(x.shape(), options_.out_features));
  }
  if (fp4_enabled())
    return fp4_forward(flat, ctx).reshape(with_last(x.shape(), options_.out_features));
  ctx = Context{};
  ctx.dtype = x.dtype();
  ctx.rows = flat.rows();
  Tensor y = Tensor::empty({ctx.rows, options_.out_features}, x.dtype());
  if (weight_fp8_) {  // inference only: no input kept, backward refused
    ctx.rows = 0;
    gemm(flat, *weight_fp8_, y, forward_epilogue());
    return y.reshape(with_last(x.shape(), options_.out_features));
  }
  gemm(flat, packed_weight(x.dtype()), y, /*trans_a=*/false, 1.0f, 0.0f, forward_epilogue());
  ctx.input = flat;
  return y.reshape(with_last(x.shape(), options_.out_features));
}

Tensor Linear::fp4_forward(const Tensor& flat, Context& ctx) {
  ctx = Context{};
  ctx.dtype = flat.dtype();
  ctx.rows = flat.rows();
  const Fp4Options& o = fp4_options();
  // The weight is quantized once per optimizer step (and recipe), as FP8's.
  if (!fp4_weight_ || fp4_weight_->recipe != o.recipe) {
    Fp4Options weights{o.recipe};
    weights.block_2d = o.recipe == Fp4Recipe::NVFP4;
    fp4_weight_ = quantize_fp4(weight.value, weights);
  }
  ctx.weight_fp4 = fp4_weight_;
  Tensor y = Tensor::empty({ctx.rows, options_.out_features}, flat.dtype());
  const Float4Tensor xq = quantize_fp4(flat, Fp4Options{o.recipe});
  if (fp8_stats_enabled()) {
    fp8_.record_stats(options_.name, "input", flat, xq);
    fp8_.record_stats(options_.name, "weight", weight.value, *ctx.weight_fp4);
  }
  gemm(xq, *ctx.weight_fp4, y, /*trans_a=*/false, /*trans_b=*/true, 1.0f, 0.0f, forward_epilogue());
  ctx.input = flat;
  ctx.fp4 = o;
  return y;
}

void Linear::fp4_gradients(const Tensor& dy, const Context& ctx, Tensor& dx) {
  const Fp4Options o = *ctx.fp4;
  const bool nv = o.recipe == Fp4Recipe::NVFP4;
  // Output gradients round stochastically, each backward of each layer from its own stream.
  Fp4Options grads{o.recipe};
  grads.stochastic = true;
  grads.seed = o.seed ^ std::hash<std::string>{}(options_.name);
  grads.offset = fp4_backward_calls_++ << 42;
  // dX = dY W: K = out, along which NVFP4's 16x16 weight blocks lie either way; MXFP4's 1x32
  // weight blocks lie along `in`, so the transpose is quantized for it.
  const Float4Tensor dyq = quantize_fp4(dy, grads);
  if (fp8_stats_enabled()) fp8_.record_stats(options_.name, "grad_output", dy, dyq);
  if (nv) {
    gemm(dyq, *ctx.weight_fp4, dx, /*trans_a=*/false, /*trans_b=*/false);
  } else {
    if (!fp4_weight_t_ || fp4_weight_t_->recipe != o.recipe) {
      fp4_weight_t_ = quantize_fp4(transposed_f32(weight.value), Fp4Options{o.recipe});
    }
    gemm(dyq, *fp4_weight_t_, dx, /*trans_a=*/false, /*trans_b=*/true);
  }
  // dW += dY^T X: K = the tokens, so both operands are quantized transposed (blocks along
  // the tokens), after the random Hadamard transform along them under NVFP4 (16 | tokens).
  run_or_defer([this, dy, input = ctx.input, grads, nv] {
    Tensor dyt = transposed_f32(dy), xt = transposed_f32(input);
    if (nv && dy.rows() % 16 == 0) {
      dyt = random_hadamard_transform(dyt, grads.seed + grads.offset);
      xt = random_hadamard_transform(xt, grads.seed + grads.offset);
    }
    Fp4Options dyt_options = grads;
    dyt_options.offset += uint64_t{1} << 41;
    gemm(quantize_fp4(dyt, dyt_options), quantize_fp4(xt, Fp4Options{grads.recipe}), weight.grad,
         /*trans_a=*/false, /*trans_b=*/true, 1.0f, 1.0f);
  });
}

Tensor Linear::forward_arriving(const Tensor& part, int64_t first, int64_t rows,
                                const std::function<Tensor()>& arrive, Context& ctx) {
  OCTET_CHECK(!fp8_enabled(), options_.name,
              ": forward_arriving runs outside fp8_autocast only (FP8 quantizes the whole input)");
  check_dtype_in(part, {DType::F32, DType::BF16}, options_.name + ": input");
  const int64_t count = part.rows();
  OCTET_CHECK(part.ndim() == 2 && part.cols() == options_.in_features && first >= 0 &&
                  first + count <= rows,
              options_.name, ": input part expected [n, in_features=", options_.in_features,
              "] within ", rows, " rows from row ", first, ", got ", shape_str(part.shape()));
  ctx = Context{};
  ctx.dtype = part.dtype();
  ctx.rows = rows;
  Tensor y = Tensor::empty({rows, options_.out_features}, part.dtype());
  PackedWeight& packed = packed_weight(part.dtype());
  auto rows_gemm = [&](const Tensor& x, int64_t begin, int64_t end) {
    if (begin == end) return;
    Tensor out = y.slice_rows(begin, end);
    gemm(x, packed, out, /*trans_a=*/false, 1.0f, 0.0f, forward_epilogue());
  };
  rows_gemm(part, first, first + count);
  const Tensor whole = arrive();
  OCTET_CHECK(whole.ndim() == 2 && whole.rows() == rows && whole.cols() == options_.in_features &&
                  whole.dtype() == part.dtype(),
              options_.name, ": arrived input expected [", rows, ",", options_.in_features, "] ",
              dtype_name(part.dtype()), ", got ", shape_str(whole.shape()), " ",
              dtype_name(whole.dtype()));
  rows_gemm(whole.slice_rows(0, first), 0, first);
  rows_gemm(whole.slice_rows(first + count, rows), first + count, rows);
  ctx.input = whole;
  return y;
}

Tensor Linear::forward_fp8_input(const Float8Tensor& xq, const Quantizer& quantizer,
                                 DType out_dtype, Context& ctx, SavedInput saved) {
  OCTET_CHECK(xq.cols == options_.in_features, options_.name, ": FP8 input expected ",
              options_.in_features, " columns, got ", xq.cols);
  ctx = Context{};
  ctx.fp8 = true;
  ctx.dtype = out_dtype;
  ctx.rows = xq.rows;
  const Fp8State::QuantizedWeight& w = fp8_.quantized_weight(0, weight.value, options_.name);
  ctx.weight_fp8 = w.weight;
  ctx.packed_weight_fp8 = w.packed;
  Tensor y = Tensor::empty({xq.rows, options_.out_features}, out_dtype);
  gemm(xq, *ctx.packed_weight_fp8, y, /*trans_a=*/false, 1.0f, 0.0f, forward_epilogue());
  if (saved == SavedInput::Fp8) {
    ctx.input_fp8 = kept_for_backward(xq);
  } else {
    ctx.input_requantizer = requantizer_for(xq, quantizer);
  }
  return y;
}

void Linear::restore_input(const Tensor& x, Context& ctx) {
  OCTET_CHECK(ctx.fp8 && ctx.input_requantizer.has_value(), options_.name,
              ": restore_input expects an FP8 context whose forward kept no input");
  OCTET_CHECK(x.numel() == ctx.rows * options_.in_features, options_.name,
              ": restore_input expected [", ctx.rows, ",", options_.in_features, "], got ",
              shape_str(x.shape()));
  const Quantizer& quantizer = *ctx.input_requantizer;
  const bool columnwise = needs_columnwise(quantizer);
  ctx.input_fp8 = kept_for_backward(
      quantizer.quantize(x.reshape({ctx.rows, options_.in_features}), !columnwise, columnwise));
  ctx.input_requantizer.reset();
}

void Linear::restore_input(Float8Tensor xq, Context& ctx) {
  OCTET_CHECK(ctx.fp8 && ctx.input_requantizer.has_value(), options_.name,
              ": restore_input expects an FP8 context whose forward kept no input");
  OCTET_CHECK(xq.mode == ScalingMode::PerTensor && xq.has_rowwise() && xq.rows == ctx.rows &&
                  xq.cols == options_.in_features,
              options_.name, ": restore_input expected per-tensor rowwise codes [", ctx.rows, ",",
              options_.in_features, "], got [", xq.rows, ",", xq.cols, "]");
  ctx.input_fp8 = std::move(xq);
  ctx.input_requantizer.reset();
}

Tensor Linear::replay_forward(const Context& ctx) {
  OCTET_CHECK(can_replay(ctx), options_.name,
              ": replay_forward needs an FP8 context with rowwise input codes");
  Tensor y = Tensor::empty({ctx.rows, options_.out_features}, ctx.dtype);
  PackedWeight packed = *ctx.packed_weight_fp8;
  gemm(ctx.input_fp8, packed, y, /*trans_a=*/false, 1.0f, 0.0f, forward_epilogue());
  return y;
}

void Linear::set_inference_fp8_weight(bool on, Fp8WeightScaling scaling) {
  OCTET_CHECK(!on || tp_ == nullptr, options_.name,
              ": inference FP8 weights run without tensor parallelism");
  weight_fp8_.reset();
  if (on) weight_fp8_ = quantize_weight_fp8(weight.value, scaling);
}

size_t Linear::inference_weight_bytes() const {
  return weight_fp8_ ? weight_fp8_->nbytes() : 0;
}

Tensor Linear::local_backward(const Tensor& dy_in, Context& ctx) {
  OCTET_CHECK(!weight_fp8_, options_.name,
              ": backward with inference FP8 weights (set_inference_fp8_weight(false) first)");
  OCTET_CHECK(ctx.rows > 0 || ctx.input.defined() || ctx.fp8, options_.name,
              ": backward called without a forward context");
  OCTET_CHECK(dy_in.numel() == ctx.rows * options_.out_features, options_.name, ": dy expected [",
              ctx.rows, ",", options_.out_features, "], got ", shape_str(dy_in.shape()));
  OCTET_CHECK(!ctx.fp8 || ctx.input_fp8.has_rowwise() || ctx.input_fp8.has_columnwise(),
              options_.name,
              ": the forward kept no FP8 input (SavedInput::None): call restore_input first");
  Tensor dy = dy_in.reshape({ctx.rows, options_.out_features});
  if (dy.dtype() != ctx.dtype) dy = dy.to(ctx.dtype);
  // With return_bias the caller added the bias (fused into its own kernel) and owns its
  // gradient; otherwise the bias gradient is the column sum of dy.
  if (options_.bias && !options_.return_bias) ops::add_column_sums(dy, bias.grad);
  Tensor dx = Tensor::empty({ctx.rows, options_.in_features}, ctx.dtype);
  if (ctx.fp4) {
    fp4_gradients(dy, ctx, dx);
  } else if (ctx.fp8) {
    fp8_.begin_backward(fp8_.recipe());
    const Quantizer quantizer = fp8_.grad_output_quantizer(0);
    Float8Tensor dyq = quantizer.quantize(dy, true, needs_columnwise(quantizer));
    if (fp8_stats_enabled()) fp8_.record_stats(options_.name, "grad_output", dy, dyq);
    fp8_gradients(dyq, ctx, dx);
  } else {
    gemm(dy, weight_as(ctx.dtype), dx, /*trans_a=*/false, /*trans_b=*/false);
    run_or_defer([this, dy, input = ctx.input] {
      gemm(dy, input, weight.grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
    });
  }
  ctx = Context{};
  return dx.reshape(with_last(dy_in.shape(), options_.in_features));
}

void Linear::fp8_gradients(const Float8Tensor& dyq, const Context& ctx, Tensor& dx) {
  gemm(dyq, ctx.weight_fp8, dx, /*trans_a=*/false, /*trans_b=*/false);
  run_or_defer([this, dyq, input = ctx.input_fp8] {
    gemm(dyq, input, weight.grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
  });
}

Tensor Linear::backward_fp8_grad(const Float8Tensor& dyq, Context& ctx) {
  OCTET_CHECK(ctx.fp8 && (ctx.input_fp8.has_rowwise() || ctx.input_fp8.has_columnwise()),
              options_.name, ": backward_fp8_grad expects an FP8 context holding its input");
  OCTET_CHECK(!options_.bias || options_.return_bias, options_.name,
              ": backward_fp8_grad cannot give the bias gradient from FP8 codes");
  OCTET_CHECK(dyq.rows == ctx.rows && dyq.cols == options_.out_features, options_.name,
              ": dy expected [", ctx.rows, ",", options_.out_features, "], got [", dyq.rows, ",",
              dyq.cols, "]");
  Tensor dx = Tensor::empty({ctx.rows, options_.in_features}, ctx.dtype);
  fp8_gradients(dyq, ctx, dx);
  ctx = Context{};
  return dx;
}

}  // namespace octet
