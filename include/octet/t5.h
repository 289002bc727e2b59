// T5 v1.1 (Raffel et al. 2020; the v1.1 checkpoints' recipe): an encoder-decoder Transformer
// with one shared token embedding, relative position biases (log-spaced buckets, one table per
// stack in its first layer, shared by the stack's layers), RMSNorm without bias, no biases in
// any linear layer, unscaled attention scores, a gated-GELU feed-forward (GEGLU), decoder
// layers with cross-attention over the encoder's output and an untied output layer. Pretrained
// on span corruption: 15% of the tokens in spans of mean length 3, each span replaced by a
// sentinel in the input and spelled out after its sentinel in the target.
#pragma once

#include <cstdint>
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
#include "octet/tensor.h"
#include "octet/trainable_model.h"

namespace octet {

struct T5Config {
  std::string name = "t5";
  // The whole vocabulary: the tokenizer's ids, then [PAD] (also the decoder's start token),
  // [EOS], and num_sentinels sentinels <extra_id_0> .. (sentinel k = vocab_size - 1 - k, as
  // T5's).
  int64_t vocab_size = 32128;
  int64_t num_sentinels = 100;
  int64_t max_seq_len = 512;       // encoder inputs
  int64_t max_target_len = 128;    // decoder inputs and targets
  int64_t num_layers = 8;          // encoder layers
  int64_t num_decoder_layers = 0;  // 0 = num_layers
  int64_t hidden = 512;            // d_model
  int64_t num_heads = 6;
  int64_t kv_channels = 64;   // d_kv: per head
  int64_t ffn_hidden = 1024;  // d_ff (each of the two GEGLU halves)
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  float layernorm_eps = 1e-6f;
  float dropout = 0.0f;
  float init_std = 1.0f;  // the token embedding's; projections use fan-in scaling, as T5's

  static T5Config from_json(const nlohmann::json& json);
  static T5Config load(const std::string& path);
  nlohmann::json to_json() const;
  int64_t decoder_layers() const { return num_decoder_layers ? num_decoder_layers : num_layers; }
  int64_t text_vocab() const { return vocab_size - 2 - num_sentinels; }  // ids below it are text
  int64_t pad_id() const { return vocab_size - 2 - num_sentinels; }
  int64_t eos_id() const { return vocab_size - 1 - num_sentinels; }
  int64_t sentinel_id(int64_t k) const { return vocab_size - 1 - k; }
  int64_t num_parameters() const;
  // Training FLOPs per input token with enc_len input tokens per dec_len target tokens: 6 x
  // the GEMMs' parameters each token meets (the encoder's layers per input token, the decoder's
  // and the output layer per target token) plus attention's 12 x layers x length x d_kv x H.
  double train_flops_per_token(int64_t enc_len, int64_t dec_len) const;
};

// A T5 span-corruption micro-batch: {"enc_ids": [B,S] I32 (the corrupted text, each noise span
// replaced by its sentinel, then [EOS], then [PAD]s), "enc_lengths": [B] I32 (tokens before
// the padding), "dec_ids": [B,T] I32 ([PAD] as the start token, then the targets shifted right
// by one), "dec_lengths": [B] I32, "targets": [B,T] I32 (sentinel 0, span 0's tokens, sentinel
// 1, ..., [EOS]; -100 on padding)}.
pipeline::MicroBatch t5_micro_batch(const Tensor& enc_ids, const Tensor& enc_lengths,
                                    const Tensor& dec_ids, const Tensor& dec_lengths,
                                    const Tensor& targets);

// T5's relative position bucket of key position j for query position i (relative position
// j - i): half the buckets for each direction when bidirectional (the encoder), exact for
// distances below num_buckets / 4 (/ 2 causal), then log-spaced up to max_distance.
int64_t t5_relative_position_bucket(int64_t relative_position, bool bidirectional,
                                    int64_t num_buckets, int64_t max_distance);

// A T5 in every layout: one process, data parallelism, tensor parallelism with or without
// sequence parallelism, pipeline stages, and their products. The layer stack holds the
// encoder's layers then the decoder's (TransformerStack's layers 0 .. L_enc-1 and
// L_enc .. L_enc+L_dec-1), cut into equal pipeline stages across that border as any other
// stack. Under TP the heads of every attention (self and cross) and the FFN columns are split
// as Megatron splits them, the shared embedding and the output layer by vocabulary rows
// (vocab-parallel cross-entropy), and the relative position biases are whole on every rank
// (each rank's heads give part of their gradients, summed over the group).
//
// Under PP (Megatron's encoder-decoder pipeline, which sends the encoder's output along with
// the decoder's hidden states): the first stage embeds both the encoder's and the decoder's
// tokens, so the shared embedding lives there alone; every stage boundary carries both streams
// as one activation, the encoder's rows then the decoder's (activation_shape()). The encoder's
// stream is its hidden state up to the stage holding the first decoder layer, which applies the
// encoder's final norm; from there on it is the normed encoder output that every decoder layer
// attends to, and its gradient sums the decoder layers' on the way back. Each stack's relative
// bias table is held by every stage with layers of that stack: tied copies, summed after each
// step (tied_parameters()).
class T5 : public TransformerStack {
 public:
  T5(const T5Config& config, uint64_t seed, ModelLayout layout = {},
     bool recompute_activations = false);

