// Bulk FP8 kernels: quantize, dequantize, widen to BF16, amax and the fused cast + transpose.
//
// Each kernel has a scalar reference (built on the scalar conversions of format.cpp) and
// AVX2 / AVX-512 ports chosen by active_isa(); the ports are bit-identical to the reference.
// amax is reduced on the integer bits of |x|: for non-NaN floats their order is the order of
// the values, and every NaN compares above +Inf, so NaN propagates without special cases.
// GCC 12 reports its own _mm512_undefined_*() placeholders as (maybe-)uninitialized when AVX-512
// intrinsics are inlined into target("avx512f") functions (GCC bug 105593); silence only that.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "octet/cpu_features.h"
#include "octet/error.h"
#include "octet/fp8.h"
#include "octet/profile.h"

#define OCTET_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define OCTET_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace octet {
namespace {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNanBits = 0x7FC00000u;
constexpr size_t kParallelMin = size_t{1} << 16;  // elements before OpenMP pays off
constexpr size_t kChunk = size_t{1} << 14;

// Compile-time description of a format for the vector encoders and decoders.
struct E4M3Format {
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr int kMaxCode = 0x7E;
  static constexpr int kNanCode = 0x7F;
};
struct E5M2Format {
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr int kMaxCode = 0x7B;
  static constexpr int kNanCode = 0x7E;
};

void check_format(DType format, const char* kernel) {
  OCTET_CHECK(is_fp8(format), kernel, ": expected format e4m3 or e5m2, got ", dtype_name(format));
}

float amax_from_bits(uint32_t bits) {
  return bits > kInfBits ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(bits);
}

inline float to_float(float value) {
  return value;
}
inline float to_float(bfloat16 value) {
  return bf16_to_float(value.bits);
}

// Runs body(begin, end) over [0, n), in parallel chunks when n is large; returns the max of
// what the calls return.
template <typename Body>
uint32_t reduce_chunks(size_t n, Body body) {
  if (n < kParallelMin) return body(size_t{0}, n);
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  uint32_t result = 0;
#pragma omp parallel for schedule(static) reduction(max : result)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    result = std::max(result, body(begin, std::min(n, begin + kChunk)));
  }
  return result;
}

// Kernel signatures; vector kernels take the format as a template argument instead.
template <typename In>
using QuantizeKernel = uint32_t (*)(const In* x, size_t n, float scale, DType format,
                                    uint8_t* codes);
using DequantizeKernel = void (*)(const uint8_t* codes, size_t n, DType format, float scale_inv,
                                  float* out);
using WidenKernel = void (*)(const uint8_t* codes, size_t n, DType format, bfloat16* out);

// ---- scalar reference -------------------------------------------------------------------

template <typename In>
uint32_t quantize_scalar(const In* x, size_t n, float scale, DType format, uint8_t* codes) {
  uint32_t amax = 0;
  for (size_t i = 0; i < n; ++i) {
    const float value = to_float(x[i]);
    amax = std::max(amax, std::bit_cast<uint32_t>(value) & kAbsMask);
    codes[i] = float_to_fp8(value * scale, format, /*saturate=*/true);
  }
  return amax;
}

template <typename In>
uint32_t amax_scalar(const In* x, size_t n) {
  uint32_t amax = 0;
  for (size_t i = 0; i < n; ++i) {
    amax = std::max(amax, std::bit_cast<uint32_t>(to_float(x[i])) & kAbsMask);
  }
  return amax;
}

