// The image-text models' shared sizes (JSON, validation, parameter and FLOP counts) and layer
// stack (layer options, the vision tower's embedding, pre-LayerNorm and layers, forward and
// backward).
#include "octet/vision_text.h"

#include <algorithm>

#include "models/config_json.h"
#include "models/image_embedding.h"
#include "modules/common.h"
#include "octet/mappings.h"
#include "octet/ops/activation.h"

namespace octet {

using models_detail::HighPrecisionScope;
using models_detail::to_dtype;

std::vector<std::string> VisionTextConfig::json_keys() {
  return {"image_size",   "channels",   "patch_size", "vision_layers", "vision_hidden",
          "vision_heads", "vision_ffn", "vocab_size", "max_text_len",  "text_layers",
          "text_hidden",  "text_heads", "text_ffn",   "activation",    "layernorm_eps",
          "dropout",      "init_std"};
}

void VisionTextConfig::read_json(const nlohmann::json& json) {
  auto get = [&](const char* key, auto& field) { models_detail::read_field(json, key, field); };
  get("image_size", image_size);
  get("channels", channels);
  get("patch_size", patch_size);
  get("vision_layers", vision_layers);
  get("vision_hidden", vision_hidden);
  get("vision_heads", vision_heads);
  get("vision_ffn", vision_ffn);
  get("vocab_size", vocab_size);
  get("max_text_len", max_text_len);
  get("text_layers", text_layers);
  get("text_hidden", text_hidden);
  get("text_heads", text_heads);
  get("text_ffn", text_ffn);
  get("activation", activation);
  get("layernorm_eps", layernorm_eps);
  get("dropout", dropout);
  get("init_std", init_std);
  models_detail::check_sizes({{"image_size", image_size, 1 << 14},
                              {"channels", channels, 1 << 10},
                              {"patch_size", patch_size, 1 << 14},
                              {"vision_layers", vision_layers, 1 << 12},
                              {"vision_hidden", vision_hidden, 1 << 20},
                              {"vision_heads", vision_heads, 1 << 12},
                              {"vocab_size", vocab_size, 1 << 26},
                              {"max_text_len", max_text_len, 1 << 20},
                              {"text_layers", text_layers, 1 << 12},
                              {"text_hidden", text_hidden, 1 << 20},
                              {"text_heads", text_heads, 1 << 12}});
  for (const auto& [key, value] : {std::pair{"vision_ffn", vision_ffn}, {"text_ffn", text_ffn}}) {
    OCTET_CHECK(value >= 0 && value <= (int64_t{1} << 22), "model config: ", key,
                " expected in [0, 4194304] (0: 4 x hidden), got ", value);
  }
  OCTET_CHECK(image_size % patch_size == 0, "model config: image_size (", image_size,
              ") must be a multiple of patch_size (", patch_size, ")");
  OCTET_CHECK(vision_hidden % vision_heads == 0, "model config: vision_hidden (", vision_hidden,
              ") must be a multiple of vision_heads (", vision_heads, ")");
  OCTET_CHECK(text_hidden % text_heads == 0, "model config: text_hidden (", text_hidden,
              ") must be a multiple of text_heads (", text_heads, ")");
  OCTET_CHECK(vocab_size >= 3, "model config: vocab_size expected at least 3 ([PAD], [SOS], ",
              "[EOS]), got ", vocab_size);
  OCTET_CHECK(max_text_len >= 2, "model config: max_text_len expected at least 2, got ",
              max_text_len);
  ops::parse_activation(activation);
  OCTET_CHECK(layernorm_eps > 0, "model config: layernorm_eps expected > 0, got ", layernorm_eps);
  OCTET_CHECK(dropout >= 0 && dropout < 1, "model config: dropout expected in [0,1), got ",
              dropout);
}

void VisionTextConfig::write_json(nlohmann::json& json) const {
  json["image_size"] = image_size;
  json["channels"] = channels;
  json["patch_size"] = patch_size;
  json["vision_layers"] = vision_layers;
  json["vision_hidden"] = vision_hidden;
  json["vision_heads"] = vision_heads;
  json["vision_ffn"] = vision_ffn;
  json["vocab_size"] = vocab_size;
  json["max_text_len"] = max_text_len;
  json["text_layers"] = text_layers;
  json["text_hidden"] = text_hidden;
  json["text_heads"] = text_heads;
  json["text_ffn"] = text_ffn;
  json["activation"] = activation;
  json["layernorm_eps"] = layernorm_eps;
  json["dropout"] = dropout;
  json["init_std"] = init_std;
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

int64_t VisionTextConfig::vision_tower_parameters() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const int64_t Cv = vision_hidden;
  return patch_dim() * Cv + Cv + vision_seq_len() * Cv + 2 * Cv +
         vision_layers * layer_parameters(Cv, vision_ffn_hidden(), gated) + 2 * Cv;
}

int64_t VisionTextConfig::text_layers_parameters() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  return text_layers * layer_parameters(text_hidden, text_ffn_hidden(), gated) + 2 * text_hidden;
}

