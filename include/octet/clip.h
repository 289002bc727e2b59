// CLIP (Radford et al. 2021): a vision tower (patches embedded by one GEMM, a class token,
// learned positions, a LayerNorm, pre-norm encoder layers, the class token's LayerNorm and a
// projection without bias) and a text tower (token and position embeddings, causal pre-norm
// layers, a final LayerNorm, the [EOS] token's row and a projection without bias), trained by
// the symmetric contrastive loss over a micro-batch's image-caption pairs: the cosine
// similarities of every image with every caption, scaled by exp(logit_scale) (at most 100),
// cross-entropy towards each image's own caption and each caption's own image, averaged.
// Evaluation also classifies each image zero-shot: the class whose prompts' mean text feature
// is the most similar. Written on the TransformerEngine-style modules, in every layout: whole,
// data parallelism (each micro-batch its own contrastive batch, so DP equals one process),
// tensor parallelism (VisionTextStack), pipeline stages and their products.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/trainable_model.h"
#include "octet/vision_text.h"

namespace octet {

struct CLIPConfig : VisionTextConfig {
  std::string name = "clip";
  // The shared embedding space and the loss.
  int64_t embed_dim = 64;
  int64_t num_classes = 10;             // zero-shot classification: K classes of M prompts each
  float logit_scale_init = 2.6592600f;  // ln(1 / 0.07), CLIP's initial temperature

  // A JSON object with "model": "clip"; unknown keys and out-of-range values are errors.
  static CLIPConfig from_json(const nlohmann::json& json);
  static CLIPConfig load(const std::string& path);
  nlohmann::json to_json() const;
  int64_t num_parameters() const;
  // Training FLOPs per image-caption pair: 6 x the GEMMs' parameters per token of each tower
  // plus attention's 12 x layers x T x hidden per token, the projections and the similarity
  // matrix's row once.
  double train_flops_per_pair() const;
};

// A CLIP micro-batch: {"pixels": [B, C*H*W] F32, "labels": [B] I32 (the images' classes, for
// zero-shot accuracy), "text_ids": [B, T] I32 (each image's caption: [SOS] words [EOS], then
// padding), "text_lengths": [B] I32 (tokens up to and with the [EOS]), "class_ids": [K*M, T]
// I32 and "class_lengths": [K*M] I32 (M prompts for each of the K classes, class k's rows
// k*M .. k*M+M-1; evaluation only)}.
pipeline::MicroBatch clip_micro_batch(const Tensor& pixels, const Tensor& labels,
                                      const Tensor& text_ids, const Tensor& text_lengths,
                                      const Tensor& class_ids, const Tensor& class_lengths);

// A CLIP: TransformerStack's layers 0 .. L_v-1 are the vision tower's, L_v .. L_v+L_t-1 the text
// tower's. The patch embedding and the two projections run in the step's dtype outside FP8 / FP4
// (the first and last GEMMs in high precision); FP8 recipes quantize the towers' layers.
// Under pipeline parallelism the stages cut the vision layers then the text layers; the first
// stage embeds the images and the captions (and, in evaluation, the class prompts), every
// boundary carries the three token streams as one flat activation (vision tokens, caption
// tokens, class-prompt tokens: zeros while training), and the last stage pools, projects and
// takes the loss (and the zero-shot classes) - the towers never meet before it.
class CLIP : public VisionTextStack {
 public:
  CLIP(const CLIPConfig& config, uint64_t seed, ModelLayout layout = {},
       bool recompute_activations = false);

  using TransformerStack::evaluate;  // the whole model's train_step and evaluate
  using TransformerStack::train_step;
  // take_eval_counts(): images classified correctly zero-shot, and images seen by evaluation.

  // Unit-length features [N, embed_dim] F32: of images [N, C*H*W], and of token sequences
  // [N, T] I32 with their lengths [N] I32 (the whole model held, no contexts kept).
  Tensor image_features(const Tensor& pixels, DType dtype);
  Tensor text_features(const Tensor& ids, const Tensor& lengths, DType dtype);
  // Zero-shot class of each image: argmax over classes of the cosine with each class's mean
  // prompt feature (class_ids [K*M, T], K = config().num_classes, M prompts per class).
  std::vector<int64_t> zero_shot(const Tensor& pixels, const Tensor& class_ids,
                                 const Tensor& class_lengths, DType dtype);

  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;  // the chunk's vision, then text layers
    VisionContext vision;
    Linear::Context visual_projection, text_projection;
    Norm::Context post_norm, final_norm;
    Tensor text_ids, text_lengths;
    int64_t batch = 0;
    int64_t class_elements = 0;  // the class-prompt stream's share of a boundary
    // The loss's gradients at the projections' outputs [B, embed_dim] F32.
    Tensor dimage, dtext;
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  std::vector<pipeline::TiedParameters> tied_parameters() override { return {}; }  // none
  std::vector<Parameter*> chunk_parameters(int chunk) override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> parameters_in_backward_order() override;
  TensorMap to_checkpoint_names(const TensorMap& ours) const override { return ours; }
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override { return theirs; }

  const CLIPConfig& config() const { return config_; }

  Parameter token_embedding;  // [V, Ct] (first stage)
  Parameter text_positions;   // [max_text_len, Ct] (first stage)
  Parameter logit_scale;      // [1]: ln of the similarities' scale (last stage)

 private:
  // ids [N,T] I32 with lengths [N] I32 (checked) -> token and position embeddings [N,T,Ct] in
  // dtype (first stage).
  void check_text(const Tensor& ids, const Tensor& lengths, const char* what) const;
  Tensor text_embed(const Tensor& ids, DType dtype);
  // Last stage: the class token's rows of the vision tokens [B,Tv,Cv] after the post-LayerNorm;
  // the [EOS] rows of text tokens [N,T,Ct] after the final LayerNorm.
  Tensor pool_image(const Tensor& tokens, Norm::Context& ctx);
  Tensor pool_text(const Tensor& tokens, const Tensor& lengths, Norm::Context& ctx);
  Tensor run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, Context* ctx, float* loss, bool count);
  // The three streams as one boundary activation (an undefined class stream: zeros), and back.
  Tensor pack(const Tensor& vision, const Tensor& text, const Tensor& classes,
              int64_t class_elements) const;
  void unpack(const Tensor& packed, int64_t B, int64_t T, const Tensor* class_ids, Tensor& vision,
              Tensor& text, Tensor* classes) const;

  CLIPConfig config_;
  std::optional<Linear> visual_projection_, text_projection_;  // the last stage's
  std::optional<Norm> post_norm_, final_norm_;                 // the last stage's
};

}  // namespace octet
