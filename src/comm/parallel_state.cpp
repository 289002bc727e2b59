// Megatron's rank layout: tensor-parallel ranks are consecutive, then data, then pipeline.
#include "octet/comm.h"
#include "octet/error.h"

namespace octet {

ParallelState::ParallelState(std::shared_ptr<Communicator> world, int tensor_size,
                             int pipeline_size, int expert_size, int context_size)
    : world_(std::move(world)),
      tensor_size_(tensor_size),
      pipeline_size_(pipeline_size),
      expert_size_(expert_size),
      context_size_(context_size) {
  const int n = world_->size();
  OCTET_CHECK(tensor_size >= 1 && pipeline_size >= 1,
              "--tensor-model-parallel-size and --pipeline-model-parallel-size expected >= 1, "
              "got ",
              tensor_size, " and ", pipeline_size);
  OCTET_CHECK(n % (tensor_size * pipeline_size) == 0, "world size ", n,
              " expected a multiple of tensor-model-parallel-size (", tensor_size,
              ") x pipeline-model-parallel-size (", pipeline_size,
              ") = ", tensor_size * pipeline_size);
  data_size_ = n / (tensor_size * pipeline_size);
  OCTET_CHECK(expert_size >= 1 && data_size_ % expert_size == 0, "--expert-model-parallel-size (",
              expert_size, ") expected >= 1 and to divide the data-parallel size ", data_size_,
              " (world ", n, " / TP ", tensor_size, " / PP ", pipeline_size, ")");
  OCTET_CHECK(context_size >= 1 && data_size_ % context_size == 0, "--context-parallel-size (",
              context_size, ") expected >= 1 and to divide the data-parallel size ", data_size_,
              " (world ", n, " / TP ", tensor_size, " / PP ", pipeline_size, ")");
  const int r = world_->rank();
  tensor_rank_ = r % tensor_size;
  data_rank_ = (r / tensor_size) % data_size_;
  pipeline_rank_ = r / (tensor_size * data_size_);
  // Each split is collective over the world: every rank makes the same calls in order.
  tensor_ = world_->split(data_rank_ + data_size_ * pipeline_rank_, tensor_rank_, "tensor");
  data_ = world_->split(tensor_rank_ + tensor_size * pipeline_rank_, data_rank_, "data");
  pipeline_ = world_->split(tensor_rank_ + tensor_size * data_rank_, pipeline_rank_, "pipeline");
  tensor_and_data_ = world_->split(pipeline_rank_, r, "tensor+data");
  model_ = world_->split(data_rank_, tensor_rank_ + tensor_size * pipeline_rank_, "model");
  const bool holds_embedding = pipeline_rank_ == 0 || pipeline_rank_ == pipeline_size - 1;
  const int model_replica = tensor_rank_ + tensor_size * data_rank_;
  embedding_ = world_->split(holds_embedding ? model_replica : tensor_size * data_size_ + r,
                             pipeline_rank_, "embedding");
  // Expert groups: consecutive data ranks (same tensor and pipeline rank) split the experts;
  // the ranks of equal expert rank across those blocks hold the same experts.
  const int block = data_rank_ / expert_size, slot = data_rank_ % expert_size;
  const int stage_slice = tensor_rank_ + tensor_size * pipeline_rank_;
  expert_ = world_->split(stage_slice + tensor_size * pipeline_size * block, slot, "expert");
  expert_data_ =
      world_->split(stage_slice + tensor_size * pipeline_size * slot, block, "expert-data");
  // Context groups: consecutive data ranks (same tensor and pipeline rank) share each sample.
  const int sample = data_rank_ / context_size;
  context_ = world_->split(stage_slice + tensor_size * pipeline_size * sample,
                           data_rank_ % context_size, "context");
}

ParallelState ParallelState::single() {
  ParallelState state;
  std::shared_ptr<Communicator> self = self_communicator();
  state.world_ = state.tensor_ = state.data_ = state.pipeline_ = self;
  state.tensor_and_data_ = state.model_ = state.embedding_ = state.expert_ = state.expert_data_ =
      state.context_ = self;
  return state;
}

int ParallelState::world_rank_of(int tensor_rank, int data_rank, int pipeline_rank) const {
  OCTET_CHECK(tensor_rank >= 0 && tensor_rank < tensor_size_ && data_rank >= 0 &&
                  data_rank < data_size_ && pipeline_rank >= 0 && pipeline_rank < pipeline_size_,
              "parallel coordinates (tp ", tensor_rank, ", dp ", data_rank, ", pp ", pipeline_rank,
              ") outside TP=", tensor_size_, " x DP=", data_size_, " x PP=", pipeline_size_);
  return tensor_rank + tensor_size_ * (data_rank + data_size_ * pipeline_rank);
}

std::string ParallelState::describe() const {
  return detail::concat(
      "TP=", tensor_size_, " x DP=", data_size_, " x PP=", pipeline_size_, " (rank ", rank(),
      ": tp ", tensor_rank_, ", dp ", data_rank_, ", pp ", pipeline_rank_, ")",
      expert_size_ > 1 ? detail::concat(", EP=", expert_size_, " (ep ", expert_rank(), ")")
                       : std::string(),
      context_size_ > 1 ? detail::concat(", CP=", context_size_, " (cp ", context_rank(), ")")
                        : std::string());
}

}  // namespace octet