double VisionTextConfig::vision_tower_flops() const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const double Tv = static_cast<double>(vision_seq_len());
  return Tv * (6.0 * vision_layers * layer_matrices(vision_hidden, vision_ffn_hidden(), gated) +
               12.0 * vision_layers * Tv * vision_hidden) +
         6.0 * num_patches() * patch_dim() * vision_hidden;
}

double VisionTextConfig::text_layers_flops(int64_t tokens) const {
  const bool gated = ops::is_gated(ops::parse_activation(activation));
  const auto T = static_cast<double>(tokens);
  return T * (6.0 * text_layers * layer_matrices(text_hidden, text_ffn_hidden(), gated) +
              12.0 * text_layers * T * text_hidden);
}

namespace {

TransformerLayerOptions layer_options(const VisionTextConfig& c, int64_t index, uint64_t seed,
                                      bool recompute, const std::string& text_prefix) {
  const bool text = index >= c.vision_layers;
  TransformerLayerOptions o;
  o.checkpoint = recompute;
  o.hidden_size = text ? c.text_hidden : c.vision_hidden;
  o.ffn_hidden_size = text ? c.text_ffn_hidden() : c.vision_ffn_hidden();
  o.num_attention_heads = text ? c.text_heads : c.vision_heads;
  o.layernorm_epsilon = c.layernorm_eps;
  o.hidden_dropout = c.dropout;
  o.attention_dropout = c.dropout;
  o.normalization = NormKind::LayerNorm;
  o.activation = ops::parse_activation(c.activation);
  o.layer_type = LayerType::Encoder;
  // Every patch sees every patch; a text token sees the tokens before it.
  o.self_attn_mask_type = text ? AttnMaskType::Causal : AttnMaskType::NoMask;
  o.init_std = c.init_std;
  o.output_init_std = c.init_std;
  o.seed = seed * 1000 + static_cast<uint64_t>(index) + 1;
  o.name = text ? text_prefix + std::to_string(index - c.vision_layers)
                : "vision_model.encoder.layers." + std::to_string(index);
  return o;
}

}  // namespace

VisionTextStack::VisionTextStack(const std::string& who, const VisionTextConfig& config,
                                 uint64_t seed, ModelLayout layout, bool recompute_activations,
                                 const std::string& text_prefix)
    : TransformerStack(who, config.num_layers(), std::move(layout),
                       [&](int64_t i) {
                         return layer_options(config, i, seed, recompute_activations, text_prefix);
                       }),
      vision_text_(config),
      who_(who) {
  const VisionTextConfig& c = config;
  const int64_t Cv = c.vision_hidden;
  if (!has_first_) return;
  patch_embed_.emplace(linear_options(c.patch_dim(), Cv, false, c.init_std, seed * 7919 + 1,
                                      "vision_model.embeddings.patch_embedding"));
  class_embedding = modules_detail::make_parameter("vision_model.embeddings.class_embedding",
                                                   {1, Cv}, c.init_std, seed * 7919 + 2);
  vision_positions =
      modules_detail::make_parameter("vision_model.embeddings.position_embedding",
                                     {c.vision_seq_len(), Cv}, c.init_std, seed * 7919 + 3);
  pre_norm_.emplace(layer_norm_options(c, Cv, "vision_model.pre_layrnorm"));
}