void dequantize_scalar(const uint8_t* codes, size_t n, DType format, float scale_inv, float* out) {
  if (n < 256) {  // vector tails: cheaper than building the table
    for (size_t i = 0; i < n; ++i) out[i] = fp8_to_float(codes[i], format) * scale_inv;
    return;
  }
  float table[256];
  for (int code = 0; code < 256; ++code) table[code] = fp8_to_float(uint8_t(code), format);
  for (size_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale_inv;
}

void widen_scalar(const uint8_t* codes, size_t n, DType format, bfloat16* out) {
  if (n < 256) {
    for (size_t i = 0; i < n; ++i) out[i].bits = float_to_bf16(fp8_to_float(codes[i], format));
    return;
  }
  uint16_t table[256];
  for (int code = 0; code < 256; ++code) {
    table[code] = float_to_bf16(fp8_to_float(uint8_t(code), format));
  }
  for (size_t i = 0; i < n; ++i) out[i].bits = table[codes[i]];
}

// ---- AVX-512 ----------------------------------------------------------------------------

OCTET_TARGET_AVX512 inline __m512 load16(const float* x) {
  return _mm512_loadu_ps(x);
}
OCTET_TARGET_AVX512 inline __m512 load16(const bfloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// float_to_fp8(y, Fmt, saturate=true) on 16 lanes; codes in the low byte of each lane.
template <typename Fmt>
OCTET_TARGET_AVX512 inline __m512i encode16(__m512 y) {
  constexpr int kShift = 23 - Fmt::kMantissaBits;
  constexpr int kMinNormalExponent = 1 - Fmt::kBias;
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(int(kAbsMask)));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  // Normal range: round the mantissa to nearest even on the integer bits, then rebias.
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(magnitude, kShift), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(magnitude,
                       _mm512_add_epi32(_mm512_set1_epi32((1 << (kShift - 1)) - 1), lsb)),
      kShift);
  const __m512i normal =
      _mm512_sub_epi32(rounded, _mm512_set1_epi32((127 - Fmt::kBias) << Fmt::kMantissaBits));
  // Subnormal range: |y| / 2^(min_normal - mantissa_bits) is exact; round it to an integer.
  const __m512 quanta = _mm512_mul_ps(
      _mm512_castsi512_ps(magnitude),
      _mm512_set1_ps(
          std::bit_cast<float>(uint32_t(127 + Fmt::kMantissaBits - kMinNormalExponent) << 23)));
  const __m512i subnormal =
      _mm512_cvt_roundps_epi32(quanta, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 is_subnormal =
      _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32((127 + kMinNormalExponent) << 23));
  __m512i code = _mm512_mask_blend_epi32(is_subnormal, normal, subnormal);
  const __mmask16 overflow = _mm512_cmpgt_epi32_mask(code, _mm512_set1_epi32(Fmt::kMaxCode));
  code = _mm512_mask_blend_epi32(overflow, code, _mm512_set1_epi32(Fmt::kMaxCode));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(int(kInfBits)));
  code = _mm512_mask_blend_epi32(is_nan, code, _mm512_set1_epi32(Fmt::kNanCode));
  return _mm512_or_si512(code, sign);
}

// fp8_to_float on 16 codes, NaN as the canonical quiet NaN with the code's sign.
template <typename Fmt>
OCTET_TARGET_AVX512 inline __m512 decode16(const uint8_t* codes) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256i wide = _mm256_cvtepu8_epi16(bytes);
  const __m256i magnitude = _mm256_and_si256(wide, _mm256_set1_epi16(0x7F));
  __m512 value;
  __mmask16 is_nan;
  if constexpr (Fmt::kMantissaBits == 2) {
    // An E5M2 code shifted into the high byte is the IEEE half with the same value.
    value = _mm512_cvtph_ps(_mm256_slli_epi16(wide, 8));
    is_nan = _mm256_cmpgt_epi16_mask(magnitude, _mm256_set1_epi16(0x7C));
  } else {
    // E4M3 magnitude bits placed under a half's exponent read as value * 2^-8.
    const __m256i half =
        _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                        _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8));
    value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    is_nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
  }
  const __m512i sign =
      _mm512_slli_epi32(_mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0x80)), 24);
  const __m512 nan =
      _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(int(kQuietNanBits))));
  return _mm512_mask_blend_ps(is_nan, value, nan);
}

template <typename Fmt, typename In>
OCTET_TARGET_AVX512 uint32_t quantize_avx512(const In* x, size_t n, float scale, DType format,
                                             uint8_t* codes) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512i amax = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 value = load16(x + i);
    amax = _mm512_max_epu32(
        amax, _mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32(int(kAbsMask))));
    const __m512i code = encode16<Fmt>(_mm512_mul_ps(value, scale_v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
  const uint32_t tail = quantize_scalar(x + i, n - i, scale, format, codes + i);
  return std::max(uint32_t(_mm512_reduce_max_epu32(amax)), tail);
}

template <typename In>
OCTET_TARGET_AVX512 uint32_t amax_avx512(const In* x, size_t n) {
  __m512i amax = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(load16(x + i)),
                                                   _mm512_set1_epi32(int(kAbsMask))));
  }
  return std::max(uint32_t(_mm512_reduce_max_epu32(amax)), amax_scalar(x + i, n - i));
}

