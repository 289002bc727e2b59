// FP4 GEMM by exact widening to BF16 (include/octet/gemm.h).
#include "octet/error.h"
#include "octet/gemm.h"
#include "octet/profile.h"

namespace octet {
namespace {

// op(X)'s blocks lie along K: stored [., K] (any blocks), or transposed with square blocks.
void check_blocks_along_k(const Float4Tensor& x, bool k_is_cols, const char* name) {
  OCTET_CHECK(k_is_cols || x.block_rows == x.block_cols, "gemm (fp4): ", name,
              " expected its scaling blocks along K: ", x.block_rows, "x", x.block_cols,
              " blocks need it ", name[0] == 'A' ? "without trans_a" : "with trans_b",
              " (or 16x16 blocks)");
}

}  // namespace

void gemm(const Float4Tensor& A, const Float4Tensor& B, Tensor& C, bool trans_a, bool trans_b,
          float alpha, float beta, const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  check_blocks_along_k(A, !trans_a, "A");
  check_blocks_along_k(B, trans_b, "B");
  gemm(A.widen_bf16(), B.widen_bf16(), C, trans_a, trans_b,
       alpha * A.global_scale_inv * B.global_scale_inv, beta, epilogue);
}

}  // namespace octet
