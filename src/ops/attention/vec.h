// Vector helpers for the softmax and attention kernels: GCC vector types of W floats
// (W = 16 under AVX-512, 8 under AVX2, 4 on the baseline), a vector exp2, and the small
// register-blocked matrix product the flash-attention tiles are made of.
//
// The bodies are written once, for any W; the per-ISA wrappers (OCTET_TARGET_* in
// ops/simd.h) instantiate them with their native width, so one source gives zmm, ymm and xmm
// code. Kernels choose their wrapper with active_isa().
#pragma once

// Vectors wider than the baseline's are returned by always-inline helpers only, never across
// a call boundary, so the ABI note GCC prints for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <cstdint>
#include <cstring>
#include <utility>

#include "ops/simd.h"

namespace octet::ops::vec {

template <int W>
struct Types {
  typedef float F __attribute__((vector_size(sizeof(float) * W)));
  typedef int32_t I __attribute__((vector_size(sizeof(int32_t) * W)));
};

template <int W>
using F = typename Types<W>::F;

template <int W>
OCTET_ALWAYS_INLINE F<W> load(const float* p) {
  F<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
OCTET_ALWAYS_INLINE void store(float* p, F<W> v) {
  std::memcpy(p, &v, sizeof v);
}
template <int W>
OCTET_ALWAYS_INLINE F<W> splat(float x) {
  return F<W>{} + x;
}
template <int W>
OCTET_ALWAYS_INLINE float reduce_max(F<W> v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
template <int W>
OCTET_ALWAYS_INLINE float reduce_sum(F<W> v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// Every lane := the max (or sum) over all lanes of v, by log2(W) butterfly steps (lane i meets
// lane i ^ step): a few permutes instead of a scalar loop, and the result is already splat.
// __builtin_shufflevector (GCC 12 and clang) takes the lane indices as constants.
template <int Step, int W, size_t... Lane>
OCTET_ALWAYS_INLINE F<W> butterfly(F<W> v, std::index_sequence<Lane...>) {
  return __builtin_shufflevector(v, v, static_cast<int>(Lane ^ Step)...);
}
template <int W, int Step = W / 2>
OCTET_ALWAYS_INLINE F<W> all_max(F<W> v) {
  if constexpr (Step == 0) {
    return v;
  } else {
    const F<W> other = butterfly<Step, W>(v, std::make_index_sequence<W>{});
    return all_max<W, Step / 2>(other > v ? other : v);
  }
}
template <int W, int Step = W / 2>
OCTET_ALWAYS_INLINE F<W> all_sum(F<W> v) {
  if constexpr (Step == 0) {
    return v;
  } else {
    return all_sum<W, Step / 2>(v + butterfly<Step, W>(v, std::make_index_sequence<W>{}));
  }
}

// 2^x to about 2e-7 relative error (Cephes exp2f polynomial on [-0.5, 0.5]); exactly 0 below
// -126 (so -inf, a masked score, gives 0); NaN stays NaN.
template <int W>
OCTET_ALWAYS_INLINE F<W> exp2(F<W> x) {
  using I = typename Types<W>::I;
  const I underflow = x < -126.0f;
  x = x > 127.0f ? splat<W>(127.0f) : x;
  x = x < -126.0f ? splat<W>(-126.0f) : x;
  const F<W> magic = splat<W>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const F<W> n = (x + magic) - magic;
  const F<W> f = x - n;
  F<W> p = splat<W>(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F<W> scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const F<W> result = p * scale;
  return underflow ? splat<W>(0.0f) : result;
}

// C[R, W*NV] (+)= A[R, K] * B[K, W*NV]: R*NV accumulators stay in registers over K. A's
// element (r, k) is at A[r * a_row + k * a_col]: a row-major A (a_col = 1), or the transpose of
// a row-major [K, R] one (a_row = 1), so backward's dV += P^T dO and dK += dS^T Q read P and dS
// where they were computed, with no transposed copy.
template <int W, int R, int NV>
OCTET_ALWAYS_INLINE void gemm_block(int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                    const float* B, int64_t ldb, float* C, int64_t ldc,
                                    bool accumulate) {
  F<W> acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NV; ++n) acc[r][n] = accumulate ? load<W>(C + r * ldc + W * n) : F<W>{};
  }
  for (int64_t k = 0; k < K; ++k) {
    F<W> b[NV];
    for (int n = 0; n < NV; ++n) b[n] = load<W>(B + k * ldb + W * n);
    for (int r = 0; r < R; ++r) {
      const F<W> a = splat<W>(A[r * a_row + k * a_col]);
      for (int n = 0; n < NV; ++n) acc[r][n] += a * b[n];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NV; ++n) store<W>(C + r * ldc + W * n, acc[r][n]);
  }
}

// C[M,N] (+)= op(A) * B[K,N], row-major with leading dimensions; N a multiple of W; op(A) is
// A [M, K] or, with TransA, A^T for A stored [K, M]. Blocks of R rows by NV vectors, then the
// leftover rows and vectors one at a time.
template <int W, int R, int NV, bool TransA = false>
OCTET_ALWAYS_INLINE void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                              const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t a_row = TransA ? 1 : lda, a_col = TransA ? lda : 1;
  int64_t n0 = 0;
  for (; n0 + W * NV <= N; n0 += W * NV) {
    int64_t m0 = 0;
    for (; m0 + R <= M; m0 += R) {
      gemm_block<W, R, NV>(K, A + m0 * a_row, a_row, a_col, B + n0, ldb, C + m0 * ldc + n0, ldc,
                           accumulate);
    }
    for (; m0 < M; ++m0) {
      gemm_block<W, 1, NV>(K, A + m0 * a_row, a_row, a_col, B + n0, ldb, C + m0 * ldc + n0, ldc,
                           accumulate);
    }
  }
  for (; n0 < N; n0 += W) {
    int64_t m0 = 0;
    for (; m0 + R <= M; m0 += R) {
      gemm_block<W, R, 1>(K, A + m0 * a_row, a_row, a_col, B + n0, ldb, C + m0 * ldc + n0, ldc,
                          accumulate);
    }
    for (; m0 < M; ++m0) {
      gemm_block<W, 1, 1>(K, A + m0 * a_row, a_row, a_col, B + n0, ldb, C + m0 * ldc + n0, ldc,
                          accumulate);
    }
  }
}

}  // namespace octet::ops::vec
