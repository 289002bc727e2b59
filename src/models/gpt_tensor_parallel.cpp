// TensorParallelGPT: forward, the vocabulary-parallel output layer + loss, backward.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "core/convert.h"
#include "models/gpt_parts.h"
#include "octet/model_tensor_parallel.h"
#include "octet/ops/dropout.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"
#include "octet/ops/optimizer.h"

namespace octet {

namespace {

// TransformerLayer's self-attention options (the same seeds and names, so the parallel
// blocks hold the shards of GPT's layer). The projection's bias is added by the row-parallel
// layer after its reduction instead of in bias_dropout_add.
MultiheadAttentionOptions attention_options(const TransformerLayerOptions& o) {
  MultiheadAttentionOptions a = TransformerLayer::attention_options(o, /*cross=*/false);
  a.return_bias = false;
  return a;
}

const GPTConfig& checked(const GPTConfig& c, Communicator& tp) {
  OCTET_CHECK(c.dropout == 0.0f, "tensor-parallel GPT: dropout expected 0, got ", c.dropout,
              " (hidden and attention dropout under TP are not implemented yet)");
  OCTET_CHECK(c.position_embedding == "learned",
              "tensor-parallel GPT: position_embedding expected 'learned', got '",
              c.position_embedding, "' (RoPE under TP is not implemented yet)");
  OCTET_CHECK(c.tied_embeddings, "tensor-parallel GPT: expects tied embeddings");
  OCTET_CHECK(c.vocab_size >= tp.size(), "tensor-parallel GPT: vocabulary ", c.vocab_size,
              " smaller than TP=", tp.size());
  return c;
}

// residual + branch (no dropout): bias_dropout_add's forward, so the rounding matches GPT's.
Tensor residual_add(const Tensor& branch, const Tensor& residual) {
  Tensor out = Tensor::empty(branch.shape(), branch.dtype());
  ops::bias_dropout_add_forward(branch, nullptr, residual, ops::DropoutParams{}, out);
  return out;
}

}  // namespace

TensorParallelGPT::TensorParallelGPT(const GPTConfig& config, uint64_t seed, bool sequence_parallel,
                                     Communicator& tp, int stages, std::vector<int> stage_of_chunk,
                                     bool recompute_activations)
    : config_(checked(config, tp)),
      sequence_parallel_(sequence_parallel),
      recompute_activations_(recompute_activations),
      tp_(&tp),
      vocab_(vocab_range(config.vocab_size, tp.rank(), tp.size())),
      stages_(stages),
      stage_of_chunk_(std::move(stage_of_chunk)) {
  OCTET_CHECK(stages >= 1 && config.num_layers % stages == 0, "tensor-parallel gpt: num_layers (",
              config.num_layers, ") expected a multiple of the pipeline stages (", stages,
              ": ranks x chunks per rank)");
  OCTET_CHECK(!stage_of_chunk_.empty(), "tensor-parallel gpt: a rank must hold at least one chunk");
  const int64_t per_stage = config.num_layers / stages;
  for (int stage : stage_of_chunk_) {
    OCTET_CHECK(stage >= 0 && stage < stages, "tensor-parallel gpt: stage ", stage, " outside 0..",
                stages - 1);
    has_first_ = has_first_ || stage == 0;
    has_last_ = has_last_ || stage == stages - 1;
    Stack stack;
    for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
      const TransformerLayerOptions o = gpt_parts::layer_options(config, i, seed, false);
      stack.push_back(std::make_unique<Layer>(Layer{
          TensorParallelSelfAttention(attention_options(o), sequence_parallel, tp),
          TensorParallelLayerNormMLP(TransformerLayer::mlp_options(o), sequence_parallel, tp)}));
    }
    layers_.push_back(std::move(stack));
  }
  if (has_first_ || has_last_) {
    // Rows of the same-seed whole table.
    Parameter full = gpt_parts::token_embedding(config, seed);
    wte = Parameter{full.name, full.value.slice_rows(vocab_.begin, vocab_.end).clone(),
                    Tensor::zeros({vocab_.size(), config.hidden}, DType::F32)};
  }
  if (has_first_) wpe = gpt_parts::position_embedding(config, seed);
  if (has_last_) final_norm_.emplace(gpt_parts::final_norm_options(config));
  register_specs();
}

