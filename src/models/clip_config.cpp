// CLIPConfig and CaptionerConfig (the image-text models): JSON in and out, validation, parameter
// and FLOP counts, on top of VisionTextConfig's.
#include <cmath>
#include <set>

#include "models/config_json.h"
#include "octet/captioner.h"
#include "octet/clip.h"

namespace octet {

namespace {

// The base's keys and the model's own.
std::set<std::string> keys_with(std::vector<std::string> own) {
  std::set<std::string> keys(own.begin(), own.end());
  for (const std::string& key : VisionTextConfig::json_keys()) keys.insert(key);
  return keys;
}

void check_model(const nlohmann::json& json, const char* expected) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  std::string model;
  models_detail::read_field(json, "model", model);
  OCTET_CHECK(model == expected, "model config: 'model' expected \"", expected, "\", got '", model,
              "'");
}

}  // namespace

CLIPConfig CLIPConfig::from_json(const nlohmann::json& json) {
  check_model(json, "clip");
  models_detail::check_known_keys(
      json, keys_with({"model", "name", "embed_dim", "num_classes", "logit_scale_init"}));
  CLIPConfig c;
  c.read_json(json);
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("name", c.name);
  get("embed_dim", c.embed_dim);
  get("num_classes", c.num_classes);
  get("logit_scale_init", c.logit_scale_init);
  models_detail::check_sizes(
      {{"embed_dim", c.embed_dim, 1 << 20}, {"num_classes", c.num_classes, 1 << 20}});
  OCTET_CHECK(std::fabs(c.logit_scale_init) <= 10.0f,
              "model config: logit_scale_init expected in [-10, 10] (ln of the scale), got ",
              c.logit_scale_init);
  return c;
}

CLIPConfig CLIPConfig::load(const std::string& path) {
  return models_detail::load_config<CLIPConfig>(path);
}

nlohmann::json CLIPConfig::to_json() const {
  nlohmann::json json = {{"model", "clip"},
                         {"name", name},
                         {"embed_dim", embed_dim},
                         {"num_classes", num_classes},
                         {"logit_scale_init", logit_scale_init}};
  write_json(json);
  return json;
}

int64_t CLIPConfig::num_parameters() const {
  return vision_tower_parameters() + vision_hidden * embed_dim +
         (vocab_size + max_text_len) * text_hidden + text_layers_parameters() +
         text_hidden * embed_dim + 1;
}

double CLIPConfig::train_flops_per_pair() const {
  return vision_tower_flops() + text_layers_flops(max_text_len) +
         6.0 * embed_dim * (vision_hidden + text_hidden);
}

CaptionerConfig CaptionerConfig::from_json(const nlohmann::json& json) {
  check_model(json, "captioner");
  models_detail::check_known_keys(json, keys_with({"model", "name", "sos_id", "eos_id"}));
  CaptionerConfig c;
  c.read_json(json);
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("name", c.name);
  get("sos_id", c.sos_id);
  get("eos_id", c.eos_id);
  for (const auto& [key, value] : {std::pair{"sos_id", c.sos_id}, {"eos_id", c.eos_id}}) {
    OCTET_CHECK(value >= 0 && value < c.vocab_size, "model config: ", key,
                " expected in [0, vocab_size = ", c.vocab_size, "), got ", value);
  }
  OCTET_CHECK(c.sos_id != c.eos_id, "model config: sos_id and eos_id expected different, both ",
              c.sos_id);
  return c;
}

CaptionerConfig CaptionerConfig::load(const std::string& path) {
  return models_detail::load_config<CaptionerConfig>(path);
}

nlohmann::json CaptionerConfig::to_json() const {
  nlohmann::json json = {
      {"model", "captioner"}, {"name", name}, {"sos_id", sos_id}, {"eos_id", eos_id}};
  write_json(json);
  return json;
}

int64_t CaptionerConfig::num_parameters() const {
  const int64_t Cv = vision_hidden, Ct = text_hidden;
  const int64_t projector = Cv * Ct + Ct + Ct * Ct + Ct;
  return vision_tower_parameters() + projector + (vocab_size + decoder_seq_len()) * Ct +
         text_layers_parameters();
}

double CaptionerConfig::train_flops_per_pair() const {
  const auto Tv = static_cast<double>(vision_seq_len());
  const double projector = Tv * 6.0 * text_hidden * (vision_hidden + text_hidden);
  return vision_tower_flops() + projector + text_layers_flops(decoder_seq_len()) +
         static_cast<double>(max_text_len) * 6.0 * text_hidden * vocab_size;
}

}  // namespace octet
