// Flash attention's tile products in BF16 pairs: VDPBF16PS multiplies two BF16 pairs per
// lane and adds both products to an F32 lane, twice the multiply-adds of an F32 FMA per
// instruction, and on processors that issue it as fast as the FMA (`octet info`: the BF16
// dot's flop rate) twice the tile throughput. Products of BF16 values are exact in F32 and
// accumulate in F32; what is rounded is the operand that was F32: P (before P V) and dS (before
// dS K and dS^T Q), to BF16, as FlashAttention does on GPUs.
//
// Operands are laid out in pairs along the reduced dimension: A's pair (r, k) is one 32-bit
// word (two BF16), broadcast to every lane; B's row k holds 16 * NV such pairs, lane n of
// vector v the pair of output column 16 v + n. The functions carry OCTET_TARGET_AVX512_BF16;
// the tile-level ones are plain calls (the kernels calling them are written once for every
// instruction set, and a function cannot inline one compiled for more features than its own).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "ops/simd.h"

#define OCTET_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace octet::ops::bf16dot {

// C[R, 16 NV] (+)= sum over k < K2 of A's pair (r, k) . B's pairs (k, column): A's pair at
// A[r * a_row + k * a_col], B's row k at B + k * ldb (BF16 elements).
template <int R, int NV>
OCTET_TARGET_AVX512_BF16 OCTET_ALWAYS_INLINE void block(int64_t K2, const uint32_t* A,
                                                        int64_t a_row, int64_t a_col,
                                                        const uint16_t* B, int64_t ldb, float* C,
                                                        int64_t ldc, bool accumulate) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NV; ++n) {
      acc[r][n] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * n) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[NV];
    for (int n = 0; n < NV; ++n) {
      b[n] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(B + k * ldb + 32 * n));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh a =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(A[r * a_row + k * a_col])));
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], a, b[n]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NV; ++n) _mm512_storeu_ps(C + r * ldc + 16 * n, acc[r][n]);
  }
}

// C[M, N] (+)= A . B over K2 pairs, N a multiple of 16: blocks of 4 rows by 4 vectors, then
// the leftover rows and vectors one at a time (as vec::gemm).
OCTET_TARGET_AVX512_BF16 inline void gemm(int64_t M, int64_t N, int64_t K2, const uint32_t* A,
                                          int64_t a_row, int64_t a_col, const uint16_t* B,
                                          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int R = 4, NV = 4;
  int64_t n0 = 0;
  for (; n0 + 16 * NV <= N; n0 += 16 * NV) {
    int64_t m0 = 0;
    for (; m0 + R <= M; m0 += R) {
      block<R, NV>(K2, A + m0 * a_row, a_row, a_col, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc,
                   accumulate);
    }
    for (; m0 < M; ++m0) {
      block<1, NV>(K2, A + m0 * a_row, a_row, a_col, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc,
                   accumulate);
    }
  }
  for (; n0 < N; n0 += 16) {
    int64_t m0 = 0;
    for (; m0 + R <= M; m0 += R) {
      block<R, 1>(K2, A + m0 * a_row, a_row, a_col, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc,
                  accumulate);
    }
    for (; m0 < M; ++m0) {
      block<1, 1>(K2, A + m0 * a_row, a_row, a_col, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc,
                  accumulate);
    }
  }
}

// The word permutation that takes [x 16 | y 16] to pairs (x0, y0, x1, y1, ...).
OCTET_TARGET_AVX512_BF16 OCTET_ALWAYS_INLINE __m512i pair_order() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                          6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// dst[0, n) := src[0, n) rounded to BF16 (nearest even), n a multiple of 32.
OCTET_TARGET_AVX512_BF16 inline void round_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t c = 0; c < n; c += 32) {
    const __m512bh pair =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16), _mm512_loadu_ps(src + c));
    _mm512_storeu_si512(dst + c, reinterpret_cast<__m512i>(pair));
  }
}

