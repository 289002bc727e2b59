// The few-rows kernel (gemm/small_m.h), and its use for plain BF16 GEMMs: at M = 1 oneDNN's
// blocked GEMM reached about half of the memory bandwidth, this kernel the bandwidth.
#include "gemm/small_m.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/lane_sums.h"
#include "gemm/matmul.h"
#include "gemm/packed_weight.h"
#include "octet/cpu_features.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#define OCTET_SMALL_M_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define OCTET_SMALL_M_TARGET __attribute__((target(OCTET_SMALL_M_ISA)))
#define OCTET_SMALL_M_INLINE OCTET_SMALL_M_TARGET inline __attribute__((always_inline))
// (A lambda takes no target from the function around it.)
#define OCTET_SMALL_M_INLINE_LAMBDA __attribute__((target(OCTET_SMALL_M_ISA), always_inline))

namespace octet::gemm_detail {

namespace {

constexpr int64_t kPassRows = 8;  // rows of A per pass: their accumulators stay in registers

typedef float F16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));

// Sum of 16 lanes by halving (vector extensions: GCC 12's extract intrinsics warn of an
// undefined operand).
OCTET_SMALL_M_INLINE float sum_lanes(__m512 v) {
  const F16 x = reinterpret_cast<F16>(v);
  const F8 h8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4 h4 =
      __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// E4M3 subnormal magnitudes m * 2^-9 (m = 0..7) times 256 as BF16 bits, in the first 8 of 32
// words.
const uint16_t* e4m3_subnormal_bf16() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(32, 0);
    for (int m = 0; m < 8; ++m) t[static_cast<size_t>(m)] = float_to_bf16(std::ldexp(m, -1));
    return t;
  }();
  return table.data();
}

// E4M3 codes widened to BF16 times 256, exactly (the 1/256 is folded into the column's
// scale), 64 at a time from one load of a weight row. A 16-bit lane holds two codes; the code
// in its high byte (the odd one as loaded, the even one after a shift left by 8), shifted right
// arithmetically by 4, has the sign in bit 15 and exponent and mantissa in bits 4..10: masked
// and ORed with 128 << 7 it is BF16's s.(eeee + 128).mmm0000, one ternary-logic instruction.
// The two halves pair K values (4j, 4j + 2) and (4j + 1, 4j + 3) in each 32-bit lane, so A is
// read from a copy permuted to match (permute_a). Codes with a zero exponent (zero and the
// subnormals m * 2^-9) do not follow the rule; one byte test per load finds them (rare in a
// weight scaled per channel) and a table lookup behind the branch takes them.
OCTET_SMALL_M_INLINE __m512bh e4m3_high_bytes(__m512i x) {
  return reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(
      _mm512_srai_epi16(x, 4), _mm512_set1_epi16(static_cast<short>(0x87f0)),
      _mm512_set1_epi16(128 << 7), 0xea));  // (a & b) | c
}
OCTET_SMALL_M_INLINE __m512bh e4m3_high_bytes_exact(__m512i x, __m512i subnormals) {
  const __mmask32 zero_exponent = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x7800));
  const __m512i tiny = _mm512_or_si512(
      _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(x, 8), _mm512_set1_epi16(7)),
                               subnormals),
      _mm512_and_si512(x, _mm512_set1_epi16(static_cast<short>(0x8000))));
  return reinterpret_cast<__m512bh>(
      _mm512_mask_blend_epi16(zero_exponent, reinterpret_cast<__m512i>(e4m3_high_bytes(x)), tiny));
}
// Each row of A [M, K] as the E4M3 kernel reads it: per 64 values, the even K pairs (4j, 4j+2)
// then the odd ones (4j+1, 4j+3), zero-padded to a multiple of 64.
int64_t permuted_k(int64_t k) {
  return (k + 63) / 64 * 64;
}
// (The pairs (4j, 4j + 2) of a block are its even elements, (4j + 1, 4j + 3) its odd ones: two
// two-source word permutations per 64 values; an index computed per element took ~1 us of a
// decode GEMM's ~3 us fixed cost.)
OCTET_SMALL_M_TARGET std::vector<uint16_t> permute_a(const uint16_t* a, int64_t m, int64_t k) {
  const int64_t kp = permuted_k(k);
  std::vector<uint16_t> out(static_cast<size_t>(m * kp));
  alignas(64) uint16_t even_index[32], odd_index[32];
  for (int i = 0; i < 32; ++i) {
    even_index[i] = static_cast<uint16_t>(2 * i);
    odd_index[i] = static_cast<uint16_t>(2 * i + 1);
  }
  const __m512i even = _mm512_load_si512(even_index), odd = _mm512_load_si512(odd_index);
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* src = a + r * k;
    uint16_t* dst = out.data() + r * kp;
    for (int64_t base = 0; base < k; base += 64) {
      const int64_t n = std::min<int64_t>(64, k - base);
      const auto first = static_cast<__mmask32>(n >= 32 ? ~0u : (1u << n) - 1);
      const auto second = static_cast<__mmask32>(n >= 64  ? ~0u
                                                 : n > 32 ? (1u << (n - 32)) - 1
                                                          : 0u);
      const __m512i x0 = _mm512_maskz_loadu_epi16(first, src + base);
      const __m512i x1 = _mm512_maskz_loadu_epi16(second, src + base + 32);
      _mm512_storeu_si512(dst + base, _mm512_permutex2var_epi16(x0, even, x1));
      _mm512_storeu_si512(dst + base + 32, _mm512_permutex2var_epi16(x0, odd, x1));
    }
  }
  return out;
}

