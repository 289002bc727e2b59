// Dtype names and sizes, and the scalar 16-bit float conversions (the reference path).
#include "octet/dtype.h"

#include <bit>
#include <string>

#include "octet/error.h"

namespace octet {

size_t dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::E4M3:
    case DType::E5M2:
    case DType::U8:
      return 1;
    case DType::I64:
      return 8;
  }
  fail("dtype_bytes: unknown dtype");
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::E4M3:
      return "e4m3";
    case DType::E5M2:
      return "e5m2";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::E5M2, DType::I32,
                      DType::I64, DType::U8}) {
    if (dtype_name(dtype) == name) return dtype;
  }
  fail(detail::concat("unknown dtype '", name,
                      "': expected one of f32, bf16, f16, e4m3, e5m2, i32, i64, u8"));
}

std::string_view device_name(Device device) {
  return device == Device::CPU ? "cpu" : "cuda";
}

float f16_to_float(uint16_t bits) {
  uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {
    uint32_t quiet = mantissa ? 0x400000u : 0u;
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13) | quiet);
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in F32
    float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t float_to_f16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: keep the top payload bits, force quiet
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  // 65520 is the midpoint between 65504 (odd mantissa) and 2^16: it and all above go to Inf.
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude >= 0x38800000u) {  // normal in F16 (>= 2^-14)
    uint32_t lsb = (magnitude >> 13) & 1u;
    magnitude += 0xfffu + lsb;
    return static_cast<uint16_t>(sign | ((magnitude - 0x38000000u) >> 13));
  }
  // Subnormal or zero: adding 0.5 (whose ulp is 2^-24) rounds to the F16 subnormal grid, RNE.
  float rounded = std::bit_cast<float>(magnitude) + 0.5f;
  return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(rounded) - 0x3f000000u));
}

}  // namespace octet
