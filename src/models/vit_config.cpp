// ViTConfig: JSON in and out, validation, parameter and FLOP counts; which family a config
// file describes.
#include <cmath>

#include "models/config_json.h"
#include "octet/ops/activation.h"
#include "octet/vit.h"

namespace octet {

std::string config_model_family(const std::string& path) {
  const nlohmann::json json = models_detail::read_config_file(path);
  if (!json.is_object() || !json.contains("model")) return "gpt";
  const nlohmann::json& model = json.at("model");
  OCTET_CHECK(
      model.is_string() && (model == "gpt" || model == "vit" || model == "bert" || model == "t5" ||
                            model == "clip" || model == "captioner"),
      "model config '", path,
      "': 'model' expected \"gpt\", \"vit\", \"bert\", \"t5\", \"clip\" or \"captioner\", got ",
      model.dump().substr(0, 64));
  return model.get<std::string>();
}

ViTConfig ViTConfig::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  ViTConfig c;
  std::string model;
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "vit", "model config: 'model' expected \"vit\", got '", model, "'");
  models_detail::check_known_keys(
      json, {"model", "name", "image_size", "channels", "patch_size", "num_classes", "num_layers",
             "hidden", "num_heads", "ffn_hidden", "activation", "normalization", "layernorm_eps",
             "dropout", "init_std"});
  get("name", c.name);
  get("image_size", c.image_size);
  get("channels", c.channels);
  get("patch_size", c.patch_size);
  get("num_classes", c.num_classes);
  get("num_layers", c.num_layers);
  get("hidden", c.hidden);
  get("num_heads", c.num_heads);
  get("ffn_hidden", c.ffn_hidden);
  get("activation", c.activation);
  get("normalization", c.normalization);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("init_std", c.init_std);
  models_detail::check_sizes({{"image_size", c.image_size, 1 << 14},
                              {"channels", c.channels, 1 << 10},
                              {"patch_size", c.patch_size, 1 << 14},
                              {"num_classes", c.num_classes, 1 << 24},
                              {"num_layers", c.num_layers, 1 << 12},
                              {"hidden", c.hidden, 1 << 20},
                              {"num_heads", c.num_heads, 1 << 12}});
  OCTET_CHECK(c.ffn_hidden >= 0 && c.ffn_hidden <= (int64_t{1} << 22),
              "model config: ffn_hidden expected in [0, 4194304] (0: 4 x hidden), got ",
              c.ffn_hidden);
  OCTET_CHECK(c.image_size % c.patch_size == 0, "model config: image_size (", c.image_size,
              ") must be a multiple of patch_size (", c.patch_size, ")");
  OCTET_CHECK(c.hidden % c.num_heads == 0, "model config: hidden (", c.hidden,
              ") must be a multiple of num_heads (", c.num_heads, ")");
  OCTET_CHECK(c.num_classes >= 2, "model config: num_classes expected at least 2, got ",
              c.num_classes);
  ops::parse_activation(c.activation);
  OCTET_CHECK(c.normalization == "layernorm" || c.normalization == "rmsnorm",
              "model config: normalization expected layernorm or rmsnorm, got '", c.normalization,
              "'");
  OCTET_CHECK(c.layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ",
              c.layernorm_eps);
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

ViTConfig ViTConfig::load(const std::string& path) {
  return models_detail::load_config<ViTConfig>(path);
}

nlohmann::json ViTConfig::to_json() const {
  return {{"model", "vit"},
          {"name", name},
          {"image_size", image_size},
          {"channels", channels},
          {"patch_size", patch_size},
          {"num_classes", num_classes},
          {"num_layers", num_layers},
          {"hidden", hidden},
          {"num_heads", num_heads},
          {"ffn_hidden", ffn_hidden},
          {"activation", activation},
          {"normalization", normalization},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"init_std", init_std}};
}

namespace {

int64_t layer_matrix_parameters(const ViTConfig& c) {
  const bool gated = ops::is_gated(ops::parse_activation(c.activation));
  return 4 * c.hidden * c.hidden + c.hidden * c.ffn() * (gated ? 2 : 1) + c.ffn() * c.hidden;
}

}  // namespace

int64_t ViTConfig::num_parameters() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const int64_t norm = normalization == "layernorm" ? 2 * hidden : hidden;
  const int64_t biases = 3 * hidden + hidden + ffn() * (gated ? 2 : 1) + hidden;
  const int64_t per_layer = layer_matrix_parameters(*this) + biases + 2 * norm;
  const int64_t embedding = patch_dim() * hidden + hidden + hidden + seq_len() * hidden;
  const int64_t head = hidden * num_classes + num_classes;
  return embedding + num_layers * per_layer + norm + head;
}

double ViTConfig::train_flops_per_token() const {
  const double matrices = double(num_layers) * layer_matrix_parameters(*this) +
                          double(patch_dim()) * hidden * num_patches() / seq_len() +
                          double(hidden) * num_classes / seq_len();
  return 6.0 * matrices + 12.0 * num_layers * seq_len() * hidden;
}

}  // namespace octet