// Software prefetch distance of the row kernels: the rows of a block are short streams (768 codes
// of FP8 at K = 768), too short for the hardware prefetcher to run ahead; 8 KiB ahead measured best
// (GPT-2 124M's layer weights cycled beyond the cache, M = 1: FP8 12.2 -> 7.8 ms, BF16
// 14.2 -> 12.5 ms).
constexpr int64_t kPrefetchBytes = 8192;

// 16 F32 values rounded to BF16 as float_to_bf16 does (nearest even, NaN kept quiet). Shifts
// by vector extensions and zero-masked conversions: GCC 12's unmasked forms warn of an undefined
// operand.
typedef uint32_t U32x16 __attribute__((vector_size(64)));
OCTET_SMALL_M_INLINE __m256i to_bf16(__m512 v) {
  const U32x16 bits = reinterpret_cast<U32x16>(v);
  U32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = reinterpret_cast<U32x16>(_mm512_mask_mov_epi32(
      reinterpret_cast<__m512i>(rounded), nan, reinterpret_cast<__m512i>((bits >> 16) | 0x40u)));
  return _mm512_maskz_cvtepi32_epi16(static_cast<__mmask16>(0xffff),
                                     reinterpret_cast<__m512i>(rounded));
}

// 16 BF16 values (the masked lanes) widened to F32.
OCTET_SMALL_M_INLINE __m512 from_bf16(const uint16_t* at, __mmask16 mask) {
  const U32x16 wide = reinterpret_cast<U32x16>(_mm512_maskz_cvtepu16_epi32(
      static_cast<__mmask16>(0xffff), _mm256_maskz_loadu_epi16(mask, at)));
  return reinterpret_cast<__m512>(wide << 16);
}

// Row `row`, columns [col, col + width) (those below N; width <= 16) of C from the F32 sums `v`
// (alpha and any column scale applied): beta * C, bias and activation, stored in C's dtype.
OCTET_SMALL_M_INLINE void store_lanes(const SmallM& p, int64_t row, int64_t col, __m512 v,
                                      int64_t width = 16) {
  const int64_t valid = std::min<int64_t>(width, p.n - col);
  const auto mask = static_cast<__mmask16>((uint32_t{1} << valid) - 1);
  const int64_t at = row * p.n + col;
  if (p.beta != 0.0f) {
    const __m512 old = p.c_bf16 ? from_bf16(static_cast<const uint16_t*>(p.c) + at, mask)
                                : _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p.c) + at);
    v = _mm512_fmadd_ps(_mm512_set1_ps(p.beta), old, v);
  }
  if (p.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p.bias + col));
  if (p.activation != Activation::None) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (float& x : lanes) x = apply_activation(p.activation, x);
    v = _mm512_load_ps(lanes);
  }
  if (p.c_bf16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.c) + at, mask, to_bf16(v));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p.c) + at, mask, v);
  }
}

