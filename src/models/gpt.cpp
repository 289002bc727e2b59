// GPT forward, fused output layer + cross-entropy (chunked over tokens, logits never held for
// the whole batch), backward, and state dicts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/convert.h"
#include "models/gpt_parts.h"
#include "octet/model.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"

namespace octet {

GPT::GPT(const GPTConfig& config, uint64_t seed, bool recompute_activations)
    : wte(gpt_parts::token_embedding(config, seed)),
      wpe(gpt_parts::position_embedding(config, seed)),
      config_(config),
      final_norm_(gpt_parts::final_norm_options(config)) {
  layers_.reserve(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    layers_.emplace_back(gpt_parts::layer_options(config, i, seed, recompute_activations));
  }
}

void GPT::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&wte);
  if (wpe.value.defined()) out.push_back(&wpe);
  for (TransformerLayer& layer : layers_) layer.collect_parameters(out);
  final_norm_.collect_parameters(out);
}

std::vector<Parameter*> GPT::parameters_in_backward_order() {
  std::vector<Parameter*> out = {&wte};
  for (Parameter* p : final_norm_.parameters()) out.push_back(p);
  for (size_t i = layers_.size(); i-- > 0;) {
    for (Parameter* p : layers_[i].parameters()) out.push_back(p);
  }
  if (wpe.value.defined()) out.push_back(&wpe);
  return out;
}

void GPT::on_parameters_updated() {
  output_cache_.invalidate();
  for (TransformerLayer& layer : layers_) layer.on_parameters_updated();
}

const Tensor& GPT::wte_as(DType dtype) {
  return gpt_parts::tied_weight_as(wte, dtype, output_cache_);
}

Tensor GPT::forward_hidden(const Tensor& ids, DType dtype,
                           std::vector<TransformerLayer::Context>* contexts,
                           Norm::Context* final_context) {
  check_dtype(ids, DType::I32, "gpt: ids");
  OCTET_CHECK(ids.ndim() == 2, "gpt: ids expected [B,T], got ", shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt: compute dtype expected f32 or "
              "bf16, got ",
              dtype_name(dtype));
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  OCTET_CHECK(T <= config_.max_seq_len, "gpt: sequence length ", T, " exceeds max_seq_len ",
              config_.max_seq_len);
  Tensor x = embed(ids, 0);
  Tensor h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({B, T, C});
  if (contexts) contexts->assign(layers_.size(), TransformerLayer::Context{});
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (contexts) {
      h = layers_[i].forward(h, (*contexts)[i]);
    } else {
      TransformerLayer::Context scratch;
      h = layers_[i].forward(h, scratch);
    }
  }
  Norm::Context scratch;
  return final_norm_.forward(h, final_context ? *final_context : scratch).reshape({B * T, C});
}

Tensor GPT::embed(const Tensor& ids, int64_t position_offset) {
  return gpt_parts::embed(ids, wte, wpe, position_offset);
}

float GPT::output_layer(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                        Tensor* dhidden) {
  return gpt_parts::tied_output_loss(hidden, targets, wte, dtype, grad_scale, dhidden,
                                     output_cache_);
}

float GPT::train_step(const Tensor& ids, const Tensor& targets, DType dtype, float grad_scale) {
  check_shape(targets, ids.shape(), "gpt: targets", "B,T");
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  std::vector<TransformerLayer::Context> contexts;
  Norm::Context final_context;
  Tensor hidden = forward_hidden(ids, dtype, &contexts, &final_context);
  Tensor dhidden;
  float loss = output_layer(hidden, targets.reshape({B * T}), dtype, grad_scale, &dhidden);
  hidden = Tensor();
  if (embedding_grad_hook_) grads_ready({&wte});
  Tensor dx = final_norm_.backward(dhidden, final_context).reshape({B, T, C});
  grads_ready(final_norm_.parameters());
  for (size_t i = layers_.size(); i-- > 0;) {
    dx = layers_[i].backward(dx, contexts[i]);
    contexts[i] = TransformerLayer::Context{};
    grads_ready(layers_[i].parameters());
  }
  Tensor dx32 = (dx.dtype() == DType::F32 ? dx : dx.to(DType::F32)).reshape({B * T, C});
  if (embedding_grad_hook_) {
    embedding_grad_hook_(wte, ids.reshape({B * T}), dx32);
  } else {
    ops::embedding_backward(ids.reshape({B * T}), dx32, wte.grad);
  }
  if (wpe.value.defined()) gpt_parts::position_embedding_backward(dx32, B, T, wpe);
  std::vector<Parameter*> embeddings;
  if (!embedding_grad_hook_) embeddings.push_back(&wte);
  if (wpe.value.defined()) embeddings.push_back(&wpe);
  if (!embeddings.empty()) grads_ready(embeddings);
  return loss;
}

