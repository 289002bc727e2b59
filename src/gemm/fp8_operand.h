// An FP8 GEMM operand: the usage of a Float8Tensor (rowwise data or its columnwise
// transpose) that carries scaling blocks along K, and its exact widening to BF16 or F32.
#pragma once

#include <cstdint>
#include <string_view>

#include "octet/fp8.h"

namespace octet::gemm_detail {

// One stored orientation of a Float8Tensor: codes [rows, cols] row-major plus its scales.
struct Fp8Matrix {
  const uint8_t* codes = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DType format = DType::E4M3;
  ScalingMode mode = ScalingMode::PerTensor;
  int block_rows = 0;
  int block_cols = 0;
  const Tensor* scale_inv = nullptr;
};

// The matrix a GEMM reads for an operand; `transposed` says it holds op(X)^T.
// For A, op(A) = A_eff [M,K]; for B, op(B) = [K,N] and the preferred matrix is B_eff [N,K].
struct Fp8Operand {
  Fp8Matrix matrix;
  bool transposed = false;
};

// A (stored [M,K], or [K,M] with trans_a) as a GEMM A operand with blocks along K.
// Throws when only the usage without K-blocks exists and the mode cannot use it
// (1xN blocks and MXFP8).
Fp8Operand select_a_operand(const Float8Tensor& a, bool trans_a, std::string_view what);
// B (stored [K,N], or [N,K] with trans_b) as a GEMM B operand with blocks along K.
Fp8Operand select_b_operand(const Float8Tensor& b, bool trans_b, std::string_view what);

// True when every block scale is a power of two whose product with every FP8 value stays a
// normal BF16 number, so widening with the scale folded in is exact.
bool bf16_foldable(const Fp8Matrix& matrix);
// The per-tensor scale_inv (applied as the GEMM's output scale), 1 for block modes.
float tensor_scale_inv(const Fp8Matrix& matrix);
// out [rows, cols] in `dtype`: BF16 = codes with power-of-two block scales folded in (needs
// bf16_foldable); F32 = codes times block scales rounded once. Per-tensor scales are left out.
void widen(const Fp8Matrix& matrix, DType dtype, void* out);

}  // namespace octet::gemm_detail