// The epilogue of rows [m0, m0 + M) x columns [n, n + C): C = act(alpha * factor * scale *
// sum + beta * C + bias). (The callers reduce their accumulators first: passing them by
// reference made GCC keep them on the stack, stored at every block.)
template <int M, int C>
OCTET_SMALL_M_INLINE void store_sums(const SmallM& p, int64_t m0, int64_t n,
                                     const float (&sums)[M][C], float factor) {
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) {
      float value = p.alpha * factor * sums[m][c];
      if (p.column_scale != nullptr) value *= p.column_scale[n + c];
      const int64_t at = (m0 + m) * p.n + n + c;
      if (p.beta != 0.0f) {
        const float old = p.c_bf16 ? bf16_to_float(static_cast<uint16_t*>(p.c)[at])
                                   : static_cast<float*>(p.c)[at];
        value += p.beta * old;
      }
      if (p.bias != nullptr) value += p.bias[n + c];
      if (p.activation != Activation::None) value = apply_activation(p.activation, value);
      if (p.c_bf16) {
        static_cast<uint16_t*>(p.c)[at] = float_to_bf16(value);
      } else {
        static_cast<float*>(p.c)[at] = value;
      }
    }
  }
}

// BF16 B: output columns [n, n + C) of rows [m0, m0 + M), C weight rows streamed side by side,
// one accumulator per (row, column), each weight block loaded once for the M rows.
template <int M, int C>
OCTET_SMALL_M_INLINE void block_bf16(const SmallM& p, int64_t m0, int64_t n) {
  const int64_t K = p.k, K32 = K / 32 * 32;
  const uint16_t* a = p.a + m0 * K;
  const uint16_t* rows[C];
  for (int c = 0; c < C; ++c) rows[c] = static_cast<const uint16_t*>(p.b) + (n + c) * K;
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  }
  // One loop, the mask computed per block (passing the accumulators to a helper by reference
  // made GCC store them to the stack at every block).
  const auto tail = static_cast<__mmask32>((uint64_t{1} << (K - K32)) - 1);
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k < K32 ? static_cast<__mmask32>(~0u) : tail;
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, rows[c] + k));
    }
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, a + m * K + k));
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], av, wv[c]);
    }
  }
  float sums[M][C];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) sums[m][c] = sum_lanes(acc[m][c]);
  }
  store_sums<M, C>(p, m0, n, sums, 1.0f);
}

// E4M3 B from 3 rows of A on: C weight rows side by side, 32 codes of each per load widened to
// BF16 (sign-extended to 16 bits, shifted and masked as e4m3_high_bytes does), each widened
// block taken by the M rows of A as they are. One test of the C blocks finds the rare
// zero-exponent codes (a table lookup then); the branch touches only the widened blocks. At 8
// rows the 64-code column kernel's A permuted in two halves took 1.3-1.6x this one's time.
template <int M, int C>
OCTET_SMALL_M_INLINE void block_e4m3(const SmallM& p, int64_t m0, int64_t n, __m512i subnormals) {
  const int64_t K = p.k, K32 = K / 32 * 32;
  const uint16_t* a = p.a + m0 * K;
  const uint8_t* rows[C];
  for (int c = 0; c < C; ++c) rows[c] = static_cast<const uint8_t*>(p.b) + (n + c) * K;
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  }
  const auto tail = static_cast<__mmask32>((uint64_t{1} << (K - K32)) - 1);
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k < K32 ? static_cast<__mmask32>(~0u) : tail;
    __m512i w[C], bits[C];
    __mmask32 abnormal = 0;
    for (int c = 0; c < C; ++c) {
      w[c] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, rows[c] + k));
      bits[c] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w[c], 4),
                                          _mm512_set1_epi16(static_cast<short>(0x87f0)),
                                          _mm512_set1_epi16(128 << 7), 0xea);  // (a & b) | c
      abnormal |= _mm512_mask_testn_epi16_mask(mask, w[c], _mm512_set1_epi16(0x78));
    }
    if (abnormal != 0) [[unlikely]] {
      for (int c = 0; c < C; ++c) {
        const __m512i tiny = _mm512_or_si512(
            _mm512_permutexvar_epi16(_mm512_and_si512(w[c], _mm512_set1_epi16(7)), subnormals),
            _mm512_and_si512(w[c], _mm512_set1_epi16(static_cast<short>(0x8000))));
        bits[c] = _mm512_mask_blend_epi16(_mm512_testn_epi16_mask(w[c], _mm512_set1_epi16(0x78)),
                                          bits[c], tiny);
      }
    }
    if (k % 64 == 0) {
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, a + m * K + k));
      for (int c = 0; c < C; ++c) {
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], av, reinterpret_cast<__m512bh>(bits[c]));
      }
    }
  }
  float sums[M][C];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) sums[m][c] = sum_lanes(acc[m][c]);
  }
  store_sums<M, C>(p, m0, n, sums, 1.0f / 256.0f);
}

