// GPT's shared pieces: layer options and seeds, embeddings, the fused tied output layer.
#include "models/gpt_parts.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/convert.h"
#include "modules/common.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"

namespace octet {

void TiedOutputCache::invalidate() {
  wte_bf16 = Tensor();
  wte_bf16_in_f32 = Tensor();
  packed.reset();
}

namespace gpt_parts {

namespace {

// Rows of logits computed at once: bounds the [rows, V] F32 buffer to ~64 MB.
int64_t logits_chunk_rows(int64_t vocab) {
  return std::max<int64_t>(16, (16 << 20) / vocab);
}

}  // namespace

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
  if (c.moe()) {
    MoELayerOptions& m = o.moe;
    m.num_experts = c.num_experts;
    m.ffn_hidden = c.moe_ffn();
    m.shared_expert_ffn_hidden = c.moe_shared_expert_ffn_hidden;
    m.router.topk = c.moe_router_topk;
    m.router.score = c.moe_router_score_function == "sigmoid" ? ops::RouterScore::Sigmoid
                                                              : ops::RouterScore::Softmax;
    m.router.normalize = c.moe_router_normalize;
    m.router.scaling = c.moe_router_topk_scaling_factor;
    m.router.aux_loss_coeff = c.moe_aux_loss_coeff;
    m.router.z_loss_coeff = c.moe_z_loss_coeff;
    m.enable_expert_bias = c.moe_router_enable_expert_bias;
    m.expert_bias_update_rate = c.moe_router_bias_update_rate;
    m.capacity_factor = c.moe_expert_capacity_factor;
    m.drop_policy =
        c.moe_token_drop_policy == "position" ? ops::DropPolicy::Position : ops::DropPolicy::Probs;
  }
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

Parameter token_embedding(const GPTConfig& c, uint64_t seed) {
  return modules_detail::make_parameter("transformer.wte.weight", {c.vocab_size, c.hidden},
                                        c.init_std, seed * 7919 + 1);
}

Parameter position_embedding(const GPTConfig& c, uint64_t seed) {
  if (c.position_embedding != "learned") return Parameter{};
  return modules_detail::make_parameter("transformer.wpe.weight", {c.max_seq_len, c.hidden},
                                        c.init_std / 2, seed * 7919 + 2);
}

Tensor embed(const Tensor& ids, const Parameter& wte, const Parameter& wpe,
             int64_t position_offset) {
  const int64_t B = ids.dim(0), T = ids.dim(1), C = wte.value.dim(1);
  Tensor x = Tensor::empty({B * T, C}, DType::F32);
  ops::embedding_forward(ids.reshape({B * T}), wte.value, x);
  if (wpe.value.defined()) ops::position_embedding_forward(x, wpe.value, T, 0, position_offset);
  return x;
}

const Tensor& tied_weight_as(Parameter& wte, DType dtype, TiedOutputCache& cache) {
  if (dtype == DType::F32) return wte.value;
  if (!cache.wte_bf16.defined()) cache.wte_bf16 = wte.value.to(DType::BF16);
  return cache.wte_bf16;
}

PackedWeight& tied_packed_as(Parameter& wte, DType dtype, TiedOutputCache& cache) {
  if (!cache.packed || cache.packed_dtype != dtype) {
    cache.packed.emplace(tied_weight_as(wte, dtype, cache), /*trans=*/true);
    cache.packed_dtype = dtype;
  }
  return *cache.packed;
}

namespace {

// rows [N, V] F32 += v [V] on every row; and sums [V] += the column sums of rows.
void add_row_vector(Tensor& rows, const Tensor& v) {
  const int64_t N = rows.dim(0), V = rows.dim(1);
  float* r = rows.data<float>();
  const float* b = v.data<float>();
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) r[i * V + j] += b[j];
  }
}

void add_column_sums(const Tensor& rows, Tensor& sums) {
  const int64_t N = rows.dim(0), V = rows.dim(1);
  const float* r = rows.data<float>();
  float* s = sums.data<float>();
#pragma omp parallel for
  for (int64_t j0 = 0; j0 < V; j0 += 256) {
    const int64_t j1 = std::min(V, j0 + 256);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = j0; j < j1; ++j) s[j] += r[i * V + j];
    }
  }
}

// The backward of one chunk where BF16 GEMMs run widened to F32 (no oneDNN BF16 matmul): the
// same products on the same values, without widening the [V, C] weight and the [rows, V]
// gradient of the logits for each GEMM (three passes over ~60-80 MB per chunk at GPT-2's
// vocabulary). `dlogits` is the F32 gradient, rounded in place to the BF16 values the BF16
// path would give its GEMMs; the weight's BF16 values are kept in F32 across chunks.
void widened_chunk_backward(Tensor& dlogits, const Tensor& h, Parameter& wte,
                            TiedOutputCache& cache, Tensor& dh) {
  if (!cache.wte_bf16_in_f32.defined()) {
    cache.wte_bf16_in_f32 = wte.value.clone();
    round_f32_to_bf16(cache.wte_bf16_in_f32.data<float>(),
                      static_cast<size_t>(cache.wte_bf16_in_f32.numel()));
  }
  round_f32_to_bf16(dlogits.data<float>(), static_cast<size_t>(dlogits.numel()));
  Tensor dh32 = Tensor::empty(dh.shape(), DType::F32);
  gemm(dlogits, cache.wte_bf16_in_f32, dh32, /*trans_a=*/false, /*trans_b=*/false);
  convert_f32_to_bf16(dh32.data<float>(), dh.data<bfloat16>(), static_cast<size_t>(dh.numel()));
  gemm(dlogits, h.to(DType::F32), wte.grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
}

}  // namespace

