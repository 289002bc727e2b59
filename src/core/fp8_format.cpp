// Scalar OCP FP8 (E4M3, E5M2) and E8M0 element conversions: the element types core knows
// about, and the reference every bulk FP8 kernel (src/fp8) matches.
#include <bit>
#include <cstdint>
#include <limits>

#include "octet/dtype.h"
#include "octet/error.h"

namespace octet {
namespace {

// The bit layout of one FP8 format, as the encoder and decoder need it.
struct Fp8Layout {
  int mantissa_bits;
  int bias;
  uint32_t max_code;      // largest finite magnitude code
  uint8_t nan_code;       // magnitude code of the NaN we produce
  uint8_t overflow_code;  // magnitude code of a non-saturated overflow (NaN or Inf)
  bool has_infinity;
  float max_value;
};

constexpr Fp8Layout kE4M3{3, 7, 0x7E, 0x7F, 0x7F, false, 448.0f};
constexpr Fp8Layout kE5M2{2, 15, 0x7B, 0x7E, 0x7C, true, 57344.0f};

const Fp8Layout& layout_of(DType format) {
  OCTET_CHECK(is_fp8(format), "fp8: expected format e4m3 or e5m2, got ", dtype_name(format));
  return format == DType::E4M3 ? kE4M3 : kE5M2;
}

float quiet_nan(bool negative) {
  return std::bit_cast<float>(0x7FC00000u | (negative ? 0x80000000u : 0u));
}

}  // namespace

float fp8_max(DType format) {
  return layout_of(format).max_value;
}

float fp8_to_float(uint8_t code, DType format) {
  const Fp8Layout& f = layout_of(format);
  const bool negative = code & 0x80;
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t exponent = magnitude >> f.mantissa_bits;
  const uint32_t mantissa = magnitude & ((1u << f.mantissa_bits) - 1);
  const uint32_t top_exponent = (1u << (7 - f.mantissa_bits)) - 1;
  if (f.has_infinity && exponent == top_exponent) {
    if (mantissa != 0) return quiet_nan(negative);
    return negative ? -std::numeric_limits<float>::infinity()
                    : std::numeric_limits<float>::infinity();
  }
  if (!f.has_infinity && magnitude == 0x7F) return quiet_nan(negative);
  float value;
  if (exponent == 0) {  // subnormal: mantissa * 2^(1 - bias - mantissa_bits), exact in F32
    const int scale_exponent = 1 - f.bias - f.mantissa_bits;
    value =
        static_cast<float>(mantissa) * std::bit_cast<float>(uint32_t(127 + scale_exponent) << 23);
  } else {
    value =
        std::bit_cast<float>((exponent - f.bias + 127) << 23 | mantissa << (23 - f.mantissa_bits));
  }
  return negative ? -value : value;
}

uint8_t float_to_fp8(float value, DType format, bool saturate) {
  const Fp8Layout& f = layout_of(format);
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | f.nan_code;
  if (magnitude == 0x7F800000u) return sign | (saturate ? f.max_code : f.overflow_code);

  const int min_normal_exponent = 1 - f.bias;  // unbiased
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  uint32_t code;
  if (exponent >= min_normal_exponent) {
    // Round the F32 mantissa to mantissa_bits (ties to even), then rebias the exponent;
    // a carry out of the mantissa correctly bumps the exponent.
    const int shift = 23 - f.mantissa_bits;
    const uint32_t rounded =
        (magnitude + (1u << (shift - 1)) - 1 + ((magnitude >> shift) & 1)) >> shift;
    code = rounded - (uint32_t(127 - f.bias) << f.mantissa_bits);
  } else if (magnitude < 0x00800000u) {
    code = 0;  // F32 subnormals lie far below half the smallest FP8 subnormal
  } else {
    // Subnormal target: count quanta of 2^(min_normal_exponent - mantissa_bits), ties to even.
    // The count may reach 2^mantissa_bits, which is exactly the code of the smallest normal.
    const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    const int shift = 23 + min_normal_exponent - f.mantissa_bits - exponent;
    if (shift > 25) {
      code = 0;
    } else {
      code = (significand + (1u << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift;
    }
  }
  if (code > f.max_code) return sign | (saturate ? f.max_code : f.overflow_code);
  return sign | static_cast<uint8_t>(code);
}

float e8m0_to_float(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127, an F32 subnormal
  return std::bit_cast<float>(uint32_t{code} << 23);
}

uint8_t float_to_e8m0_ceil(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7F800000u) == 0x7F800000u) return 0xFF;      // NaN or +-Inf
  if (value <= std::bit_cast<float>(0x00400000u)) return 0;  // <= 2^-127, zero and negatives
  const uint32_t exponent = bits >> 23;                      // sign is 0 here
  if (exponent == 0) return 1;                               // 2^-127 < value < 2^-126
  const uint32_t code = exponent + ((bits & 0x7FFFFFu) != 0 ? 1 : 0);
  return static_cast<uint8_t>(code > 254 ? 254 : code);
}

}  // namespace octet
