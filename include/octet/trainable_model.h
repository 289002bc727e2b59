// What the trainer needs of a model, whatever the layout: the training interface. A model
// implementing it (GPT today, in every layout; BERT, T5, ViT next) trains in every layout
// with the same flags and checkpoints - the trainer never asks which model it runs. Through
// pipeline::StagedModel it also runs as pipeline stages under the executor.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "octet/modules.h"
#include "octet/pipeline_stage.h"
#include "octet/safetensors.h"
#include "octet/tensor_parallel.h"

namespace octet {

// Which part of a model this process holds (every model of octet: GPT, ViT). Under pipeline
// parallelism (Megatron's pre_process / post_process, generalized to several chunks per rank)
// the model is cut into `stages` equal runs of layers, and chunk c of this rank holds stage
// stage_of_chunk[c]. The default, one stage held as chunk 0, is the whole model. Under tensor
// parallelism (a group given) every layer is split across the group (and what else the model
// says).
struct ModelLayout {
  int stages = 1;
  std::vector<int> stage_of_chunk = {0};  // pipeline::stages_of_rank(schedule, rank)
  Communicator* tensor = nullptr;         // the tensor-parallel group; null: none
  // With a group: the residual stream and norms on token shards [B*T/TP, C] (B*T divisible
  // by TP at run time).
  bool sequence_parallel = false;
  // The expert-parallel group (a mixture of experts' layers hold their share of the experts);
  // null: none.
  Communicator* expert = nullptr;
  // The context-parallel group: micro-batches hold this rank's T / CP tokens of each sequence
  // (chunks r and 2CP-1-r, see context_parallel_chunk), positions are the tokens' own, and
  // self-attention spans the whole sequence, exchanged as cp_comm_type says. null: none.
  Communicator* context = nullptr;
  CpCommType cp_comm_type = CpCommType::P2P;
  // Per chunk (indexed like stage_of_chunk), groups of the same ranks that replace `expert` /
  // `context` for that chunk's layers: DualPipe's overlapped F&B pairs run two chunks at once
  // on two threads, whose exchanges must not share a communicator. Empty: `expert` / `context`.
  std::vector<Communicator*> chunk_expert = {}, chunk_context = {};
};

// Context parallelism's share of a micro-batch: every [B, T] tensor of `batch` (ids,
// targets) becomes [B, T / CP] holding chunks r and 2CP-1-r of its 2CP equal chunks (r = the
// group's rank); the batch itself at CP = 1. T not divisible by 2CP, or a tensor of another
// rank, is an error.
pipeline::MicroBatch context_parallel_split(const pipeline::MicroBatch& batch,
                                            const Communicator& group);

class TrainableModel : public pipeline::StagedModel {
 public:
  // One micro-batch through the whole model (one stage held): forward in `dtype` (F32 or
  // BF16; FP8 GEMMs inside fp8_autocast), the loss and backward; gradients accumulate, scaled
  // by grad_scale. Returns the micro-batch's mean loss (equal on every tensor rank).
  virtual float train_step(const pipeline::MicroBatch& batch, DType dtype, float grad_scale) = 0;
  // The micro-batch's mean loss, without gradients.
  virtual float evaluate(const pipeline::MicroBatch& batch, DType dtype) = 0;
  // Classifiers: the correct predictions and the samples that evaluation saw since the last
  // call (each counted by one rank of the model group); {0, 0} for other models.
  virtual std::pair<int64_t, int64_t> take_eval_counts() { return {0, 0}; }

  // Every FP8 state of the part held, and each one's index in the whole model's list: a
  // checkpoint's fp8.{index}. entries name the same GEMM at every layout.
  virtual std::vector<Fp8State*> fp8_states() = 0;
  virtual std::vector<int64_t> fp8_state_indices() = 0;

  // The part's parameters under whole-model names (tensor shards gathered: collective over
  // the tensor group), and loading this part from a whole-model map (other stages' tensors
  // ignored; missing or mismatched ones are errors).
  virtual TensorMap state_dict() = 0;
  virtual void load_state_dict(const TensorMap& tensors) = 0;
  // Names on disk (e.g. Hugging Face's) from state_dict()'s names, and back.
  virtual TensorMap to_checkpoint_names(const TensorMap& ours) const = 0;
  virtual TensorMap from_checkpoint_names(const TensorMap& theirs) const = 0;

