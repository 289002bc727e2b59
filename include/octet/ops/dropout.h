// Bias + dropout + residual add, fused (Megatron's bias_dropout_add), with a mask that is
// regenerated from a counter-based RNG in backward instead of being stored.
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

// Element i of the flattened [N,C] tensor is kept when philox_uniform(seed, offset, i) >= p
// (include/octet/rng.h); kept values are scaled by 1 / (1 - p). p in [0, 1).
struct DropoutParams {
  float probability = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;  // advance by ceil(numel / 4) between calls to get fresh masks
};

// x, residual [N,C] F32|BF16; bias [C] F32 or null; out [N,C] F32|BF16.
// out = residual + dropout(x + bias).
void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& dropout, Tensor& out);
// dout [N,C] F32|BF16; dx [N,C] F32|BF16 = dout * mask / (1 - p); dbias [C] F32 = column
// sums of dx (or null). The residual's gradient is dout itself.
void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& dropout, Tensor& dx,
                               Tensor* dbias);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& dropout, Tensor& out);
void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& dropout, Tensor& dx,
                               Tensor* dbias);
}  // namespace cpu

namespace reference {
void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& dropout, Tensor& out);
void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& dropout, Tensor& dx,
                               Tensor* dbias);
}  // namespace reference

}  // namespace octet::ops
