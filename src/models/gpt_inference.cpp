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
  gemm(last_rows(hidden, B, T), wte_as(hidden.dtype()), logits, false, true);
  return logits;
}

Tensor GPT::logits_of_last(const Tensor& hidden) {
  Norm::Context scratch;
  Tensor normalized = final_norm_->forward(hidden, scratch);
  Tensor logits = Tensor::empty({hidden.dim(0), config_.vocab_size}, DType::F32);
  gemm(normalized, wte_as(hidden.dtype()), logits, false, true);
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

}  // namespace octet
