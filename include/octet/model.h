// GPT: token + position embeddings, a stack of pre-norm TransformerLayers, a final norm and
// the output layer tied to the token embedding. Training runs one micro-batch through
// forward, the chunked fused cross-entropy and backward; generation keeps no activations.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/safetensors.h"
#include "octet/tensor_parallel.h"
#include "octet/trainable_model.h"

namespace octet {

struct GPTConfig {
  std::string name = "gpt";
  int64_t vocab_size = 50257;
  int64_t max_seq_len = 256;
  int64_t num_layers = 6;
  int64_t hidden = 384;
  int64_t num_heads = 6;
  int64_t num_gqa_groups = 0;  // kv heads; 0 = num_heads
  int64_t ffn_hidden = 0;      // 0 = 4 * hidden
  std::string activation = "gelu";
  std::string normalization = "layernorm";     // layernorm | rmsnorm
  std::string position_embedding = "learned";  // learned | rope
  float rope_theta = 10000.0f;
  float layernorm_eps = 1e-5f;
  float dropout = 0.0f;
  bool bias = true;
  bool tied_embeddings = true;
  float init_std = 0.02f;
  // Mixture of experts (Megatron-Core's names): num_experts > 0 replaces every layer's MLP by
  // num_experts experts of moe_ffn_hidden (0: ffn()) and a shared expert of
  // moe_shared_expert_ffn_hidden (0: none), each token routed to moe_router_topk experts.
  int64_t num_experts = 0;
  int64_t moe_ffn_hidden = 0;
  int64_t moe_shared_expert_ffn_hidden = 0;
  int64_t moe_router_topk = 2;
  std::string moe_router_score_function = "softmax";  // softmax | sigmoid
  bool moe_router_normalize = false;                  // the k chosen scores divided by their sum
  float moe_router_topk_scaling_factor = 1.0f;
  float moe_aux_loss_coeff = 0.0f;  // switch-style load-balancing loss
  float moe_z_loss_coeff = 0.0f;
  bool moe_router_enable_expert_bias = false;  // DeepSeek-V3's aux-loss-free balancing
  float moe_router_bias_update_rate = 1e-3f;
  // Token dropping: each expert takes at most ceil(tokens * k / E * factor) pairs (0: dropless),
  // those of the highest probabilities ("probs") or the first ("position").
  float moe_expert_capacity_factor = 0.0f;
  std::string moe_token_drop_policy = "probs";

  static GPTConfig from_json(const nlohmann::json& json);  // unknown keys are errors
  static GPTConfig load(const std::string& path);
  void check_moe() const;  // the mixture-of-experts fields (from_json calls it)
  nlohmann::json to_json() const;
  int64_t ffn() const { return ffn_hidden ? ffn_hidden : 4 * hidden; }
  int64_t moe_ffn() const { return moe_ffn_hidden ? moe_ffn_hidden : ffn(); }
  bool moe() const { return num_experts > 0; }
  // Every parameter; and those one token meets (a mixture of experts: k experts of E).
  int64_t num_parameters() const;
  int64_t num_active_parameters() const;
  // Training FLOPs per token: 6 * (non-embedding parameters + output layer) plus attention's
  // 12 * layers * T * hidden (the PaLM appendix B count), T = the sequence length used.
  double train_flops_per_token(int64_t seq_len) const;
};

// The tied output layer's caches, kept across steps: wte in BF16 and packed for the GEMM (both
// rebuilt after a parameter update; without a BF16 GEMM, also those BF16 values in F32 for the
// backward) and the logits workspaces.
struct TiedOutputCache {
  Tensor wte_bf16;
  Tensor wte_bf16_in_f32;
  std::optional<PackedWeight> packed;
  DType packed_dtype = DType::F32;
  Tensor logits, dlogits;
  void invalidate();  // after the parameters changed
};

// Which part of a GPT this process holds: a ModelLayout (trainable_model.h), whose pipeline
// stages are equal runs of layers and whose tensor group splits every layer, the token
// embedding and the tied output layer.
using GPTLayout = ModelLayout;

// A GPT, or the part of one that a rank holds: chunk c holds layers [s*L/stages,
// (s+1)*L/stages) of stage s = stage_of_chunk[c], plus the embeddings (wte, wpe) when s is the
// first stage and the final norm + tied output layer (wte again) + loss when s is the last.
// Every parameter is named and initialized exactly as in the whole model, so a stage's
// parameters equal the single-process model's. A rank holding the first stage and another
// holding the last each keep a copy of wte (a tied group: the pipeline executor sums their
// gradients). The whole-model calls (train_step, evaluate) need one stage.
//
// With a tensor-parallel group (Megatron's GPTModel with TP) the layers are TransformerLayers
// given the group; wte holds this rank's vocabulary rows (vocab_range), so the embedding is a
// vocabulary-parallel lookup summed over the group and the loss a vocabulary-parallel
// cross-entropy that never gathers the logits. state_dict() gathers whole-model tensors and
// load_state_dict() takes this rank's slices (TensorShard), so checkpoints load at any layout.
// Activations between stages are [B,T,C], or this rank's token rows [B*T/TP, C] under
// sequence parallelism. No dropout under TP yet; KV-cache inference runs without it.
class GPT : public TransformerStack {
 public:
  // recompute_activations: each layer keeps only its input and recomputes in backward.
  GPT(const GPTConfig& config, uint64_t seed, bool recompute_activations = false);
  GPT(const GPTConfig& config, uint64_t seed, GPTLayout layout, bool recompute_activations = false);

