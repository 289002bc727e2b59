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
    : TransformerStack("gpt", config.num_layers, std::move(layout),
                       [&](int64_t i) {
                         return gpt_parts::layer_options(config, i, seed, recompute_activations);
                       }),
      config_(config) {
  Communicator* tp = layout_.tensor;
  OCTET_CHECK(tp == nullptr || config.vocab_size >= tp->size(), "gpt: vocabulary ",
              config.vocab_size, " smaller than TP=", tp ? tp->size() : 1);
  vocab_ = tp ? vocab_range(config.vocab_size, tp->rank(), tp->size())
              : VocabRange{0, config.vocab_size};
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

void GPT::set_tp_comm_overlap(bool on) {
  for (std::vector<TransformerLayer>& stack : layers_) {
    for (TransformerLayer& layer : stack) layer.set_overlap_gather(on);
  }
}

void GPT::check_inference(const char* what) const {
  check_whole(what);
  OCTET_CHECK(layout_.tensor == nullptr, "gpt: ", what,
              " runs without tensor parallelism (this model is split over ", layout_.tensor->size(),
              " tensor ranks)");
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
  TransformerStack::on_parameters_updated();
}

TensorMap GPT::to_checkpoint_names(const TensorMap& ours) const {
  return to_hf_gpt2_names(ours);
}

TensorMap GPT::from_checkpoint_names(const TensorMap& theirs) const {
  return from_hf_gpt2_names(theirs);
}

PackedWeight& GPT::wte_packed_as(DType dtype) {
  return gpt_parts::tied_packed_as(wte, dtype, output_cache_);
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

namespace {

// Rows [0, rows) of x are tokens first_row.. of a [B*T] token matrix; under context parallelism
// (cp given) each sequence's T tokens are two chunks of T / 2, at the positions of chunks
// context_parallel_chunk(rank, size, 0 / 1). f(begin, end, seq_len, first_row, offset) gets
// runs of rows for ops::position_embedding_forward / _backward.
template <typename F>
void position_runs(int64_t rows, int64_t T, int64_t first_row, const Communicator* cp, F f) {
  if (cp == nullptr || cp->size() == 1) {
    f(0, rows, T, first_row, 0);
    return;
  }
  const int64_t c = T / 2;
  for (int64_t r = 0; r < rows;) {
    const int64_t t = (first_row + r) % T, within = t % c;
    const int64_t n = std::min(rows - r, c - within);
    f(r, r + n, c, within,
      context_parallel_chunk(cp->rank(), cp->size(), static_cast<int>(t / c)) * c);
    r += n;
  }
}

}  // namespace

void GPT::add_positions(Tensor& x, int64_t T, int64_t first_row) const {
  position_runs(x.rows(), T, first_row, layout_.context,
                [&](int64_t begin, int64_t end, int64_t seq_len, int64_t first, int64_t offset) {
                  Tensor rows = x.slice_rows(begin, end);
                  ops::position_embedding_forward(rows, wpe.value, seq_len, first, offset);
                });
}

void GPT::positions_backward(const Tensor& dx, int64_t T, int64_t first_row) {
  position_runs(dx.rows(), T, first_row, layout_.context,
                [&](int64_t begin, int64_t end, int64_t seq_len, int64_t first, int64_t offset) {
                  ops::position_embedding_backward(dx.slice_rows(begin, end), seq_len, wpe.grad,
                                                   first, offset);
                });
}

Tensor GPT::embed(const Tensor& ids) {
  Communicator* tp = layout_.tensor;
  const int64_t T = ids.dim(1), N = ids.numel();
  if (tp == nullptr) {
    Tensor x = Tensor::empty({N, config_.hidden}, DType::F32);
    ops::embedding_forward(ids.reshape({N}), wte.value, x);
    if (wpe.value.defined()) add_positions(x, T, 0);
    return x;
  }
  Tensor partial = Tensor::empty({N, config_.hidden}, DType::F32);
  ops::embedding_part_forward(ids.reshape({N}), wte.value, vocab_.begin, config_.vocab_size,
                              partial);
  Tensor x = sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(partial, *tp)
                                 : reduce_from_tensor_parallel_region(partial, *tp);
  if (wpe.value.defined()) {
    // x's rows are tokens first_row.. of the whole [B*T].
    const int64_t first_row = sequence_parallel() ? tp->rank() * x.rows() : 0;
    add_positions(x, T, first_row);
  }
  return x;
}

void GPT::embed_backward(const Tensor& ids, const Tensor& dx) {
  // The tied table's gradient is shared with the output layer (DualPipe's overlapped F&B may
  // run the two on two threads): queued to run after the pair, in a fixed order.
  if (WeightGradientQueue* queue = deferred_shared_gradients()) {
    queue->push([this, ids, dx] { accumulate_embedding_grad(ids, dx); });
    return;
  }
  accumulate_embedding_grad(ids, dx);
}

void GPT::accumulate_embedding_grad(const Tensor& ids, const Tensor& dx) {
  std::lock_guard<std::mutex> lock(*tied_grad_mutex_);
  Communicator* tp = layout_.tensor;
  const int64_t T = ids.dim(1), N = ids.numel();
  if (wpe.value.defined()) {
    // Under SP this rank's token rows give a partial gradient (summed over the group later).
    const int64_t first_row = sequence_parallel() ? tp->rank() * dx.rows() : 0;
    positions_backward(dx, T, first_row);
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
  std::lock_guard<std::mutex> lock(*tied_grad_mutex_);
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
    h = checked_input(chunk, input, boundary, dtype);
  }
  // Under sequence parallelism the layers' token rows are a shard of the T tokens.
  h = forward_layers(chunk, h, ctx ? &ctx->layers : nullptr, sequence_parallel() ? T : 0, nullptr,
                     grad_scale);
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
  dx = backward_layers(chunk, dx, ctx.layers);
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

}  // namespace octet
