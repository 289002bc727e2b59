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

struct Parameter {
  std::string name;
  Tensor value;  // F32 master
  Tensor grad;   // F32, same shape
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

}  // namespace octet
