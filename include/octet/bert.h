// BERT (Devlin et al. 2019): word, position and token-type embeddings; a stack of encoder
// TransformerLayers with a padding mask (post-LN as the original, pre-LN as an option); the
// masked-language-model head (dense, GELU, LayerNorm, the decoder tied to the word embedding
// with its own bias) over the masked positions only, and the next-sentence head (pooler: dense
// and tanh over [CLS], then two classes). The loss is the MLM mean over masked tokens plus the
// NSP mean over sequences, as Hugging Face's BertForPreTraining. Written once on the
// TransformerEngine-style modules, it runs in the layouts GPT does (ModelLayout: pipeline
// stages, tensor and sequence parallelism) through the same trainer, flags and checkpoints.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/model.h"
#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/safetensors.h"
#include "octet/trainable_model.h"

namespace octet {

struct BertConfig {
  std::string name = "bert";
  // The whole vocabulary: the tokenizer's ids, then the four special tokens at its end
  // ([PAD], [CLS], [SEP], [MASK]).
  int64_t vocab_size = 30522;
  int64_t max_seq_len = 512;
  int64_t type_vocab_size = 2;
  int64_t num_layers = 12;
  int64_t hidden = 768;
  int64_t num_heads = 12;
  int64_t ffn_hidden = 0;  // 0 = 4 * hidden
  std::string activation = "gelu_erf";
  // true: the original post-LN layers (LayerNorm after each residual add, the embeddings'
  // LayerNorm); false: pre-LN layers (Megatron's BERT) and a final LayerNorm, no
  // embedding LayerNorm.
  bool post_layernorm = true;
  float layernorm_eps = 1e-12f;
  float dropout = 0.0f;
  float init_std = 0.02f;

  // A JSON object with "model": "bert"; unknown keys and out-of-range values are errors.
  static BertConfig from_json(const nlohmann::json& json);
  static BertConfig load(const std::string& path);
  nlohmann::json to_json() const;
  int64_t ffn() const { return ffn_hidden ? ffn_hidden : 4 * hidden; }
  // The special tokens: the last four ids.
  int64_t text_vocab() const { return vocab_size - 4; }  // ids below it are text
  int64_t pad_id() const { return vocab_size - 4; }
  int64_t cls_id() const { return vocab_size - 3; }
  int64_t sep_id() const { return vocab_size - 2; }
  int64_t mask_id() const { return vocab_size - 1; }
  int64_t num_parameters() const;
  // Training FLOPs per token at sequence length T: 6 x the encoder's GEMM parameters plus
  // attention's 12 x layers x T x hidden, plus the MLM head over 15% of the tokens.
  double train_flops_per_token(int64_t seq_len) const;
};

// A BERT pretraining micro-batch: {"ids": [B,T] I32 (masked input: [CLS] A [SEP] B [SEP],
// then [PAD]s), "token_types": [B,T] I32 (0: [CLS], A and its [SEP]; 1: B and its [SEP]; 0:
// padding), "lengths": [B] I32 (tokens before the padding, in [1, T]), "targets": [B,T] I32
// (the original token at the masked positions, -100 elsewhere; at least one per batch),
// "nsp_labels": [B] I32 (0: B follows A in the text, 1: B is a random segment)}.
pipeline::MicroBatch bert_micro_batch(const Tensor& ids, const Tensor& token_types,
                                      const Tensor& lengths, const Tensor& targets,
                                      const Tensor& nsp_labels);

// A BERT, or the part of one that a rank holds (as GPT: chunk c holds the layers of stage
// stage_of_chunk[c]; the embeddings on the first stage, the heads and the loss on the last;
// the word embedding is tied between them). Under tensor parallelism the layers and the word
// embedding (vocabulary rows, with the decoder's bias) are split across the group; the
// position / token-type embeddings, the MLM transform and the NSP head are replicated.
class Bert : public TransformerStack {
 public:
  Bert(const BertConfig& config, uint64_t seed, ModelLayout layout = {},
       bool recompute_activations = false);

  using TransformerStack::evaluate;  // the whole model's train_step and evaluate
  using TransformerStack::train_step;
  // take_eval_counts(): masked tokens predicted correctly (the MLM logits' argmax) and masked
  // tokens seen by evaluation; counted on tensor rank 0 only.
  // The last evaluation's two losses (MLM, NSP) of the last micro-batch evaluated.
  std::pair<float, float> last_losses() const { return last_losses_; }

  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;
    Norm::Context embedding_norm, final_norm, mlm_norm;
    Linear::Context mlm_dense, pooler, nsp;
    Tensor ids, token_types, lengths;  // the micro-batch's
    Tensor mlm_rows;                   // [M] I32: the masked rows of [B*T]
    Tensor mlm_pre_activation;         // [M, C] F32: the transform's dense output
    Tensor pooled;                     // [B, C] F32: tanh of the pooler's output
    Tensor dhidden;  // last stage: the losses' gradient at the last layer's output
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  std::vector<pipeline::TiedParameters> tied_parameters() override;
  std::vector<Parameter*> chunk_parameters(int chunk) override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> parameters_in_backward_order() override;
  // Hugging Face's BertForPreTraining names (post-LN) or MegatronBertForPreTraining's
  // (pre-LN): the fused QKV split into query, key and value.
  TensorMap to_checkpoint_names(const TensorMap& ours) const override;
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override;

  const BertConfig& config() const { return config_; }

  // First and last stage: the word embedding [V, C] (this rank's vocabulary rows under TP).
  Parameter word_embeddings;
  // First stage: positions [max_seq_len, C], token types [type_vocab_size, C].
  Parameter position_embeddings, token_type_embeddings;
  // Last stage: the decoder's bias [V] (this rank's vocabulary entries under TP).
  Parameter mlm_bias;

 private:
  Tensor run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, Context* ctx, float* loss);
  Tensor embed(const Tensor& ids, const Tensor& token_types, DType dtype, Context* ctx);
  void embed_backward(const Tensor& dx, Context& ctx);
  // The last stage's heads (and pre-LN's final norm), in the order backward finishes them.
  std::vector<Parameter*> heads_in_backward_order();
  float heads_loss(const Tensor& h, const pipeline::MicroBatch& batch, DType dtype,
                   float grad_scale, Context* ctx, bool count);

  BertConfig config_;
  VocabRange vocab_;
  std::optional<Norm> embedding_norm_;  // first stage, post-LN
  std::optional<Norm> final_norm_;      // last stage, pre-LN
  std::optional<Linear> mlm_dense_, pooler_, nsp_;
  std::optional<Norm> mlm_norm_;
  TiedOutputCache output_cache_;
  std::pair<float, float> last_losses_{0.0f, 0.0f};
};

}  // namespace octet