// E4M3 B at one or two rows of A, one column at a time: the codes of a thread's columns are then
// one sequential stream (the blocks of 8 columns above read 8 runs side by side), taken 64
// codes per load into four accumulators per row over K, each column's accumulators reduced to
// one vector, `out[m][slot]`. Plain loads but for the tail: with masked ones and no software
// prefetch the stream ran at 14 GB/s (the hardware prefetcher did not follow it). Prefetched
// 8 KiB ahead, GPT-2 124M's 49 decode weights cycled past the cache read at 50-52 GB/s against
// 52-54 for the BF16 kernel's (alternated in one process, an AMD EPYC VM); the blocks of 8
// columns read at 0.75-0.9x a plain read of the same bytes.
template <int M>
OCTET_SMALL_M_INLINE void column_e4m3(const SmallM& p, const uint16_t* a, int64_t n,
                                      __m512i subnormals, F16 (&out)[M][16], int slot) {
  constexpr int U = 4;
  const int64_t K = p.k, K64 = K / 64 * 64, lda = permuted_k(K);
  const uint8_t* row = static_cast<const uint8_t*>(p.b) + n * K;
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  }
  const __m512i exponent = _mm512_set1_epi8(0x78);
  // 64 codes at k into accumulator u: `valid` masks the tail past K's last multiple of 64 (the
  // full blocks take plain loads).
  auto step = [&](int64_t k, int u, bool full, __mmask64 valid) OCTET_SMALL_M_INLINE_LAMBDA {
    const __m512i w = full ? _mm512_loadu_si512(row + k) : _mm512_maskz_loadu_epi8(valid, row + k);
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
    const __m512i even = _mm512_slli_epi16(w, 8);
    __m512bh lo, hi;
    if (_mm512_mask_testn_epi8_mask(valid, w, exponent) != 0) [[unlikely]] {
      lo = e4m3_high_bytes_exact(even, subnormals);
      hi = e4m3_high_bytes_exact(w, subnormals);
    } else {
      lo = e4m3_high_bytes(even);
      hi = e4m3_high_bytes(w);
    }
    for (int m = 0; m < M; ++m) {
      const uint16_t* am = a + m * lda + k;
      acc[m][u] =
          _mm512_dpbf16_ps(acc[m][u], reinterpret_cast<__m512bh>(_mm512_loadu_si512(am)), lo);
      acc[m][u] =
          _mm512_dpbf16_ps(acc[m][u], reinterpret_cast<__m512bh>(_mm512_loadu_si512(am + 32)), hi);
    }
  };
  int64_t k = 0;
  for (; k + 64 * U <= K64; k += 64 * U) {
    for (int u = 0; u < U; ++u) step(k + 64 * u, u, true, ~__mmask64{0});
  }
  for (int u = 0; k < K64; k += 64, ++u) step(k, u, true, ~__mmask64{0});
  if (k < K) step(k, U - 1, false, ~uint64_t{0} >> (64 - (K - k)));
  for (int m = 0; m < M; ++m) {
    out[m][slot] = reinterpret_cast<F16>(
        _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
  }
}

// Columns [n, n + count) (count <= 16) of rows [m0, m0 + M) by column_e4m3, their sums
// reduced together and the epilogue taken 16 columns at a time: with K = 768 a column is only
// 12 loads. From the cache GPT-2's layer weights read at 56-77 GB/s so, 49-65 with a reduction
// and scalar store per column (noisy runs; the BF16 kernel: 135-150 GB/s of its bytes).
template <int M>
OCTET_SMALL_M_INLINE void column_group_e4m3(const SmallM& p, const uint16_t* a, int64_t m0,
                                            int64_t n, int64_t count, __m512i subnormals) {
  alignas(64) F16 sums[M][16];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < 16; ++c) sums[m][c] = F16{};
  }
  for (int64_t c = 0; c < count; ++c) {
    column_e4m3<M>(p, a, n + c, subnormals, sums, static_cast<int>(c));
  }
  const auto mask = static_cast<__mmask16>((uint32_t{1} << count) - 1);
  __m512 factor = _mm512_set1_ps(p.alpha / 256.0f);
  if (p.column_scale != nullptr) {
    factor = _mm512_mul_ps(factor, _mm512_maskz_loadu_ps(mask, p.column_scale + n));
  }
  for (int m = 0; m < M; ++m) {
    F16 lanes;
    lane_sums16(sums[m], &lanes);
    const __m512 v = _mm512_mul_ps(factor, reinterpret_cast<__m512>(lanes));
    store_lanes(p, m0 + m, n, v, count);
  }
}