  using TransformerStack::evaluate;  // the whole model's train_step and evaluate
  using TransformerStack::train_step;
  // take_eval_counts(): target tokens predicted correctly (argmax) and target tokens seen by
  // evaluation.

  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;  // the chunk's encoder, then decoder layers
    Norm::Context encoder_norm, decoder_norm;
    Tensor enc_ids, dec_ids, enc_lengths, dec_lengths;
    Tensor enc_buckets, dec_buckets;  // [S,S], [T,T] I32: each score's bucket
    // The encoder's normed output (chunks with decoder layers): [B,S,C], or this rank's rows
    // under SP.
    Tensor enc_out;
    Tensor dhidden;  // the loss's gradient at the decoder's final norm output
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  // The relative bias tables' copies: each stack's on the stages holding its layers.
  std::vector<pipeline::TiedParameters> tied_parameters() override;
  std::vector<Parameter*> chunk_parameters(int chunk) override;
  // Encoder and decoder layers hold different numbers of FP8 states (cross-attention's).
  std::vector<int64_t> fp8_state_indices() override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> parameters_in_backward_order() override;
  // Hugging Face's T5ForConditionalGeneration (v1.1) names: q, k, v split from the fused
  // projections, the gated FFN's wi_0 / wi_1 from FC1.
  TensorMap to_checkpoint_names(const TensorMap& ours) const override;
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override;

  const T5Config& config() const { return config_; }

  // Each defined where this rank holds a stage that uses it: shared on the first stage,
  // a bias table with its stack's layers, lm_head on the last.
  Parameter shared;                 // [V, C] (this rank's rows under TP): both token embeddings
  Parameter encoder_relative_bias;  // [buckets, H]
  Parameter decoder_relative_bias;  // [buckets, H]
  Parameter lm_head;                // [V, C] (this rank's rows under TP)

 private:
  // A chunk's layers: `encoder` of them encoder layers, then decoder layers; `norm` when it
  // holds the first decoder layer (the encoder's final norm runs there).
  struct ChunkLayers {
    size_t encoder = 0;
    bool decoder = false, norm = false;
  };
  ChunkLayers chunk_layers(int chunk) const;
  Tensor run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, Context* ctx, float* loss, bool count);
  // Both streams as one boundary activation [rows, C] (the encoder's rows first), and back.
  Tensor pack(const Tensor& encoder, const Tensor& decoder) const;
  std::pair<Tensor, Tensor> unpack(const Tensor& packed, int64_t B, int64_t S, int64_t T) const;

  // ids [B,L] -> their embeddings in dtype: [B,L,C], or this rank's token rows under SP.
  Tensor embed(const Tensor& ids, DType dtype);
  // The gradient at those embeddings -> shared.grad.
  void embed_backward(const Tensor& ids, const Tensor& dx);

  T5Config config_;
  VocabRange vocab_;
  std::optional<Norm> encoder_norm_, decoder_norm_;  // where a held stage runs them
  TiedOutputCache output_cache_;
};

}  // namespace octet
