// Boundary checks shared by the GEMM entry points; messages name the symbolic shape.
#pragma once

#include <string_view>

#include "octet/gemm.h"

namespace octet::gemm_detail {

struct GemmShape {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
};

// op(A) from a stored [rows, cols] (transposed when trans_a).
void check_matrix(const Tensor& x, std::string_view what);
// B stored [b_rows, b_cols] must be [K,N] (or [N,K] with trans_b); returns N.
int64_t check_b_dims(int64_t b_rows, int64_t b_cols, int64_t k, bool trans_b,
                     std::string_view what);
// C [M,N] (its leading dimensions may be flattened into M) and its dtype.
void check_c(const Tensor& c, int64_t m, int64_t n, std::initializer_list<DType> allowed,
             std::string_view operands);
void check_epilogue(const Epilogue& epilogue, int64_t n);
// C = act(beta * C + bias): the whole GEMM when K = 0.
void apply_epilogue_only(Tensor& c, int64_t m, int64_t n, float beta, const Epilogue& epilogue);

}  // namespace octet::gemm_detail
