// Inference: token sampling and text generation from a trained GPT.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "octet/model.h"

namespace octet {

struct SamplingOptions {
  float temperature = 1.0f;  // 0 = greedy (argmax), deterministic
  int64_t top_k = 0;         // 0 = no top-k cut
  float top_p = 1.0f;        // nucleus: smallest set of tokens whose probability >= top_p
  uint64_t seed = 0;
};

// Picks the next token from logits [V] F32. `step` selects this draw's random number, so a
// (seed, step) pair always gives the same choice.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options,
                     uint64_t step);

// Continues `prompt_ids` by max_new_tokens tokens, calling on_token after each one.
// The context seen by the model is the last max_seq_len tokens.
std::vector<int32_t> generate(GPT& model, const std::vector<int32_t>& prompt_ids,
                              int64_t max_new_tokens, const SamplingOptions& options,
                              DType dtype = DType::F32,
                              const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace octet
