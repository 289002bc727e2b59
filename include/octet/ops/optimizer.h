// Fused multi-tensor AdamW (torch.optim.AdamW semantics) and global gradient-norm clipping
// (torch.nn.utils.clip_grad_norm_), over lists of tensors in one parallel pass.
#pragma once

#include <cstdint>
#include <span>

#include "octet/tensor.h"

namespace octet {

// AdamW's options, for the optimizers that train (AdamW) and data parallelism's sharded one
// (DistributedOptimizer) alike.
struct AdamWOptions {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied to matrices only, not to biases and norm weights
  float clip_grad = 1.0f;     // global-norm clipping; 0 disables it
};

}  // namespace octet

namespace octet::ops {

// One parameter tensor and its optimizer state. Tensors are handles: the kernel writes
// through them. All have the same number of elements (shapes may differ, e.g. [V,C] vs [V*C]).
struct AdamWTensor {
  Tensor param;       // F32 master weights, updated in place
  Tensor grad;        // F32|BF16, read
  Tensor exp_avg;     // F32 first moment, updated in place
  Tensor exp_avg_sq;  // F32 second moment, updated in place
  // Optional model copy, written in the same pass from the updated param: BF16 (rounded to
  // nearest even), or E4M3|E5M2 codes = fp8(param * model_scale), saturating.
  Tensor model;
  float model_scale = 1.0f;
  float weight_decay = 0.0f;  // decoupled: param *= 1 - lr * weight_decay
  float model_amax = 0.0f;    // written for an FP8 model copy: max |param| (NaN if any is NaN)
};

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  int64_t step = 1;  // 1 on the first update; bias correction uses beta^step
};

// For each tensor, in torch's order of operations (FP32):
//   param *= 1 - lr*wd;  m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g;
//   param -= lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps)
void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper);

// sqrt(sum of g^2 over every element of every tensor), accumulated in FP64 in a fixed order
// (the same bits whatever the thread count). grads F32|BF16. NaN / Inf propagate.
double global_grad_norm(std::span<const Tensor> grads);

// torch.nn.utils.clip_grad_norm_: norm = global_grad_norm(grads); when
// max_norm / (norm + 1e-6) < 1 (or is NaN), every grad is scaled by it in place.
// Returns the norm before clipping.
double clip_grad_norm(std::span<Tensor> grads, double max_norm);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper);
double global_grad_norm(std::span<const Tensor> grads);
double clip_grad_norm(std::span<Tensor> grads, double max_norm);
}  // namespace cpu

namespace reference {
void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper);
double global_grad_norm(std::span<const Tensor> grads);
double clip_grad_norm(std::span<Tensor> grads, double max_norm);
}  // namespace reference

}  // namespace octet::ops
