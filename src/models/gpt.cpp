// GPT, whole or as the part a rank holds (pipeline stages, tensor shards): construction, the one
// forward (embeddings on the first stage; layers; final norm, fused chunked output layer +
// cross-entropy on the last) and its backward, parameters and state dicts. Inference is in
// gpt_inference.cpp.
#include <algorithm>
#include <optional>

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

GPT::GPT(const GPTConfig& config, uint64_t seed, bool recompute_activations)
    : GPT(config, seed, GPTLayout{}, recompute_activations) {}

GPT::GPT(const GPTConfig& config, uint64_t seed, GPTLayout layout, bool recompute_activations)
    : config_(config), layout_(std::move(layout)) {
  Communicator* tp = layout_.tensor;
  OCTET_CHECK(tp == nullptr || config.vocab_size >= tp->size(), "gpt: vocabulary ",
              config.vocab_size, " smaller than TP=", tp ? tp->size() : 1);
  vocab_ = tp ? vocab_range(config.vocab_size, tp->rank(), tp->size())
              : VocabRange{0, config.vocab_size};
  const int stages = layout_.stages;
  OCTET_CHECK(stages >= 1 && config.num_layers % stages == 0, "gpt: num_layers (",
              config.num_layers, ") expected a multiple of the pipeline stages (", stages,
              ": ranks x chunks per rank)");
  OCTET_CHECK(!layout_.stage_of_chunk.empty(), "gpt: a rank must hold at least one chunk");
  const int64_t per_stage = config.num_layers / stages;
  for (int stage : layout_.stage_of_chunk) {
    OCTET_CHECK(stage >= 0 && stage < stages, "gpt: stage ", stage, " outside 0..", stages - 1);
    has_first_ = has_first_ || stage == 0;
    has_last_ = has_last_ || stage == stages - 1;
    std::vector<TransformerLayer> layers;
    layers.reserve(static_cast<size_t>(per_stage));
    for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
      TransformerLayerOptions o = gpt_parts::layer_options(config, i, seed, recompute_activations);
      o.sequence_parallel = sequence_parallel();
      layers.emplace_back(o, tp);
    }
    layers_.push_back(std::move(layers));
  }
  if (has_first_ || has_last_) {
    wte = gpt_parts::token_embedding(config, seed);
    if (tp) {
      // This rank's rows of the same-seed whole table.
      wte.value = wte.value.slice_rows(vocab_.begin, vocab_.end).clone();
      wte.grad = Tensor::zeros(wte.value.shape(), DType::F32);
      wte.shard = TensorShard::vocabulary_rows({config.vocab_size, config.hidden});
    }
  }
  if (has_first_) wpe = gpt_parts::position_embedding(config, seed);
  if (has_last_) final_norm_.emplace(gpt_parts::final_norm_options(config));
  // Applied to token shards under sequence parallelism: partial gradients.
  wpe.shard.sequence_parallel = sequence_parallel();
  if (final_norm_) {
    for (Parameter* p : final_norm_->parameters()) p->shard.sequence_parallel = sequence_parallel();
  }
}

bool GPT::set_embedding_grad_hook(EmbeddingGradHook hook) {
  if (layout_.tensor) return false;  // vocabulary shards: rows summed over the group first
  embedding_grad_hook_ = std::move(hook);
  return true;
}

void GPT::set_high_precision_layers(int64_t first, int64_t last) {
  OCTET_CHECK(first >= 0 && last >= 0 && first + last <= config_.num_layers,
              "gpt: layers kept in high precision (first ", first, ", last ", last,
              ") expected >= 0 and at most num_layers=", config_.num_layers, " together");
  high_precision_first_ = first;
  high_precision_last_ = last;
}

bool GPT::is_high_precision_layer(int64_t layer) const {
  return layer < high_precision_first_ || layer >= config_.num_layers - high_precision_last_;
}

int64_t GPT::global_layer(int chunk, size_t i) const {
  const int64_t per_stage = config_.num_layers / layout_.stages;
  return stage_of_chunk(chunk) * per_stage + static_cast<int64_t>(i);
}

namespace {

// Outside FP8 and FP4 for the scope's lifetime when `plain`, else nothing changes.
struct HighPrecisionScope {
  explicit HighPrecisionScope(bool plain) {
    if (plain) {
      fp8.emplace(false);
      fp4.emplace(false);
    }
  }
  std::optional<fp8_autocast> fp8;
  std::optional<fp4_autocast> fp4;
};

}  // namespace

void GPT::set_tp_comm_overlap(bool on) {
  for (std::vector<TransformerLayer>& stack : layers_) {
    for (TransformerLayer& layer : stack) layer.set_overlap_gather(on);
  }
}

Tensor GPT::gather(const Parameter& p, const Tensor& local) {
  return layout_.tensor ? gather_shards(p, local, *layout_.tensor) : local;
}