template <typename Fmt>
OCTET_TARGET_AVX512 void dequantize_avx512(const uint8_t* codes, size_t n, DType format,
                                           float scale_inv, float* out) {
  const __m512 scale_v = _mm512_set1_ps(scale_inv);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_mul_ps(decode16<Fmt>(codes + i), scale_v));
  }
  dequantize_scalar(codes + i, n - i, format, scale_inv, out + i);
}

template <typename Fmt>
OCTET_TARGET_AVX512 void widen_avx512(const uint8_t* codes, size_t n, DType format, bfloat16* out) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // Every FP8 value (and our canonical NaN) is exact in BF16: truncation is the conversion.
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(decode16<Fmt>(codes + i)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(bits));
  }
  widen_scalar(codes + i, n - i, format, out + i);
}

// ---- AVX2 -------------------------------------------------------------------------------

OCTET_TARGET_AVX2 inline __m256 load8(const float* x) {
  return _mm256_loadu_ps(x);
}
OCTET_TARGET_AVX2 inline __m256 load8(const bfloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

OCTET_TARGET_AVX2 inline uint32_t reduce_max_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return uint32_t(_mm_cvtsi128_si32(m));
}

// The low byte of each of 8 lanes, as 8 consecutive bytes.
OCTET_TARGET_AVX2 inline void store8_low_bytes(__m256i v, uint8_t* out) {
  const __m256i gather =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, gather),
                                                     _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

template <typename Fmt>
OCTET_TARGET_AVX2 inline __m256i encode8(__m256 y) {
  constexpr int kShift = 23 - Fmt::kMantissaBits;
  constexpr int kMinNormalExponent = 1 - Fmt::kBias;
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(int(kAbsMask)));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(magnitude, kShift), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(magnitude,
                       _mm256_add_epi32(_mm256_set1_epi32((1 << (kShift - 1)) - 1), lsb)),
      kShift);
  const __m256i normal =
      _mm256_sub_epi32(rounded, _mm256_set1_epi32((127 - Fmt::kBias) << Fmt::kMantissaBits));
  const __m256 quanta = _mm256_mul_ps(
      _mm256_castsi256_ps(magnitude),
      _mm256_set1_ps(
          std::bit_cast<float>(uint32_t(127 + Fmt::kMantissaBits - kMinNormalExponent) << 23)));
  const __m256i subnormal =
      _mm256_cvttps_epi32(_mm256_round_ps(quanta, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i is_subnormal =
      _mm256_cmpgt_epi32(_mm256_set1_epi32((127 + kMinNormalExponent) << 23), magnitude);
  __m256i code = _mm256_blendv_epi8(normal, subnormal, is_subnormal);
  const __m256i overflow = _mm256_cmpgt_epi32(code, _mm256_set1_epi32(Fmt::kMaxCode));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(Fmt::kMaxCode), overflow);
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(int(kInfBits)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(Fmt::kNanCode), is_nan);
  return _mm256_or_si256(code, sign);
}

template <typename Fmt>
OCTET_TARGET_AVX2 inline __m256 decode8(const uint8_t* codes) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m128i wide = _mm_cvtepu8_epi16(bytes);
  const __m128i magnitude = _mm_and_si128(wide, _mm_set1_epi16(0x7F));
  __m256 value;
  __m128i is_nan;
  if constexpr (Fmt::kMantissaBits == 2) {
    value = _mm256_cvtph_ps(_mm_slli_epi16(wide, 8));
    is_nan = _mm_cmpgt_epi16(magnitude, _mm_set1_epi16(0x7C));
  } else {
    const __m128i half = _mm_or_si128(_mm_slli_epi16(magnitude, 7),
                                      _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8));
    value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    is_nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F));
  }
  const __m256i sign =
      _mm256_slli_epi32(_mm256_and_si256(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(0x80)), 24);
  const __m256 nan =
      _mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_set1_epi32(int(kQuietNanBits))));
  return _mm256_blendv_ps(value, nan, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(is_nan)));
}