float tied_output_loss(const Tensor& hidden, const Tensor& targets, Parameter& wte, DType dtype,
                       float grad_scale, Tensor* dhidden, TiedOutputCache& cache,
                       const ChunkLoss& loss, int64_t chunk_vocab, Parameter* bias) {
  const int64_t N = hidden.dim(0), V = wte.value.dim(0);
  if (bias) check_shape(bias->value, {V}, "output layer bias", "V");
  const Tensor& weight = tied_weight_as(wte, dtype, cache);
  const int64_t valid = ops::count_valid_targets(targets);
  OCTET_CHECK(valid > 0, "gpt: every target is ignore_index; nothing to learn from");
  if (dhidden) *dhidden = Tensor::empty(hidden.shape(), dtype);
  // Equal chunks (no small tail GEMM), each at most logits_chunk_rows(V) rows.
  const int64_t chunk_limit = logits_chunk_rows(chunk_vocab > 0 ? chunk_vocab : V);
  const int64_t chunks = (N + chunk_limit - 1) / chunk_limit;
  const int64_t chunk = (N + chunks - 1) / chunks;
  // The workspaces live across steps: fresh 60+ MB buffers every step cost page faults.
  if (!cache.logits.defined() || cache.logits.dim(0) < chunk) {
    cache.logits = Tensor::empty({chunk, V}, DType::F32);
    cache.dlogits = Tensor();
  }
  const bool widened_backward =
      dhidden && dtype == DType::BF16 && !gemm_bf16_native() && wte.grad.dtype() == DType::F32;
  if (dhidden && dtype == DType::BF16 && !widened_backward && !cache.dlogits.defined()) {
    cache.dlogits = Tensor::empty({chunk, V}, DType::BF16);
  }
  PackedWeight& packed = tied_packed_as(wte, dtype, cache);
  double loss_sum = 0.0;
  Tensor losses_buffer = Tensor::empty({chunk}, DType::F32);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk), rows = r1 - r0;
    Tensor h = hidden.slice_rows(r0, r1);
    Tensor logits = cache.logits.slice_rows(0, rows);
    gemm(h, packed, logits, /*trans_a=*/false);
    if (bias) add_row_vector(logits, bias->value);
    Tensor losses = losses_buffer.slice_rows(0, rows);
    const Tensor target_rows = targets.slice_rows(r0, r1);
    const float scale = grad_scale / static_cast<float>(valid);
    if (loss) {
      loss(logits, target_rows, losses, dhidden != nullptr, scale);
    } else {
      ops::CrossEntropyOptions options;
      options.grad_scale = scale;
      ops::cross_entropy_forward_backward(logits, target_rows, losses, dhidden ? &logits : nullptr,
                                          options);
    }
    for (float l : losses.to_floats()) loss_sum += l;
    if (!dhidden) continue;
    if (bias) add_column_sums(logits, bias->grad);
    Tensor dh = dhidden->slice_rows(r0, r1);
    if (widened_backward) {
      widened_chunk_backward(logits, h, wte, cache, dh);
      continue;
    }
    Tensor dlogits = logits;
    if (dtype == DType::BF16) {
      dlogits = cache.dlogits.slice_rows(0, rows);
      convert_f32_to_bf16(logits.data<float>(), dlogits.data<bfloat16>(),
                          static_cast<size_t>(rows * V));
    }
    gemm(dlogits, weight, dh, /*trans_a=*/false, /*trans_b=*/false);
    gemm(dlogits, h, wte.grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
  }
  return static_cast<float>(loss_sum / static_cast<double>(valid));
}

std::vector<int64_t> vocab_argmax(const Tensor& hidden, Parameter& weight, DType dtype,
                                  TiedOutputCache& cache, VocabRange vocab, Communicator* tp,
                                  const Parameter* bias) {
  const Tensor& w = tied_weight_as(weight, dtype, cache);
  const int64_t M = hidden.rows(), Vl = w.dim(0);
  Tensor logits = Tensor::empty({M, Vl}, DType::F32);
  gemm(hidden, w, logits, /*trans_a=*/false, /*trans_b=*/true);
  // This rank's best value and id of each row: [value_0 .. value_M-1, id_0 .. id_M-1].
  Tensor best = Tensor::empty({2 * M}, DType::F32);
  const float* l = logits.data<float>();
  const float* b = bias ? bias->value.data<float>() : nullptr;
  float* out = best.data<float>();
  for (int64_t i = 0; i < M; ++i) {
    int64_t arg = 0;
    float top = -INFINITY;
    for (int64_t j = 0; j < Vl; ++j) {
      const float v = l[i * Vl + j] + (b ? b[j] : 0.0f);
      if (v > top) top = v, arg = j;
    }
    out[i] = top;
    out[M + i] = static_cast<float>(vocab.begin + arg);  // exact below 2^24
  }
  const std::vector<float> all = tp ? tp->all_gather(best).to_floats() : best.to_floats();
  const int64_t ranks = tp ? tp->size() : 1;
  std::vector<int64_t> ids(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) {
    float top = -INFINITY;
    for (int64_t q = 0; q < ranks; ++q) {
      const auto at = [&](int64_t k) { return all[static_cast<size_t>(q * 2 * M + k)]; };
      if (at(i) > top) top = at(i), ids[static_cast<size_t>(i)] = static_cast<int64_t>(at(M + i));
    }
  }
  return ids;
}

}  // namespace gpt_parts
}  // namespace octet