std::vector<Parameter*> TensorParallelGPT::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  if (is_first(chunk)) {
    out.push_back(&wte);
    if (wpe.value.defined()) out.push_back(&wpe);
  }
  for (auto& layer : layers_.at(static_cast<size_t>(chunk))) {
    layer->attention.collect_parameters(out);
    layer->mlp.collect_parameters(out);
  }
  if (is_last(chunk)) {
    if (!is_first(chunk)) out.push_back(&wte);
    final_norm_->collect_parameters(out);
  }
  return out;
}

void TensorParallelGPT::collect_parameters(std::vector<Parameter*>& out) {
  // GPT's order (wte, wpe, layers by index, final norm), wte once.
  if (wte.value.defined()) out.push_back(&wte);
  if (wpe.value.defined()) out.push_back(&wpe);
  for (int chunk : chunks_in_stage_order()) {
    for (auto& layer : layers_[static_cast<size_t>(chunk)]) {
      layer->attention.collect_parameters(out);
      layer->mlp.collect_parameters(out);
    }
  }
  if (final_norm_) final_norm_->collect_parameters(out);
}

void TensorParallelGPT::set_tp_comm_overlap(bool on) {
  for (Stack& stack : layers_) {
    for (auto& layer : stack) {
      layer->attention.qkv.set_overlap_gather(on);
      layer->mlp.fc1.set_overlap_gather(on);
    }
  }
}

std::vector<Parameter*> TensorParallelGPT::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  if (final_norm_) out = final_norm_->parameters();
  std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    Stack& stack = layers_[static_cast<size_t>(*chunk)];
    for (size_t i = stack.size(); i-- > 0;) {
      for (Parameter* p : stack[i]->mlp.parameters()) out.push_back(p);
      for (Parameter* p : stack[i]->attention.parameters()) out.push_back(p);
    }
  }
  if (wpe.value.defined()) out.push_back(&wpe);
  if (wte.value.defined()) out.push_back(&wte);
  return out;
}

void TensorParallelGPT::on_parameters_updated() {
  output_cache_.invalidate();
  for (Stack& stack : layers_) {
    for (auto& layer : stack) {
      layer->attention.on_parameters_updated();
      layer->mlp.on_parameters_updated();
    }
  }
}

