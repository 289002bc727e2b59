// One pipeline rank's chunks of a GPT: the same layers, seeds and output layer as GPT, cut at
// stage boundaries, with forward and backward per (micro-batch, chunk) for the executor.
#include <algorithm>

#include "models/gpt_parts.h"
#include "octet/model.h"
#include "octet/ops/embedding.h"

namespace octet {

pipeline::MicroBatch gpt_micro_batch(const Tensor& ids, const Tensor& targets) {
  return {{"ids", ids}, {"targets", targets}};
}

std::vector<pipeline::MicroBatch> gpt_micro_batches(const std::vector<Tensor>& ids,
                                                    const std::vector<Tensor>& targets) {
  OCTET_CHECK(ids.size() == targets.size(), "gpt_micro_batches: ", ids.size(), " ids and ",
              targets.size(), " targets");
  std::vector<pipeline::MicroBatch> batches;
  for (size_t m = 0; m < ids.size(); ++m) batches.push_back(gpt_micro_batch(ids[m], targets[m]));
  return batches;
}

GPTStage::GPTStage(const GPTConfig& config, uint64_t seed, int stages,
                   std::vector<int> stage_of_chunk, bool recompute_activations)
    : config_(config), stages_(stages), stage_of_chunk_(std::move(stage_of_chunk)) {
  OCTET_CHECK(stages >= 1 && config.num_layers % stages == 0, "gpt stage: num_layers (",
              config.num_layers, ") expected a multiple of the pipeline stages (", stages,
              ": ranks x chunks per rank)");
  OCTET_CHECK(!stage_of_chunk_.empty(), "gpt stage: a rank must hold at least one chunk");
  const int64_t per_stage = config.num_layers / stages;
  for (int stage : stage_of_chunk_) {
    OCTET_CHECK(stage >= 0 && stage < stages, "gpt stage: stage ", stage, " outside 0..",
                stages - 1);
    has_first_ = has_first_ || stage == 0;
    has_last_ = has_last_ || stage == stages - 1;
    std::vector<TransformerLayer> layers;
    layers.reserve(static_cast<size_t>(per_stage));
    for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
      layers.emplace_back(gpt_parts::layer_options(config, i, seed, recompute_activations));
    }
    layers_.push_back(std::move(layers));
  }
  if (has_first_ || has_last_) wte = gpt_parts::token_embedding(config, seed);
  if (has_first_) wpe = gpt_parts::position_embedding(config, seed);
  if (has_last_) final_norm_.emplace(gpt_parts::final_norm_options(config));
}

std::vector<Parameter*> GPTStage::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  if (is_first(chunk)) {
    out.push_back(&wte);
    if (wpe.value.defined()) out.push_back(&wpe);
  }
  for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  if (is_last(chunk)) {
    if (!is_first(chunk)) out.push_back(&wte);
    final_norm_->collect_parameters(out);
  }
  return out;
}

void GPTStage::collect_parameters(std::vector<Parameter*>& out) {
  // GPT's order (wte, wpe, layers by index, final norm), wte once.
  if (wte.value.defined()) out.push_back(&wte);
  if (wpe.value.defined()) out.push_back(&wpe);
  for (int chunk : chunks_in_stage_order()) {
    for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  }
  if (final_norm_) final_norm_->collect_parameters(out);
}

void GPTStage::on_parameters_updated() {
  output_cache_.invalidate();
  for (std::vector<TransformerLayer>& chunk : layers_) {
    for (TransformerLayer& layer : chunk) layer.on_parameters_updated();
  }
}

TensorMap GPTStage::state_dict() {
  TensorMap out;
  for (Parameter* p : parameters()) out[p->name] = p->value;
  return out;
}

void GPTStage::load_state_dict(const TensorMap& tensors) {
  for (Parameter* p : parameters()) {
    auto it = tensors.find(p->name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", p->name,
                "' (does the checkpoint match this model config?)");
    check_shape(it->second, p->value.shape(), "checkpoint: tensor '" + p->name + "'");
    check_dtype(it->second, DType::F32, "checkpoint: tensor '" + p->name + "'");
    p->value.copy_from(it->second);
  }
  on_parameters_updated();
}

std::unique_ptr<pipeline::StagedModel::Context> GPTStage::make_context() const {
  return std::make_unique<Context>();
}

