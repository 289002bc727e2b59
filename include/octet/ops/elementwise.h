// Elementwise updates the modules and the trainer apply to parameters, gradients and
// activations: a scaled add, an in-place scale, a bias added to every row and a bias gradient
// (column sums). Memory-bound: one pass, vectorized per instruction set.
#pragma once

#include <span>

#include "octet/tensor.h"

namespace octet::ops {

// out += alpha * x, elementwise. x F32|BF16 and out F32 of the same number of elements.
void add_scaled(const Tensor& x, float alpha, Tensor& out);

// Every tensor (F32) *= factor, in place (e.g. gradient clipping by a norm computed across
// ranks).
void scale(std::span<Tensor> tensors, float factor);

// y [N, C] F32|BF16 += bias [C] F32 on every row, in place (BF16: the sum in F32, rounded once
// to nearest even).
void add_bias(Tensor& y, const Tensor& bias);

// out [C] F32 += the column sums of x [N, C] F32|BF16 (a bias's gradient), each column's rows
// added in row order in F32: the same bits whatever the thread count.
void add_column_sums(const Tensor& x, Tensor& out);

// The CPU kernels: OpenMP over rows or blocks, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void add_scaled(const Tensor& x, float alpha, Tensor& out);
void scale(std::span<Tensor> tensors, float factor);
void add_bias(Tensor& y, const Tensor& bias);
void add_column_sums(const Tensor& x, Tensor& out);
}  // namespace cpu

namespace reference {
void add_scaled(const Tensor& x, float alpha, Tensor& out);
void scale(std::span<Tensor> tensors, float factor);
void add_bias(Tensor& y, const Tensor& bias);
void add_column_sums(const Tensor& x, Tensor& out);
}  // namespace reference

}  // namespace octet::ops
