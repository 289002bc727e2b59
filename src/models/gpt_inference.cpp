// GPT inference over the whole model: last-position logits, and KV-cache prefill / decode
// steps (no contexts kept, the final norm and output layer on the last positions only).
#include <cstring>

#include "models/gpt_parts.h"
#include "octet/model.h"

namespace octet {

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
  check_inference("last_logits");
  check_micro_batch(ids, dtype);
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  Tensor x = embed(ids);
  Tensor h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({B, T, C});
  for (TransformerLayer& layer : layers()) {
    TransformerLayer::Context scratch;
    h = layer.forward(h, scratch);
  }
  Norm::Context scratch;
  Tensor hidden = final_norm_->forward(h, scratch).reshape({B * T, C});
  Tensor logits = Tensor::empty({B, config_.vocab_size}, DType::F32);
  gemm(last_rows(hidden, B, T), wte_packed_as(hidden.dtype()), logits, false);
  return logits;
}

Tensor GPT::logits_of_last(const Tensor& hidden) {
  Norm::Context scratch;
  Tensor normalized = final_norm_->forward(hidden, scratch);
  Tensor logits = Tensor::empty({hidden.dim(0), config_.vocab_size}, DType::F32);
  if (wte_fp8_) {
    gemm(normalized, *wte_fp8_, logits);
    return logits;
  }
  // The copy packed for oneDNN: decode's few rows read it in K pairs (gemm/small_m.h).
  gemm(normalized, wte_packed_as(hidden.dtype()), logits, false);
  return logits;
}

