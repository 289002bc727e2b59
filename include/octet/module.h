// A parameter (FP32 master value and gradient, under its checkpoint name) and the Module
// interface every layer and model implements: what optimizers, data parallelism and the
// pipeline need of a module, without the modules themselves; and the deferral of weight-
// gradient GEMMs that zero-bubble pipeline schedules ask of every module.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "octet/tensor.h"

namespace octet {

// How a parameter is split across the tensor-parallel group (Megatron's tensor_model_parallel
// and partition_dim attributes), set by the module that owns it: checkpoints gather the whole
// tensor from the shards and slice it back at any group size, and gradient norms count each
// element once.
struct TensorShard {
  enum class Kind {
    Replicated,  // every rank holds the whole tensor
    Rows,        // dimension 0 split: rank r holds the r-th 1/TP of each block
    Columns,     // dimension 1 split in equal 1/TP parts
  };
  Kind kind = Kind::Replicated;
  Shape whole_shape;  // the whole tensor's shape (not replicated)
  // Rows: dimension 0 is made of these blocks (empty: one block), e.g. a fused [q | k | v].
  std::vector<int64_t> blocks;
  // Rows: split by vocabulary ranges of ceil(V/TP) rows (the last may be shorter) instead.
  bool vocabulary = false;
  // Replicated but applied to token shards under sequence parallelism: each rank's gradient is
  // partial until summed over the group (all_reduce_sequence_parallel_gradients).
  bool sequence_parallel = false;
  // One expert's of a mixture of experts: under expert parallelism only one rank of the expert
  // group holds it (under its global name), and its gradient is reduced over the expert-data
  // group.
  bool expert = false;

  static TensorShard rows(Shape whole, std::vector<int64_t> blocks = {}) {
    TensorShard s;
    s.kind = Kind::Rows;
    s.whole_shape = std::move(whole);
    s.blocks = std::move(blocks);
    return s;
  }
  static TensorShard vocabulary_rows(Shape whole) {
    TensorShard s = rows(std::move(whole));
    s.vocabulary = true;
    return s;
  }
  static TensorShard columns(Shape whole) {
    TensorShard s;
    s.kind = Kind::Columns;
    s.whole_shape = std::move(whole);
    return s;
  }
};

struct Parameter {
  std::string name;
  Tensor value;  // F32 master
  Tensor grad;   // F32, same shape
  TensorShard shard = {};
  // False for a frozen parameter (--freeze): it keeps its value, and a backward whose only use
  // would be its gradient may be skipped (grad then stays as it was).
  bool requires_grad = true;
};

class Module {
 public:
  virtual ~Module() = default;
  virtual void collect_parameters(std::vector<Parameter*>& out) = 0;
  std::vector<Parameter*> parameters();
  void zero_grad();
  // After the optimizer changed parameter values: drop cached BF16 / packed / FP8 copies.
  virtual void on_parameters_updated() {}
};

// Zero-bubble pipeline schedules split a backward into its input-gradient part, run at once
// (its result goes upstream), and its weight-gradient GEMMs, run later to fill bubbles
// (TransformerEngine's delay_wgrad_compute). While a defer_weight_gradients scope is active on
// this thread, Linear::backward queues its weight-gradient GEMM (dy^T x, FP8 or not) into the
// scope's queue instead of running it; run() later accumulates each into weight.grad exactly
// as backward would have. Bias and norm gradients (column sums) are not deferred.
class WeightGradientQueue {
 public:
  void push(std::function<void()> work) { work_.push_back(std::move(work)); }
  void run();  // in queue order, then empty
  bool empty() const { return work_.empty(); }
  size_t size() const { return work_.size(); }

 private:
  std::vector<std::function<void()>> work_;
};

class defer_weight_gradients {
 public:
  explicit defer_weight_gradients(WeightGradientQueue& queue);
  ~defer_weight_gradients();
  defer_weight_gradients(const defer_weight_gradients&) = delete;
  defer_weight_gradients& operator=(const defer_weight_gradients&) = delete;

 private:
  WeightGradientQueue* previous_;
};
// The innermost active scope's queue on this thread, or nullptr.
WeightGradientQueue* deferred_weight_gradients();

// DualPipe's overlapped F&B pair runs one chunk's forward and another's backward on two
// threads; a gradient both add into (a tied table's: the output layer's part in the last
// stage's forward, the embedding's in the first stage's backward) would then be summed in
// whichever order the threads reach it. While a defer_shared_gradients scope is active on this
// thread, such sums are queued instead, and the executor runs the queue after the pair, in the
// order the pair run one after the other makes them: the same bits either way.
class defer_shared_gradients {
 public:
  explicit defer_shared_gradients(WeightGradientQueue& queue);
  ~defer_shared_gradients();
  defer_shared_gradients(const defer_shared_gradients&) = delete;
  defer_shared_gradients& operator=(const defer_shared_gradients&) = delete;

 private:
  WeightGradientQueue* previous_;
};
// The innermost active scope's queue on this thread, or nullptr.
WeightGradientQueue* deferred_shared_gradients();

}  // namespace octet
