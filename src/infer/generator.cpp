// Text generation: prefill the prompt into the KV cache, then decode one token per forward;
// past max_seq_len, a sliding window recomputed for each token. The uncached loop is the
// oracle the cached one must match token for token.
#include <algorithm>

#include "octet/infer.h"

namespace octet {

namespace {

void check_prompt(const GPT& model, const std::vector<int32_t>& prompt_ids) {
  OCTET_CHECK(!prompt_ids.empty(), "generate: the prompt has no tokens");
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : prompt_ids) {
    OCTET_CHECK(id >= 0 && id < vocab, "generate: prompt token ", id, " outside [0, ", vocab, ")");
  }
}

// ids[begin:] as a [1, n] I32 tensor.
Tensor token_row(const std::vector<int32_t>& ids, size_t begin) {
  Tensor row = Tensor::empty({1, static_cast<int64_t>(ids.size() - begin)}, DType::I32);
  std::copy(ids.begin() + static_cast<int64_t>(begin), ids.end(), row.data<int32_t>());
  return row;
}

// The logits of the last max_seq_len tokens, recomputed from scratch.
Tensor window_logits(GPT& model, const std::vector<int32_t>& ids, DType dtype) {
  const size_t window = static_cast<size_t>(model.config().max_seq_len);
  return model.last_logits(token_row(ids, ids.size() - std::min(ids.size(), window)), dtype);
}

// The penalties on the context so far, then the draw of step `step`.
int32_t pick_next(Tensor& logits, int64_t vocab, const std::vector<int32_t>& ids,
                  size_t prompt_size, const SamplingOptions& options, int64_t step) {
  const std::span<const int32_t> all(ids);
  apply_penalties(logits.data<float>(), vocab, all.first(prompt_size), all.subspan(prompt_size),
                  options);
  return sample_token(logits.data<float>(), vocab, options, static_cast<uint64_t>(step));
}

}  // namespace

std::vector<int32_t> generate(GPT& model, const std::vector<int32_t>& prompt_ids,
                              int64_t max_new_tokens, const SamplingOptions& options, DType dtype,
                              const std::function<void(int32_t)>& on_token) {
  check_prompt(model, prompt_ids);
  const int64_t vocab = model.config().vocab_size, window = model.config().max_seq_len;
  InferenceParams cache = model.make_inference_params(1);  // buffers allocated on first use
  std::vector<int32_t> ids = prompt_ids;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    Tensor logits;
    if (static_cast<int64_t>(ids.size()) <= window) {
      // The tokens not yet cached: the whole prompt first, then the last sampled one.
      logits = model.forward_inference(
          token_row(ids, static_cast<size_t>(cache.sequence_len_offset)), cache, dtype);
    } else {
      logits = window_logits(model, ids, dtype);
    }
    const int32_t next = pick_next(logits, vocab, ids, prompt_ids.size(), options, step);
    ids.push_back(next);
    if (on_token) on_token(next);
  }
  return std::vector<int32_t>(ids.begin() + static_cast<int64_t>(prompt_ids.size()), ids.end());
}

std::vector<int32_t> generate_uncached(GPT& model, const std::vector<int32_t>& prompt_ids,
                                       int64_t max_new_tokens, const SamplingOptions& options,
                                       DType dtype, const std::function<void(int32_t)>& on_token) {
  check_prompt(model, prompt_ids);
  const int64_t vocab = model.config().vocab_size;
  std::vector<int32_t> ids = prompt_ids;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    Tensor logits = window_logits(model, ids, dtype);
    const int32_t next = pick_next(logits, vocab, ids, prompt_ids.size(), options, step);
    ids.push_back(next);
    if (on_token) on_token(next);
  }
  return std::vector<int32_t>(ids.begin() + static_cast<int64_t>(prompt_ids.size()), ids.end());
}

}  // namespace octet
