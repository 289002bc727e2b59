// GPTConfig: JSON in and out, validation, parameter and FLOP counts.
#include <cmath>
#include <fstream>
#include <limits>

#include "models/config_json.h"
#include "octet/model.h"
#include "octet/ops/activation.h"

namespace octet {

namespace models_detail {

nlohmann::json read_config_file(const std::string& path) {
  std::ifstream in(path);
  OCTET_CHECK(in.good(), "model config '", path, "' not found");
  nlohmann::json json = nlohmann::json::parse(in, nullptr, false);
  OCTET_CHECK(!json.is_discarded(), "model config '", path, "' is not valid JSON");
  return json;
}

}  // namespace models_detail

GPTConfig GPTConfig::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  GPTConfig c;
  std::string model = "gpt";
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "gpt", "model config: 'model' expected \"gpt\" here, got '", model, "'");
  models_detail::check_known_keys(json, {"model",
                                         "name",
                                         "vocab_size",
                                         "max_seq_len",
                                         "num_layers",
                                         "hidden",
                                         "num_heads",
                                         "num_gqa_groups",
                                         "ffn_hidden",
                                         "activation",
                                         "normalization",
                                         "position_embedding",
                                         "rope_theta",
                                         "layernorm_eps",
                                         "dropout",
                                         "bias",
                                         "tied_embeddings",
                                         "init_std",
                                         "num_experts",
                                         "moe_ffn_hidden",
                                         "moe_shared_expert_ffn_hidden",
                                         "moe_router_topk",
                                         "moe_router_score_function",
                                         "moe_router_normalize",
                                         "moe_router_topk_scaling_factor",
                                         "moe_aux_loss_coeff",
                                         "moe_z_loss_coeff",
                                         "moe_router_enable_expert_bias",
                                         "moe_router_bias_update_rate",
                                         "moe_expert_capacity_factor",
                                         "moe_token_drop_policy"});
  get("name", c.name);
  get("vocab_size", c.vocab_size);
  get("max_seq_len", c.max_seq_len);
  get("num_layers", c.num_layers);
  get("hidden", c.hidden);
  get("num_heads", c.num_heads);
  get("num_gqa_groups", c.num_gqa_groups);
  get("ffn_hidden", c.ffn_hidden);
  get("activation", c.activation);
  get("normalization", c.normalization);
  get("position_embedding", c.position_embedding);
  get("rope_theta", c.rope_theta);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("bias", c.bias);
  get("tied_embeddings", c.tied_embeddings);
  get("init_std", c.init_std);
  get("num_experts", c.num_experts);
  get("moe_ffn_hidden", c.moe_ffn_hidden);
  get("moe_shared_expert_ffn_hidden", c.moe_shared_expert_ffn_hidden);
  get("moe_router_topk", c.moe_router_topk);
  get("moe_router_score_function", c.moe_router_score_function);
  get("moe_router_normalize", c.moe_router_normalize);
  get("moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor);
  get("moe_aux_loss_coeff", c.moe_aux_loss_coeff);
  get("moe_z_loss_coeff", c.moe_z_loss_coeff);
  get("moe_router_enable_expert_bias", c.moe_router_enable_expert_bias);
  get("moe_router_bias_update_rate", c.moe_router_bias_update_rate);
  get("moe_expert_capacity_factor", c.moe_expert_capacity_factor);
  get("moe_token_drop_policy", c.moe_token_drop_policy);
  c.check_moe();
  OCTET_CHECK(
      c.vocab_size > 0 && c.max_seq_len > 0 && c.num_layers > 0 && c.hidden > 0 && c.num_heads > 0,
      "model config: vocab_size, max_seq_len, num_layers, hidden, num_heads must be "
      "positive");
  // Upper bounds far above any real model, so that parameter and FLOP counts cannot overflow.
  auto check_at_most = [](const char* key, int64_t value, int64_t limit) {
    OCTET_CHECK(value <= limit, "model config: ", key, " expected at most ", limit, ", got ",
                value);
  };
  check_at_most("vocab_size", c.vocab_size, std::numeric_limits<int32_t>::max());  // int32 ids
  check_at_most("max_seq_len", c.max_seq_len, int64_t{1} << 24);
  check_at_most("num_layers", c.num_layers, int64_t{1} << 12);
  check_at_most("hidden", c.hidden, int64_t{1} << 20);
  check_at_most("ffn_hidden", c.ffn_hidden, int64_t{1} << 22);
  OCTET_CHECK(c.num_gqa_groups >= 0 && c.ffn_hidden >= 0, "model config: num_gqa_groups (",
              c.num_gqa_groups, ") and ffn_hidden (", c.ffn_hidden,
              ") expected >= 0 (0: the default)");
  OCTET_CHECK(c.hidden % c.num_heads == 0, "model config: hidden (", c.hidden,
              ") must be a multiple of num_heads (", c.num_heads, ")");
  int64_t kv = c.num_gqa_groups ? c.num_gqa_groups : c.num_heads;
  OCTET_CHECK(c.num_heads % kv == 0, "model config: num_heads (", c.num_heads,
              ") must be a multiple of num_gqa_groups (", kv, ")");
  ops::parse_activation(c.activation);
  OCTET_CHECK(c.normalization == "layernorm" || c.normalization == "rmsnorm",
              "model config: normalization expected layernorm or rmsnorm, got '", c.normalization,
              "'");
  OCTET_CHECK(c.position_embedding == "learned" || c.position_embedding == "rope",
              "model config: position_embedding expected learned or rope, got '",
              c.position_embedding, "'");
  OCTET_CHECK(c.tied_embeddings, "model config: only tied embeddings are supported");
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

void GPTConfig::check_moe() const {
  OCTET_CHECK(num_experts >= 0 && num_experts <= 4096,
              "model config: num_experts expected in [0, 4096] (0: a dense MLP), got ",
              num_experts);
  OCTET_CHECK(
      moe_ffn_hidden >= 0 && moe_ffn_hidden <= (int64_t{1} << 22) &&
          moe_shared_expert_ffn_hidden >= 0 && moe_shared_expert_ffn_hidden <= (int64_t{1} << 22),
      "model config: moe_ffn_hidden (", moe_ffn_hidden, ") and moe_shared_expert_ffn_hidden (",
      moe_shared_expert_ffn_hidden, ") expected in [0, 2^22]");
  if (num_experts == 0) return;
  OCTET_CHECK(moe_router_topk >= 1 && moe_router_topk <= num_experts,
              "model config: moe_router_topk expected in [1, num_experts = ", num_experts,
              "], got ", moe_router_topk);
  OCTET_CHECK(moe_router_score_function == "softmax" || moe_router_score_function == "sigmoid",
              "model config: moe_router_score_function expected softmax or sigmoid, got '",
              moe_router_score_function, "'");
  OCTET_CHECK(std::isfinite(moe_router_topk_scaling_factor) && moe_router_topk_scaling_factor > 0,
              "model config: moe_router_topk_scaling_factor expected > 0, got ",
              moe_router_topk_scaling_factor);
  OCTET_CHECK(std::isfinite(moe_aux_loss_coeff) && moe_aux_loss_coeff >= 0 &&
                  std::isfinite(moe_z_loss_coeff) && moe_z_loss_coeff >= 0,
              "model config: moe_aux_loss_coeff (", moe_aux_loss_coeff, ") and moe_z_loss_coeff (",
              moe_z_loss_coeff, ") expected finite and >= 0");
  OCTET_CHECK(std::isfinite(moe_router_bias_update_rate) && moe_router_bias_update_rate >= 0,
              "model config: moe_router_bias_update_rate expected >= 0, got ",
              moe_router_bias_update_rate);
  OCTET_CHECK(std::isfinite(moe_expert_capacity_factor) && moe_expert_capacity_factor >= 0,
              "model config: moe_expert_capacity_factor expected >= 0 (0: dropless), got ",
              moe_expert_capacity_factor);
  OCTET_CHECK(moe_token_drop_policy == "probs" || moe_token_drop_policy == "position",
              "model config: moe_token_drop_policy expected probs or position, got '",
              moe_token_drop_policy, "'");
}

GPTConfig GPTConfig::load(const std::string& path) {
  const nlohmann::json json = models_detail::read_config_file(path);
  try {
    return from_json(json);
  } catch (const Error& e) {
    fail(detail::concat(path, ": ", e.what()));
  }
}

nlohmann::json GPTConfig::to_json() const {
  return {{"name", name},
          {"vocab_size", vocab_size},
          {"max_seq_len", max_seq_len},
          {"num_layers", num_layers},
          {"hidden", hidden},
          {"num_heads", num_heads},
          {"num_gqa_groups", num_gqa_groups},
          {"ffn_hidden", ffn_hidden},
          {"activation", activation},
          {"normalization", normalization},
          {"position_embedding", position_embedding},
          {"rope_theta", rope_theta},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"bias", bias},
          {"tied_embeddings", tied_embeddings},
          {"init_std", init_std},
          {"num_experts", num_experts},
          {"moe_ffn_hidden", moe_ffn_hidden},
          {"moe_shared_expert_ffn_hidden", moe_shared_expert_ffn_hidden},
          {"moe_router_topk", moe_router_topk},
          {"moe_router_score_function", moe_router_score_function},
          {"moe_router_normalize", moe_router_normalize},
          {"moe_router_topk_scaling_factor", moe_router_topk_scaling_factor},
          {"moe_aux_loss_coeff", moe_aux_loss_coeff},
          {"moe_z_loss_coeff", moe_z_loss_coeff},
          {"moe_router_enable_expert_bias", moe_router_enable_expert_bias},
          {"moe_router_bias_update_rate", moe_router_bias_update_rate},
          {"moe_expert_capacity_factor", moe_expert_capacity_factor},
          {"moe_token_drop_policy", moe_token_drop_policy}};
}

