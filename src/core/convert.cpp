// Bulk F32 <-> BF16 / F16 conversions: scalar reference, AVX2 and AVX-512 paths.
//
// The vector paths are exact ports of the scalar conversions in dtype.cpp. NaN encodings are
// defined in one place only: a vector block holding a NaN is redone with the scalar functions.
#include "core/convert.h"

// GCC 12 reports its own _mm512_undefined_*() placeholders as (maybe-)uninitialized when AVX-512
// intrinsics are inlined into target("avx512f") functions (GCC bug 105593); silence only that.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "octet/cpu_features.h"

#define OCTET_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define OCTET_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace octet {
namespace {

// Splits [0, n) into chunks spread over OpenMP threads when n is large enough to pay for it.
template <typename Body>
void for_chunks(size_t n, Body body) {
  constexpr size_t kParallelMin = size_t{1} << 16;
  constexpr size_t kChunk = size_t{1} << 14;
  if (n < kParallelMin) {
    body(size_t{0}, n);
    return;
  }
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    body(begin, std::min(n, begin + kChunk));
  }
}

// ---- scalar reference -------------------------------------------------------------------

void f32_to_bf16_scalar(const float* in, bfloat16* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i].bits = float_to_bf16(in[i]);
}
void bf16_to_f32_scalar(const bfloat16* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i].bits);
}
void f32_to_f16_scalar(const float* in, float16* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i].bits = float_to_f16(in[i]);
}
void f16_to_f32_scalar(const float16* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_float(in[i].bits);
}

// ---- AVX-512 ----------------------------------------------------------------------------

OCTET_TARGET_AVX512 void f32_to_bf16_avx512(const float* in, bfloat16* out, size_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000);
  const __m512i round_bias = _mm512_set1_epi32(0x7FFF);
  const __m512i one = _mm512_set1_epi32(1);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(in + i);
    const __m512i magnitude = _mm512_and_si512(bits, abs_mask);
    if (_mm512_cmpgt_epu32_mask(magnitude, inf_bits) != 0) {
      f32_to_bf16_scalar(in + i, out + i, 16);
      continue;
    }
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(round_bias, lsb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  f32_to_bf16_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX512 void bf16_to_f32_avx512(const bfloat16* in, float* out, size_t n) {
  const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
  const __m256i inf_bits = _mm256_set1_epi16(0x7F80);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    // Magnitudes fit in 15 bits, so a signed compare is an unsigned one.
    if (!_mm256_testz_si256(_mm256_cmpgt_epi16(_mm256_and_si256(bits, abs_mask), inf_bits),
                            _mm256_set1_epi16(-1))) {
      bf16_to_f32_scalar(in + i, out + i, 16);
      continue;
    }
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  bf16_to_f32_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX512 void f32_to_f16_avx512(const float* in, float16* out, size_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(in + i);
    if (_mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), inf_bits) != 0) {
      f32_to_f16_scalar(in + i, out + i, 16);
      continue;
    }
    const __m256i half =
        _mm512_cvtps_ph(_mm512_castsi512_ps(bits), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), half);
  }
  f32_to_f16_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX512 void f16_to_f32_avx512(const float16* in, float* out, size_t n) {
  const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
  const __m256i inf_bits = _mm256_set1_epi16(0x7C00);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    if (!_mm256_testz_si256(_mm256_cmpgt_epi16(_mm256_and_si256(bits, abs_mask), inf_bits),
                            _mm256_set1_epi16(-1))) {
      f16_to_f32_scalar(in + i, out + i, 16);
      continue;
    }
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(bits));
  }
  f16_to_f32_scalar(in + i, out + i, n - i);
}

// ---- AVX2 -------------------------------------------------------------------------------

OCTET_TARGET_AVX2 bool any_nan_f32(__m256i bits) {
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  // Magnitudes fit in 31 bits, so a signed compare is an unsigned one.
  return _mm256_movemask_epi8(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000))) != 0;
}