std::vector<Parameter*> TensorParallelGPT::sequence_parallel_parameters() {
  std::vector<Parameter*> out;
  if (!sequence_parallel_) return out;
  if (wpe.value.defined()) out.push_back(&wpe);
  for (Stack& stack : layers_) {
    for (auto& layer : stack) {
      for (Parameter* p : layer->attention.sequence_parallel_parameters()) out.push_back(p);
      for (Parameter* p : layer->mlp.sequence_parallel_parameters()) out.push_back(p);
    }
  }
  if (final_norm_) {
    for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Fp8State*> TensorParallelGPT::fp8_states() {
  std::vector<Fp8State*> out;
  for (int chunk : chunks_in_stage_order()) {
    for (auto& layer : layers_[static_cast<size_t>(chunk)]) {
      for (Linear* linear :
           {&layer->attention.qkv, &layer->attention.proj, &layer->mlp.fc1, &layer->mlp.fc2}) {
        out.push_back(&linear->fp8_state());
      }
    }
  }
  return out;
}

double TensorParallelGPT::grad_norm(Communicator& model_group,
                                    const std::vector<Parameter*>& counted) {
  double squares = 0;
  for (Parameter* p : counted_in_norm(counted)) {
    const Tensor grads[] = {p->grad};
    const double norm = ops::global_grad_norm(grads);
    squares += norm * norm;
  }
  return std::sqrt(model_group.all_reduce(squares, ReduceOp::Sum));
}

std::vector<Parameter*> TensorParallelGPT::counted_in_norm(
    const std::vector<Parameter*>& candidates) const {
  std::vector<Parameter*> out;
  for (Parameter* p : candidates) {
    if (spec(*p).kind != ShardSpec::Kind::Replicated || tp_->rank() == 0) out.push_back(p);
  }
  return out;
}

Shape TensorParallelGPT::activation_shape(const pipeline::MicroBatch& batch) const {
  const Tensor& ids = pipeline::batch_tensor(batch, "ids", "tensor-parallel gpt");
  return boundary_shape(ids.dim(0), ids.dim(1));
}

std::vector<pipeline::TiedParameters> TensorParallelGPT::tied_parameters() {
  pipeline::TiedParameters embedding;
  embedding.stages = {0, stages_ - 1};
  if (stages_ == 1) embedding.stages = {0};
  if (wte.value.defined()) embedding.parameters = {&wte};
  return {embedding};
}

Shape TensorParallelGPT::boundary_shape(int64_t batch, int64_t seq_len) const {
  const int64_t rows = batch * seq_len;
  return {sequence_parallel_ ? rows / tp_->size() : rows, config_.hidden};
}

std::unique_ptr<pipeline::StagedModel::Context> TensorParallelGPT::make_context() const {
  return std::make_unique<Context>();
}

void TensorParallelGPT::check_micro_batch(const Tensor& ids, DType dtype) const {
  check_dtype(ids, DType::I32, "tensor-parallel gpt: ids");
  OCTET_CHECK(ids.ndim() == 2, "tensor-parallel gpt: ids expected [B,T], got ",
              shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "tensor-parallel gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const int64_t N = ids.numel();
  OCTET_CHECK(ids.dim(1) <= config_.max_seq_len, "tensor-parallel gpt: sequence length ",
              ids.dim(1), " exceeds max_seq_len ", config_.max_seq_len);
  OCTET_CHECK(!sequence_parallel_ || N % tp_->size() == 0,
              "tensor-parallel gpt: sequence parallelism needs B*T (", N,
              ") divisible by TP=", tp_->size());
}

Tensor TensorParallelGPT::embed(const Tensor& ids) {
  const int64_t T = ids.dim(1), N = ids.numel();
  const Tensor partial = vocab_parallel_embedding_forward(ids.reshape({N}), wte.value, vocab_);
  Tensor x = sequence_parallel_ ? reduce_scatter_to_sequence_parallel_region(partial, *tp_)
                                : reduce_from_tensor_parallel_region(partial, *tp_);
  if (wpe.value.defined()) {
    // x's rows are tokens first_row.. of the whole [B*T].
    const int64_t first_row = sequence_parallel_ ? tp_->rank() * x.rows() : 0;
    ops::position_embedding_forward(x, wpe.value, T, first_row);
  }
  return x;
}

void TensorParallelGPT::embed_backward(const Tensor& ids, const Tensor& d) {
  const int64_t T = ids.dim(1), N = ids.numel();
  const Tensor dx = d.dtype() == DType::F32 ? d : d.to(DType::F32);
  if (wpe.value.defined()) {
    // Under SP this rank's token rows give a partial gradient (summed over the group later).
    const int64_t first_row = sequence_parallel_ ? tp_->rank() * dx.rows() : 0;
    ops::position_embedding_backward(dx, T, wpe.grad, first_row);
  }
  const Tensor dwhole = sequence_parallel_
                            ? reduce_scatter_to_sequence_parallel_region_backward(dx, *tp_)
                            : reduce_from_tensor_parallel_region_backward(dx, *tp_);
  vocab_parallel_embedding_backward(ids.reshape({N}), dwhole, wte.grad, vocab_);
}

Tensor TensorParallelGPT::layers_forward(int chunk, Tensor h, int64_t B, int64_t T,
                                         std::vector<LayerContext>* contexts) {
  Stack& stack = layers_.at(static_cast<size_t>(chunk));
  if (contexts) contexts->assign(stack.size(), LayerContext{});
  for (size_t i = 0; i < stack.size(); ++i) {
    LayerContext scratch;
    if (contexts && recompute_activations_) {
      LayerContext& kept = (*contexts)[i];
      kept.input = h;
      kept.batch = B;
      kept.seq_len = T;
      if (fp8_enabled()) kept.fp8_recipe = fp8_recipe();
      kept.recompute = true;
    }
    LayerContext& ctx = contexts && !recompute_activations_ ? (*contexts)[i] : scratch;
    h = layer_forward(*stack[i], h, B, T, ctx);
    if (contexts && recompute_activations_ && fp8_enabled()) {
      for (Linear* linear : linears(*stack[i])) {
        (*contexts)[i].fp8_forward_metas.push_back(linear->fp8_state().forward_meta());
      }
    }
  }
  return h;
}

std::vector<Linear*> TensorParallelGPT::linears(Layer& layer) {
  return {&layer.attention.qkv, &layer.attention.proj, &layer.mlp.fc1, &layer.mlp.fc2};
}

Tensor TensorParallelGPT::layer_forward(Layer& layer, const Tensor& x, int64_t B, int64_t T,
                                        LayerContext& ctx) {
  const Tensor attention = layer.attention.forward(x, B, T, ctx.attention);
  const Tensor h = residual_add(attention, x);
  const Tensor mlp = layer.mlp.forward(h, ctx.mlp);
  return residual_add(mlp, h);
}

Tensor TensorParallelGPT::layers_backward(int chunk, Tensor d,
                                          std::vector<LayerContext>& contexts) {
  Stack& stack = layers_.at(static_cast<size_t>(chunk));
  OCTET_CHECK(contexts.size() == stack.size(), "tensor-parallel gpt: backward of chunk ", chunk,
              " before its forward");
  for (size_t i = stack.size(); i-- > 0;) {
    Layer& layer = *stack[i];
    if (contexts[i].recompute) {
      // Replay the forward as it ran: its FP8 recipe and metas (no step counted), then the
      // live metas back.
      LayerContext& kept = contexts[i];
      LayerContext fresh;
      const std::vector<Linear*> fp8_linears =
          kept.fp8_recipe ? linears(layer) : std::vector<Linear*>{};
      std::vector<FP8Meta> live;
      for (size_t k = 0; k < fp8_linears.size(); ++k) {
        Fp8State& state = fp8_linears[k]->fp8_state();
        live.push_back(std::exchange(state.mutable_forward_meta(), kept.fp8_forward_metas.at(k)));
        state.set_recomputing(true);
      }
      {
        fp8_autocast scope(kept.fp8_recipe.has_value(),
                           kept.fp8_recipe.value_or(recipe::DelayedScaling{}));
        layer_forward(layer, kept.input, kept.batch, kept.seq_len, fresh);
      }
      for (size_t k = 0; k < fp8_linears.size(); ++k) {
        Fp8State& state = fp8_linears[k]->fp8_state();
        state.mutable_forward_meta() = std::move(live[k]);
        state.set_recomputing(false);
      }
      contexts[i] = std::move(fresh);
    }
    const Tensor dmlp = layer.mlp.backward(d, contexts[i].mlp);
    const Tensor dh = residual_add(dmlp, d);
    const Tensor dattention = layer.attention.backward(dh, contexts[i].attention);
    d = residual_add(dattention, dh);
    contexts[i] = LayerContext{};
    if (reporting_grads_) {
      std::vector<Parameter*> ready = layer.mlp.parameters();
      for (Parameter* p : layer.attention.parameters()) ready.push_back(p);
      grad_ready_hook_(ready);
    }
  }
  return d;
}

float TensorParallelGPT::output_loss(const Tensor& hidden, const Tensor& targets, DType dtype,
                                     float grad_scale, Tensor* dhidden) {
  // Every rank needs every token against its vocabulary rows.
  const Tensor whole = sequence_parallel_ ? gather_from_sequence_parallel_region(hidden, *tp_)
                                          : copy_to_tensor_parallel_region(hidden, *tp_);
  Tensor dwhole;
  const float loss = gpt_parts::tied_output_loss(
      whole, targets, wte, dtype, grad_scale, dhidden ? &dwhole : nullptr, output_cache_,
      [&](Tensor& logits, const Tensor& target_rows, Tensor& losses, bool backward, float scale) {
        vocab_parallel_cross_entropy(logits, target_rows, vocab_, losses, backward, scale, *tp_);
      },
      // Rank 0's shard is the widest: every rank cuts the same chunks (collective per chunk).
      vocab_range(config_.vocab_size, 0, tp_->size()).size());
  if (dhidden) {
    // Each rank's part of dhidden comes from its vocabulary rows: summed over the group.
    *dhidden = sequence_parallel_ ? gather_from_sequence_parallel_region_backward(dwhole, *tp_)
                                  : copy_to_tensor_parallel_region_backward(dwhole, *tp_);
  }
  return loss;
}

namespace {

TensorParallelGPT::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<TensorParallelGPT::Context*>(&base);
  OCTET_CHECK(ctx, "tensor-parallel gpt: expected a context from make_context()");
  return *ctx;
}

}  // namespace

Tensor TensorParallelGPT::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                                  DType dtype, float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "tensor-parallel gpt"),
                     pipeline::batch_tensor(batch, "targets", "tensor-parallel gpt"), dtype,
                     grad_scale, &ctx, &ctx.loss);
}

