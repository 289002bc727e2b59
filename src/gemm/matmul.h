// The oneDNN matmul behind every CPU GEMM: one engine and stream, primitives cached by shape,
// dtypes and epilogue; the B operand either plain (strided, so transposes cost no copy) or
// packed once by a PackedWeight in the layout the primitive prefers.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "octet/gemm.h"

namespace octet::gemm_detail {

struct PackedWeightState;

dnnl::engine& cpu_engine();
dnnl::stream& cpu_stream();
dnnl::memory::data_type dnnl_type(DType dtype);
// A logical [rows, cols] matrix; `transposed` means it is stored as [cols, rows] row-major.
dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, DType dtype, bool transposed);

// C[M,N] = act(output_scale * op(A) op(B) + beta * C + bias), FP32 accumulation.
// op(A) is [M,K] (stored [K,M] with trans_a); op(B) is [K,N] (stored [N,K] with trans_b).
struct MatmulArgs {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  DType a_dtype = DType::F32;
  DType b_dtype = DType::F32;
  DType c_dtype = DType::F32;
  bool trans_a = false;
  bool trans_b = false;
  const void* a = nullptr;
  const void* b = nullptr;              // plain B; null when `packed` is given
  PackedWeightState* packed = nullptr;  // B packed in b_dtype (trans_b is then ignored)
  void* c = nullptr;
  float output_scale = 1.0f;
  float beta = 0.0f;
  const Tensor* bias = nullptr;  // [N], F32 or BF16
  Activation activation = Activation::None;
};
void run_matmul(const MatmulArgs& args);
// Few rows of BF16 A against a BF16 B stored [N, K], or packed by a PackedWeight in K pairs
// (up to 8 and 16 rows by default, OCTET_GEMM_SMALL_M rows when set), on AVX-512 BF16: runs the
// weight-streaming kernels (gemm/small_m.h) and returns true; else false.
bool run_small_m_bf16(const MatmulArgs& args);

// Number of distinct primitives created so far (tests check the cache is used).
size_t matmul_cache_size();
// The oneDNN implementation of this thread's last matmul ("brg:avx512_core", "gemm:jit", ...;
// empty before any): tests check that no epilogue sends a GEMM to oneDNN's reference matmul
// ("ref:any").
std::string last_matmul_kernel();
// Whether that matmul took alpha as oneDNN's runtime output scale (true: folded into gemm:jit's
// alpha) rather than as a binary_mul post-op (brgemm's preference).
bool last_matmul_scale_in_output_scale();

}  // namespace octet::gemm_detail