Tensor GPT::shard(const Parameter& p, const Tensor& whole) const {
  if (layout_.tensor) return shard_of(p, whole, *layout_.tensor);
  check_shape(whole, p.value.shape(), "checkpoint: tensor '" + p.name + "'");
  check_dtype(whole, DType::F32, "checkpoint: tensor '" + p.name + "'");
  return whole;
}

std::vector<Parameter*> GPT::counted_in_norm(const std::vector<Parameter*>& candidates) const {
  return layout_.tensor ? counted_once(candidates, *layout_.tensor) : candidates;
}

void GPT::check_whole(const char* what) const {
  OCTET_CHECK(layout_.stages == 1, "gpt: ", what, " needs the whole model; this rank holds ",
              chunks(), " of ", layout_.stages,
              " pipeline stages (run them through the pipeline executor)");
}

void GPT::check_inference(const char* what) const {
  check_whole(what);
  OCTET_CHECK(layout_.tensor == nullptr, "gpt: ", what,
              " runs without tensor parallelism (this model is split over ", layout_.tensor->size(),
              " tensor ranks)");
}

std::vector<TransformerLayer>& GPT::layers() {
  check_whole("layers()");
  return layers_.front();
}

std::vector<Parameter*> GPT::chunk_parameters(int chunk) {
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

void GPT::collect_parameters(std::vector<Parameter*>& out) {
  // The whole model's order (wte, wpe, layers by index, final norm), wte once.
  if (wte.value.defined()) out.push_back(&wte);
  if (wpe.value.defined()) out.push_back(&wpe);
  for (int chunk : chunks_in_stage_order()) {
    for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  }
  if (final_norm_) final_norm_->collect_parameters(out);
}

std::vector<Parameter*> GPT::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  // With the embedding hook (no tensor parallelism) wte is final first, else last.
  const bool wte_first = layout_.tensor == nullptr;
  if (wte.value.defined() && wte_first) out.push_back(&wte);
  if (final_norm_) {
    for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  }
  std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = stack.size(); i-- > 0;) {
      for (Parameter* p : stack[i].parameters()) out.push_back(p);
    }
  }
  if (wpe.value.defined()) out.push_back(&wpe);
  if (wte.value.defined() && !wte_first) out.push_back(&wte);
  return out;
}

void GPT::on_parameters_updated() {
  output_cache_.invalidate();
  for (std::vector<TransformerLayer>& chunk : layers_) {
    for (TransformerLayer& layer : chunk) layer.on_parameters_updated();
  }
}

std::vector<Fp8State*> GPT::fp8_states() {
  std::vector<Fp8State*> out;
  for (int chunk : chunks_in_stage_order()) {
    for (TransformerLayer& layer : layers(chunk)) {
      for (Fp8State* s : layer.fp8_states()) out.push_back(s);
    }
  }
  return out;
}

std::vector<int64_t> GPT::fp8_state_indices() {
  const size_t states = fp8_states().size();
  return layout_.stages == 1 ? octet::fp8_state_indices(states)
                             : octet::fp8_state_indices(*this, states, config_.num_layers);
}

TensorMap GPT::to_checkpoint_names(const TensorMap& ours) const {
  return to_hf_gpt2_names(ours);
}

TensorMap GPT::from_checkpoint_names(const TensorMap& theirs) const {
  return from_hf_gpt2_names(theirs);
}

const Tensor& GPT::wte_as(DType dtype) {
  return gpt_parts::tied_weight_as(wte, dtype, output_cache_);
}

std::unique_ptr<pipeline::StagedModel::Context> GPT::make_context() const {
  return std::make_unique<Context>();
}

namespace {

GPT::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<GPT::Context*>(&base);
  OCTET_CHECK(ctx, "gpt: expected a context from GPT::make_context()");
  return *ctx;
}

}  // namespace

Tensor GPT::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                    float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "gpt"),
                     pipeline::batch_tensor(batch, "targets", "gpt"), dtype, grad_scale, &ctx,
                     &ctx.loss);
}

Tensor GPT::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float* loss) {
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "gpt"),
                     pipeline::batch_tensor(batch, "targets", "gpt"), dtype, 1.0f, nullptr, loss);
}

Shape GPT::activation_shape(const pipeline::MicroBatch& batch) const {
  const Tensor& ids = pipeline::batch_tensor(batch, "ids", "gpt");
  if (sequence_parallel()) return {ids.numel() / layout_.tensor->size(), config_.hidden};
  return {ids.dim(0), ids.dim(1), config_.hidden};
}

std::vector<pipeline::TiedParameters> GPT::tied_parameters() {
  pipeline::TiedParameters embedding;
  embedding.stages = {0};
  if (layout_.stages > 1) embedding.stages.push_back(layout_.stages - 1);
  if (wte.value.defined()) embedding.parameters = {&wte};
  return {embedding};
}

