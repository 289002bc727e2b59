// GPT split across a tensor-parallel group (Megatron's GPTModel with TP > 1): a
// vocabulary-parallel token embedding and tied output layer, TensorParallelSelfAttention and
// TensorParallelLayerNormMLP layers, and a vocabulary-parallel cross-entropy that never
// gathers the logits. Optional sequence parallelism keeps the residual stream, the norms and
// the position embedding on token shards [B*T/TP, C]. With pipeline parallelism as well
// (TP x PP) it holds only its pipeline rank's stages, cut as GPT(config, seed, GPTLayout) cuts
// them, and the pipeline executor runs it chunk by chunk; the activations crossing a stage boundary
// are [B*T, C] (each tensor rank sends its copy to the same tensor rank of the next stage) or,
// under sequence parallelism, this rank's token shard [B*T/TP, C].
//
// The vocabulary V is split in contiguous row ranges of ceil(V/TP) rows (the last range is
// shorter when TP does not divide V): no padding rows, so the softmax runs over exactly V
// logits and the loss equals the single-process GPT's.
//
// Parameters are the shards of GPT(config, seed)'s, under the same names; state_dict()
// gathers them into GPT's whole-model tensors and load_state_dict() takes this rank's slices
// of them, so checkpoints load at any layout.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "octet/model.h"
#include "octet/tensor_parallel.h"

namespace octet {

// The rows [begin, end) of a V-row vocabulary that rank `rank` of `size` holds.
struct VocabRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
VocabRange vocab_range(int64_t vocab, int rank, int size);

// Vocabulary-parallel embedding. ids [N] I32 (whole vocabulary), table [range.size(), C] F32
// -> partial rows [N, C] F32: table[id - begin] where this rank owns id, zeros elsewhere (the
// sum over the group is the embedding).
Tensor vocab_parallel_embedding_forward(const Tensor& ids, const Tensor& table, VocabRange range);
// table_grad [range.size(), C] += dx [N, C] F32 rows of the owned ids.
void vocab_parallel_embedding_backward(const Tensor& ids, const Tensor& dx, Tensor& table_grad,
                                       VocabRange range);

// Vocabulary-parallel cross-entropy over the group (collective). logits [N, range.size()]
// F32: this rank's columns of the whole [N, V]; targets [N] I32 (whole-vocabulary ids, -100
// ignored). Writes losses [N] F32 (the same on every rank; 0 for ignored rows). With
// `backward`, overwrites logits with grad_scale x (softmax - onehot) of this rank's columns.
void vocab_parallel_cross_entropy(Tensor& logits, const Tensor& targets, VocabRange range,
                                  Tensor& losses, bool backward, float grad_scale,
                                  Communicator& tp);

// How a parameter is split across the tensor group.
struct ShardSpec {
  enum class Kind { Replicated, Rows, Columns };
  Kind kind = Kind::Replicated;
  Shape full_shape;
  // Rows: the whole dimension 0 is made of these blocks, rank r holding the r-th 1/TP of
  // each (empty: one block). Columns: dimension 1 in equal 1/TP parts.
  std::vector<int64_t> blocks;
  bool vocabulary = false;  // Rows by vocab_range (uneven) instead of blocks
};

class TensorParallelGPT : public TrainableModel {
 public:
  // Needs no dropout, learned positions (no RoPE), heads divisible by TP, num_layers divisible
  // by `stages`; with sequence_parallel, B*T divisible by TP at run time. Clear errors
  // otherwise. stages = 1, stage_of_chunk = {0}: the whole model; otherwise chunk c holds
  // pipeline stage stage_of_chunk[c] of `stages` (pipeline::stages_of_rank).
  // recompute_activations: each layer keeps only its input; backward recomputes its forward
  // (collectives included, as Megatron's full recomputation does) with the FP8 scales frozen.
  TensorParallelGPT(const GPTConfig& config, uint64_t seed, bool sequence_parallel,
                    Communicator& tp, int stages = 1, std::vector<int> stage_of_chunk = {0},
                    bool recompute_activations = false);

