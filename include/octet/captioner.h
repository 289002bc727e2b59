// An image captioner in LLaVA's shape (Liu et al. 2023): a vision encoder (CLIP's vision tower:
// patches embedded by one GEMM, a class token, learned positions, a LayerNorm, pre-norm encoder
// layers and a LayerNorm over every token), a projector (LLaVA-1.5's two-layer MLP with GELU)
// that turns each of the image's tokens into a prefix token of the language model, and a GPT
// decoder (token and learned position embeddings, causal pre-norm layers, a final LayerNorm,
// the output layer tied to the token embedding) trained to write the image's caption after its
// prefix. Greedy decoding writes captions. Its vision tensors carry CLIP's names, so a CLIP
// checkpoint's vision tower can be loaded (--pretrained-checkpoint) and frozen (--freeze
// vision_model). Every layout: data, tensor and pipeline parallelism (VisionTextStack).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/model.h"
#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/trainable_model.h"
#include "octet/vision_text.h"

namespace octet {

struct CaptionerConfig : VisionTextConfig {
  std::string name = "captioner";
  // Captions are [SOS] words [EOS] of at most max_text_len tokens.
  int64_t sos_id = 1;  // every caption starts with it; greedy decoding starts from it
  int64_t eos_id = 2;  // greedy decoding stops after it

  // A JSON object with "model": "captioner"; unknown keys and out-of-range values are errors.
  static CaptionerConfig from_json(const nlohmann::json& json);
  static CaptionerConfig load(const std::string& path);
  nlohmann::json to_json() const;
  // The decoder's sequence: the image's prefix tokens, then the caption's.
  int64_t decoder_seq_len() const { return vision_seq_len() + max_text_len; }
  int64_t num_parameters() const;
  // Training FLOPs per image-caption pair: 6 x the GEMMs' parameters per token (the encoder over
  // the image's tokens; the projector over them; the decoder over prefix and caption) plus
  // attention's 12 x layers x T x hidden per token, and the output layer over the caption.
  double train_flops_per_pair() const;
};

// A micro-batch: {"pixels": [B, C*H*W] F32, "labels": [B] I32 (the images' classes; only
// carried), "text_ids": [B, T] I32 (each image's caption: [SOS] words [EOS], then padding),
// "text_lengths": [B] I32 (tokens up to and with the [EOS])}. CLIP's micro-batches have these.
//
// The loss: the mean cross-entropy of each caption token after the [SOS] (words and [EOS]),
// predicted from the prefix and the tokens before it.

// TransformerStack's layers 0 .. L_v-1 are the encoder's, L_v .. L_v+L_t-1 the decoder's. The
// patch embedding, the projector and the output layer run in the step's dtype outside FP8 /
// FP4; FP8 recipes quantize the encoder's and decoder's layers.
//
// Pipeline stages cut the encoder's then the decoder's layers into equal runs (Megatron's LLaVA
// pipeline): the first stage embeds the images; the stage holding the first decoder layer (the
// bridge) applies the encoder's LayerNorm and the projector, embeds the captions and places
// the prefix before them; the last stage applies the final LayerNorm and the tied output
// layer. A boundary inside the encoder carries the image tokens [B, Tv, Cv], one inside the
// decoder the prefix and caption tokens [B, Tv + T, Ct] (boundary_shape()). The token
// embedding is a tied copy on the bridge and the last stage when they differ.
class ImageCaptioner : public VisionTextStack {
 public:
  ImageCaptioner(const CaptionerConfig& config, uint64_t seed, ModelLayout layout = {},
                 bool recompute_activations = false);

  using TransformerStack::evaluate;  // the whole model's train_step and evaluate
  using TransformerStack::train_step;
  // take_eval_counts(): caption tokens predicted correctly (argmax, teacher forcing), and caption
  // tokens seen by evaluation.

  // Greedy captions of images [N, C*H*W]: each starts from [SOS] and takes the most likely next
  // token until [EOS] or max_text_len tokens. The ids, [SOS] first (and [EOS] last when reached).
  std::vector<std::vector<int32_t>> generate(const Tensor& pixels, DType dtype);

  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;  // the chunk's encoder, then decoder layers
    VisionContext vision;
    Linear::Context project_in, project_out;
    Norm::Context post_norm, final_norm;
    Tensor projector_hidden;  // the first projector GEMM's output (GELU's input)
    Tensor text_ids;          // [B, T]
    int64_t batch = 0;
    Tensor dhidden;  // the loss's gradient at the final norm's output rows of the caption
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  // The image tokens [B, Tv, Cv] (inside the encoder); boundary_shape() for any stage.
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  Shape boundary_shape(const pipeline::MicroBatch& batch, int stage) const override;
  std::vector<pipeline::TiedParameters> tied_parameters() override;
  std::vector<Parameter*> chunk_parameters(int chunk) override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> parameters_in_backward_order() override;
  TensorMap to_checkpoint_names(const TensorMap& ours) const override { return ours; }
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override { return theirs; }

  const CaptionerConfig& config() const { return config_; }

  Parameter token_embedding;  // [V, Ct], also the output layer (bridge and last stage)
  Parameter text_positions;   // [Tv + max_text_len, Ct]: the prefix's, then the text's (bridge)

 private:
  // The stage holding the first decoder layer, and whether the chunk is that stage.
  int bridge_stage() const;
  bool is_bridge(int chunk) const { return stage_of_chunk(chunk) == bridge_stage(); }
  // The encoder's output tokens [B, Tv, Cv] in dtype -> the prefix [B*Tv, Ct] F32: the
  // encoder's LayerNorm and the projector (contexts kept with ctx). And its backward: the
  // prefix's gradient -> the tokens' (undefined where the whole encoder is frozen).
  Tensor project(const Tensor& tokens, DType dtype, Context* ctx);
  Tensor project_backward(const Tensor& dprefix, Context& ctx);
  // The prefix [B*Tv, Ct] F32 and ids [B, T] -> the decoder's input [B, Tv + T, Ct] in dtype
  // (prefix then caption of each image, plus the positions). And the gradient at it -> the
  // embeddings' (reported ready) and the prefix's [B*Tv, Ct] F32.
  Tensor decoder_input(const Tensor& prefix, const Tensor& ids, DType dtype);
  Tensor decoder_input_backward(const Tensor& dx, const Tensor& ids);
  Tensor run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, Context* ctx, float* loss, bool count);
  // The last stage: the final LayerNorm's output [B*Td, Ct] -> the loss over the caption's
  // tokens (ids and lengths checked before; its gradient kept in ctx); with count, the
  // correctly predicted tokens counted.
  float caption_loss(const Tensor& hidden, const Tensor& ids, const Tensor& lengths, DType dtype,
                     float grad_scale, Context* ctx, bool count);

  CaptionerConfig config_;
  std::optional<Linear> project_in_, project_out_;
  std::optional<Norm> post_norm_, final_norm_;
  TiedOutputCache output_cache_;
};

}  // namespace octet