float GPT::train_step(const Tensor& ids, const Tensor& targets, DType dtype, float grad_scale) {
  check_whole("train_step");
  Context ctx;
  run_forward(0, Tensor(), ids, targets, dtype, grad_scale, &ctx, &ctx.loss);
  const float loss = ctx.loss;
  backward(0, Tensor(), ctx);
  return loss;
}

float GPT::train_step(const pipeline::MicroBatch& batch, DType dtype, float grad_scale) {
  return train_step(pipeline::batch_tensor(batch, "ids", "gpt"),
                    pipeline::batch_tensor(batch, "targets", "gpt"), dtype, grad_scale);
}

float GPT::evaluate(const pipeline::MicroBatch& batch, DType dtype) {
  return evaluate(pipeline::batch_tensor(batch, "ids", "gpt"),
                  pipeline::batch_tensor(batch, "targets", "gpt"), dtype);
}

float GPT::evaluate(const Tensor& ids, const Tensor& targets, DType dtype) {
  check_whole("evaluate");
  float loss = 0.0f;
  run_forward(0, Tensor(), ids, targets, dtype, 1.0f, nullptr, &loss);
  return loss;
}

void GPT::check_micro_batch(const Tensor& ids, DType dtype) const {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  check_dtype(ids, DType::I32, "gpt: ids");
  OCTET_CHECK(ids.ndim() == 2, "gpt: ids expected [B,T], got ", shape_str(ids.shape()));
  OCTET_CHECK(ids.dim(1) <= config_.max_seq_len, "gpt: sequence length ", ids.dim(1),
              " exceeds max_seq_len ", config_.max_seq_len);
  OCTET_CHECK(!sequence_parallel() || ids.numel() % layout_.tensor->size() == 0,
              "gpt: sequence parallelism needs B*T (", ids.numel(),
              ") divisible by TP=", sequence_parallel() ? layout_.tensor->size() : 1);
}

Tensor GPT::embed(const Tensor& ids) {
  Communicator* tp = layout_.tensor;
  if (tp == nullptr) return gpt_parts::embed(ids, wte, wpe, 0);
  const int64_t T = ids.dim(1), N = ids.numel();
  Tensor partial = Tensor::empty({N, config_.hidden}, DType::F32);
  ops::embedding_part_forward(ids.reshape({N}), wte.value, vocab_.begin, config_.vocab_size,
                              partial);
  Tensor x = sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(partial, *tp)
                                 : reduce_from_tensor_parallel_region(partial, *tp);
  if (wpe.value.defined()) {
    // x's rows are tokens first_row.. of the whole [B*T].
    const int64_t first_row = sequence_parallel() ? tp->rank() * x.rows() : 0;
    ops::position_embedding_forward(x, wpe.value, T, first_row);
  }
  return x;
}

void GPT::embed_backward(const Tensor& ids, const Tensor& dx) {
  Communicator* tp = layout_.tensor;
  const int64_t T = ids.dim(1), N = ids.numel();
  if (wpe.value.defined()) {
    // Under SP this rank's token rows give a partial gradient (summed over the group later).
    const int64_t first_row = sequence_parallel() ? tp->rank() * dx.rows() : 0;
    ops::position_embedding_backward(dx, T, wpe.grad, first_row);
  }
  if (tp == nullptr) {
    if (embedding_grad_hook_) {
      embedding_grad_hook_(wte, ids.reshape({N}), dx);
    } else {
      ops::embedding_backward(ids.reshape({N}), dx, wte.grad);
    }
    return;
  }
  const Tensor dwhole = sequence_parallel()
                            ? reduce_scatter_to_sequence_parallel_region_backward(dx, *tp)
                            : reduce_from_tensor_parallel_region_backward(dx, *tp);
  ops::embedding_part_backward(ids.reshape({N}), dwhole, vocab_.begin, config_.vocab_size,
                               wte.grad);
}

float GPT::output_loss(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                       Tensor* dhidden) {
  Communicator* tp = layout_.tensor;
  if (tp == nullptr) {
    return gpt_parts::tied_output_loss(hidden, targets, wte, dtype, grad_scale, dhidden,
                                       output_cache_);
  }
  // Every rank needs every token against its vocabulary rows.
  const Tensor whole = sequence_parallel() ? gather_from_sequence_parallel_region(hidden, *tp)
                                           : copy_to_tensor_parallel_region(hidden, *tp);
  Tensor dwhole;
  const float loss = gpt_parts::tied_output_loss(
      whole, targets, wte, dtype, grad_scale, dhidden ? &dwhole : nullptr, output_cache_,
      [&](Tensor& logits, const Tensor& target_rows, Tensor& losses, bool backward, float scale) {
        vocab_parallel_cross_entropy(logits, target_rows, vocab_, losses, backward, scale, *tp);
      },
      // Rank 0's shard is the widest: every rank cuts the same chunks (collective per chunk).
      vocab_range(config_.vocab_size, 0, tp->size()).size());
  if (dhidden) {
    // Each rank's part of dhidden comes from its vocabulary rows: summed over the group.
    *dhidden = sequence_parallel() ? gather_from_sequence_parallel_region_backward(dwhole, *tp)
                                   : copy_to_tensor_parallel_region_backward(dwhole, *tp);
  }
  return loss;
}