  // One micro-batch: ids, targets [B,T] I32 (targets may hold -100 to ignore). Runs forward
  // in `dtype` (F32 or BF16; FP8 GEMMs when called inside fp8_autocast), the fused
  // cross-entropy, and backward, accumulating gradients scaled by grad_scale (1 / number of
  // micro-batches for accumulation). Returns the micro-batch's mean loss.
  float train_step(const Tensor& ids, const Tensor& targets, DType dtype, float grad_scale);
  // Mean loss without gradients.
  float evaluate(const Tensor& ids, const Tensor& targets, DType dtype);
  // The same on micro-batches of gpt_micro_batch() (the training interface).
  float train_step(const pipeline::MicroBatch& batch, DType dtype, float grad_scale) override;
  float evaluate(const pipeline::MicroBatch& batch, DType dtype) override;
  // Logits of the last position of each sequence: ids [B,T] -> [B,V] F32.
  Tensor last_logits(const Tensor& ids, DType dtype);
  // KV-cache inference (no dropout, no contexts kept): ids [B,T] I32 are the T new tokens of
  // each sequence, at positions [offset, offset + T) after the params.sequence_len_offset
  // already cached (learned position embeddings and RoPE both start at offset). Returns the
  // logits of the last new position [B,V] F32 and advances the offset by T. offset + T must
  // fit in max_seq_len and in the cache. A prefill is the prompt at offset 0; each decode
  // step is one token.
  Tensor forward_inference(const Tensor& ids, InferenceParams& params, DType dtype);
  // A cache for max_batch_size sequences of up to max_seq_len tokens.
  InferenceParams make_inference_params(int64_t max_batch_size = 1) const;
  // Paged KV-cache inference (the engine's step): ids [1, N] I32 pack the new tokens of the
  // sequences of params.batch (InferenceParams::paged), each at its own positions. Returns the
  // logits of each sequence's last new token [S, V] F32. The caller advances the lengths.
  Tensor forward_paged(const Tensor& ids, InferenceParams& params, DType dtype);
  // A paged cache of num_blocks blocks of block_size tokens.
  InferenceParams make_paged_inference_params(int64_t num_blocks, int64_t block_size) const;
  // KV-cache bytes per token (keys and values of every layer) in dtype (E4M3: codes + scales).
  size_t kv_bytes_per_token(DType dtype) const;
  // Inference with weight-only FP8 (E4M3, one scale per output channel or per 128 x 128 block:
  // gemm.h's Fp8WeightScaling): every layer's GEMM weights and the tied output layer quantized
  // once from the current weights and read as bytes by the decode GEMMs
  // (Linear::set_inference_fp8_weight). Training is refused while on; off frees them. Returns
  // the bytes of the FP8 weights (codes and scales).
  size_t set_inference_fp8_weights(bool on,
                                   Fp8WeightScaling scaling = Fp8WeightScaling::PerChannel);
  bool inference_fp8_weights() const { return wte_fp8_.has_value(); }
  // The scaling of the FP8 weights when on.
  Fp8WeightScaling inference_fp8_scaling() const {
    return wte_fp8_ ? wte_fp8_->scaling : Fp8WeightScaling::PerChannel;
  }
  // Bytes of the weights the inference GEMMs read per token in `dtype` (FP8 when on).
  size_t inference_weight_bytes(DType dtype);