Tensor TensorParallelGPT::evaluate(int chunk, const Tensor& input,
                                   const pipeline::MicroBatch& batch, DType dtype, float* loss) {
  return run_forward(chunk, input, pipeline::batch_tensor(batch, "ids", "tensor-parallel gpt"),
                     pipeline::batch_tensor(batch, "targets", "tensor-parallel gpt"), dtype, 1.0f,
                     nullptr, loss);
}

Tensor TensorParallelGPT::run_forward(int chunk, const Tensor& input, const Tensor& ids,
                                      const Tensor& targets, DType dtype, float grad_scale,
                                      Context* ctx, float* loss) {
  check_micro_batch(ids, dtype);
  const int64_t B = ids.dim(0), T = ids.dim(1);
  if (ctx) ctx->ids = ids;
  Tensor h;
  if (is_first(chunk)) {
    const Tensor x = embed(ids);
    h = dtype == DType::F32 ? x : x.to(dtype);
  } else {
    const std::string what = "tensor-parallel gpt: input of chunk " + std::to_string(chunk);
    check_shape(input, boundary_shape(B, T), what, sequence_parallel_ ? "B*T/TP,C" : "B*T,C");
    check_dtype(input, dtype, what);
    h = input;
  }
  h = layers_forward(chunk, std::move(h), B, T, ctx ? &ctx->layers : nullptr);
  if (!is_last(chunk)) return h;
  check_shape(targets, ids.shape(), "tensor-parallel gpt: targets", "B,T");
  Norm::Context norm_scratch;
  const Tensor hidden = final_norm_->forward(h, ctx ? ctx->final_norm : norm_scratch);
  h = Tensor();
  *loss = output_loss(hidden, targets.reshape({B * T}), dtype, grad_scale,
                      ctx ? &ctx->doutput : nullptr);
  return Tensor();
}