float GPT::evaluate(const Tensor& ids, const Tensor& targets, DType dtype) {
  check_shape(targets, ids.shape(), "gpt: targets", "B,T");
  Tensor hidden = forward_hidden(ids, dtype, nullptr, nullptr);
  return output_layer(hidden, targets.reshape({targets.numel()}), dtype, 1.0f, nullptr);
}

namespace {

// Row (b + 1) * T - 1 of hidden [B*T, C] for each b: [B, C].
Tensor last_rows(const Tensor& hidden, int64_t B, int64_t T) {
  const int64_t C = hidden.dim(-1);
  Tensor last = Tensor::empty({B, C}, hidden.dtype());
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(hidden.dtype());
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(static_cast<char*>(last.raw()) + b * row_bytes,
                static_cast<const char*>(hidden.raw()) + ((b + 1) * T - 1) * row_bytes, row_bytes);
  }
  return last;
}

}  // namespace

Tensor GPT::last_logits(const Tensor& ids, DType dtype) {
  const int64_t B = ids.dim(0), T = ids.dim(1);
  Tensor hidden = forward_hidden(ids, dtype, nullptr, nullptr);
  Tensor logits = Tensor::empty({B, config_.vocab_size}, DType::F32);
  gemm(last_rows(hidden, B, T), wte_as(hidden.dtype()), logits, false, true);
  return logits;
}

Tensor GPT::logits_of_last(const Tensor& hidden) {
  Norm::Context scratch;
  Tensor normalized = final_norm_.forward(hidden, scratch);
  Tensor logits = Tensor::empty({hidden.dim(0), config_.vocab_size}, DType::F32);
  gemm(normalized, wte_as(hidden.dtype()), logits, false, true);
  return logits;
}

Tensor GPT::forward_inference(const Tensor& ids, InferenceParams& params, DType dtype) {
  check_dtype(ids, DType::I32, "gpt: ids");
  OCTET_CHECK(ids.ndim() == 2 && ids.dim(1) > 0, "gpt: ids expected [B,T] with T > 0, got ",
              shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  const int64_t offset = params.sequence_len_offset;
  OCTET_CHECK(offset + T <= config_.max_seq_len, "gpt: ", offset, " cached + ", T,
              " new tokens exceed max_seq_len ", config_.max_seq_len);
  Tensor x = embed(ids, offset);
  Tensor h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({B, T, C});
  for (size_t i = 0; i < layers_.size(); ++i) {
    h = layers_[i].forward_inference(h, params, static_cast<int64_t>(i));
  }
  params.sequence_len_offset = offset + T;
  // The final norm is per row: only the last position of each sequence needs it.
  return logits_of_last(last_rows(h.reshape({B * T, C}), B, T));
}

InferenceParams GPT::make_inference_params(int64_t max_batch_size) const {
  return InferenceParams(max_batch_size, config_.max_seq_len);
}

TensorMap GPT::state_dict() {
  TensorMap out;
  for (Parameter* p : parameters()) out[p->name] = p->value;
  return out;
}

void GPT::load_state_dict(const TensorMap& tensors) {
  std::vector<Parameter*> params = parameters();
  for (Parameter* p : params) {
    auto it = tensors.find(p->name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", p->name,
                "' (does the checkpoint match this model config?)");
    check_shape(it->second, p->value.shape(), "checkpoint: tensor '" + p->name + "'");
    check_dtype(it->second, DType::F32, "checkpoint: tensor '" + p->name + "'");
    p->value.copy_from(it->second);
  }
  OCTET_CHECK(tensors.size() == params.size(), "checkpoint: holds ", tensors.size(),
              " tensors, the model has ", params.size(), " parameters");
  on_parameters_updated();
}

}  // namespace octet