size_t VisionTextStack::vision_layers_in(int chunk) const {
  return layers_before(chunk, vision_text_.vision_layers);
}

LinearOptions VisionTextStack::linear_options(int64_t in, int64_t out, bool bias, float init_std,
                                              uint64_t seed, std::string name) {
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.bias = bias;
  o.init_std = init_std;
  o.seed = seed;
  o.name = std::move(name);
  return o;
}

NormOptions VisionTextStack::layer_norm_options(const VisionTextConfig& c, int64_t hidden,
                                                std::string name) {
  NormOptions n;
  n.hidden = hidden;
  n.kind = NormKind::LayerNorm;
  n.eps = c.layernorm_eps;
  n.name = std::move(name);
  return n;
}

void VisionTextStack::collect_vision_embedding(std::vector<Parameter*>& out) {
  if (!has_first_) return;
  patch_embed_->collect_parameters(out);
  out.push_back(&class_embedding);
  out.push_back(&vision_positions);
  pre_norm_->collect_parameters(out);
}

void VisionTextStack::collect_chunk_vision(int chunk, std::vector<Parameter*>& out) {
  if (is_first(chunk)) collect_vision_embedding(out);
  std::vector<TransformerLayer>& stack = layers(chunk);
  for (size_t i = 0; i < vision_layers_in(chunk); ++i) stack[i].collect_parameters(out);
}

void VisionTextStack::collect_vision_parameters(std::vector<Parameter*>& out) {
  for (int chunk : chunks_in_stage_order()) collect_chunk_vision(chunk, out);
}

void VisionTextStack::add_vision_parameters_in_backward_order(std::vector<Parameter*>& out) {
  auto add = [&](const std::vector<Parameter*>& ps) {
    out.insert(out.end(), ps.begin(), ps.end());
  };
  const std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = vision_layers_in(*chunk); i-- > 0;) add(stack[i].parameters());
  }
  add_vision_embedding_in_backward_order(out);
}

void VisionTextStack::add_vision_embedding_in_backward_order(std::vector<Parameter*>& out) {
  if (!has_first_) return;
  for (const std::vector<Parameter*>& ps :
       {pre_norm_->parameters(), patch_embed_->parameters(),
        std::vector<Parameter*>{&class_embedding, &vision_positions}}) {
    out.insert(out.end(), ps.begin(), ps.end());
  }
}

Tensor VisionTextStack::vision_embed(const Tensor& pixels, DType dtype, VisionContext* ctx) {
  const VisionTextConfig& c = vision_text_;
  check_dtype(pixels, DType::F32, who_ + ": pixels");
  OCTET_CHECK(pixels.ndim() == 2 && pixels.dim(1) == c.pixels() && pixels.dim(0) > 0, who_,
              ": pixels expected [B, ", c.pixels(), "] (", c.channels, "x", c.image_size, "x",
              c.image_size, " images), got ", shape_str(pixels.shape()));
  const int64_t B = pixels.dim(0), T = c.vision_seq_len(), C = c.vision_hidden;
  VisionContext scratch;
  VisionContext& x_ctx = ctx ? *ctx : scratch;
  const Tensor x =
      models_detail::embed_images(pixels, c.channels, c.image_size, c.patch_size, *patch_embed_,
                                  class_embedding, vision_positions, dtype, x_ctx.patch);
  return pre_norm_->forward(to_dtype(x, dtype), x_ctx.pre_norm).reshape({B, T, C});
}

