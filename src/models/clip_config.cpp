// CLIPConfig and CaptionerConfig (the image-text models): JSON in and out, validation, parameter
// and FLOP counts.
#include <cmath>

#include "models/config_json.h"
#include "octet/captioner.h"
#include "octet/clip.h"
#include "octet/ops/activation.h"

namespace octet {

CLIPConfig CLIPConfig::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  CLIPConfig c;
  std::string model;
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "clip", "model config: 'model' expected \"clip\", got '", model, "'");
  models_detail::check_known_keys(
      json, {"model",         "name",          "image_size",       "channels",   "patch_size",
             "vision_layers", "vision_hidden", "vision_heads",     "vision_ffn", "vocab_size",
             "max_text_len",  "text_layers",   "text_hidden",      "text_heads", "text_ffn",
             "embed_dim",     "num_classes",   "logit_scale_init", "activation", "layernorm_eps",
             "dropout",       "init_std"});
  get("name", c.name);
  get("image_size", c.image_size);
  get("channels", c.channels);
  get("patch_size", c.patch_size);
  get("vision_layers", c.vision_layers);
  get("vision_hidden", c.vision_hidden);
  get("vision_heads", c.vision_heads);
  get("vision_ffn", c.vision_ffn);
  get("vocab_size", c.vocab_size);
  get("max_text_len", c.max_text_len);
  get("text_layers", c.text_layers);
  get("text_hidden", c.text_hidden);
  get("text_heads", c.text_heads);
  get("text_ffn", c.text_ffn);
  get("embed_dim", c.embed_dim);
  get("num_classes", c.num_classes);
  get("logit_scale_init", c.logit_scale_init);
  get("activation", c.activation);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("init_std", c.init_std);
  models_detail::check_sizes({{"image_size", c.image_size, 1 << 14},
                              {"channels", c.channels, 1 << 10},
                              {"patch_size", c.patch_size, 1 << 14},
                              {"vision_layers", c.vision_layers, 1 << 12},
                              {"vision_hidden", c.vision_hidden, 1 << 20},
                              {"vision_heads", c.vision_heads, 1 << 12},
                              {"vocab_size", c.vocab_size, 1 << 26},
                              {"max_text_len", c.max_text_len, 1 << 20},
                              {"text_layers", c.text_layers, 1 << 12},
                              {"text_hidden", c.text_hidden, 1 << 20},
                              {"text_heads", c.text_heads, 1 << 12},
                              {"embed_dim", c.embed_dim, 1 << 20},
                              {"num_classes", c.num_classes, 1 << 20}});
  for (const auto& [key, value] :
       {std::pair{"vision_ffn", c.vision_ffn}, {"text_ffn", c.text_ffn}}) {
    OCTET_CHECK(value >= 0 && value <= (int64_t{1} << 22), "model config: ", key,
                " expected in [0, 4194304] (0: 4 x hidden), got ", value);
  }
  OCTET_CHECK(c.image_size % c.patch_size == 0, "model config: image_size (", c.image_size,
              ") must be a multiple of patch_size (", c.patch_size, ")");
  OCTET_CHECK(c.vision_hidden % c.vision_heads == 0, "model config: vision_hidden (",
              c.vision_hidden, ") must be a multiple of vision_heads (", c.vision_heads, ")");
  OCTET_CHECK(c.text_hidden % c.text_heads == 0, "model config: text_hidden (", c.text_hidden,
              ") must be a multiple of text_heads (", c.text_heads, ")");
  OCTET_CHECK(c.vocab_size >= 3,
              "model config: vocab_size expected at least 3 ([PAD], [SOS], "
              "[EOS]), got ",
              c.vocab_size);
  OCTET_CHECK(c.max_text_len >= 2, "model config: max_text_len expected at least 2, got ",
              c.max_text_len);
  OCTET_CHECK(std::fabs(c.logit_scale_init) <= 10.0f,
              "model config: logit_scale_init expected in [-10, 10] (ln of the scale), got ",
              c.logit_scale_init);
  ops::parse_activation(c.activation);
  OCTET_CHECK(c.layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ",
              c.layernorm_eps);
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

CLIPConfig CLIPConfig::load(const std::string& path) {
  return models_detail::load_config<CLIPConfig>(path);
}