  // One micro-batch as GPT::train_step (the whole model only): ids, targets [B,T] I32, dtype
  // F32|BF16. Gradients accumulate (scaled by grad_scale); under sequence parallelism the
  // replicated parameters' gradients are partial until all_reduce_sequence_parallel_gradients.
  // Returns the micro-batch's mean loss (equal on every rank).
  float train_step(const Tensor& ids, const Tensor& targets, DType dtype, float grad_scale);
  float evaluate(const Tensor& ids, const Tensor& targets, DType dtype);
  // The same on micro-batches of gpt_micro_batch() (the training interface).
  float train_step(const pipeline::MicroBatch& batch, DType dtype, float grad_scale) override;
  float evaluate(const pipeline::MicroBatch& batch, DType dtype) override;

  // One TransformerLayer's contexts; under recomputation only its input until backward.
  struct LayerContext {
    TensorParallelSelfAttention::Context attention;
    TensorParallelLayerNormMLP::Context mlp;
    Tensor input;  // [B*T(/TP), C]: kept for recomputation
    int64_t batch = 0, seq_len = 0;
    std::optional<recipe::Recipe> fp8_recipe;  // the forward's, replayed with frozen scales
    // Each Linear's forward FP8 meta as the forward left it (its scales, its amaxes): the
    // recomputation quantizes with these, not with scales a later micro-batch's forward
    // (pipeline schedules) has moved on to, and records nothing into the live histories.
    std::vector<FP8Meta> fp8_forward_metas;
    bool recompute = false;
  };
  // The pipeline interface (collective over the tensor group, like everything here).
  struct Context : StagedModel::Context {
    std::vector<LayerContext> layers;
    Norm::Context final_norm;
    Tensor ids;      // [B,T] I32
    Tensor doutput;  // last stage: gradient at the final norm's output, from the loss
  };
  std::unique_ptr<StagedModel::Context> make_context() const override;
  // Micro-batches of gpt_micro_batch().
  Tensor forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                 float grad_scale, StagedModel::Context& ctx) override;
  Tensor backward(int chunk, const Tensor& doutput, StagedModel::Context& ctx) override;
  Tensor evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                  float* loss) override;
  int chunks() const override { return static_cast<int>(stage_of_chunk_.size()); }
  int stages() const override { return stages_; }
  int stage_of_chunk(int chunk) const override {
    return stage_of_chunk_.at(static_cast<size_t>(chunk));
  }
  // [B*T, C], or [B*T/TP, C] under sequence parallelism.
  Shape activation_shape(const pipeline::MicroBatch& batch) const override;
  // wte's vocabulary shard, held by the first stage (the token embedding) and the last (the
  // output layer).
  std::vector<pipeline::TiedParameters> tied_parameters() override;
  std::vector<Parameter*> chunk_parameters(int chunk) override;
  bool holds_first_stage() const { return has_first_; }
  bool holds_last_stage() const { return has_last_; }

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  // The whole model's backward (train_step) calls the hook with the parameters whose
  // gradients became final for the micro-batch: the final norm, each layer from the last, then
  // the embeddings (wpe, this rank's wte rows). Data parallelism starts reducing them while
  // backward continues (sequence-parallel ones are still partial: sum them over the tensor
  // ranks first). Not called through the pipeline interface (the executor reports chunks).
  void set_grad_ready_hook(GradReadyHook hook) override { grad_ready_hook_ = std::move(hook); }
  // --tp-comm-overlap: every column GEMM's sequence-parallel all-gather overlapped with the
  // GEMM of the local rows (Linear::set_overlap_gather).
  void set_tp_comm_overlap(bool on);
  // Every parameter, in the order the hook reports them.
  std::vector<Parameter*> parameters_in_backward_order() override;
  // Replicated parameters applied to token shards: partial gradients under SP (else empty).
  std::vector<Parameter*> sequence_parallel_parameters() override;
  // Every FP8 state (per layer: QKV, projection, FC1, FC2), in fp8_states(GPT&)'s order, so
  // the checkpoint entries fp8.{i}. name the same GEMMs in every layout. Delayed scaling needs
  // their amaxes reduced (max) over tensor x data ranks after each micro-batch: a shard's amax
  // is a part of the whole tensor's (reduce_fp8_amax).
  std::vector<Fp8State*> fp8_states() override;
  std::vector<int64_t> fp8_state_indices() override;
  // sqrt of the sum of squared gradients over `counted` (this rank's share of the model:
  // parameters(), or a pipeline executor's owned_parameters()): sharded parameters counted on
  // every tensor rank, replicated ones on tensor rank 0, summed over `model_group` (tensor x
  // pipeline; collective).
  double grad_norm(Communicator& model_group, const std::vector<Parameter*>& counted);
  // The parameters of `candidates` this rank counts in such a norm: sharded ones, and the
  // replicated ones on tensor rank 0 only (the distributed optimizer's GradNormScope).
  std::vector<Parameter*> counted_in_norm(const std::vector<Parameter*>& candidates) const override;

  // GPT's whole-model tensors of the stages held (collective over the tensor group).
  TensorMap state_dict() override;
  // This rank's slices of a whole-model map (GPT names); missing / mismatched are errors,
  // and so are extra tensors when the whole model is held (other stages' are ignored).
  void load_state_dict(const TensorMap& tensors) override;
  // Checkpoints hold Hugging Face GPT-2 names (to_hf_gpt2_names).
  TensorMap to_checkpoint_names(const TensorMap& ours) const override;
  TensorMap from_checkpoint_names(const TensorMap& theirs) const override;
  // The whole tensor of parameter p from every rank's `local` (shaped like p.value; e.g. its
  // optimizer state): collective. And this rank's slice of a whole tensor.
  Tensor gather(const Parameter& p, const Tensor& local) override;
  Tensor shard(const Parameter& p, const Tensor& full) const override;
  const ShardSpec& spec(const Parameter& p) const;

  const GPTConfig& config() const { return config_; }
  VocabRange vocab() const { return vocab_; }
  bool sequence_parallel() const { return sequence_parallel_; }

  // [vocab().size(), C]: whole-vocabulary rows vocab().begin ..; where the first or the last
  // stage is held, else undefined.
  Parameter wte;
  Parameter wpe;  // [max_seq_len, C], replicated; on the first stage

 private:
  // One TransformerLayer: x + attention(x), then h + mlp(h).
  struct Layer {
    TensorParallelSelfAttention attention;
    TensorParallelLayerNormMLP mlp;
  };
  using Stack = std::vector<std::unique_ptr<Layer>>;
  bool is_first(int chunk) const { return stage_of_chunk(chunk) == 0; }
  bool is_last(int chunk) const { return stage_of_chunk(chunk) == stages_ - 1; }
  void check_micro_batch(const Tensor& ids, DType dtype) const;
  Shape boundary_shape(int64_t batch, int64_t seq_len) const;
  // forward (ctx given: kept for backward, the loss's gradient computed) or evaluate.
  Tensor run_forward(int chunk, const Tensor& input, const Tensor& ids, const Tensor& targets,
                     DType dtype, float grad_scale, Context* ctx, float* loss);
  // ids [B,T] -> token + position embeddings [B*T(/TP), C] F32, and their backward from dx.
  Tensor embed(const Tensor& ids);
  void embed_backward(const Tensor& ids, const Tensor& dx);
  // A chunk's layers over h [B*T(/TP), C]; keeps contexts when given.
  Tensor layers_forward(int chunk, Tensor h, int64_t B, int64_t T,
                        std::vector<LayerContext>* contexts);
  Tensor layers_backward(int chunk, Tensor d, std::vector<LayerContext>& contexts);
  // One layer: x + attention(x), then h + mlp(h).
  Tensor layer_forward(Layer& layer, const Tensor& x, int64_t B, int64_t T, LayerContext& ctx);
  static std::vector<Linear*> linears(Layer& layer);  // QKV, projection, FC1, FC2
  // The tied output layer + loss over hidden [N(/TP), C]; dhidden shaped like hidden.
  float output_loss(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                    Tensor* dhidden);
  void register_specs();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> segments(const ShardSpec& spec) const;

  GPTConfig config_;
  bool sequence_parallel_;
  bool recompute_activations_ = false;
  Communicator* tp_;
  VocabRange vocab_;
  int stages_ = 1;
  std::vector<int> stage_of_chunk_;
  bool has_first_ = false, has_last_ = false;
  std::vector<Stack> layers_;       // [chunk][layer of that stage]
  std::optional<Norm> final_norm_;  // last stage only
  TiedOutputCache output_cache_;
  std::map<std::string, ShardSpec> specs_;
  GradReadyHook grad_ready_hook_;
  bool reporting_grads_ = false;  // inside train_step: backward calls grad_ready_hook_
};

}  // namespace octet