// Columns [n0, n1) of rows [m0, m0 + M). Blocks of 8 columns up to 2 rows (BF16; E4M3 goes a
// column at a time there), 4 up to 4 rows and 2 past that (the accumulators and weight blocks
// stay in the 32 registers), then the rest by 4 and one by one. Eight columns against four:
// 1.07-1.11x over GPT-2 124M's decode weights at one row (median of alternated rounds, an AMD
// EPYC VM); twelve no faster. `a`: rows [m0, m0 + M) of A permuted (permute_a) for E4M3
// weights at one or two rows, null otherwise.
template <int M>
OCTET_SMALL_M_TARGET void columns(const SmallM& p, const uint16_t* a, int64_t m0, int64_t n0,
                                  int64_t n1) {
  constexpr int C = M <= 2 ? 8 : M <= 4 ? 4 : 2;
  int64_t n = n0;
  if (p.b_e4m3) {
    const __m512i subnormals = _mm512_loadu_si512(e4m3_subnormal_bf16());
    if constexpr (M <= 2) {  // a column at a time, 16 to an epilogue
      for (; n < n1; n += 16) {
        column_group_e4m3<M>(p, a, m0, n, std::min<int64_t>(16, n1 - n), subnormals);
      }
    } else {  // blocks of C columns, each 32 values of A taken by the C columns
      for (; n + C <= n1; n += C) block_e4m3<M, C>(p, m0, n, subnormals);
      if constexpr (C > 4) {
        for (; n + 4 <= n1; n += 4) block_e4m3<M, 4>(p, m0, n, subnormals);
      }
      for (; n < n1; ++n) block_e4m3<M, 1>(p, m0, n, subnormals);
    }
    return;
  }
  for (; n + C <= n1; n += C) block_bf16<M, C>(p, m0, n);
  if constexpr (C > 4) {
    for (; n + 4 <= n1; n += 4) block_bf16<M, 4>(p, m0, n);
  }
  for (; n < n1; ++n) block_bf16<M, 1>(p, m0, n);
}

using ColumnsFn = void (*)(const SmallM&, const uint16_t*, int64_t, int64_t, int64_t);
constexpr ColumnsFn kColumns[kPassRows] = {columns<1>, columns<2>, columns<3>, columns<4>,
                                           columns<5>, columns<6>, columns<7>, columns<8>};

// ---- B packed in K pairs (run_small_m_pairs) --------------------------------------------------

constexpr int64_t kPairRows = 4;  // rows of A per pass over a block: 4 x 4 accumulators at most

// Columns [n, n + 16 G) of rows [m0, m0 + R) from one block of K pairs: per pair, G lines of
// weights (16 columns x 2 K values each) against each row's two A values broadcast. The block
// is one sequential stream: at one row the hardware prefetcher alone was faster (GPT-2 124M's
// decode weights against the row kernel, alternated rounds: 1.21-1.29x without software
// prefetch, 0.96-1.12x with it 2-8 KiB ahead); at 4 and 8 rows prefetching 8 KiB ahead helped
// (1.23-1.31x against 1.12-1.27x). A's rows are `lda` apart with an even lda and a zero past
// K when K is odd.
template <int R, int G>
OCTET_SMALL_M_TARGET void pair_block(const SmallM& p, const uint16_t* a, int64_t lda,
                                     const uint16_t* w, int64_t m0, int64_t n) {
  const int64_t pairs = (p.k + 1) / 2;
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = a + (m0 + r) * lda;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint16_t* wq = w + q * 32 * G;
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) {
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wq + 32 * g));
      if constexpr (R > 1) {
        _mm_prefetch(reinterpret_cast<const char*>(wq + 32 * g) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    for (int r = 0; r < R; ++r) {
      uint32_t two;
      std::memcpy(&two, rows[r] + 2 * q, sizeof(two));
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(two)));
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], av, wv[g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      const int64_t col = n + 16 * g;
      if (col >= p.n) break;
      store_lanes(p, m0 + r, col, _mm512_mul_ps(_mm512_set1_ps(p.alpha), acc[r][g]));
    }
  }
}