  // Tensor parallelism (identities where nothing is split): the whole tensor of p from every
  // rank's `local` (shaped like p.value, e.g. its optimizer state; collective over the tensor
  // group), and this rank's slice of a whole one.
  virtual Tensor gather(const Parameter& p, const Tensor& local) { return local; }
  virtual Tensor shard(const Parameter& p, const Tensor& whole) const { return whole; }
  // The parameters of `candidates` this rank counts in a norm over the model group, so that
  // each model parameter counts once (replicated ones on tensor rank 0 only).
  virtual std::vector<Parameter*> counted_in_norm(const std::vector<Parameter*>& candidates) const {
    return candidates;
  }
  // Replicated parameters applied to token shards: partial gradients under sequence
  // parallelism, summed over the tensor group before the optimizer.
  virtual std::vector<Parameter*> sequence_parallel_parameters() {
    return octet::sequence_parallel_parameters(parameters());
  }

  // Data parallelism while backward runs (whole model only): every parameter in the order
  // backward finalizes their gradients, and a hook that backward calls with each group as it
  // becomes final.
  virtual std::vector<Parameter*> parameters_in_backward_order() = 0;
  using GradReadyHook = std::function<void(const std::vector<Parameter*>&)>;
  virtual void set_grad_ready_hook(GradReadyHook hook) = 0;
  // Optional: the token embedding's backward hands its rows (table, ids [N] I32, rows [N,C]
  // F32) to the hook instead of adding them into table.grad, so the table's gradient is final
  // at the start of backward. Returns false where the model does not support it.
  using EmbeddingGradHook =
      std::function<void(Parameter& table, const Tensor& ids, const Tensor& rows)>;
  virtual bool set_embedding_grad_hook(EmbeddingGradHook hook) { return false; }
  // The mixture-of-experts layers of the part held, chunks in stage order, each with its layer's
  // index in the whole model (none in a dense model): after each optimizer step the trainer
  // sums each layer's load over every rank holding a copy of it (data-parallel replicas,
  // DualPipe's two directions), moves its expert bias and reports the balance.
  struct MoELayerRef {
    int64_t layer = 0;
    MoELayer* moe = nullptr;
  };
  virtual std::vector<MoELayerRef> moe_layers() { return {}; }
};

// What octet's models share (Megatron's TransformerBlock with pre_process / post_process): a
// stack of num_layers TransformerLayers cut into a ModelLayout's equal pipeline stages (chunk c
// holds the layers of stage stage_of_chunk[c]) and split over its tensor group. It answers the
// layout's part of the training interface - chunks and stages, tensor-shard gathering and
// slicing, FP8 states and their whole-model indices, state dicts under whole-model names - so
// that a model (GPT, ViT) adds its embeddings, its head and its loss.
class TransformerStack : public TrainableModel {
 public:
  int chunks() const override { return static_cast<int>(layout_.stage_of_chunk.size()); }
  int stages() const override { return layout_.stages; }
  int stage_of_chunk(int chunk) const override {
    return layout_.stage_of_chunk.at(static_cast<size_t>(chunk));
  }
  const ModelLayout& layout() const { return layout_; }
  bool holds_first_stage() const { return has_first_; }
  bool holds_last_stage() const { return has_last_; }
  // The layers of the whole model (one stage held), or of one chunk.
  std::vector<TransformerLayer>& layers();
  std::vector<TransformerLayer>& layers(int chunk) {
    return layers_.at(static_cast<size_t>(chunk));
  }

  // One micro-batch through the whole model (one stage held) by the pipeline interface:
  // forward of chunk 0 in a fresh context, then its backward; and the loss alone.
  float train_step(const pipeline::MicroBatch& batch, DType dtype, float grad_scale) override;
  float evaluate(const pipeline::MicroBatch& batch, DType dtype) override;
  using pipeline::StagedModel::evaluate;  // a chunk's
  // The classifier's eval_correct_ / eval_seen_ since the last call.
  std::pair<int64_t, int64_t> take_eval_counts() override;

