// BertConfig: JSON in and out, validation, parameter and FLOP counts; the micro-batch form.
#include <cmath>

#include "models/config_json.h"
#include "octet/bert.h"
#include "octet/ops/activation.h"

namespace octet {

pipeline::MicroBatch bert_micro_batch(const Tensor& ids, const Tensor& token_types,
                                      const Tensor& lengths, const Tensor& targets,
                                      const Tensor& nsp_labels) {
  return {{"ids", ids},
          {"token_types", token_types},
          {"lengths", lengths},
          {"targets", targets},
          {"nsp_labels", nsp_labels}};
}

BertConfig BertConfig::from_json(const nlohmann::json& json) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  BertConfig c;
  std::string model;
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("model", model);
  OCTET_CHECK(model == "bert", "model config: 'model' expected \"bert\", got '", model, "'");
  models_detail::check_known_keys(
      json, {"model", "name", "vocab_size", "max_seq_len", "type_vocab_size", "num_layers",
             "hidden", "num_heads", "ffn_hidden", "activation", "post_layernorm", "layernorm_eps",
             "dropout", "init_std"});
  get("name", c.name);
  get("vocab_size", c.vocab_size);
  get("max_seq_len", c.max_seq_len);
  get("type_vocab_size", c.type_vocab_size);
  get("num_layers", c.num_layers);
  get("hidden", c.hidden);
  get("num_heads", c.num_heads);
  get("ffn_hidden", c.ffn_hidden);
  get("activation", c.activation);
  get("post_layernorm", c.post_layernorm);
  get("layernorm_eps", c.layernorm_eps);
  get("dropout", c.dropout);
  get("init_std", c.init_std);
  models_detail::check_sizes({{"vocab_size", c.vocab_size, 1 << 24},
                              {"max_seq_len", c.max_seq_len, 1 << 20},
                              {"type_vocab_size", c.type_vocab_size, 1 << 10},
                              {"num_layers", c.num_layers, 1 << 12},
                              {"hidden", c.hidden, 1 << 20},
                              {"num_heads", c.num_heads, 1 << 12}});
  OCTET_CHECK(c.vocab_size >= 5,
              "model config: vocab_size expected at least 5 (text ids and "
              "the four special tokens [PAD] [CLS] [SEP] [MASK] at its end), got ",
              c.vocab_size);
  OCTET_CHECK(c.max_seq_len >= 4,
              "model config: max_seq_len expected at least 4 ([CLS] A [SEP] "
              "B [SEP]), got ",
              c.max_seq_len);
  OCTET_CHECK(c.type_vocab_size >= 2,
              "model config: type_vocab_size expected at least 2 "
              "(sentences A and B), got ",
              c.type_vocab_size);
  OCTET_CHECK(c.ffn_hidden >= 0 && c.ffn_hidden <= (int64_t{1} << 22),
              "model config: ffn_hidden expected in [0, 4194304] (0: 4 x hidden), got ",
              c.ffn_hidden);
  OCTET_CHECK(c.hidden % c.num_heads == 0, "model config: hidden (", c.hidden,
              ") must be a multiple of num_heads (", c.num_heads, ")");
  OCTET_CHECK(!ops::is_gated(ops::parse_activation(c.activation)),
              "model config: BERT's activation expected gelu_erf, gelu, relu or silu, got '",
              c.activation, "'");
  OCTET_CHECK(c.layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ",
              c.layernorm_eps);
  OCTET_CHECK(c.dropout >= 0 && c.dropout < 1, "model config: dropout expected in [0,1), got ",
              c.dropout);
  return c;
}

BertConfig BertConfig::load(const std::string& path) {
  return models_detail::load_config<BertConfig>(path);
}

nlohmann::json BertConfig::to_json() const {
  return {{"model", "bert"},
          {"name", name},
          {"vocab_size", vocab_size},
          {"max_seq_len", max_seq_len},
          {"type_vocab_size", type_vocab_size},
          {"num_layers", num_layers},
          {"hidden", hidden},
          {"num_heads", num_heads},
          {"ffn_hidden", ffn_hidden},
          {"activation", activation},
          {"post_layernorm", post_layernorm},
          {"layernorm_eps", layernorm_eps},
          {"dropout", dropout},
          {"init_std", init_std}};
}

int64_t BertConfig::num_parameters() const {
  const int64_t C = hidden, norm = 2 * C;
  const int64_t per_layer = 4 * C * C + 4 * C + 2 * C * ffn() + ffn() + C + 2 * norm;
  const int64_t embeddings = (vocab_size + max_seq_len + type_vocab_size) * C + norm;
  const int64_t heads = (C * C + C + norm + vocab_size) + (C * C + C) + (2 * C + 2);
  return embeddings + num_layers * per_layer + heads;  // the decoder is the word embedding
}

double BertConfig::train_flops_per_token(int64_t seq_len) const {
  const double layer = 4.0 * hidden * hidden + 2.0 * hidden * ffn();
  const double mlm = 0.15 * (double(hidden) * hidden + double(hidden) * vocab_size);
  return 6.0 * (num_layers * layer + mlm) + 12.0 * num_layers * seq_len * hidden;
}

}  // namespace octet
