// TensorParallelGPT: forward, the vocabulary-parallel output layer + loss, backward.
#include <algorithm>
#include <cmath>

#include "core/convert.h"
#include "models/gpt_parts.h"
#include "octet/model_tensor_parallel.h"
#include "octet/ops/dropout.h"
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
                                     Communicator& tp)
    : wpe(gpt_parts::position_embedding(checked(config, tp), seed)),
      config_(config),
      sequence_parallel_(sequence_parallel),
      tp_(&tp),
      vocab_(vocab_range(config.vocab_size, tp.rank(), tp.size())),
      final_norm_(gpt_parts::final_norm_options(config)) {
  {
    // Rows of the same-seed whole table.
    Parameter full = gpt_parts::token_embedding(config, seed);
    wte = Parameter{full.name, full.value.slice_rows(vocab_.begin, vocab_.end).clone(),
                    Tensor::zeros({vocab_.size(), config.hidden}, DType::F32)};
  }
  layers_.reserve(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const TransformerLayerOptions o = gpt_parts::layer_options(config, i, seed, false);
    layers_.push_back(std::make_unique<Layer>(Layer{
        TensorParallelSelfAttention(attention_options(o), sequence_parallel, tp),
        TensorParallelLayerNormMLP(TransformerLayer::mlp_options(o), sequence_parallel, tp)}));
  }
  register_specs();
}

void TensorParallelGPT::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&wte);
  if (wpe.value.defined()) out.push_back(&wpe);
  for (auto& layer : layers_) {
    layer->attention.collect_parameters(out);
    layer->mlp.collect_parameters(out);
  }
  final_norm_.collect_parameters(out);
}

void TensorParallelGPT::on_parameters_updated() {
  output_cache_.invalidate();
  for (auto& layer : layers_) {
    layer->attention.on_parameters_updated();
    layer->mlp.on_parameters_updated();
  }
}

std::vector<Parameter*> TensorParallelGPT::sequence_parallel_parameters() {
  std::vector<Parameter*> out;
  if (!sequence_parallel_) return out;
  if (wpe.value.defined()) out.push_back(&wpe);
  for (auto& layer : layers_) {
    for (Parameter* p : layer->attention.sequence_parallel_parameters()) out.push_back(p);
    for (Parameter* p : layer->mlp.sequence_parallel_parameters()) out.push_back(p);
  }
  for (Parameter* p : final_norm_.parameters()) out.push_back(p);
  return out;
}

double TensorParallelGPT::grad_norm(Communicator& model_group) {
  double squares = 0;
  for (Parameter* p : parameters()) {
    if (spec(*p).kind == ShardSpec::Kind::Replicated && tp_->rank() != 0) continue;
    const Tensor grads[] = {p->grad};
    const double norm = ops::global_grad_norm(grads);
    squares += norm * norm;
  }
  return std::sqrt(model_group.all_reduce(squares, ReduceOp::Sum));
}

