// LayerNorm and RMSNorm over the last dimension, forward and backward, optionally storing
// the output directly as per-tensor-scaled FP8 for the GEMM that follows.
#pragma once

#include <cstdint>

#include "octet/ops/fp8_store.h"
#include "octet/tensor.h"

namespace octet::ops {

// x [N,C] F32|BF16 (leading dims flattened); gamma [C] F32; beta [C] F32 or null;
// y [N,C] F32|BF16, or undefined when fp8 is given (then only the codes are written);
// mean, rstd [N] F32 (saved for backward).
// y = (x - mean) * rstd * w + beta, w = gamma, or 1 + gamma with zero_centered_gamma.
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                       bool zero_centered_gamma, Tensor& y, Tensor& mean, Tensor& rstd,
                       Fp8Store* fp8 = nullptr);
// dy, x [N,C] F32|BF16; dx [N,C] F32|BF16 (written); dgamma, dbeta [C] F32 (written; dbeta
// may be null).
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& gamma, bool zero_centered_gamma, Tensor& dx, Tensor& dgamma,
                        Tensor* dbeta);

// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). Shapes as for LayerNorm.
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, bool zero_centered_gamma,
                     Tensor& y, Tensor& rstd, Fp8Store* fp8 = nullptr);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      bool zero_centered_gamma, Tensor& dx, Tensor& dgamma);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                       bool zero_centered_gamma, Tensor& y, Tensor& mean, Tensor& rstd,
                       Fp8Store* fp8 = nullptr);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& gamma, bool zero_centered_gamma, Tensor& dx, Tensor& dgamma,
                        Tensor* dbeta);
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, bool zero_centered_gamma,
                     Tensor& y, Tensor& rstd, Fp8Store* fp8 = nullptr);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      bool zero_centered_gamma, Tensor& dx, Tensor& dgamma);
}  // namespace cpu

namespace reference {
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                       bool zero_centered_gamma, Tensor& y, Tensor& mean, Tensor& rstd,
                       Fp8Store* fp8 = nullptr);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& gamma, bool zero_centered_gamma, Tensor& dx, Tensor& dgamma,
                        Tensor* dbeta);
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, bool zero_centered_gamma,
                     Tensor& y, Tensor& rstd, Fp8Store* fp8 = nullptr);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      bool zero_centered_gamma, Tensor& dx, Tensor& dgamma);
}  // namespace reference

}  // namespace octet::ops