nlohmann::json CLIPConfig::to_json() const {
  return {{"model", "clip"},
          {"name", name},
          {"image_size", image_size},
          {"channels", channels},
          {"patch_size", patch_size},
          {"vision_layers", vision_layers},
          {"vision_hidden", vision_hidden},
          {"vision_heads", vision_heads},
          {"vision_ffn", vision_ffn},
          {"vocab_size", vocab_size},
          {"max_text_len", max_text_len},
          {"text_layers", text_layers},
          {"text_hidden", text_hidden},
          {"text_heads", text_heads},
          {"text_ffn", text_ffn},
          {"embed_dim", embed_dim},
          {"num_classes", num_classes},
          {"logit_scale_init", logit_scale_init},
          {"activation", activation},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"init_std", init_std}};
}

namespace {

// One pre-norm layer's GEMM weights, and all its parameters.
int64_t layer_matrices(int64_t hidden, int64_t ffn, bool gated) {
  return 4 * hidden * hidden + hidden * ffn * (gated ? 2 : 1) + ffn * hidden;
}
int64_t layer_parameters(int64_t hidden, int64_t ffn, bool gated) {
  const int64_t biases = 3 * hidden + hidden + ffn * (gated ? 2 : 1) + hidden;
  return layer_matrices(hidden, ffn, gated) + biases + 2 * 2 * hidden;
}

}  // namespace

int64_t CLIPConfig::num_parameters() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const int64_t Cv = vision_hidden, Ct = text_hidden;
  const int64_t vision = patch_dim() * Cv + Cv + vision_seq_len() * Cv + 2 * Cv +
                         vision_layers * layer_parameters(Cv, vision_ffn_hidden(), gated) + 2 * Cv +
                         Cv * embed_dim;
  const int64_t text = vocab_size * Ct + max_text_len * Ct +
                       text_layers * layer_parameters(Ct, text_ffn_hidden(), gated) + 2 * Ct +
                       Ct * embed_dim;
  return vision + text + 1;
}

double CLIPConfig::train_flops_per_pair() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const double Tv = static_cast<double>(vision_seq_len()), Tt = static_cast<double>(max_text_len);
  const double vision =
      Tv * (6.0 * vision_layers * layer_matrices(vision_hidden, vision_ffn_hidden(), gated) +
            12.0 * vision_layers * Tv * vision_hidden) +
      6.0 * num_patches() * patch_dim() * vision_hidden;
  const double text =
      Tt * (6.0 * text_layers * layer_matrices(text_hidden, text_ffn_hidden(), gated) +
            12.0 * text_layers * Tt * text_hidden);
  return vision + text + 6.0 * embed_dim * (vision_hidden + text_hidden);
}