namespace {

GPTStage::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<GPTStage::Context*>(&base);
  OCTET_CHECK(ctx, "gpt stage: expected a context from GPTStage::make_context()");
  return *ctx;
}

}  // namespace

Tensor GPTStage::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                         DType dtype, float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "gpt stage"),
                     pipeline::batch_tensor(batch, "targets", "gpt stage"), dtype, grad_scale, &ctx,
                     &ctx.loss);
}

Tensor GPTStage::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                          DType dtype, float* loss) {
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "gpt stage"),
                     pipeline::batch_tensor(batch, "targets", "gpt stage"), dtype, 1.0f, nullptr,
                     loss);
}

Shape GPTStage::activation_shape(const pipeline::MicroBatch& batch) const {
  const Tensor& ids = pipeline::batch_tensor(batch, "ids", "gpt stage");
  return {ids.dim(0), ids.dim(1), config_.hidden};
}

std::vector<pipeline::TiedParameters> GPTStage::tied_parameters() {
  pipeline::TiedParameters embedding;
  embedding.stages = {0, stages_ - 1};
  if (stages_ == 1) embedding.stages = {0};
  if (wte.value.defined()) embedding.parameters = {&wte};
  return {embedding};
}

Tensor GPTStage::run_forward(int chunk, const Tensor& input, const Tensor& ids,
                             const Tensor& targets, DType dtype, float grad_scale, Context* ctx,
                             float* loss) {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt stage: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  check_dtype(ids, DType::I32, "gpt stage: ids");
  OCTET_CHECK(ids.ndim() == 2, "gpt stage: ids expected [B,T], got ", shape_str(ids.shape()));
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  OCTET_CHECK(T <= config_.max_seq_len, "gpt stage: sequence length ", T, " exceeds max_seq_len ",
              config_.max_seq_len);
  if (ctx) ctx->ids = ids;
  Tensor h;
  if (is_first(chunk)) {
    Tensor x = gpt_parts::embed(ids, wte, wpe, 0);
    h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({B, T, C});
  } else {
    check_shape(input, {B, T, C}, "gpt stage: input of chunk " + std::to_string(chunk), "B,T,C");
    check_dtype(input, dtype, "gpt stage: input of chunk " + std::to_string(chunk));
    h = input;
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  if (ctx) ctx->layers.assign(stack.size(), TransformerLayer::Context{});
  for (size_t i = 0; i < stack.size(); ++i) {
    TransformerLayer::Context scratch;
    h = stack[i].forward(h, ctx ? ctx->layers[i] : scratch);
  }
  if (!is_last(chunk)) return h;
  check_shape(targets, ids.shape(), "gpt stage: targets", "B,T");
  Norm::Context norm_scratch;
  Tensor hidden = final_norm_->forward(h, ctx ? ctx->final_norm : norm_scratch).reshape({B * T, C});
  *loss = gpt_parts::tied_output_loss(hidden, targets.reshape({B * T}), wte, dtype, grad_scale,
                                      ctx ? &ctx->doutput : nullptr, output_cache_);
  return Tensor();
}

Tensor GPTStage::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  Tensor dx;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.doutput.defined(), "gpt stage: backward of the last stage before its forward");
    const int64_t B = ctx.ids.dim(0), T = ctx.ids.dim(1), C = config_.hidden;
    dx = final_norm_->backward(ctx.doutput, ctx.final_norm).reshape({B, T, C});
  } else {
    dx = doutput;
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  OCTET_CHECK(ctx.layers.size() == stack.size(), "gpt stage: backward of chunk ", chunk,
              " before its forward");
  for (size_t i = stack.size(); i-- > 0;) {
    dx = stack[i].backward(dx, ctx.layers[i]);
    ctx.layers[i] = TransformerLayer::Context{};
  }
  if (!is_first(chunk)) {
    ctx = Context{};
    return dx;
  }
  const int64_t B = ctx.ids.dim(0), T = ctx.ids.dim(1), C = config_.hidden;
  Tensor dx32 = (dx.dtype() == DType::F32 ? dx : dx.to(DType::F32)).reshape({B * T, C});
  ops::embedding_backward(ctx.ids.reshape({B * T}), dx32, wte.grad);
  if (wpe.value.defined()) gpt_parts::position_embedding_backward(dx32, B, T, wpe);
  ctx = Context{};
  return Tensor();
}

}  // namespace octet
