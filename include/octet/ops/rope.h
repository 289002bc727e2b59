// Rotary position embedding (RoPE), forward and backward, applied in place.
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

enum class RopeLayout {
  RotateHalf,   // GPT-NeoX / TransformerEngine default: pairs (x[k], x[k + rotary_dim/2])
  Interleaved,  // GPT-J / Meta: pairs (x[2k], x[2k+1])
};

struct RopeOptions {
  int64_t rotary_dim = 0;       // even, <= D; 0 means D. Channels past it are untouched.
  float theta = 10000.0f;       // base: pair k turns at theta^(-2k / rotary_dim) per position
  int64_t position_offset = 0;  // position of row t is offset + t (KV-cache decoding)
  RopeLayout layout = RopeLayout::RotateHalf;
};

// cos, sin [T, rotary_dim/2] F32 (written): angle(t, k) = (offset + t) * theta^(-2k/rotary_dim),
// computed in double and rounded once.
void rope_tables(int64_t T, int64_t rotary_dim, const RopeOptions& options, Tensor& cos,
                 Tensor& sin);

// x [B,T,H,D] F32|BF16 (q or k; rotated in place, computed in F32). Each pair (a, b) becomes
// (a cos - b sin, b cos + a sin).
void rope_forward(Tensor& x, const RopeOptions& options);
// dx [B,T,H,D] F32|BF16 (in place): the gradient of a rotation is the rotation by -angle.
void rope_backward(Tensor& dx, const RopeOptions& options);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void rope_forward(Tensor& x, const RopeOptions& options);
void rope_backward(Tensor& dx, const RopeOptions& options);
}  // namespace cpu

namespace reference {
void rope_forward(Tensor& x, const RopeOptions& options);
void rope_backward(Tensor& dx, const RopeOptions& options);
}  // namespace reference

}  // namespace octet::ops
