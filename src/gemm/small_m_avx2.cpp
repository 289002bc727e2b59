// The few-rows kernel (gemm/small_m.h) for processors with AVX2 and FMA but no AVX-512 BF16
// (an AMD EPYC of the Zen 3 generation, say): each weight row streamed once and widened to F32
// in registers, against A widened to F32 once per call, with FMA's exact products and F32
// sums. There, without it, a BF16 decode read the weight widened to F32 by oneDNN's F32
// matmul (twice the bytes) and an FP8 one widened every weight row per call.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/convert.h"
#include "gemm/small_m.h"
#include "octet/dtype.h"

#define OCTET_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define OCTET_AVX2_INLINE OCTET_AVX2_TARGET inline __attribute__((always_inline))
// (A lambda takes no target from the function around it.)
#define OCTET_AVX2_INLINE_LAMBDA __attribute__((target("avx2,fma,f16c"), always_inline))

namespace octet::gemm_detail {

namespace {

constexpr int64_t kPassRows = 8;  // rows of A per pass: 8 accumulators and 2 weight vectors
// Columns per chunk when M takes several passes: each pass reads the chunk's weight rows
// again, from the cache (16 rows of K = 3072 BF16 values: 96 KiB, in L2).
constexpr int64_t kChunkColumns = 16;
constexpr int64_t kPrefetchBytes = 4096;

// 16 E4M3 codes widened exactly to F32, times 2^-8: a code sign-extended to 16 bits and
// shifted left by 7 puts its exponent and mantissa in FP16's fields (exponent bias 15 against
// E4M3's 7) and its sign in bit 15 (and bit 14, cleared). The subnormals land on FP16's
// subnormals with the same 2^-8, and F16C widens all of them exactly. The callers fold 256
// into the column's scale. (Sign-extending to 32 bits, shifting and masking into F32's fields,
// then multiplying by 2^112 is as exact, but ran at half the speed over random codes on a Zen 3
// VM, 10.4-10.8 GB/s against 14-20 at one row: F32 subnormal operands take a slow path. And
// moving the fields by integer shifts, masks and an add where a test of 16 codes finds no zero
// exponent, F16C otherwise, ran at 0.75-0.95x this one's speed over quantized Gaussian rows.
// The integer form into BF16's fields (shift by 4, mask, add 112 << 7, then widen_bf16's
// shift and mask), one byte test per 64 codes sending the rare zero exponents to F16C: at one
// row 1.1-1.2x this one's bytes per second on one thread, but at two threads, memory-bound,
// GPT-2 124M's decode ran no faster (FP8/BF16 1.44-1.69x against 1.45-1.66x, processes
// alternated), and from two rows on, where the FMAs bound the kernel, it ran slower.)
OCTET_AVX2_INLINE void widen_e4m3(const uint8_t* codes, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                        _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}

// 16 BF16 values: the even ones (K 0, 2, ..., 14) in `lo`, the odd ones in `hi`; A is stored
// permuted to match (widened_a).
OCTET_AVX2_INLINE void widen_bf16(const uint16_t* values, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

OCTET_AVX2_INLINE float sum_lanes(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// A [M, K] as F32 in blocks of 16 K: natural order for E4M3 B; for BF16 B the 8 even K of each
// block, then the 8 odd ones (widen_bf16's order). The last K % 16 values stay in order.
std::vector<float> widened_a(const SmallM& p) {
  std::vector<float> a(static_cast<size_t>(p.m * p.k));
  convert_bf16_to_f32(reinterpret_cast<const bfloat16*>(p.a), a.data(), a.size());
  if (p.b_e4m3) return a;
  const int64_t K16 = p.k / 16 * 16;
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t k = 0; k < K16; k += 16) {
      float* block = a.data() + m * p.k + k;
      float even_odd[16];
      for (int i = 0; i < 16; ++i) even_odd[(i % 2) * 8 + i / 2] = block[i];
      std::copy_n(even_odd, 16, block);
    }
  }
  return a;
}

// C[row, n] from the F32 sum of its products: act(factor * scale * sum + beta * C + bias).
OCTET_AVX2_INLINE void store(const SmallM& p, int64_t row, int64_t n, float factor, float sum) {
  float value = factor * sum;
  if (p.column_scale != nullptr) value *= p.column_scale[n];
  const int64_t at = row * p.n + n;
  if (p.beta != 0.0f) {
    value += p.beta * (p.c_bf16 ? bf16_to_float(static_cast<const uint16_t*>(p.c)[at])
                                : static_cast<const float*>(p.c)[at]);
  }
  if (p.bias != nullptr) value += p.bias[n];
  if (p.activation != Activation::None) value = apply_activation(p.activation, value);
  if (p.c_bf16) {
    static_cast<uint16_t*>(p.c)[at] = float_to_bf16(value);
  } else {
    static_cast<float*>(p.c)[at] = value;
  }
}

// Weight row n's value at K index t (past the last block of 16), times 2^-8 for E4M3.
template <bool E4M3>
OCTET_AVX2_INLINE float tail_value(const SmallM& p, int64_t n, int64_t t) {
  if constexpr (E4M3) {
    return fp8_to_float(static_cast<const uint8_t*>(p.b)[n * p.k + t], DType::E4M3) / 256.0f;
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(p.b)[n * p.k + t]);
  }
}

// Columns [n0, n1) of rows [m0, m0 + R), a column at a time: its weight row one sequential
// stream, prefetched ahead, 16 values per widening taken by the R rows. The R rows share 8
// accumulators (8 / R chains each, to cover FMA's latency at one row).
template <bool E4M3, int R>
OCTET_AVX2_TARGET void columns(const SmallM& p, const float* a, int64_t m0, int64_t n0,
                               int64_t n1) {
  constexpr int A = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;  // accumulators per row
  const int64_t K = p.k, K16 = K / 16 * 16, bytes = E4M3 ? 1 : 2;
  const float* ar = a + m0 * K;
  const float factor = p.alpha * (E4M3 ? 256.0f : 1.0f);
  for (int64_t n = n0; n < n1; ++n) {
    const auto* row = static_cast<const uint8_t*>(p.b) + n * K * bytes;
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < A; ++j) acc[r][j] = _mm256_setzero_ps();
    }
    // 16 K into accumulators s0 and s1 of each row.
    auto block = [&](int64_t k, int s0, int s1) OCTET_AVX2_INLINE_LAMBDA {
      if ((k * bytes) % 64 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row + k * bytes) + kPrefetchBytes, _MM_HINT_T0);
      }
      __m256 lo, hi;
      if constexpr (E4M3) {
        widen_e4m3(row + k, lo, hi);
      } else {
        widen_bf16(reinterpret_cast<const uint16_t*>(row) + k, lo, hi);
      }
      for (int r = 0; r < R; ++r) {
        const float* x = ar + r * K + k;
        acc[r][s0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), acc[r][s0]);
        acc[r][s1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), acc[r][s1]);
      }
    };
    constexpr int G = A >= 2 ? A / 2 : 1;  // blocks per step: each of the A accumulators once
    int64_t k = 0;
    for (; k + 16 * G <= K16; k += 16 * G) {
      for (int g = 0; g < G; ++g) block(k + 16 * g, (2 * g) % A, (2 * g + 1) % A);
    }
    for (; k < K16; k += 16) block(k, 0, 1 % A);
    for (int r = 0; r < R; ++r) {
      __m256 total = acc[r][0];
      for (int j = 1; j < A; ++j) total = _mm256_add_ps(total, acc[r][j]);
      float sum = sum_lanes(total);
      for (int64_t t = K16; t < K; ++t) sum += ar[r * K + t] * tail_value<E4M3>(p, n, t);
      store(p, m0 + r, n, factor, sum);
    }
  }
}

