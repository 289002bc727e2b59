// What the trainer needs of a model, whatever the layout: the training interface. A model
// implementing it (GPT today, in every layout; BERT, T5, ViT next) trains in every layout
// with the same flags and checkpoints - the trainer never asks which model it runs. Through
// pipeline::StagedModel it also runs as pipeline stages under the executor.
#pragma once

#include <cstdint>
#include <functional>
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
};

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
};

}  // namespace octet
