// ViT (Dosovitskiy et al. 2021): an image cut into P x P patches, each patch embedded by one
// GEMM, a class token prepended, learned positions added, a stack of pre-norm encoder
// TransformerLayers (no attention mask), the final norm of the class token and a linear
// classification head trained with cross-entropy. Written once on the TransformerEngine-style
// modules, it runs in the layouts GPT does (ModelLayout: pipeline stages, tensor and sequence
// parallelism) and trains through the same trainer, flags and checkpoints.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/safetensors.h"
#include "octet/trainable_model.h"

namespace octet {

struct ViTConfig {
  std::string name = "vit";
  int64_t image_size = 28;  // square images, image_size x image_size
  int64_t channels = 1;
  int64_t patch_size = 4;  // image_size must be a multiple
  int64_t num_classes = 10;
  int64_t num_layers = 6;
  int64_t hidden = 128;
  int64_t num_heads = 4;
  int64_t ffn_hidden = 0;  // 0 = 4 * hidden
  std::string activation = "gelu";
  std::string normalization = "layernorm";  // layernorm | rmsnorm
  float layernorm_eps = 1e-6f;
  float dropout = 0.0f;
  float init_std = 0.02f;

  // A JSON object with "model": "vit"; unknown keys and out-of-range values are errors.
  static ViTConfig from_json(const nlohmann::json& json);
  static ViTConfig load(const std::string& path);
  nlohmann::json to_json() const;
  int64_t ffn() const { return ffn_hidden ? ffn_hidden : 4 * hidden; }
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int64_t patch_dim() const { return patch_size * patch_size * channels; }
  int64_t seq_len() const { return num_patches() + 1; }  // patches and the class token
  int64_t pixels() const { return image_size * image_size * channels; }
  int64_t num_parameters() const;
  // Training FLOPs per token (patch or class token): 6 x the GEMMs' parameters plus
  // attention's 12 x layers x T x hidden, T = seq_len(); the head counts once per image.
  double train_flops_per_token() const;
};

// The model family of a config file: its "model" key ("vit", "bert", "t5"), "gpt" without one.
std::string config_model_family(const std::string& path);

// A ViT micro-batch: {"pixels": [B, C*H*W] F32 (channel-major images, normalized), "labels":
// [B] I32 in [0, num_classes)}.
pipeline::MicroBatch vit_micro_batch(const Tensor& pixels, const Tensor& labels);

// A ViT, or the part of one that a rank holds (as GPT: chunk c holds the layers of stage
// stage_of_chunk[c]; the patch embedding, class token and positions live on the first stage,
// the final norm, the head and the loss on the last). Under tensor parallelism the layers
// are split across the group and the patch embedding and head are replicated (each rank
// computes them whole; under sequence parallelism the embedded tokens are scattered to the
// ranks' rows and the class tokens gathered back before the head). The patch embedding and
// the head always run in the step's dtype outside FP8 / FP4 (TransformerEngine keeps the
// first and last GEMMs in high precision): FP8 recipes quantize the encoder layers' GEMMs.
class ViT : public TransformerStack {
 public:
  ViT(const ViTConfig& config, uint64_t seed, ModelLayout layout = {},
      bool recompute_activations = false);

  // The training interface on vit_micro_batch() micro-batches.
  using TransformerStack::evaluate;  // the whole model's train_step and evaluate
  using TransformerStack::train_step;
  // Logits [B, num_classes] F32 of pixels [B, C*H*W] (the whole model, no contexts kept).
  Tensor logits(const Tensor& pixels, DType dtype);
  // take_eval_counts(): correct predictions and images seen by evaluation (evaluate(), and
  // the last stage's evaluate chunk); counted on tensor rank 0 only.

  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;
    Linear::Context patch, head;
    Norm::Context final_norm;
    int64_t batch = 0;
    Tensor dclass;  // last stage: the loss's gradient at the class tokens' final layer output
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  std::vector<pipeline::TiedParameters> tied_parameters() override { return {}; }
  std::vector<Parameter*> chunk_parameters(int chunk) override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> parameters_in_backward_order() override;
  TensorMap to_checkpoint_names(const TensorMap& ours) const override { return ours; }
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override { return theirs; }

  const ViTConfig& config() const { return config_; }

  // First stage: the class token [1, C] and the positions [T, C] (T = seq_len()).
  Parameter cls_token, pos_embed;

 private:
  // pixels [B, C*H*W] -> tokens [B*T, C] F32 (class token and positions added).
  Tensor embed(const Tensor& pixels, DType dtype, Linear::Context& patch_ctx);
  void embed_backward(const Tensor& dx, int64_t batch, Linear::Context& patch_ctx);
  // The last layer's output h (this rank's rows under SP) -> the loss (and the class tokens'
  // gradient in ctx with backward).
  float head_loss(const Tensor& h, const Tensor& labels, int64_t batch, DType dtype,
                  float grad_scale, Context* ctx, bool count);
  Tensor run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, Context* ctx, float* loss);

  ViTConfig config_;
  std::optional<Linear> patch_embed_;  // first stage
  std::optional<Norm> final_norm_;     // last stage
  std::optional<Linear> head_;         // last stage
};

}  // namespace octet