Tensor TensorParallelGPT::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  Tensor d;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.doutput.defined(),
                "tensor-parallel gpt: backward of the last stage before its forward");
    d = final_norm_->backward(ctx.doutput, ctx.final_norm);
    ctx.doutput = Tensor();
    if (reporting_grads_) grad_ready_hook_(final_norm_->parameters());
  } else {
    d = doutput;
  }
  d = layers_backward(chunk, std::move(d), ctx.layers);
  if (!is_first(chunk)) {
    ctx = Context{};
    return d;
  }
  embed_backward(ctx.ids, d);
  ctx = Context{};
  if (reporting_grads_) {
    std::vector<Parameter*> ready;
    if (wpe.value.defined()) ready.push_back(&wpe);
    ready.push_back(&wte);
    grad_ready_hook_(ready);
  }
  return Tensor();
}

float TensorParallelGPT::train_step(const Tensor& ids, const Tensor& targets, DType dtype,
                                    float grad_scale) {
  OCTET_CHECK(stages_ == 1,
              "tensor-parallel gpt: train_step needs the whole model; this rank "
              "holds pipeline stages of ",
              stages_, " (run it through the pipeline executor)");
  check_shape(targets, ids.shape(), "tensor-parallel gpt: targets", "B,T");
  Context ctx;
  run_forward(0, Tensor(), ids, targets, dtype, grad_scale, &ctx, &ctx.loss);
  const float loss = ctx.loss;
  reporting_grads_ = static_cast<bool>(grad_ready_hook_);
  try {
    backward(0, Tensor(), ctx);  // frees ctx
  } catch (...) {
    reporting_grads_ = false;
    throw;
  }
  reporting_grads_ = false;
  return loss;
}

float TensorParallelGPT::train_step(const pipeline::MicroBatch& batch, DType dtype,
                                    float grad_scale) {
  return train_step(pipeline::batch_tensor(batch, "ids", "tensor-parallel gpt"),
                    pipeline::batch_tensor(batch, "targets", "tensor-parallel gpt"), dtype,
                    grad_scale);
}

float TensorParallelGPT::evaluate(const pipeline::MicroBatch& batch, DType dtype) {
  return evaluate(pipeline::batch_tensor(batch, "ids", "tensor-parallel gpt"),
                  pipeline::batch_tensor(batch, "targets", "tensor-parallel gpt"), dtype);
}

std::vector<int64_t> TensorParallelGPT::fp8_state_indices() {
  const size_t states = fp8_states().size();
  return stages_ == 1 ? octet::fp8_state_indices(states)
                      : octet::fp8_state_indices(*this, states, config_.num_layers);
}

TensorMap TensorParallelGPT::to_checkpoint_names(const TensorMap& ours) const {
  return to_hf_gpt2_names(ours);
}

TensorMap TensorParallelGPT::from_checkpoint_names(const TensorMap& theirs) const {
  return from_hf_gpt2_names(theirs);
}

float TensorParallelGPT::evaluate(const Tensor& ids, const Tensor& targets, DType dtype) {
  OCTET_CHECK(stages_ == 1,
              "tensor-parallel gpt: evaluate needs the whole model; this rank "
              "holds pipeline stages of ",
              stages_);
  float loss = 0.0f;
  run_forward(0, Tensor(), ids, targets, dtype, 1.0f, nullptr, &loss);
  return loss;
}

}  // namespace octet