  // The pipeline interface. Micro-batches of gpt_micro_batch(); activations [B,T,C] in the
  // compute dtype.
  struct Context : StagedModel::Context {
    std::vector<TransformerLayer::Context> layers;
    Norm::Context final_norm;
    Tensor ids;      // [B,T] I32: the micro-batch's shape; the embedding backward's rows
    Tensor doutput;  // last stage: gradient at the final norm's output [B*T,C], from the loss
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  // wte, held by the first stage (the token embedding) and the last (the output layer).
  std::vector<pipeline::TiedParameters> tied_parameters() override;
  std::vector<Parameter*> chunk_parameters(int chunk) override;

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  // Backward calls the grad-ready hook with the parameters whose gradients became final for
  // the micro-batch: the final norm, each layer from the last, then the embeddings. Data
  // parallelism starts reducing them while backward continues.
  // With this hook, the token embedding's backward hands its rows to the hook (rows[n]
  // belongs to row ids[n] of wte; ids [N] I32, rows [N,C] F32) instead of adding them into
  // wte.grad. wte's gradient is then final right after the output layer, at the start of
  // backward, and reported ready there: its large reduction overlaps the whole backward.
  bool set_embedding_grad_hook(EmbeddingGradHook hook) override;  // not under TP: false
  // Every parameter, in the order the hooks report them (both hooks set).
  std::vector<Parameter*> parameters_in_backward_order() override;
  // --tp-comm-overlap: every column GEMM's sequence-parallel all-gather overlapped with the
  // GEMM of this rank's own rows.
  void set_tp_comm_overlap(bool on);
  // This rank's rows of the vocabulary (all of it without a group).
  VocabRange vocab() const { return vocab_; }
  const GPTConfig& config() const { return config_; }
  // Checkpoints hold Hugging Face GPT-2 names (to_hf_gpt2_names).
  TensorMap to_checkpoint_names(const TensorMap& ours) const override;
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override;

  // [V,C] (this rank's vocab() rows under TP) where the first or the last stage is held, else
  // undefined.
  Parameter wte;
  Parameter wpe;  // [max_seq_len, C] on the first stage (learned positions only)

 private:
  void check_inference(const char* what) const;  // the whole model, no tensor group
  void check_micro_batch(const Tensor& ids, DType dtype) const;
  // ids [B,T] -> token + position embeddings [B*T(/TP), C] F32, and their backward from dx.
  Tensor embed(const Tensor& ids);
  void embed_backward(const Tensor& ids, const Tensor& dx);
  void accumulate_embedding_grad(const Tensor& ids, const Tensor& dx);
  // Learned positions over rows first_row.. of [B*T] (a context-parallel rank's chunks at
  // their own positions): x += wpe rows; wpe.grad += dx rows.
  void add_positions(Tensor& x, int64_t T, int64_t first_row) const;
  void positions_backward(const Tensor& dx, int64_t T, int64_t first_row);
  // The tied output layer + loss over hidden [B*T(/TP), C]; dhidden shaped like hidden.
  float output_loss(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                    Tensor* dhidden);
  // forward (ctx given: kept for backward, the loss's gradient computed) or evaluate.
  Tensor run_forward(int chunk, const Tensor& input, const Tensor& ids, const Tensor& targets,
                     DType dtype, float grad_scale, Context* ctx, float* loss);
  PackedWeight& wte_packed_as(DType dtype);  // for the output GEMM
  // Final norm then the tied output layer: hidden [B,C] -> logits [B,V] F32.
  Tensor logits_of_last(const Tensor& hidden);
  EmbeddingGradHook embedding_grad_hook_;

  GPTConfig config_;
  VocabRange vocab_;
  std::optional<Norm> final_norm_;  // last stage only
  TiedOutputCache output_cache_;
  // The tied table's gradient takes the output layer's part (in the last stage's forward) and
  // the embedding's (in the first stage's backward): DualPipe's overlapped F&B may run those
  // two stages on two threads at once, so each holds this lock while it accumulates.
  std::shared_ptr<std::mutex> tied_grad_mutex_ = std::make_shared<std::mutex>();
  std::optional<Fp8WeightOnly> wte_fp8_;  // set_inference_fp8_weights
};

// A GPT micro-batch for the pipeline executor: {"ids": ids, "targets": targets}, each [B,T]
// I32 (targets may hold -100 to ignore); and one per pair.
pipeline::MicroBatch gpt_micro_batch(const Tensor& ids, const Tensor& targets);
std::vector<pipeline::MicroBatch> gpt_micro_batches(const std::vector<Tensor>& ids,
                                                    const std::vector<Tensor>& targets);

// Checkpoint names: a state_dict() renamed to Hugging Face GPT-2's names where the layer
// matches (transformer.h.{i}.ln_1 / attn.c_attn / attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj,
// linear weights transposed to GPT-2's Conv1D [in, out]); other names pass unchanged.
TensorMap to_hf_gpt2_names(const TensorMap& ours);
TensorMap from_hf_gpt2_names(const TensorMap& theirs);

}  // namespace octet