// Columns [n0, n1) of rows [m0, m0 + R) two at a time (one by `columns` when odd): each
// value of A loaded once for both columns, each widened weight vector taken by the R rows,
// one accumulator per (row, column).
template <bool E4M3, int R>
OCTET_AVX2_TARGET void column_pairs(const SmallM& p, const float* a, int64_t m0, int64_t n0,
                                    int64_t n1) {
  const int64_t K = p.k, K16 = K / 16 * 16, bytes = E4M3 ? 1 : 2;
  const float* ar = a + m0 * K;
  const float factor = p.alpha * (E4M3 ? 256.0f : 1.0f);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const auto* row0 = static_cast<const uint8_t*>(p.b) + n * K * bytes;
    const auto* row1 = row0 + K * bytes;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      if ((k * bytes) % 64 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row0 + k * bytes) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row1 + k * bytes) + kPrefetchBytes, _MM_HINT_T0);
      }
      __m256 w[2][2];
      if constexpr (E4M3) {
        widen_e4m3(row0 + k, w[0][0], w[0][1]);
        widen_e4m3(row1 + k, w[1][0], w[1][1]);
      } else {
        widen_bf16(reinterpret_cast<const uint16_t*>(row0) + k, w[0][0], w[0][1]);
        widen_bf16(reinterpret_cast<const uint16_t*>(row1) + k, w[1][0], w[1][1]);
      }
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r) {
          const __m256 x = _mm256_loadu_ps(ar + r * K + k + 8 * h);
          acc[r][0] = _mm256_fmadd_ps(w[0][h], x, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(w[1][h], x, acc[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 2; ++c) {
        float sum = sum_lanes(acc[r][c]);
        for (int64_t t = K16; t < K; ++t) sum += ar[r * K + t] * tail_value<E4M3>(p, n + c, t);
        store(p, m0 + r, n + c, factor, sum);
      }
    }
  }
  if (n < n1) columns<E4M3, R>(p, a, m0, n, n1);
}