  void set_grad_ready_hook(GradReadyHook hook) override { grad_ready_hook_ = std::move(hook); }
  // Tensor parallelism: whole tensors from shards and back, and each element counted once in
  // a norm over the model group (identities without a group).
  Tensor gather(const Parameter& p, const Tensor& local) override;
  Tensor shard(const Parameter& p, const Tensor& whole) const override;
  std::vector<Parameter*> counted_in_norm(const std::vector<Parameter*>& candidates) const override;
  // Every layer's FP8 states, chunks in stage order, and each one's whole-model index.
  std::vector<Fp8State*> fp8_states() override;
  std::vector<int64_t> fp8_state_indices() override;
  // This rank's parameters under whole-model names (shards gathered), and loading this part
  // from a whole-model map: missing or mismatched tensors are errors, and so are extra ones
  // when the whole model is held. Mixture-of-experts layers with an expert bias add it as
  // NAME.router.expert_bias (a buffer, not a parameter).
  TensorMap state_dict() override;
  void load_state_dict(const TensorMap& tensors) override;
  void on_parameters_updated() override;  // the layers' weight caches
  std::vector<MoELayerRef> moe_layers() override;
  // Megatron's --first-last-layers-bf16: the first `first` and last `last` transformer layers
  // of the whole model run outside fp8_autocast / fp4_autocast (in the step's dtype), forward,
  // backward and recomputation alike, as the published NVFP4 recipe keeps them.
  void set_high_precision_layers(int64_t first, int64_t last);
  bool is_high_precision_layer(int64_t layer) const;

 protected:
  // who: the model's name in errors ("gpt"); layer(i): the options of layer i (global index)
  // of the whole model, so that every layout builds the same parameters.
  TransformerStack(std::string who, int64_t num_layers, ModelLayout layout,
                   const std::function<TransformerLayerOptions(int64_t)>& layer);
  bool is_first(int chunk) const { return stage_of_chunk(chunk) == 0; }
  bool is_last(int chunk) const { return stage_of_chunk(chunk) == layout_.stages - 1; }
  bool sequence_parallel() const { return layout_.tensor && layout_.sequence_parallel; }
  // An error unless this rank holds the whole model (one stage).
  void check_whole(const char* what) const;
  int64_t global_layer(int chunk, size_t i) const;  // layer i of the chunk, in the whole model
  // How many of the chunk's layers come before layer `border` of the whole model (where one
  // stack of a two-stack model ends: T5's encoder, CLIP's vision tower).
  size_t layers_before(int chunk, int64_t border) const;
  void grads_ready(const std::vector<Parameter*>& parameters) const {
    if (grad_ready_hook_) grad_ready_hook_(parameters);
  }
  // A chunk's input from the previous stage, checked: [B,T,C] (or [B*T/TP, C] under sequence
  // parallelism) = `boundary`, in the compute dtype.
  const Tensor& checked_input(int chunk, const Tensor& input, const Shape& boundary,
                              DType dtype) const;
  // The chunk's layers over h ([B,T,C], or this rank's token rows [B*T/TP, C] with seq_len = T
  // under sequence parallelism). With `contexts` each layer's is kept there for backward.
  // lengths [B] I32: each sequence's tokens before its padding (padding-mask layers).
  // loss_scale: the main loss's grad_scale, by which mixture-of-experts layers scale their
  // auxiliary losses' gradients.
  Tensor forward_layers(int chunk, Tensor h, std::vector<TransformerLayer::Context>* contexts,
                        int64_t seq_len, const Tensor* lengths = nullptr, float loss_scale = 1.0f);
  // Backward through the chunk's layers from the last: each context released, each layer's
  // parameters reported to the grad-ready hook as they become final.
  Tensor backward_layers(int chunk, Tensor dx, std::vector<TransformerLayer::Context>& contexts);

  std::string who_;
  int64_t num_layers_ = 0;
  // Evaluation's correct predictions and samples so far (classifiers; take_eval_counts()).
  int64_t eval_correct_ = 0, eval_seen_ = 0;
  ModelLayout layout_;
  bool has_first_ = false, has_last_ = false;
  int64_t high_precision_first_ = 0, high_precision_last_ = 0;
  std::vector<std::vector<TransformerLayer>> layers_;  // [chunk][layer of that stage]
  GradReadyHook grad_ready_hook_;
};

// Each of a part's FP8 states' index in the whole model's list, for models whose layers all
// hold the same number of states: the identity for the whole model (`states` states), and
// for a pipeline part its layers' places in the model of num_layers layers cut into
// part.stages() equal stages (`states` = the part's list size, its chunks in stage order).
std::vector<int64_t> fp8_state_indices(size_t states);
std::vector<int64_t> fp8_state_indices(const pipeline::StagedModel& part, size_t states,
                                       int64_t num_layers);

}  // namespace octet
