// T5Config: JSON in and out, validation; the micro-batch form; relative position buckets.
#include <cmath>

#include "models/config_json.h"
#include "octet/t5.h"

namespace octet {

pipeline::MicroBatch t5_micro_batch(const Tensor& enc_ids, const Tensor& enc_lengths,
                                    const Tensor& dec_ids, const Tensor& dec_lengths,
                                    const Tensor& targets) {
  return {{"enc_ids", enc_ids},
          {"enc_lengths", enc_lengths},
          {"dec_ids", dec_ids},
          {"dec_lengths", dec_lengths},
          {"targets", targets}};
}

int64_t t5_relative_position_bucket(int64_t relative_position, bool bidirectional,
                                    int64_t num_buckets, int64_t max_distance) {
  int64_t bucket = 0;
  int64_t n = num_buckets;
  if (bidirectional) {
    n /= 2;
    if (relative_position > 0) bucket += n;
    relative_position = std::abs(relative_position);
  } else {
    relative_position = -std::min<int64_t>(relative_position, 0);  // keys before the query
  }
  const int64_t max_exact = n / 2;
  if (relative_position < max_exact) return bucket + relative_position;
  // Log-spaced from max_exact to max_distance over the other half of the buckets, in F32 as
  // Hugging Face's T5 computes it (the divisor's logarithm in double, then rounded to F32).
  const float ratio =
      std::log(static_cast<float>(relative_position) / static_cast<float>(max_exact));
  const auto span = static_cast<float>(
      std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  const float scaled = ratio / span * static_cast<float>(n - max_exact);
  const int64_t large = max_exact + static_cast<int64_t>(scaled);
  return bucket + std::min<int64_t>(large, n - 1);
}

int64_t T5Config::num_parameters() const {
  const int64_t C = hidden, A = num_heads * kv_channels, F = ffn_hidden;
  const int64_t self_attention = 4 * A * C + C, mlp = 3 * F * C + C;
  const int64_t encoder_layer = self_attention + mlp;
  const int64_t decoder_layer = encoder_layer + 4 * A * C + C;  // cross-attention
  return 2 * vocab_size * C + 2 * relative_attention_num_buckets * num_heads + 2 * C +
         num_layers * encoder_layer + decoder_layers() * decoder_layer;
}

double T5Config::train_flops_per_token(int64_t enc_len, int64_t dec_len) const {
  const double C = static_cast<double>(hidden), A = double(num_heads) * kv_channels;
  const double F = static_cast<double>(ffn_hidden);
  const double encoder_layer = 4 * A * C + 3 * F * C;
  const double decoder_layer = encoder_layer + 4 * A * C;
  // Per input token: the decoder's work on dec_len / enc_len target tokens.
  const double ratio = static_cast<double>(dec_len) / static_cast<double>(enc_len);
  const double matrices = num_layers * encoder_layer +
                          ratio * (decoder_layers() * decoder_layer + double(vocab_size) * C);
  const double attention =
      num_layers * enc_len * A + ratio * decoder_layers() * (dec_len + enc_len) * A;
  return 6.0 * matrices + 12.0 * attention;
}

T5Config T5Config::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  T5Config c;
  std::string model;
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "t5", "model config: 'model' expected \"t5\", got '", model, "'");
  models_detail::check_known_keys(
      json, {"model", "name", "vocab_size", "num_sentinels", "max_seq_len", "max_target_len",
             "num_layers", "num_decoder_layers", "hidden", "num_heads", "kv_channels", "ffn_hidden",
             "relative_attention_num_buckets", "relative_attention_max_distance", "layernorm_eps",
             "dropout", "init_std"});
  get("name", c.name);
  get("vocab_size", c.vocab_size);
  get("num_sentinels", c.num_sentinels);
  get("max_seq_len", c.max_seq_len);
  get("max_target_len", c.max_target_len);
  get("num_layers", c.num_layers);
  get("num_decoder_layers", c.num_decoder_layers);
  get("hidden", c.hidden);
  get("num_heads", c.num_heads);
  get("kv_channels", c.kv_channels);
  get("ffn_hidden", c.ffn_hidden);
  get("relative_attention_num_buckets", c.relative_attention_num_buckets);
  get("relative_attention_max_distance", c.relative_attention_max_distance);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("init_std", c.init_std);
  models_detail::check_sizes(
      {{"vocab_size", c.vocab_size, 1 << 24},
       {"num_sentinels", c.num_sentinels, 1 << 16},
       {"max_seq_len", c.max_seq_len, 1 << 20},
       {"max_target_len", c.max_target_len, 1 << 20},
       {"num_layers", c.num_layers, 1 << 12},
       {"hidden", c.hidden, 1 << 20},
       {"num_heads", c.num_heads, 1 << 12},
       {"kv_channels", c.kv_channels, 256},
       {"ffn_hidden", c.ffn_hidden, 1 << 22},
       {"relative_attention_num_buckets", c.relative_attention_num_buckets, 1 << 12},
       {"relative_attention_max_distance", c.relative_attention_max_distance, 1 << 20}});
  OCTET_CHECK(c.num_decoder_layers >= 0 && c.num_decoder_layers <= (1 << 12),
              "model config: num_decoder_layers expected in [0, 4096] (0: num_layers), got ",
              c.num_decoder_layers);
  OCTET_CHECK(c.vocab_size > c.num_sentinels + 2, "model config: vocab_size (", c.vocab_size,
              ") expected above num_sentinels + 2 (", c.num_sentinels + 2,
              ": [PAD], [EOS] and the sentinels end the vocabulary)");
  OCTET_CHECK(c.relative_attention_num_buckets >= 4,
              "model config: "
              "relative_attention_num_buckets expected at least 4, got ",
              c.relative_attention_num_buckets);
  OCTET_CHECK(c.relative_attention_max_distance > c.relative_attention_num_buckets / 2,
              "model config: relative_attention_max_distance expected above "
              "relative_attention_num_buckets / 2 (",
              c.relative_attention_num_buckets / 2, "), got ", c.relative_attention_max_distance);
  OCTET_CHECK(c.layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ",
              c.layernorm_eps);
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

T5Config T5Config::load(const std::string& path) {
  return models_detail::load_config<T5Config>(path);
}

nlohmann::json T5Config::to_json() const {
  return {{"model", "t5"},
          {"name", name},
          {"vocab_size", vocab_size},
          {"num_sentinels", num_sentinels},
          {"max_seq_len", max_seq_len},
          {"max_target_len", max_target_len},
          {"num_layers", num_layers},
          {"num_decoder_layers", num_decoder_layers},
          {"hidden", hidden},
          {"num_heads", num_heads},
          {"kv_channels", kv_channels},
          {"ffn_hidden", ffn_hidden},
          {"relative_attention_num_buckets", relative_attention_num_buckets},
          {"relative_attention_max_distance", relative_attention_max_distance},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"init_std", init_std}};
}

}  // namespace octet