// Up to 2 rows a column at a time (8 and 4 chains of accumulators per row); 3 to 6 rows two
// columns at a time (FP8 at 4 rows over GPT-2 124M's decode weights on a Zen 3 VM, alternated
// with the BF16 kernel in one process: 1.2-1.45x the one-column kernel's bytes per second); 7
// and 8 a column at a time again (2 x 8 accumulators would not fit AVX2's 16 registers).
using ColumnsFn = void (*)(const SmallM&, const float*, int64_t, int64_t, int64_t);
template <bool E4M3>
constexpr ColumnsFn kColumns[kPassRows] = {
    columns<E4M3, 1>,      columns<E4M3, 2>,      column_pairs<E4M3, 3>, column_pairs<E4M3, 4>,
    column_pairs<E4M3, 5>, column_pairs<E4M3, 6>, columns<E4M3, 7>,      columns<E4M3, 8>};

}  // namespace

void run_small_m_avx2(const SmallM& p) {
  OCTET_CHECK(p.block_scale == nullptr ||
                  (p.b_e4m3 && p.column_scale == nullptr &&
                   p.block_scale_stride == (p.k + kFp8WeightBlock - 1) / kFp8WeightBlock),
              "run_small_m_avx2: block scales need E4M3 B, no column scales and ceil(K / 128) = ",
              (p.k + kFp8WeightBlock - 1) / kFp8WeightBlock, " per block row, got ",
              p.block_scale_stride);
  if (p.m == 0 || p.n == 0) return;
  const std::vector<float> a = widened_a(p);
  const ColumnsFn* table = p.b_e4m3 ? kColumns<true> : kColumns<false>;
  // Threads take contiguous column ranges. One pass streams them; more read each chunk of
  // columns from memory once and again from the cache for the next passes. (E4M3 chunks
  // widened once to F32 into a buffer of the thread's own, that each pass then read instead of
  // the codes, ran slower: FP8/BF16 0.74-0.90x against 1.01-1.08x at 16-64 rows over GPT-2
  // 124M's decode weights on a Zen 3 VM; the passes read four times the bytes from L2.)
  // Block scales: the columns of each block row of B (128 of them) read A times each of the
  // row's K-block scales, made once per block row in the thread's own buffer: M x K
  // multiplications per 128 columns. (Summing each 128 K apart and scaling the sums instead
  // cost a reduction per 128 codes: 0.69-0.75x per-channel scales' speed over GPT-2 124M's
  // decode weights at 1-32 rows on a Zen 3 VM.)
  auto part = [&](int t, int threads) {
    const int64_t n0 = p.n * t / threads, n1 = p.n * (t + 1) / threads;
    std::vector<float> scaled;
    for (int64_t b0 = n0, b1 = n0; b0 < n1; b0 = b1) {
      const float* a_used = a.data();
      b1 = n1;
      if (p.block_scale != nullptr) {
        b1 = std::min(n1, (b0 / kFp8WeightBlock + 1) * kFp8WeightBlock);
        scaled.resize(a.size());
        scale_by_k_blocks(a.data(), p.m, p.k,
                          p.block_scale + b0 / kFp8WeightBlock * p.block_scale_stride,
                          scaled.data());
        a_used = scaled.data();
      }
      const int64_t chunk = p.m <= kPassRows ? b1 - b0 : kChunkColumns;
      for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
        const int64_t c1 = std::min(b1, c0 + chunk);
        for (int64_t m0 = 0; m0 < p.m; m0 += kPassRows) {
          table[std::min(kPassRows, p.m - m0) - 1](p, a_used, m0, c0, c1);
        }
      }
    }
  };
  if (p.n * p.k < (int64_t{1} << 18)) {  // not worth waking the pool (as run_small_m)
    part(0, 1);
    return;
  }
#pragma omp parallel
  part(omp_get_thread_num(), omp_get_num_threads());
}

}  // namespace octet::gemm_detail
