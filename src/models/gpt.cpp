// GPT forward, fused output layer + cross-entropy (chunked over tokens, logits never held for
// the whole batch), backward, and state dicts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/convert.h"
#include "octet/model.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"

namespace octet {

namespace {

// Rows of logits computed at once: bounds the [rows, V] F32 buffer to ~64 MB.
int64_t logits_chunk_rows(int64_t vocab) {
  return std::max<int64_t>(16, (16 << 20) / vocab);
}

TransformerLayerOptions layer_options(const GPTConfig& c, int64_t index, uint64_t seed,
                                      bool recompute) {
  TransformerLayerOptions o;
  o.checkpoint = recompute;
  o.hidden_size = c.hidden;
  o.ffn_hidden_size = c.ffn();
  o.num_attention_heads = c.num_heads;
  o.num_gqa_groups = c.num_gqa_groups;
  o.layernorm_epsilon = c.layernorm_eps;
  o.hidden_dropout = c.dropout;
  o.attention_dropout = c.dropout;
  o.normalization = c.normalization == "rmsnorm" ? NormKind::RMSNorm : NormKind::LayerNorm;
  o.activation = ops::parse_activation(c.activation);
  o.layer_type = LayerType::Encoder;
  o.self_attn_mask_type = AttnMaskType::Causal;
  o.rope = c.position_embedding == "rope";
  o.rope_theta = c.rope_theta;
  o.bias = c.bias;
  o.init_std = c.init_std;
  // GPT-2: residual projections scaled by 1/sqrt(2 * layers).
  o.output_init_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  o.seed = seed * 1000 + static_cast<uint64_t>(index) + 1;
  o.name = "transformer.h." + std::to_string(index);
  return o;
}

NormOptions final_norm_options(const GPTConfig& c) {
  NormOptions o;
  o.hidden = c.hidden;
  o.kind = c.normalization == "rmsnorm" ? NormKind::RMSNorm : NormKind::LayerNorm;
  o.eps = c.layernorm_eps;
  o.name = "transformer.ln_f";
  return o;
}

Parameter normal_parameter(std::string name, Shape shape, float std, uint64_t seed) {
  Parameter p{std::move(name), Tensor::empty(shape, DType::F32), Tensor::zeros(shape, DType::F32)};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, std);
  float* v = p.value.data<float>();
  for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = normal(rng);
  return p;
}

}  // namespace

GPT::GPT(const GPTConfig& config, uint64_t seed, bool recompute_activations)
    : wte(normal_parameter("transformer.wte.weight", {config.vocab_size, config.hidden},
                           config.init_std, seed * 7919 + 1)),
      config_(config),
      final_norm_(final_norm_options(config)) {
  if (config.position_embedding == "learned") {
    wpe = normal_parameter("transformer.wpe.weight", {config.max_seq_len, config.hidden},
                           config.init_std / 2, seed * 7919 + 2);
  }
  layers_.reserve(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    layers_.emplace_back(layer_options(config, i, seed, recompute_activations));
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
  wte_bf16_ = Tensor();
  wte_packed_.reset();
  for (TransformerLayer& layer : layers_) layer.on_parameters_updated();
}

const Tensor& GPT::wte_as(DType dtype) {
  if (dtype == DType::F32) return wte.value;
  if (!wte_bf16_.defined()) wte_bf16_ = wte.value.to(DType::BF16);
  return wte_bf16_;
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
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  Tensor x = Tensor::empty({B * T, C}, DType::F32);
  ops::embedding_forward(ids.reshape({B * T}), wte.value, x);
  if (wpe.value.defined()) {
    float* xs = x.data<float>();
    const float* pos = wpe.value.data<float>() + position_offset * C;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < B * T; ++row) {
      const float* p = pos + (row % T) * C;
      for (int64_t c = 0; c < C; ++c) xs[row * C + c] += p[c];
    }
  }
  return x;
}

float GPT::output_layer(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                        Tensor* dhidden) {
  const int64_t N = hidden.dim(0), V = config_.vocab_size;
  const Tensor& weight = wte_as(dtype);
  const int64_t valid = ops::count_valid_targets(targets);
  OCTET_CHECK(valid > 0, "gpt: every target is ignore_index; nothing to learn from");
  if (dhidden) *dhidden = Tensor::empty(hidden.shape(), dtype);
  // Equal chunks (no small tail GEMM), each at most logits_chunk_rows(V) rows.
  const int64_t chunks = (N + logits_chunk_rows(V) - 1) / logits_chunk_rows(V);
  const int64_t chunk = (N + chunks - 1) / chunks;
  // The workspaces live across steps: fresh 60+ MB buffers every step cost page faults.
  if (!logits_workspace_.defined() || logits_workspace_.dim(0) < chunk) {
    logits_workspace_ = Tensor::empty({chunk, V}, DType::F32);
    dlogits_workspace_ = Tensor();
  }
  if (dhidden && dtype == DType::BF16 && !dlogits_workspace_.defined()) {
    dlogits_workspace_ = Tensor::empty({chunk, V}, DType::BF16);
  }
  if (!wte_packed_ || wte_packed_dtype_ != dtype) {
    wte_packed_.emplace(weight, /*trans=*/true);
    wte_packed_dtype_ = dtype;
  }
  double loss_sum = 0.0;
  Tensor losses_buffer = Tensor::empty({chunk}, DType::F32);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk), rows = r1 - r0;
    Tensor h = hidden.slice_rows(r0, r1);
    Tensor logits = logits_workspace_.slice_rows(0, rows);
    gemm(h, *wte_packed_, logits, /*trans_a=*/false);
    Tensor losses = losses_buffer.slice_rows(0, rows);
    ops::CrossEntropyOptions options;
    options.grad_scale = grad_scale / static_cast<float>(valid);
    Tensor target_rows = targets.slice_rows(r0, r1);
    ops::cross_entropy_forward_backward(logits, target_rows, losses, dhidden ? &logits : nullptr,
                                        options);
    for (float l : losses.to_floats()) loss_sum += l;
    if (!dhidden) continue;
    Tensor dlogits = logits;
    if (dtype == DType::BF16) {
      dlogits = dlogits_workspace_.slice_rows(0, rows);
      convert_f32_to_bf16(logits.data<float>(), dlogits.data<bfloat16>(),
                          static_cast<size_t>(rows * V));
    }
    Tensor dh = dhidden->slice_rows(r0, r1);
    gemm(dlogits, weight, dh, /*trans_a=*/false, /*trans_b=*/false);
    gemm(dlogits, h, wte.grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
  }
  return static_cast<float>(loss_sum / static_cast<double>(valid));
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
  if (wpe.value.defined()) {
    const float* d = dx32.data<float>();
    float* g = wpe.grad.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t c = 0; c < C; ++c) g[t * C + c] += d[(b * T + t) * C + c];
      }
    }
  }
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
