// AdamW over a module's parameters: FP32 masters are the parameter values themselves;
// the update runs as one fused multi-tensor pass (src/ops/optimizer).
#include <cmath>

#include "octet/ops/elementwise.h"
#include "octet/ops/optimizer.h"
#include "octet/train.h"

namespace octet {

AdamW::AdamW(std::vector<Parameter*> parameters, const AdamWOptions& options)
    : parameters_(std::move(parameters)), options_(options) {
  for (Parameter* p : parameters_) {
    exp_avg_.push_back(Tensor::zeros(p->value.shape(), DType::F32));
    exp_avg_sq_.push_back(Tensor::zeros(p->value.shape(), DType::F32));
  }
}

double AdamW::step(float lr) {
  std::vector<Tensor> grads;
  for (Parameter* p : parameters_) grads.push_back(p->grad);
  // The norm first: a non-finite one skips the step with the gradients as they are (so the
  // caller can find the offending one; torch's clipping would scale them all by NaN).
  const double norm = ops::global_grad_norm(grads);
  if (!std::isfinite(norm)) return norm;  // skip: one bad batch must not poison the weights
  const double coefficient = options_.clip_grad / (norm + 1e-6);
  if (options_.clip_grad > 0 && coefficient < 1.0) {
    ops::scale(grads, static_cast<float>(coefficient));  // clip_grad_norm's scaling, as torch
  }
  ++steps_;
  std::vector<ops::AdamWTensor> tensors;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    ops::AdamWTensor t;
    t.param = parameters_[i]->value;
    t.grad = parameters_[i]->grad;
    t.exp_avg = exp_avg_[i];
    t.exp_avg_sq = exp_avg_sq_[i];
    // Megatron / GPT-2 practice: no decay on biases and norm weights (vectors).
    t.weight_decay = parameters_[i]->value.ndim() >= 2 ? options_.weight_decay : 0.0f;
    tensors.push_back(t);
  }
  ops::AdamWHyper hyper{lr, options_.beta1, options_.beta2, options_.eps, steps_};
  ops::adamw_step(tensors, hyper);
  return norm;
}

TensorMap AdamW::state() const {
  TensorMap out;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    out[parameters_[i]->name + ".exp_avg"] = exp_avg_[i];
    out[parameters_[i]->name + ".exp_avg_sq"] = exp_avg_sq_[i];
  }
  return out;
}

void AdamW::load_state(const TensorMap& state, int64_t steps) {
  for (size_t i = 0; i < parameters_.size(); ++i) {
    for (auto [suffix, target] : {std::pair<const char*, Tensor*>{".exp_avg", &exp_avg_[i]},
                                  {".exp_avg_sq", &exp_avg_sq_[i]}}) {
      std::string name = parameters_[i]->name + suffix;
      auto it = state.find(name);
      OCTET_CHECK(it != state.end(), "optimizer state: missing tensor '", name, "'");
      check_shape(it->second, target->shape(), "optimizer state: " + name);
      check_dtype(it->second, DType::F32, "optimizer state: " + name);
      target->copy_from(it->second);
    }
  }
  steps_ = steps;
}

}  // namespace octet