using PairBlockFn = void (*)(const SmallM&, const uint16_t*, int64_t, const uint16_t*, int64_t,
                             int64_t);
template <int G>
constexpr PairBlockFn kPairBlocks[kPairRows] = {pair_block<1, G>, pair_block<2, G>,
                                                pair_block<3, G>, pair_block<4, G>};
constexpr const PairBlockFn* kPairBlocksByWidth[4] = {kPairBlocks<1>, kPairBlocks<2>,
                                                      kPairBlocks<3>, kPairBlocks<4>};

// Rows up to which plain BF16 GEMMs take the kernels (OCTET_GEMM_SMALL_M=R for both, 0:
// never). The row kernel, eight by default, one pass: with the weights beyond the cache, GPT-2
// 124M's decode GEMMs per step took 5.2-7.8 ms through it at batch 4 against oneDNN's 9.0-9.2,
// and 7.0-9.4 against 10.4-11.4 at batch 8 (an AMD EPYC VM, runs alternated); at 12 and 16
// rows, two passes read the weights twice and oneDNN is faster (14.2-14.7 ms against 11.3-12.4
// at 12). The pair-blocked kernel reads a block again from the cache for each pass of 4 rows:
// sixteen by default (the same weights: 1.10x oneDNN at 12 and 16 rows, 0.92x at 24, 0.89x at
// 32).
int64_t max_rows(bool pair_blocked) {
  static const int64_t set_rows = [] {
    const char* set = std::getenv("OCTET_GEMM_SMALL_M");
    if (set == nullptr || *set == '\0') return int64_t{-1};
    char* end = nullptr;
    const long value = std::strtol(set, &end, 10);
    OCTET_CHECK(*end == '\0' && value >= 0 && value <= 64,
                "OCTET_GEMM_SMALL_M expected rows 0..64 (0: never), got '", set, "'");
    return static_cast<int64_t>(value);
  }();
  if (set_rows >= 0) return set_rows;
  if (pair_blocked) return 2 * kPassRows;
  // Where BF16 GEMMs run widened to F32 (gemm_bf16_native() false: VDPBF16PS slower than the
  // FMA), the widened GEMM reads 4 bytes per weight element and widens A and B first: decode
  // batches below 32 rows stay here (gpt2-124m decode at batch 8: 305 tokens/s through
  // oneDNN's BF16 matmul, 199 widened).
  static const int64_t rows = gemm_bf16_native() ? kPassRows : int64_t{31};
  return rows;
}

}  // namespace

void scale_by_k_blocks(const float* a, int64_t m, int64_t k, const float* scales, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k0 = 0; k0 < k; k0 += kFp8WeightBlock) {
      const float scale = scales[k0 / kFp8WeightBlock];
      const int64_t k1 = std::min(k, k0 + kFp8WeightBlock);
#pragma omp simd
      for (int64_t i = k0; i < k1; ++i) out[r * k + i] = a[r * k + i] * scale;
    }
  }
}

bool small_m_avx512() {
  return active_isa() == Isa::Avx512 && cpu_features().avx512_bf16;
}

bool small_m_supported() {
  return small_m_avx512() || active_isa() != Isa::Scalar;
}

void run_small_m(const SmallM& p) {
  OCTET_CHECK(small_m_supported(), "run_small_m: needs AVX-512 BF16, or AVX2 with FMA and F16C");
  if (!small_m_avx512() || p.block_scale != nullptr) return run_small_m_avx2(p);
  if (p.m == 0 || p.n == 0) return;
  // E4M3 B: the rows taken in passes of one or two (the column kernel's) read A permuted.
  const int64_t tail_rows = p.m % kPassRows, permuted_from = p.m - tail_rows;
  const bool permute = p.b_e4m3 && (tail_rows == 1 || tail_rows == 2);
  const std::vector<uint16_t> a =
      permute ? permute_a(p.a + permuted_from * p.k, tail_rows, p.k) : std::vector<uint16_t>{};
  // Threads take contiguous column ranges (each weight row read by one thread, once per pass
  // of 8 rows); a weight under 256 Ki elements is not worth waking them for.
  // (A small one runs on the calling thread: a region, even one whose `if` is false, wakes the
  // pool.)
  auto part = [&](int t, int threads) {
    const int64_t n0 = p.n * t / threads, n1 = p.n * (t + 1) / threads;
    for (int64_t m0 = 0; m0 < p.m; m0 += kPassRows) {
      kColumns[std::min(kPassRows, p.m - m0) - 1](p, m0 == permuted_from ? a.data() : nullptr, m0,
                                                  n0, n1);
    }
  };
  if (p.n * p.k < (int64_t{1} << 18)) {
    part(0, 1);
    return;
  }
#pragma omp parallel
  part(omp_get_thread_num(), omp_get_num_threads());
}

