// What the image-text models (CLIP, the captioner) share: the sizes of a vision tower and a text
// stack, and the layer stack that holds both with the vision tower's embedding (patches by one
// GEMM, a class token, learned positions) and pre-LayerNorm, under CLIP's tensor names.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/modules.h"
#include "octet/trainable_model.h"

namespace octet {

struct VisionTextConfig {
  // The vision tower (square images).
  int64_t image_size = 28;
  int64_t channels = 1;
  int64_t patch_size = 4;  // image_size must be a multiple
  int64_t vision_layers = 4;
  int64_t vision_hidden = 128;
  int64_t vision_heads = 4;
  int64_t vision_ffn = 0;  // 0 = 4 x vision_hidden
  // The text layers: sequences of at most max_text_len tokens.
  int64_t vocab_size = 128;
  int64_t max_text_len = 16;
  int64_t text_layers = 2;
  int64_t text_hidden = 128;
  int64_t text_heads = 4;
  int64_t text_ffn = 0;  // 0 = 4 x text_hidden
  std::string activation = "gelu";
  float layernorm_eps = 1e-5f;
  float dropout = 0.0f;
  float init_std = 0.02f;

  // The keys above, read from `json` (unknown keys are the caller's check) and validated, and
  // written back.
  static std::vector<std::string> json_keys();
  void read_json(const nlohmann::json& json);
  void write_json(nlohmann::json& json) const;

  int64_t vision_ffn_hidden() const { return vision_ffn ? vision_ffn : 4 * vision_hidden; }
  int64_t text_ffn_hidden() const { return text_ffn ? text_ffn : 4 * text_hidden; }
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int64_t patch_dim() const { return patch_size * patch_size * channels; }
  int64_t vision_seq_len() const { return num_patches() + 1; }  // patches and the class token
  int64_t pixels() const { return image_size * image_size * channels; }
  int64_t num_layers() const { return vision_layers + text_layers; }
  // Parameters of the vision tower (embedding, pre-LayerNorm, layers and the LayerNorm after
  // them) and of `text_layers` text layers with a final LayerNorm.
  int64_t vision_tower_parameters() const;
  int64_t text_layers_parameters() const;
  // Training FLOPs of the vision tower over one image (its layers and the patch GEMM), and of
  // the text layers over `tokens` tokens.
  double vision_tower_flops() const;
  double text_layers_flops(int64_t tokens) const;
};

// TransformerStack's layers 0 .. L_v-1 are the vision tower's (no mask), L_v .. L_v+L_t-1 the
// text layers (causal), named `text_prefix` + index. Under tensor parallelism the layers split
// their heads and FFN columns and everything else is replicated: activations enter and leave
// the layers whole on every rank (this rank's token rows inside them under sequence
// parallelism). Under pipeline parallelism the stages cut the vision layers then the text
// layers into equal runs; the vision tower's embedding and pre-LayerNorm live on the first
// stage (a model that cannot be staged refuses at construction).
class VisionTextStack : public TransformerStack {
 public:
  Parameter class_embedding;   // [1, Cv]
  Parameter vision_positions;  // [Tv, Cv]

 protected:
  VisionTextStack(const std::string& who, const VisionTextConfig& config, uint64_t seed,
                  ModelLayout layout, bool recompute_activations, const std::string& text_prefix);

  struct VisionContext {
    Linear::Context patch;
    Norm::Context pre_norm;
  };
  // pixels [B, C*H*W] F32 (checked) -> the vision layers' input [B, Tv, Cv] in dtype (the
  // embedding and the pre-LayerNorm: first stage); with ctx, kept for the backward. And the
  // gradient at it -> the embedding's and pre-LayerNorm's (reported ready).
  Tensor vision_embed(const Tensor& pixels, DType dtype, VisionContext* ctx);
  void vision_embed_backward(const Tensor& dx, VisionContext& ctx);
  // The whole tower (one stage held): pixels -> the tokens after the last vision layer
  // [B, Tv, Cv] in dtype; with ctx and layers, the contexts for the backward.
  Tensor vision_encode(const Tensor& pixels, DType dtype, VisionContext* ctx,
                       std::vector<TransformerLayer::Context>* layers);
  // The gradient at those tokens -> every vision parameter's (reported ready as they are).
  // Nothing where the whole tower is frozen (vision_tower_frozen()).
  void vision_encode_backward(Tensor dtokens, VisionContext& ctx,
                              std::vector<TransformerLayer::Context>& layers);
  // Whether no parameter of the vision tower up to its last layer trains (--freeze): its
  // backward would compute nothing that is used. False under pipeline parallelism (a stage
  // sees its own part of the tower only).
  bool vision_tower_frozen();
  // Whether none of `parameters` trains.
  static bool frozen(const std::vector<Parameter*>& parameters);
  // Layers [first, last) over x [N*T, C] or [N, T, C] (whole, the same on every rank) of N
  // sequences of T tokens -> [N, T, C] whole; with contexts, kept for the backward. And the
  // backward: the whole gradient at the output (the same on every rank) -> the whole gradient
  // at the input [N, T, C], each layer's parameters reported ready.
  // The layers [first, last) of `chunk`.
  Tensor layers_forward(int chunk, const Tensor& x, int64_t T, size_t first, size_t last,
                        std::vector<TransformerLayer::Context>* contexts);
  Tensor layers_backward(int chunk, const Tensor& dy, int64_t T, size_t first, size_t last,
                         std::vector<TransformerLayer::Context>& contexts);
  // The vision tower's parameters this rank holds up to its last layer (the embedding on the
  // first stage, each chunk's vision layers in stage order), in forward order; and in backward
  // order.
  void collect_vision_parameters(std::vector<Parameter*>& out);
  void collect_vision_embedding(std::vector<Parameter*>& out);  // the first stage's part
  // The chunk's part of the tower: the embedding on the first stage, then its vision layers.
  void collect_chunk_vision(int chunk, std::vector<Parameter*>& out);
  void add_vision_embedding_in_backward_order(std::vector<Parameter*>& out);  // the same
  void add_vision_parameters_in_backward_order(std::vector<Parameter*>& out);
  // The first text layer's index in the whole model's stack; and how many of a chunk's first
  // layers are vision layers (the rest are text layers).
  size_t first_text_layer() const { return static_cast<size_t>(vision_text_.vision_layers); }
  size_t vision_layers_in(int chunk) const;
  void vision_parameters_updated() {
    if (patch_embed_) patch_embed_->on_parameters_updated();
  }
  static LinearOptions linear_options(int64_t in, int64_t out, bool bias, float init_std,
                                      uint64_t seed, std::string name);
  static NormOptions layer_norm_options(const VisionTextConfig& c, int64_t hidden,
                                        std::string name);

 private:
  VisionTextConfig vision_text_;
  std::string who_;
  std::optional<Linear> patch_embed_;
  std::optional<Norm> pre_norm_;
};

}  // namespace octet