Tensor GPT::run_forward(int chunk, const Tensor& input, const Tensor& ids, const Tensor& targets,
                        DType dtype, float grad_scale, Context* ctx, float* loss) {
  check_micro_batch(ids, dtype);
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  if (is_last(chunk)) check_shape(targets, ids.shape(), "gpt: targets", "B,T");
  if (ctx) ctx->ids = ids;
  const Shape boundary = activation_shape(gpt_micro_batch(ids, targets));
  Tensor h;
  if (is_first(chunk)) {
    Tensor x = embed(ids);
    h = (dtype == DType::F32 ? x : x.to(dtype)).reshape(boundary);
  } else {
    const std::string what = "gpt: input of chunk " + std::to_string(chunk);
    check_shape(input, boundary, what, sequence_parallel() ? "B*T/TP,C" : "B,T,C");
    check_dtype(input, dtype, what);
    h = input;
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  if (ctx) ctx->layers.assign(stack.size(), TransformerLayer::Context{});
  const int64_t seq_len = sequence_parallel() ? T : 0;  // the layers' token rows are a shard
  for (size_t i = 0; i < stack.size(); ++i) {
    TransformerLayer::Context scratch;
    HighPrecisionScope scope(is_high_precision_layer(global_layer(chunk, i)));
    h = stack[i].forward(h, ctx ? ctx->layers[i] : scratch, nullptr, nullptr, nullptr, seq_len);
  }
  if (!is_last(chunk)) return h;
  Norm::Context norm_scratch;
  Tensor hidden = final_norm_->forward(h, ctx ? ctx->final_norm : norm_scratch);
  hidden = hidden.reshape({hidden.numel() / C, C});
  h = Tensor();
  *loss = output_loss(hidden, targets.reshape({B * T}), dtype, grad_scale,
                      ctx ? &ctx->doutput : nullptr);
  return Tensor();
}

Tensor GPT::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  Tensor dx;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.doutput.defined(), "gpt: backward of the last stage before its forward");
    // With the embedding hook, wte's rows go to the hook: its gradient is final already.
    if (embedding_grad_hook_ && is_first(chunk)) grads_ready({&wte});
    dx = final_norm_->backward(ctx.doutput, ctx.final_norm)
             .reshape(activation_shape(gpt_micro_batch(ctx.ids, ctx.ids)));
    ctx.doutput = Tensor();
    grads_ready(final_norm_->parameters());
  } else {
    dx = doutput;
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  OCTET_CHECK(ctx.layers.size() == stack.size(), "gpt: backward of chunk ", chunk,
              " before its forward");
  for (size_t i = stack.size(); i-- > 0;) {
    HighPrecisionScope scope(is_high_precision_layer(global_layer(chunk, i)));
    dx = stack[i].backward(dx, ctx.layers[i]);
    ctx.layers[i] = TransformerLayer::Context{};
    grads_ready(stack[i].parameters());
  }
  if (!is_first(chunk)) {
    ctx = Context{};
    return dx;
  }
  const Tensor dx32 = dx.dtype() == DType::F32 ? dx : dx.to(DType::F32);
  embed_backward(ctx.ids, dx32.reshape({dx32.numel() / config_.hidden, config_.hidden}));
  std::vector<Parameter*> embeddings;
  if (!embedding_grad_hook_) embeddings.push_back(&wte);
  if (wpe.value.defined()) embeddings.push_back(&wpe);
  if (!embeddings.empty()) grads_ready(embeddings);
  ctx = Context{};
  return Tensor();
}

TensorMap GPT::state_dict() {
  TensorMap out;
  for (Parameter* p : parameters()) out[p->name] = gather(*p, p->value);
  return out;
}

void GPT::load_state_dict(const TensorMap& tensors) {
  std::vector<Parameter*> params = parameters();
  for (Parameter* p : params) {
    auto it = tensors.find(p->name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", p->name,
                "' (does the checkpoint match this model config?)");
    p->value.copy_from(shard(*p, it->second));
  }
  // Another stage's tensors are expected in a whole-model map; the whole model has no others.
  OCTET_CHECK(layout_.stages > 1 || tensors.size() == params.size(), "checkpoint: holds ",
              tensors.size(), " tensors, the model has ", params.size(), " parameters");
  on_parameters_updated();
}

}  // namespace octet