void run_small_m_pairs(const SmallM& p, const uint16_t* b, int64_t width) {
  OCTET_CHECK(small_m_avx512(), "run_small_m_pairs: needs AVX-512 BF16");
  OCTET_CHECK(width % 16 == 0 && width >= 16 && width <= 64,
              "run_small_m_pairs: expected blocks of 16, 32, 48 or 64 columns, got ", width);
  if (p.m == 0 || p.n == 0) return;
  // An odd K reads A in pairs from a copy with a zero after each row (B's padding is zero).
  const uint16_t* a = p.a;
  int64_t lda = p.k;
  std::vector<uint16_t> padded;
  if (p.k % 2 != 0) {
    lda = p.k + 1;
    padded.assign(static_cast<size_t>(p.m * lda), 0);
    for (int64_t m = 0; m < p.m; ++m) std::copy_n(p.a + m * p.k, p.k, padded.data() + m * lda);
    a = padded.data();
  }
  const PairBlockFn* table = kPairBlocksByWidth[width / 16 - 1];
  const int64_t blocks = (p.n + width - 1) / width;
  const int64_t block_elements = (p.k + 31) / 32 * 32 * width;
  auto part = [&](int t, int threads) {
    const int64_t j0 = blocks * t / threads, j1 = blocks * (t + 1) / threads;
    for (int64_t j = j0; j < j1; ++j) {
      // Rows past the first pass read the block again from the cache.
      for (int64_t m0 = 0; m0 < p.m; m0 += kPairRows) {
        table[std::min(kPairRows, p.m - m0) - 1](p, a, lda, b + j * block_elements, m0, j * width);
      }
    }
  };
  if (p.n * p.k < (int64_t{1} << 18)) {  // on the calling thread, as run_small_m
    part(0, 1);
    return;
  }
#pragma omp parallel
  part(omp_get_thread_num(), omp_get_num_threads());
}

bool run_small_m_bf16(const MatmulArgs& args) {
  if (args.a_dtype != DType::BF16 || args.b_dtype != DType::BF16 || args.trans_a || args.k == 0 ||
      !small_m_supported()) {
    return false;
  }
  const void* b = args.b;
  const uint16_t* pairs = nullptr;
  dnnl::memory pairs_memory;  // held while the kernel reads it
  int64_t width = 0;
  if (args.packed != nullptr) {
    if (args.packed->is_fp8 || args.m > std::max(max_rows(true), max_rows(false))) return false;
    // The copy oneDNN's BF16 matmul reads (prefill's), when it is packed in K pairs: one
    // sequential stream per block of columns, and no copy beyond those already made.
    if (args.m <= max_rows(true) && small_m_avx512()) {  // (OCTET_ISA may lower the ISA)
      pairs_memory = args.packed->pair_blocked(width);
      if (width > 0) pairs = static_cast<const uint16_t*>(pairs_memory.get_data_handle());
    }
    if (pairs == nullptr) {
      if (!args.packed->trans || args.m > max_rows(false)) return false;
      b = args.packed->tensor.raw();
    }
  } else if (!args.trans_b || args.m > max_rows(false)) {
    return false;
  }
  SmallM p;
  p.a = static_cast<const uint16_t*>(args.a);
  p.b = b;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.c = args.c;
  p.c_bf16 = args.c_dtype == DType::BF16;
  p.alpha = args.output_scale;
  p.beta = args.beta;
  p.activation = args.activation;
  std::vector<float> bias;
  if (args.bias != nullptr) {
    bias = args.bias->to_floats();
    p.bias = bias.data();
  }
  if (pairs != nullptr) {
    run_small_m_pairs(p, pairs, width);
  } else {
    run_small_m(p);
  }
  return true;
}

}  // namespace octet::gemm_detail