Tensor TensorParallelGPT::forward_hidden(const Tensor& ids, DType dtype,
                                         std::vector<LayerContext>* contexts,
                                         Norm::Context* final_context) {
  check_dtype(ids, DType::I32, "tensor-parallel gpt: ids");
  OCTET_CHECK(ids.ndim() == 2, "tensor-parallel gpt: ids expected [B,T], got ",
              shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "tensor-parallel gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  OCTET_CHECK(!fp8_enabled(), "tensor-parallel gpt: FP8 is not implemented yet");
  const int64_t B = ids.dim(0), T = ids.dim(1), N = B * T, C = config_.hidden;
  OCTET_CHECK(T <= config_.max_seq_len, "tensor-parallel gpt: sequence length ", T,
              " exceeds max_seq_len ", config_.max_seq_len);
  OCTET_CHECK(!sequence_parallel_ || N % tp_->size() == 0,
              "tensor-parallel gpt: sequence parallelism needs B*T (", N,
              ") divisible by TP=", tp_->size());
  const Tensor partial = vocab_parallel_embedding_forward(ids.reshape({N}), wte.value, vocab_);
  Tensor x = sequence_parallel_ ? reduce_scatter_to_sequence_parallel_region(partial, *tp_)
                                : reduce_from_tensor_parallel_region(partial, *tp_);
  if (wpe.value.defined()) {
    // x's rows are tokens first_row.. of the whole [B*T]: position (row % T).
    const int64_t first_row = sequence_parallel_ ? tp_->rank() * x.rows() : 0;
    float* xs = x.data<float>();
    const float* pos = wpe.value.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < x.rows(); ++row) {
      const float* p = pos + ((first_row + row) % T) * C;
      for (int64_t c = 0; c < C; ++c) xs[row * C + c] += p[c];
    }
  }
  Tensor h = dtype == DType::F32 ? x : x.to(dtype);
  if (contexts) contexts->assign(layers_.size(), LayerContext{});
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerContext scratch;
    LayerContext& ctx = contexts ? (*contexts)[i] : scratch;
    Layer& layer = *layers_[i];
    const Tensor attention = layer.attention.forward(h, B, T, ctx.attention);
    h = residual_add(attention, h);
    const Tensor mlp = layer.mlp.forward(h, ctx.mlp);
    h = residual_add(mlp, h);
  }
  Norm::Context scratch;
  return final_norm_.forward(h, final_context ? *final_context : scratch);
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

float TensorParallelGPT::train_step(const Tensor& ids, const Tensor& targets, DType dtype,
                                    float grad_scale) {
  check_shape(targets, ids.shape(), "tensor-parallel gpt: targets", "B,T");
  const int64_t T = ids.dim(1), N = ids.numel(), C = config_.hidden;
  std::vector<LayerContext> contexts;
  Norm::Context final_context;
  Tensor hidden = forward_hidden(ids, dtype, &contexts, &final_context);
  Tensor dhidden;
  const float loss = output_loss(hidden, targets.reshape({N}), dtype, grad_scale, &dhidden);
  hidden = Tensor();
  Tensor d = final_norm_.backward(dhidden, final_context);
  for (size_t i = layers_.size(); i-- > 0;) {
    Layer& layer = *layers_[i];
    const Tensor dmlp = layer.mlp.backward(d, contexts[i].mlp);
    const Tensor dh = residual_add(dmlp, d);
    const Tensor dattention = layer.attention.backward(dh, contexts[i].attention);
    d = residual_add(dattention, dh);
    contexts[i] = LayerContext{};
  }
  const Tensor dx = d.dtype() == DType::F32 ? d : d.to(DType::F32);
  if (wpe.value.defined()) {
    // Under SP this rank's token rows give a partial gradient (summed over the group later).
    const int64_t first_row = sequence_parallel_ ? tp_->rank() * dx.rows() : 0;
    const float* g = dx.data<float>();
    float* w = wpe.grad.data<float>();
    // Threads split the positions; each adds its rows in row order (as GPT does).
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* p = w + t * C;
      for (int64_t row = ((t - first_row) % T + T) % T; row < dx.rows(); row += T) {
        for (int64_t c = 0; c < C; ++c) p[c] += g[row * C + c];
      }
    }
  }
  const Tensor dwhole = sequence_parallel_
                            ? reduce_scatter_to_sequence_parallel_region_backward(dx, *tp_)
                            : reduce_from_tensor_parallel_region_backward(dx, *tp_);
  vocab_parallel_embedding_backward(ids.reshape({N}), dwhole, wte.grad, vocab_);
  return loss;
}

float TensorParallelGPT::evaluate(const Tensor& ids, const Tensor& targets, DType dtype) {
  check_shape(targets, ids.shape(), "tensor-parallel gpt: targets", "B,T");
  const Tensor hidden = forward_hidden(ids, dtype, nullptr, nullptr);
  return output_loss(hidden, targets.reshape({targets.numel()}), dtype, 1.0f, nullptr);
}

}  // namespace octet
