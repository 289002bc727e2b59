// Few rows of BF16 A against a weight stored [N, K] row-major, BF16 or E4M3 codes with one
// scale per output channel (decode's matrix-vector products). There the weight's bytes set
// the time: each weight row is streamed once and serves every row of A.
#pragma once

#include <cstdint>

#include "octet/gemm.h"

namespace octet::gemm_detail {

struct SmallM {
  const uint16_t* a = nullptr;  // [M, K] BF16
  const void* b = nullptr;      // [N, K] BF16, or E4M3 codes with `column_scale`
  bool b_e4m3 = false;
  const float* column_scale = nullptr;  // [N], E4M3 only: each column's sum times it
  // E4M3 only, instead of column_scale: one scale per 128 x 128 block of B, [ceil(N / 128),
  // block_scale_stride = ceil(K / 128)]; each block row of B reads A times its K blocks'
  // scales (scale_by_k_blocks). Only the AVX2 form (run_small_m_avx2) reads it: run_small_m
  // sends such a call there.
  const float* block_scale = nullptr;
  int64_t block_scale_stride = 0;
  int64_t m = 0, n = 0, k = 0;
  void* c = nullptr;  // [M, N] F32 or BF16
  bool c_bf16 = false;
  float alpha = 1.0f, beta = 0.0f;
  const float* bias = nullptr;  // [N] F32 or null
  Activation activation = Activation::None;
};

// out [M, K] = a [M, K] with each 128 K times its scale: scales[k / 128] (F32 products,
// rounded once). The A that one block row of a 128 x 128 block-scaled weight multiplies.
void scale_by_k_blocks(const float* a, int64_t m, int64_t k, const float* scales, float* out);

// Whether the kernel runs on this processor: AVX-512 BF16 (and OCTET_ISA allows AVX-512), or
// AVX2 with FMA and F16C.
bool small_m_supported();
// C = act(alpha * column_scale * A B^T + beta * C + bias), exact products and FP32 sums
// (VDPBF16PS, as oneDNN's BF16 kernels; or both operands widened to F32 and FMA), any M
// (passes of 8 rows).
void run_small_m(const SmallM& p);
// The AVX2 form (gemm/small_m_avx2.cpp), which run_small_m takes without AVX-512 BF16.
void run_small_m_avx2(const SmallM& p);
// Whether run_small_m takes the AVX-512 BF16 kernels (which also read B packed in K pairs).
bool small_m_avx512();

// The same with a BF16 B stored as oneDNN packs a [K, N] weight for its BF16 matmul
// (BA16a{W}b2a): blocks of `width` columns (16, 32, 48 or 64), each [ceil(K / 32) * 16 K pairs]
// [width][2], zero-padded. A block is one sequential stream, and each 64-byte line holds the
// two K values of 16 columns that one VDPBF16PS takes. `p.b` and `p.b_e4m3` are not read.
void run_small_m_pairs(const SmallM& p, const uint16_t* b, int64_t width);  // AVX-512 BF16

}  // namespace octet::gemm_detail
