// The small GPTs of the inference suites: large weights (std 0.2) for clear argmax margins, in
// three variants: GPT-2's learned positions; RoPE with grouped-query attention, RMSNorm,
// SwiGLU and no biases; and a mixture of experts.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "octet/model.h"

namespace octet::testing {

struct GptVariant {
  std::string name;
  nlohmann::json config;  // keys over the tiny base
};

inline void PrintTo(const GptVariant& variant, std::ostream* out) {
  *out << variant.name;
}

inline GPTConfig tiny_gpt_config(const GptVariant& variant, int64_t max_seq_len) {
  nlohmann::json json = {{"name", "tiny"},  {"vocab_size", 97}, {"max_seq_len", max_seq_len},
                         {"num_layers", 2}, {"hidden", 32},     {"num_heads", 4},
                         {"init_std", 0.2}};
  json.update(variant.config);
  return GPTConfig::from_json(json);
}

inline std::vector<GptVariant> tiny_gpt_variants() {
  return {GptVariant{"learned_positions", nlohmann::json::object()},
          GptVariant{"rope_gqa",
                     {{"position_embedding", "rope"},
                      {"num_gqa_groups", 2},
                      {"normalization", "rmsnorm"},
                      {"activation", "swiglu"},
                      {"bias", false}}},
          // A mixture of experts in every layer: each token routed on its own, so caching,
          // batching and paging change nothing of what it computes.
          GptVariant{"moe",
                     {{"num_experts", 4},
                      {"moe_ffn_hidden", 32},
                      {"moe_shared_expert_ffn_hidden", 16},
                      {"moe_router_topk", 2},
                      {"moe_router_enable_expert_bias", true}}}};
}

inline std::string gpt_variant_name(const ::testing::TestParamInfo<GptVariant>& param) {
  return param.param.name;
}

}  // namespace octet::testing
