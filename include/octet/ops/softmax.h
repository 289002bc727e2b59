// Scaled masked softmax over the last dimension of attention scores, forward and backward
// (TransformerEngine's scaled_softmax, scaled_masked_softmax and
// scaled_upper_triang_masked_softmax in one entry point).
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

enum class SoftmaxMaskKind {
  None,
  // Key j is masked for query i when j > i + (Tk - Tq): the upper triangle, aligned to the
  // bottom-right corner when Tq != Tk (the last query sees every key), as in TE and
  // flash-attn. With Tq > Tk the first Tq - Tk rows are fully masked.
  Causal,
  Padding,    // key j masked for batch b when j >= key_lengths[b]
  Arbitrary,  // key j masked for (b, i) when mask[b, 0, i, j] != 0
};

struct SoftmaxMask {
  SoftmaxMaskKind kind = SoftmaxMaskKind::None;
  const Tensor* key_lengths = nullptr;  // Padding: [B] I32, each in [0, Tk]
  const Tensor* mask = nullptr;         // Arbitrary: [B,1,Tq,Tk] or [1,1,Tq,Tk] U8, 1 = masked
};

// x, y [B,H,Tq,Tk] F32|BF16 (y may be x, for in place).
// y = softmax(scale * x + mask) over Tk, computed in F32; masked entries are 0 and a fully
// masked row is all zeros (not NaN).
void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y);
// y, dy, dx [B,H,Tq,Tk] F32|BF16 (dx may be dy). dx = scale * y * (dy - sum(dy * y)):
// masked entries have y = 0, so the mask is not needed again.
void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y);
void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx);
}  // namespace cpu

namespace reference {
void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y);
void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx);
}  // namespace reference

}  // namespace octet::ops
