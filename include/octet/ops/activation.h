// Activations with the bias add fused in, and their backward fused with the bias gradient
// and the FP8 cast of the gradient. Gated kinds follow TransformerEngine: the input's last
// dimension holds [a | b] and y = act(a) * b.
#pragma once

#include <string_view>

#include "octet/ops/fp8_store.h"
#include "octet/tensor.h"

namespace octet::ops {

enum class ActivationKind { GeluTanh, GeluErf, Relu, Silu, SwiGlu, GeGlu };
bool is_gated(ActivationKind kind);
std::string_view activation_name(
    ActivationKind kind);  // "gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu"
ActivationKind parse_activation(std::string_view name);

// x [N,F_in] F32|BF16 (pre-activation, before the bias); bias [F_in] F32 or null;
// y [N,F] F32|BF16 with F = F_in, or F_in/2 for gated kinds (may be undefined with fp8).
// y = act(x + bias).
void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8 = nullptr);
// dy [N,F] F32|BF16; x, bias as in forward; dx [N,F_in] F32|BF16 (written); dbias [F_in] F32
// (written, = column sums of dx) or null; fp8 stores dx quantized (the next GEMM's input).
void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8 = nullptr);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8 = nullptr);
void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8 = nullptr);
}  // namespace cpu

namespace reference {
void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8 = nullptr);
void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8 = nullptr);
}  // namespace reference

}  // namespace octet::ops