template <typename Fmt, typename In>
OCTET_TARGET_AVX2 uint32_t quantize_avx2(const In* x, size_t n, float scale, DType format,
                                         uint8_t* codes) {
  const __m256 scale_v = _mm256_set1_ps(scale);
  __m256i amax = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 value = load8(x + i);
    amax = _mm256_max_epu32(
        amax, _mm256_and_si256(_mm256_castps_si256(value), _mm256_set1_epi32(int(kAbsMask))));
    store8_low_bytes(encode8<Fmt>(_mm256_mul_ps(value, scale_v)), codes + i);
  }
  const uint32_t tail = quantize_scalar(x + i, n - i, scale, format, codes + i);
  return std::max(reduce_max_epu32(amax), tail);
}

template <typename In>
OCTET_TARGET_AVX2 uint32_t amax_avx2(const In* x, size_t n) {
  __m256i amax = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(load8(x + i)),
                                                   _mm256_set1_epi32(int(kAbsMask))));
  }
  return std::max(reduce_max_epu32(amax), amax_scalar(x + i, n - i));
}

// 16 codes at a time where none is a NaN (one byte test per load): each moved into FP16's
// fields by a shift (E5M2 is FP16's upper byte; E4M3 sign-extended and shifted 7 left puts its
// exponent and mantissa in FP16's, 2^8 below, and its sign in bit 15, with bit 14 cleared),
// widened by F16C, times the scale (with E4M3's 2^8 folded in where that stays finite: the
// same single rounding of the exact product). A load holding a NaN takes decode8's blend.
// About half the instructions of decode8 per code, for the GEMMs' widening of FP8 operands
// where oneDNN has no BF16 matmul.
template <typename Fmt>
OCTET_TARGET_AVX2 void dequantize_avx2(const uint8_t* codes, size_t n, DType format,
                                       float scale_inv, float* out) {
  const __m256 scale_v = _mm256_set1_ps(scale_inv);
  constexpr bool e4m3 = Fmt::kMantissaBits == 3;
  const bool fold = !e4m3 || std::isfinite(scale_inv * 256.0f);
  const __m256 scale16 = _mm256_set1_ps(e4m3 && fold ? scale_inv * 256.0f : scale_inv);
  const __m128i magnitude_mask = _mm_set1_epi8(0x7F);
  size_t i = 0;
  for (; fold && i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m128i magnitude = _mm_and_si128(bytes, magnitude_mask);
    const __m128i nan = e4m3 ? _mm_cmpeq_epi8(magnitude, magnitude_mask)
                             : _mm_cmpgt_epi8(magnitude, _mm_set1_epi8(0x7C));
    if (_mm_movemask_epi8(nan) != 0) {
      for (size_t j = i; j < i + 16; j += 8) {
        _mm256_storeu_ps(out + j, _mm256_mul_ps(decode8<Fmt>(codes + j), scale_v));
      }
      continue;
    }
    __m256i half;
    if constexpr (e4m3) {
      half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                              _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    } else {
      half = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    }
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), scale16));
    _mm256_storeu_ps(out + i + 8,
                     _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), scale16));
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(decode8<Fmt>(codes + i), scale_v));
  }
  dequantize_scalar(codes + i, n - i, format, scale_inv, out + i);
}