Tensor GPT::forward_inference(const Tensor& ids, InferenceParams& params, DType dtype) {
  check_inference("forward_inference");
  check_dtype(ids, DType::I32, "gpt: ids");
  OCTET_CHECK(ids.ndim() == 2 && ids.dim(1) > 0, "gpt: ids expected [B,T] with T > 0, got ",
              shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const int64_t B = ids.dim(0), T = ids.dim(1), C = config_.hidden;
  const int64_t offset = params.sequence_len_offset;
  OCTET_CHECK(offset + T <= config_.max_seq_len, "gpt: ", offset, " cached + ", T,
              " new tokens exceed max_seq_len ", config_.max_seq_len);
  Tensor x = gpt_parts::embed(ids, wte, wpe, offset);
  Tensor h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({B, T, C});
  std::vector<TransformerLayer>& stack = layers();
  for (size_t i = 0; i < stack.size(); ++i) {
    h = stack[i].forward_inference(h, params, static_cast<int64_t>(i));
  }
  params.sequence_len_offset = offset + T;
  // The final norm is per row: only the last position of each sequence needs it.
  return logits_of_last(last_rows(h.reshape({B * T, C}), B, T));
}

InferenceParams GPT::make_inference_params(int64_t max_batch_size) const {
  return InferenceParams(max_batch_size, config_.max_seq_len);
}

Tensor GPT::forward_paged(const Tensor& ids, InferenceParams& params, DType dtype) {
  check_inference("forward_paged");
  check_dtype(ids, DType::I32, "gpt: ids");
  OCTET_CHECK(params.is_paged, "gpt: forward_paged needs a paged cache (InferenceParams::paged)");
  const InferenceParams::PagedBatch& batch = params.batch;
  const int64_t S = batch.sequences(), C = config_.hidden;
  OCTET_CHECK(S > 0 && ids.ndim() == 2 && ids.dim(0) == 1 && ids.dim(1) == batch.row_offsets.back(),
              "gpt: packed ids expected [1, N] with N = ", S > 0 ? batch.row_offsets.back() : 0,
              " (the paged batch's rows), got ", shape_str(ids.shape()));
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "gpt: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const int64_t N = ids.dim(1);
  // Each sequence's tokens embedded at its own positions.
  Tensor x = Tensor::empty({N, C}, DType::F32);
  for (int64_t s = 0; s < S; ++s) {
    const size_t i = static_cast<size_t>(s);
    const int64_t begin = batch.row_offsets[i], end = batch.row_offsets[i + 1];
    OCTET_CHECK(batch.cached_lengths[i] + end - begin <= config_.max_seq_len, "gpt: sequence ", s,
                " reaches ", batch.cached_lengths[i] + end - begin, " tokens, over max_seq_len ",
                config_.max_seq_len);
    Tensor segment = ids.reshape({N}).slice_rows(begin, end).reshape({1, end - begin});
    Tensor embedded = gpt_parts::embed(segment, wte, wpe, batch.cached_lengths[i]);
    std::memcpy(x.data<float>() + begin * C, embedded.data<float>(),
                static_cast<size_t>((end - begin) * C) * sizeof(float));
  }
  Tensor h = (dtype == DType::F32 ? x : x.to(dtype)).reshape({1, N, C});
  std::vector<TransformerLayer>& stack = layers();
  for (size_t i = 0; i < stack.size(); ++i) {
    h = stack[i].forward_inference(h, params, static_cast<int64_t>(i));
  }
  // The last new row of each sequence.
  Tensor flat = h.reshape({N, C});
  Tensor last = Tensor::empty({S, C}, h.dtype());
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(h.dtype());
  for (int64_t s = 0; s < S; ++s) {
    std::memcpy(static_cast<char*>(last.raw()) + s * row_bytes,
                static_cast<const char*>(flat.raw()) +
                    (batch.row_offsets[static_cast<size_t>(s) + 1] - 1) * row_bytes,
                row_bytes);
  }
  return logits_of_last(last);
}

InferenceParams GPT::make_paged_inference_params(int64_t num_blocks, int64_t block_size) const {
  return InferenceParams::paged(num_blocks, block_size, config_.max_seq_len);
}

namespace {

// The GEMM layers of a transformer layer (a mixture of experts: its shared expert's; the
// experts' own weights are not Linears).
std::vector<Linear*> linears_of(TransformerLayer& layer) {
  std::vector<Linear*> out;
  MultiheadAttention& a = layer.self_attention;
  if (a.layernorm_qkv) out.push_back(&a.layernorm_qkv->linear);
  if (a.qkv) out.push_back(&*a.qkv);
  out.push_back(&a.proj);
  if (layer.layernorm_mlp) {
    out.push_back(&layer.layernorm_mlp->fc1);
    out.push_back(&layer.layernorm_mlp->fc2);
  }
  return out;
}

}  // namespace

size_t GPT::set_inference_fp8_weights(bool on, Fp8WeightScaling scaling) {
  check_inference("set_inference_fp8_weights");
  size_t bytes = 0;
  for (TransformerLayer& layer : layers()) {
    OCTET_CHECK(!layer.inter_attention, "gpt: inference FP8 weights: cross-attention layers");
    OCTET_CHECK(!layer.moe,
                "gpt: inference FP8 weights of a mixture of experts are not supported "
                "yet (serve it in BF16)");
    for (Linear* linear : linears_of(layer)) {
      linear->set_inference_fp8_weight(on, scaling);
      bytes += linear->inference_weight_bytes();
    }
  }
  wte_fp8_.reset();
  if (on) {
    wte_fp8_ = quantize_weight_fp8(wte.value, scaling);
    bytes += wte_fp8_->nbytes();
  }
  return bytes;
}

size_t GPT::inference_weight_bytes(DType dtype) {
  size_t bytes =
      wte_fp8_ ? wte_fp8_->nbytes() : static_cast<size_t>(wte.value.numel()) * dtype_bytes(dtype);
  for (TransformerLayer& layer : layers()) {
    for (Linear* linear : linears_of(layer)) {
      bytes += linear->inference_fp8_weight()
                   ? linear->inference_weight_bytes()
                   : static_cast<size_t>(linear->weight.value.numel()) * dtype_bytes(dtype);
    }
    if (layer.moe) {
      // The router's and the top-k experts' weights a token reads (all experts: the bound for
      // a batch).
      MoELayer& moe = *layer.moe;
      const auto& o = moe.options();
      const int64_t per_expert =
          moe.fc1.weights[0].value.numel() + moe.fc2.weights[0].value.numel();
      bytes += static_cast<size_t>(moe.router.weight.value.numel()) * 4 +
               static_cast<size_t>(o.router.topk * per_expert) * dtype_bytes(dtype);
      if (moe.shared_fc1) {
        bytes += static_cast<size_t>(moe.shared_fc1->weight.value.numel() +
                                     moe.shared_fc2->weight.value.numel()) *
                 dtype_bytes(dtype);
      }
    }
  }
  return bytes;
}

size_t GPT::kv_bytes_per_token(DType dtype) const {
  const int64_t kv_heads = config_.num_gqa_groups ? config_.num_gqa_groups : config_.num_heads;
  const int64_t head_dim = config_.hidden / config_.num_heads;
  // An FP8 cache also keeps one F32 scale per (token, kv head).
  const int64_t per_head =
      dtype == DType::E4M3 ? head_dim + 4 : head_dim * static_cast<int64_t>(dtype_bytes(dtype));
  return static_cast<size_t>(2 * config_.num_layers * kv_heads * per_head);
}

}  // namespace octet
