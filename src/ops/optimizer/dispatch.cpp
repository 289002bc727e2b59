// The optimizer operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/optimizer.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

#include <vector>

namespace octet::ops {

namespace {

// Every tensor of every AdamW group (the optional model copy included when defined).
std::vector<Tensor> tensor_list(std::span<AdamWTensor> tensors) {
  std::vector<Tensor> out;
  for (const AdamWTensor& t : tensors) {
    for (const Tensor* part : {&t.param, &t.grad, &t.exp_avg, &t.exp_avg_sq, &t.model}) {
      if (part->defined()) out.push_back(*part);
    }
  }
  return out;
}

}  // namespace

void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper) {
  const profile::Scope scope(profile::Category::Optimizer);
  const Device device = device_of("adamw_step", std::span<const Tensor>(tensor_list(tensors)));
  if (device == Device::CPU) return cpu::adamw_step(tensors, hyper);
  no_kernel("adamw_step", device);
}

double global_grad_norm(std::span<const Tensor> grads) {
  const profile::Scope scope(profile::Category::Optimizer);
  const Device device = device_of("global_grad_norm", grads);
  if (device == Device::CPU) return cpu::global_grad_norm(grads);
  no_kernel("global_grad_norm", device);
}

double clip_grad_norm(std::span<Tensor> grads, double max_norm) {
  const profile::Scope scope(profile::Category::Optimizer);
  const Device device = device_of("clip_grad_norm", grads);
  if (device == Device::CPU) return cpu::clip_grad_norm(grads, max_norm);
  no_kernel("clip_grad_norm", device);
}

}  // namespace octet::ops