template <typename Fmt>
OCTET_TARGET_AVX2 void widen_avx2(const uint8_t* codes, size_t n, DType format, bfloat16* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(decode8<Fmt>(codes + i)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  widen_scalar(codes + i, n - i, format, out + i);
}

// ---- dispatch ---------------------------------------------------------------------------

template <typename In>
QuantizeKernel<In> quantize_kernel(DType format) {
  const bool e4m3 = format == DType::E4M3;
  switch (active_isa()) {
    case Isa::Avx512:
      return e4m3 ? quantize_avx512<E4M3Format, In> : quantize_avx512<E5M2Format, In>;
    case Isa::Avx2:
      return e4m3 ? quantize_avx2<E4M3Format, In> : quantize_avx2<E5M2Format, In>;
    case Isa::Scalar:
      break;
  }
  return quantize_scalar<In>;
}

template <typename In>
float quantize_impl(const In* x, size_t n, float scale, DType format, uint8_t* codes) {
  check_format(format, "quantize_fp8");
  const QuantizeKernel<In> kernel = quantize_kernel<In>(format);
  return amax_from_bits(reduce_chunks(n, [&](size_t begin, size_t end) {
    return kernel(x + begin, end - begin, scale, format, codes + begin);
  }));
}

template <typename In>
float amax_impl(const In* x, size_t n) {
  uint32_t (*kernel)(const In*, size_t) = amax_scalar<In>;
  if (active_isa() == Isa::Avx512) kernel = amax_avx512<In>;
  if (active_isa() == Isa::Avx2) kernel = amax_avx2<In>;
  return amax_from_bits(
      reduce_chunks(n, [&](size_t begin, size_t end) { return kernel(x + begin, end - begin); }));
}

// in [16, 16] (row stride in_stride) -> out [16, 16] transposed (row stride out_stride), with
// four rounds of interleaving; SSE2 is part of x86-64, so every path may use it.
void transpose_16x16_bytes(const uint8_t* in, size_t in_stride, uint8_t* out, size_t out_stride) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_stride));
  }
  for (int i = 0; i < 8; ++i) {  // pairs of rows -> 2-byte columns
    b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // quads of rows -> 4-byte columns
    const int base = 4 * g;
    a[base + 0] = _mm_unpacklo_epi16(b[base + 0], b[base + 2]);
    a[base + 1] = _mm_unpackhi_epi16(b[base + 0], b[base + 2]);
    a[base + 2] = _mm_unpacklo_epi16(b[base + 1], b[base + 3]);
    a[base + 3] = _mm_unpackhi_epi16(b[base + 1], b[base + 3]);
  }
  for (int g = 0; g < 2; ++g) {  // octets of rows -> 8-byte columns
    const int base = 8 * g;
    for (int k = 0; k < 4; ++k) {
      b[base + 2 * k] = _mm_unpacklo_epi32(a[base + k], a[base + 4 + k]);
      b[base + 2 * k + 1] = _mm_unpackhi_epi32(a[base + k], a[base + 4 + k]);
    }
  }
  for (int k = 0; k < 8; ++k) {  // all 16 rows -> whole columns
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * k) * out_stride),
                     _mm_unpacklo_epi64(b[k], b[8 + k]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * k + 1) * out_stride),
                     _mm_unpackhi_epi64(b[k], b[8 + k]));
  }
}

// in [block_rows, block_cols] (row stride in_stride) -> out [block_cols, block_rows] (row stride
// out_stride): whole 16x16 blocks by interleaving, the ragged edges element by element.
void transpose_block(const uint8_t* in, int64_t in_stride, int64_t block_rows, int64_t block_cols,
                     uint8_t* out, int64_t out_stride) {
  const int64_t full_rows = block_rows / 16 * 16;
  const int64_t full_cols = block_cols / 16 * 16;
  for (int64_t r = 0; r < full_rows; r += 16) {
    for (int64_t c = 0; c < full_cols; c += 16) {
      transpose_16x16_bytes(in + r * in_stride + c, size_t(in_stride), out + c * out_stride + r,
                            size_t(out_stride));
    }
  }
  for (int64_t c = 0; c < block_cols; ++c) {
    const int64_t r_begin = c < full_cols ? full_rows : 0;  // rows the blocks did not cover
    for (int64_t r = r_begin; r < block_rows; ++r) out[c * out_stride + r] = in[r * in_stride + c];
  }
}