CaptionerConfig CaptionerConfig::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  CaptionerConfig c;
  std::string model;
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "captioner", "model config: 'model' expected \"captioner\", got '", model,
              "'");
  models_detail::check_known_keys(
      json,
      {"model",         "name",         "image_size", "channels",   "patch_size",   "vision_layers",
       "vision_hidden", "vision_heads", "vision_ffn", "vocab_size", "max_text_len", "text_layers",
       "text_hidden",   "text_heads",   "text_ffn",   "sos_id",     "eos_id",       "activation",
       "layernorm_eps", "dropout",      "init_std"});
  get("name", c.name);
  get("image_size", c.image_size);
  get("channels", c.channels);
  get("patch_size", c.patch_size);
  get("vision_layers", c.vision_layers);
  get("vision_hidden", c.vision_hidden);
  get("vision_heads", c.vision_heads);
  get("vision_ffn", c.vision_ffn);
  get("vocab_size", c.vocab_size);
  get("max_text_len", c.max_text_len);
  get("text_layers", c.text_layers);
  get("text_hidden", c.text_hidden);
  get("text_heads", c.text_heads);
  get("text_ffn", c.text_ffn);
  get("sos_id", c.sos_id);
  get("eos_id", c.eos_id);
  get("activation", c.activation);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("init_std", c.init_std);
  models_detail::check_sizes({{"image_size", c.image_size, 1 << 14},
                              {"channels", c.channels, 1 << 10},
                              {"patch_size", c.patch_size, 1 << 14},
                              {"vision_layers", c.vision_layers, 1 << 12},
                              {"vision_hidden", c.vision_hidden, 1 << 20},
                              {"vision_heads", c.vision_heads, 1 << 12},
                              {"vocab_size", c.vocab_size, 1 << 26},
                              {"max_text_len", c.max_text_len, 1 << 20},
                              {"text_layers", c.text_layers, 1 << 12},
                              {"text_hidden", c.text_hidden, 1 << 20},
                              {"text_heads", c.text_heads, 1 << 12}});
  for (const auto& [key, value] :
       {std::pair{"vision_ffn", c.vision_ffn}, {"text_ffn", c.text_ffn}}) {
    OCTET_CHECK(value >= 0 && value <= (int64_t{1} << 22), "model config: ", key,
                " expected in [0, 4194304] (0: 4 x hidden), got ", value);
  }
  OCTET_CHECK(c.image_size % c.patch_size == 0, "model config: image_size (", c.image_size,
              ") must be a multiple of patch_size (", c.patch_size, ")");
  OCTET_CHECK(c.vision_hidden % c.vision_heads == 0, "model config: vision_hidden (",
              c.vision_hidden, ") must be a multiple of vision_heads (", c.vision_heads, ")");
  OCTET_CHECK(c.text_hidden % c.text_heads == 0, "model config: text_hidden (", c.text_hidden,
              ") must be a multiple of text_heads (", c.text_heads, ")");
  for (const auto& [key, value] : {std::pair{"sos_id", c.sos_id}, {"eos_id", c.eos_id}}) {
    OCTET_CHECK(value >= 0 && value < c.vocab_size, "model config: ", key,
                " expected in [0, vocab_size = ", c.vocab_size, "), got ", value);
  }
  OCTET_CHECK(c.sos_id != c.eos_id, "model config: sos_id and eos_id expected different, both ",
              c.sos_id);
  OCTET_CHECK(c.max_text_len >= 2, "model config: max_text_len expected at least 2, got ",
              c.max_text_len);
  ops::parse_activation(c.activation);
  OCTET_CHECK(c.layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ",
              c.layernorm_eps);
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

CaptionerConfig CaptionerConfig::load(const std::string& path) {
  return models_detail::load_config<CaptionerConfig>(path);
}

nlohmann::json CaptionerConfig::to_json() const {
  return {{"model", "captioner"},
          {"name", name},
          {"image_size", image_size},
          {"channels", channels},
          {"patch_size", patch_size},
          {"vision_layers", vision_layers},
          {"vision_hidden", vision_hidden},
          {"vision_heads", vision_heads},
          {"vision_ffn", vision_ffn},
          {"vocab_size", vocab_size},
          {"max_text_len", max_text_len},
          {"text_layers", text_layers},
          {"text_hidden", text_hidden},
          {"text_heads", text_heads},
          {"text_ffn", text_ffn},
          {"sos_id", sos_id},
          {"eos_id", eos_id},
          {"activation", activation},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"init_std", init_std}};
}

int64_t CaptionerConfig::num_parameters() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const int64_t Cv = vision_hidden, Ct = text_hidden;
  const int64_t vision = patch_dim() * Cv + Cv + vision_seq_len() * Cv + 2 * Cv +
                         vision_layers * layer_parameters(Cv, vision_ffn_hidden(), gated) + 2 * Cv;
  const int64_t projector = Cv * Ct + Ct + Ct * Ct + Ct;
  const int64_t text = vocab_size * Ct + decoder_seq_len() * Ct +
                       text_layers * layer_parameters(Ct, text_ffn_hidden(), gated) + 2 * Ct;
  return vision + projector + text;
}

double CaptionerConfig::train_flops_per_pair() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const double Tv = static_cast<double>(vision_seq_len());
  const double Td = static_cast<double>(decoder_seq_len()), Tt = static_cast<double>(max_text_len);
  const double vision =
      Tv * (6.0 * vision_layers * layer_matrices(vision_hidden, vision_ffn_hidden(), gated) +
            12.0 * vision_layers * Tv * vision_hidden) +
      6.0 * num_patches() * patch_dim() * vision_hidden;
  const double projector = Tv * 6.0 * text_hidden * (vision_hidden + text_hidden);
  const double text =
      Td * (6.0 * text_layers * layer_matrices(text_hidden, text_ffn_hidden(), gated) +
            12.0 * text_layers * Td * text_hidden);
  return vision + projector + text + Tt * 6.0 * text_hidden * vocab_size;
}

}  // namespace octet
