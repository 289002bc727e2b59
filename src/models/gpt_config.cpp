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
  models_detail::check_known_keys(
      json, {"model", "name", "vocab_size", "max_seq_len", "num_layers", "hidden", "num_heads",
             "num_gqa_groups", "ffn_hidden", "activation", "normalization", "position_embedding",
             "rope_theta", "layernorm_eps", "dropout", "bias", "tied_embeddings", "init_std"});
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
          {"init_std", init_std}};
}

namespace {

// Matrix parameters of one layer (what the GEMMs multiply by).
int64_t layer_matrix_parameters(const GPTConfig& c) {
  int64_t head_dim = c.hidden / c.num_heads;
  int64_t kv = c.num_gqa_groups ? c.num_gqa_groups : c.num_heads;
  int64_t qkv = c.hidden * (c.num_heads + 2 * kv) * head_dim;
  int64_t proj = c.num_heads * head_dim * c.hidden;
  bool gated = ops::is_gated(ops::parse_activation(c.activation));
  int64_t mlp = c.hidden * c.ffn() * (gated ? 2 : 1) + c.ffn() * c.hidden;
  return qkv + proj + mlp;
}

}  // namespace

int64_t GPTConfig::num_parameters() const {
  int64_t head_dim = hidden / num_heads;
  int64_t kv = num_gqa_groups ? num_gqa_groups : num_heads;
  bool gated = ops::is_gated(ops::parse_activation(activation));
  int64_t norm = normalization == "layernorm" ? 2 * hidden : hidden;
  int64_t biases =
      bias ? (num_heads + 2 * kv) * head_dim + hidden + ffn() * (gated ? 2 : 1) + hidden : 0;
  int64_t per_layer = layer_matrix_parameters(*this) + biases + 2 * norm;
  int64_t positions = position_embedding == "learned" ? max_seq_len * hidden : 0;
  return vocab_size * hidden + positions + num_layers * per_layer + norm;
}

double GPTConfig::train_flops_per_token(int64_t seq_len) const {
  double matrices =
      double(num_layers) * layer_matrix_parameters(*this) + double(vocab_size) * hidden;
  return 6.0 * matrices + 12.0 * num_layers * seq_len * hidden;
}

}  // namespace octet