namespace {

// Weights and biases of an MLP of width f (biases when the config has them).
struct MlpCount {
  int64_t matrices = 0, biases = 0;
};
MlpCount mlp_count(const GPTConfig& c, int64_t f) {
  const bool gated = ops::is_gated(ops::parse_activation(c.activation));
  MlpCount m;
  m.matrices = c.hidden * f * (gated ? 2 : 1) + f * c.hidden;
  m.biases = c.bias ? f * (gated ? 2 : 1) + c.hidden : 0;
  return m;
}

// Matrix parameters of one layer (what the GEMMs multiply by): every expert's, or the `active`
// ones a token meets (the router, k experts and the shared expert).
int64_t layer_matrix_parameters(const GPTConfig& c, bool active) {
  int64_t head_dim = c.hidden / c.num_heads;
  int64_t kv = c.num_gqa_groups ? c.num_gqa_groups : c.num_heads;
  int64_t qkv = c.hidden * (c.num_heads + 2 * kv) * head_dim;
  int64_t proj = c.num_heads * head_dim * c.hidden;
  if (!c.moe()) return qkv + proj + mlp_count(c, c.ffn()).matrices;
  const int64_t experts = active ? c.moe_router_topk : c.num_experts;
  return qkv + proj + c.hidden * c.num_experts + experts * mlp_count(c, c.moe_ffn()).matrices +
         (c.moe_shared_expert_ffn_hidden ? mlp_count(c, c.moe_shared_expert_ffn_hidden).matrices
                                         : 0);
}

int64_t count_parameters(const GPTConfig& c, bool active) {
  int64_t head_dim = c.hidden / c.num_heads;
  int64_t kv = c.num_gqa_groups ? c.num_gqa_groups : c.num_heads;
  int64_t norm = c.normalization == "layernorm" ? 2 * c.hidden : c.hidden;
  int64_t biases = c.bias ? (c.num_heads + 2 * kv) * head_dim + c.hidden : 0;
  if (!c.moe()) {
    biases += mlp_count(c, c.ffn()).biases;
  } else {
    biases += (active ? c.moe_router_topk : c.num_experts) * mlp_count(c, c.moe_ffn()).biases;
    if (c.moe_shared_expert_ffn_hidden) {
      biases += mlp_count(c, c.moe_shared_expert_ffn_hidden).biases;
    }
  }
  int64_t per_layer = layer_matrix_parameters(c, active) + biases + 2 * norm;
  int64_t positions = c.position_embedding == "learned" ? c.max_seq_len * c.hidden : 0;
  return c.vocab_size * c.hidden + positions + c.num_layers * per_layer + norm;
}

}  // namespace

int64_t GPTConfig::num_parameters() const {
  return count_parameters(*this, false);
}

int64_t GPTConfig::num_active_parameters() const {
  return count_parameters(*this, true);
}

double GPTConfig::train_flops_per_token(int64_t seq_len) const {
  // A token's GEMMs: the active weights only.
  double matrices =
      double(num_layers) * layer_matrix_parameters(*this, true) + double(vocab_size) * hidden;
  return 6.0 * matrices + 12.0 * num_layers * seq_len * hidden;
}

}  // namespace octet