OCTET_TARGET_AVX2 bool any_nan_16(__m128i bits, int16_t inf_bits) {
  const __m128i magnitude = _mm_and_si128(bits, _mm_set1_epi16(0x7FFF));
  return _mm_movemask_epi8(_mm_cmpgt_epi16(magnitude, _mm_set1_epi16(inf_bits))) != 0;
}

OCTET_TARGET_AVX2 void f32_to_bf16_avx2(const float* in, bfloat16* out, size_t n) {
  const __m256i round_bias = _mm256_set1_epi32(0x7FFF);
  const __m256i one = _mm256_set1_epi32(1);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    if (any_nan_f32(bits)) {
      f32_to_bf16_scalar(in + i, out + i, 8);
      continue;
    }
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(round_bias, lsb)), 16);
    // packus works within 128-bit lanes; gather the two low halves afterwards.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  f32_to_bf16_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX2 void bf16_to_f32_avx2(const bfloat16* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    if (any_nan_16(bits, 0x7F80)) {
      bf16_to_f32_scalar(in + i, out + i, 8);
      continue;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  bf16_to_f32_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX2 void f32_to_f16_avx2(const float* in, float16* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    if (any_nan_f32(bits)) {
      f32_to_f16_scalar(in + i, out + i, 8);
      continue;
    }
    const __m128i half =
        _mm256_cvtps_ph(_mm256_castsi256_ps(bits), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
  }
  f32_to_f16_scalar(in + i, out + i, n - i);
}

OCTET_TARGET_AVX2 void f16_to_f32_avx2(const float16* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    if (any_nan_16(bits, 0x7C00)) {
      f16_to_f32_scalar(in + i, out + i, 8);
      continue;
    }
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(bits));
  }
  f16_to_f32_scalar(in + i, out + i, n - i);
}

// Runs the kernel for the active instruction set over chunks of [0, n).
template <typename In, typename Out>
void dispatch(const In* in, Out* out, size_t n, void (*scalar)(const In*, Out*, size_t),
              void (*avx2)(const In*, Out*, size_t), void (*avx512)(const In*, Out*, size_t)) {
  const Isa isa = active_isa();
  auto* kernel = isa == Isa::Avx512 ? avx512 : isa == Isa::Avx2 ? avx2 : scalar;
  for_chunks(n, [&](size_t begin, size_t end) { kernel(in + begin, out + begin, end - begin); });
}

}  // namespace

void convert_f32_to_bf16(const float* in, bfloat16* out, size_t n) {
  dispatch(in, out, n, f32_to_bf16_scalar, f32_to_bf16_avx2, f32_to_bf16_avx512);
}

void convert_bf16_to_f32(const bfloat16* in, float* out, size_t n) {
  dispatch(in, out, n, bf16_to_f32_scalar, bf16_to_f32_avx2, bf16_to_f32_avx512);
}

void round_f32_to_bf16(float* x, size_t n) {
  const Isa isa = active_isa();
  auto* narrow = isa == Isa::Avx512 ? f32_to_bf16_avx512
                 : isa == Isa::Avx2 ? f32_to_bf16_avx2
                                    : f32_to_bf16_scalar;
  auto* widen = isa == Isa::Avx512 ? bf16_to_f32_avx512
                : isa == Isa::Avx2 ? bf16_to_f32_avx2
                                   : bf16_to_f32_scalar;
  // The two conversions over blocks that stay in L1: one pass over memory.
  for_chunks(n, [&](size_t begin, size_t end) {
    constexpr size_t kBlock = 2048;
    bfloat16 block[kBlock];
    for (size_t i = begin; i < end; i += kBlock) {
      const size_t count = std::min(kBlock, end - i);
      narrow(x + i, block, count);
      widen(block, x + i, count);
    }
  });
}

void convert_f32_to_f16(const float* in, float16* out, size_t n) {
  dispatch(in, out, n, f32_to_f16_scalar, f32_to_f16_avx2, f32_to_f16_avx512);
}

void convert_f16_to_f32(const float16* in, float* out, size_t n) {
  dispatch(in, out, n, f16_to_f32_scalar, f16_to_f32_avx2, f16_to_f32_avx512);
}

}  // namespace octet