void VisionTextStack::vision_embed_backward(const Tensor& dx_in, VisionContext& ctx) {
  const int64_t T = vision_text_.vision_seq_len(), C = vision_text_.vision_hidden;
  const int64_t B = dx_in.numel() / (T * C);
  const Tensor dx = pre_norm_->backward(dx_in.reshape({B * T, C}), ctx.pre_norm);
  grads_ready(pre_norm_->parameters());
  models_detail::embed_images_backward(to_dtype(dx, DType::F32).reshape({B * T, C}), B,
                                       *patch_embed_, class_embedding, vision_positions, ctx.patch);
  grads_ready(patch_embed_->parameters());
  grads_ready({&class_embedding, &vision_positions});
}

Tensor VisionTextStack::vision_encode(const Tensor& pixels, DType dtype, VisionContext* ctx,
                                      std::vector<TransformerLayer::Context>* contexts) {
  check_whole("the vision tower's forward");
  const Tensor h = vision_embed(pixels, dtype, ctx);
  return layers_forward(0, h, vision_text_.vision_seq_len(), 0, first_text_layer(), contexts);
}

Tensor VisionTextStack::layers_forward(int chunk, const Tensor& x, int64_t T, size_t first,
                                       size_t last,
                                       std::vector<TransformerLayer::Context>* contexts) {
  const int64_t C = x.dim(-1), N = x.numel() / (T * C);
  Communicator* tp = layout_.tensor;
  const bool sp = sequence_parallel();
  Tensor h =
      sp ? scatter_to_sequence_parallel_region(x.reshape({N * T, C}), *tp) : x.reshape({N, T, C});
  std::vector<TransformerLayer>& stack = layers(chunk);
  for (size_t i = first; i < last; ++i) {
    TransformerLayer::Context scratch;
    HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
    h = stack[i].forward(h, contexts ? (*contexts)[i] : scratch, nullptr, nullptr, nullptr,
                         sp ? T : 0);
  }
  return (sp ? gather_from_sequence_parallel_region(h, *tp) : h).reshape({N, T, C});
}

Tensor VisionTextStack::layers_backward(int chunk, const Tensor& dy, int64_t T, size_t first,
                                        size_t last,
                                        std::vector<TransformerLayer::Context>& contexts) {
  const int64_t C = dy.dim(-1), N = dy.numel() / (T * C);
  Communicator* tp = layout_.tensor;
  const bool sp = sequence_parallel();
  // The output was gathered for consumers that run alike on every rank: this rank's rows of
  // their (equal) gradient are its part.
  Tensor dh =
      sp ? scatter_to_sequence_parallel_region(dy.reshape({N * T, C}), *tp) : dy.reshape({N, T, C});
  std::vector<TransformerLayer>& stack = layers(chunk);
  for (size_t i = last; i-- > first;) {
    HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
    dh = stack[i].backward(dh, contexts[i]);
    contexts[i] = TransformerLayer::Context{};
    grads_ready(stack[i].parameters());
  }
  return (sp ? scatter_to_sequence_parallel_region_backward(dh, *tp) : dh).reshape({N, T, C});
}

bool VisionTextStack::frozen(const std::vector<Parameter*>& parameters) {
  return std::none_of(parameters.begin(), parameters.end(),
                      [](const Parameter* p) { return p->requires_grad; });
}

bool VisionTextStack::vision_tower_frozen() {
  if (layout_.stages > 1) return false;
  std::vector<Parameter*> tower;
  collect_vision_parameters(tower);
  return frozen(tower);
}

void VisionTextStack::vision_encode_backward(Tensor dh, VisionContext& ctx,
                                             std::vector<TransformerLayer::Context>& contexts) {
  if (vision_tower_frozen()) {
    for (size_t i = 0; i < first_text_layer(); ++i) contexts[i] = TransformerLayer::Context{};
    return;
  }
  const int64_t T = vision_text_.vision_seq_len();
  vision_embed_backward(layers_backward(0, dh, T, 0, first_text_layer(), contexts), ctx);
}

}  // namespace octet