// x [rows, cols] is cut into kTile x kTile tiles; each tile is quantized row by row into codes
// (or a local buffer when codes is null) and written transposed to codes_t while in cache.
template <typename In>
float cast_transpose_impl(const In* x, int64_t rows, int64_t cols, float scale, DType format,
                          uint8_t* codes, uint8_t* codes_t) {
  check_format(format, "cast_transpose_fp8");
  OCTET_CHECK(rows >= 0 && cols >= 0, "cast_transpose_fp8: expected a non-negative shape, got [",
              rows, ",", cols, "]");
  constexpr int64_t kTile = 128;
  const QuantizeKernel<In> kernel = quantize_kernel<In>(format);
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = row_tiles * col_tiles;
  const bool parallel = static_cast<size_t>(rows * cols) >= kParallelMin;
  uint32_t amax = 0;
#pragma omp parallel for schedule(static) reduction(max : amax) if (parallel)
  for (int64_t tile_index = 0; tile_index < tiles; ++tile_index) {
    const int64_t r0 = (tile_index / col_tiles) * kTile;
    const int64_t c0 = (tile_index % col_tiles) * kTile;
    const int64_t tile_rows = std::min(kTile, rows - r0);
    const int64_t tile_cols = std::min(kTile, cols - c0);
    alignas(64) uint8_t buffer[kTile * kTile];
    uint8_t* tile = codes != nullptr ? codes + r0 * cols + c0 : buffer;
    const int64_t tile_stride = codes != nullptr ? cols : kTile;
    for (int64_t r = 0; r < tile_rows; ++r) {
      amax = std::max(amax, kernel(x + (r0 + r) * cols + c0, static_cast<size_t>(tile_cols), scale,
                                   format, tile + r * tile_stride));
    }
    if (codes_t != nullptr) {
      transpose_block(tile, tile_stride, tile_rows, tile_cols, codes_t + c0 * rows + r0, rows);
    }
  }
  return amax_from_bits(amax);
}

}  // namespace

float quantize_fp8(const float* x, size_t n, float scale, DType format, uint8_t* codes) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return quantize_impl(x, n, scale, format, codes);
}

float quantize_fp8(const bfloat16* x, size_t n, float scale, DType format, uint8_t* codes) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return quantize_impl(x, n, scale, format, codes);
}

void dequantize_fp8(const uint8_t* codes, size_t n, DType format, float scale_inv, float* out) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  check_format(format, "dequantize_fp8");
  const bool e4m3 = format == DType::E4M3;
  DequantizeKernel kernel = dequantize_scalar;
  if (active_isa() == Isa::Avx512) {
    kernel = e4m3 ? dequantize_avx512<E4M3Format> : dequantize_avx512<E5M2Format>;
  } else if (active_isa() == Isa::Avx2) {
    kernel = e4m3 ? dequantize_avx2<E4M3Format> : dequantize_avx2<E5M2Format>;
  }
  reduce_chunks(n, [&](size_t begin, size_t end) {
    kernel(codes + begin, end - begin, format, scale_inv, out + begin);
    return uint32_t{0};
  });
}

void fp8_to_bf16(const uint8_t* codes, size_t n, DType format, bfloat16* out) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  check_format(format, "fp8_to_bf16");
  const bool e4m3 = format == DType::E4M3;
  WidenKernel kernel = widen_scalar;
  if (active_isa() == Isa::Avx512) {
    kernel = e4m3 ? widen_avx512<E4M3Format> : widen_avx512<E5M2Format>;
  } else if (active_isa() == Isa::Avx2) {
    kernel = e4m3 ? widen_avx2<E4M3Format> : widen_avx2<E5M2Format>;
  }
  reduce_chunks(n, [&](size_t begin, size_t end) {
    kernel(codes + begin, end - begin, format, out + begin);
    return uint32_t{0};
  });
}

float amax_of(const float* x, size_t n) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return amax_impl(x, n);
}
float amax_of(const bfloat16* x, size_t n) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return amax_impl(x, n);
}

float cast_transpose_fp8(const float* x, int64_t rows, int64_t cols, float scale, DType format,
                         uint8_t* codes, uint8_t* codes_t) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return cast_transpose_impl(x, rows, cols, scale, format, codes, codes_t);
}

float cast_transpose_fp8(const bfloat16* x, int64_t rows, int64_t cols, float scale, DType format,
                         uint8_t* codes, uint8_t* codes_t) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  return cast_transpose_impl(x, rows, cols, scale, format, codes, codes_t);
}

}  // namespace octet
