// Inference: token sampling and text generation from a trained GPT, with the KV cache
// (InferenceParams, declared with the modules in octet/modules.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "octet/model.h"

namespace octet {

struct SamplingOptions {
  float temperature = 1.0f;  // 0 = greedy (argmax), deterministic
  int64_t top_k = 0;         // 0 = no top-k cut
  float top_p = 1.0f;        // nucleus: smallest set of tokens whose probability >= top_p
  uint64_t seed = 0;
  // Penalties on tokens already there, applied to the logits before anything else (vLLM's
  // semantics): repetition (CTRL, Hugging Face) over the prompt and the generated tokens, a
  // logit > 0 divided by it and one < 0 multiplied; frequency and presence (OpenAI) over the
  // generated tokens, logit -= count * frequency_penalty + (count > 0) * presence_penalty.
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float frequency_penalty = 0.0f;   // in [-2, 2]
  float presence_penalty = 0.0f;    // in [-2, 2]
};

// Throws octet::Error naming the first option out of range.
void check_sampling_options(const SamplingOptions& options);

// Whether any penalty above is on (apply_penalties changes nothing otherwise).
bool has_penalties(const SamplingOptions& options);
// The penalties above on logits [vocab] in place; `prompt` and `generated` are the ids so far.
void apply_penalties(float* logits, int64_t vocab, std::span<const int32_t> prompt,
                     std::span<const int32_t> generated, const SamplingOptions& options);

// Picks the next token from logits [V] F32. `step` selects this draw's random number, so a
// (seed, step) pair always gives the same choice.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options,
                     uint64_t step);

// Continues `prompt_ids` by max_new_tokens tokens, calling on_token after each one. The
// prompt is prefilled into a KV cache (InferenceParams) in one forward, then each new token
// is one cached decode step. The model sees at most the last max_seq_len tokens: once the
// sequence outgrows max_seq_len, every further token recomputes that sliding window without
// the cache (as generate_uncached does), so the tokens equal generate_uncached's.
std::vector<int32_t> generate(GPT& model, const std::vector<int32_t>& prompt_ids,
                              int64_t max_new_tokens, const SamplingOptions& options,
                              DType dtype = DType::F32,
                              const std::function<void(int32_t)>& on_token = nullptr);

// The oracle: one full forward over the context (the last max_seq_len tokens) per new token.
std::vector<int32_t> generate_uncached(GPT& model, const std::vector<int32_t>& prompt_ids,
                                       int64_t max_new_tokens, const SamplingOptions& options,
                                       DType dtype = DType::F32,
                                       const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace octet