// dst[c][2] := (src0[c], src1[c]) rounded to BF16 for c < n, n a multiple of 16: two rows
// interleaved into pairs (B's layout when the reduced dimension is the rows).
OCTET_TARGET_AVX512_BF16 inline void interleave_rows(const float* src0, const float* src1,
                                                     uint16_t* dst, int64_t n) {
  // cvtne2ps gives [src1 16 | src0 16]; this permutation interleaves them as pairs.
  const __m512i order = pair_order();
  for (int64_t c = 0; c < n; c += 16) {
    const __m512i both = reinterpret_cast<__m512i>(
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src1 + c), _mm512_loadu_ps(src0 + c)));
    _mm512_storeu_si512(dst + 2 * c, _mm512_permutexvar_epi16(order, both));
  }
}

// dst [rows/2, dp, 2] := rows l and l + 1 of src (row l at src + l * stride, D elements) as
// pairs, for l < rows; rows from L on and elements from D on as zeros.
OCTET_TARGET_AVX512_BF16 inline void interleave_bf16_rows(const uint16_t* src, int64_t stride,
                                                          int64_t L, int64_t rows, int64_t D,
                                                          int64_t dp, uint16_t* dst) {
  // Element 2i of the result is the first row's i (index i), 2i + 1 the second's (32 + i).
  const __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                         8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t l = 0; l < rows; l += 2) {
    const __mmask32 first = l < L ? ~__mmask32{0} : 0, second = l + 1 < L ? ~__mmask32{0} : 0;
    for (int64_t d = 0; d < dp; d += 16) {
      const int64_t left = std::clamp<int64_t>(D - d, 0, 16);
      const __mmask32 mask = static_cast<__mmask32>((uint32_t{1} << left) - 1);
      // A masked-off row is never read, so its address may lie past the input.
      const __m512i a = _mm512_maskz_loadu_epi16(mask & first, src + l * stride + d);
      const __m512i b = _mm512_maskz_loadu_epi16(mask & second, src + (l + 1) * stride + d);
      _mm512_storeu_si512(dst + l * dp + 2 * d, _mm512_permutex2var_epi16(a, order, b));
    }
  }
}

// dst[j * dst_stride + r] := src[r * src_stride + j] for r < 16, j < out_rows (<= 16): a
// 16 x 16 transpose of 32-bit words, rows from `rows` on and columns from `cols` on read as
// zeros.
OCTET_TARGET_AVX512_BF16 inline void transpose_words_16x16(const uint32_t* src, int64_t src_stride,
                                                           int64_t rows, int64_t cols,
                                                           uint32_t* dst, int64_t dst_stride,
                                                           int64_t out_rows) {
  const __mmask16 col_mask = static_cast<__mmask16>((uint32_t{1} << cols) - 1);
  // The zero-masking forms with every lane selected: GCC 12's plain forms pass an undefined
  // vector that its -Wuninitialized reports.
  const __mmask16 kAll16 = 0xffff;
  const __mmask8 kAll8 = 0xff;
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = i < rows ? _mm512_maskz_loadu_epi32(col_mask, src + i * src_stride)
                    : _mm512_setzero_si512();
  }
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of words
    t[i] = _mm512_maskz_unpacklo_epi32(kAll16, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_epi32(kAll16, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks
    r[i] = _mm512_maskz_unpacklo_epi64(kAll8, t[i], t[i + 2]);
    r[i + 1] = _mm512_maskz_unpackhi_epi64(kAll8, t[i], t[i + 2]);
    r[i + 2] = _mm512_maskz_unpacklo_epi64(kAll8, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_maskz_unpackhi_epi64(kAll8, t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i + 4 | i + 8, i + 12
    t[i] = _mm512_maskz_shuffle_i32x4(kAll16, r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_maskz_shuffle_i32x4(kAll16, r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_maskz_shuffle_i32x4(kAll16, r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_maskz_shuffle_i32x4(kAll16, r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_maskz_shuffle_i32x4(kAll16, t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_maskz_shuffle_i32x4(kAll16, t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_maskz_shuffle_i32x4(kAll16, t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_maskz_shuffle_i32x4(kAll16, t[i + 4], t[i + 12], 0xdd);
  }
  for (int j = 0; j < out_rows; ++j) _mm512_storeu_si512(dst + j * dst_stride, r[j]);  // column j
}

}  // namespace octet::ops::bf16dot
