// Element types and devices, plus the scalar conversions every kernel's reference path uses.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace octet {

enum class DType : uint8_t { F32, BF16, F16, E4M3, E5M2, I32, I64, U8 };
enum class Device : uint8_t { CPU, CUDA };

size_t dtype_bytes(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", "f16", "e4m3", "e5m2", "i32", ...
DType parse_dtype(std::string_view name);  // inverse of dtype_name; throws on unknown names
inline bool is_fp8(DType dtype) {
  return dtype == DType::E4M3 || dtype == DType::E5M2;
}
std::string_view device_name(Device device);

// OCP FP8 element conversions (src/core/fp8_format.cpp), the scalar reference of every bulk
// FP8 kernel. Encoding rounds to nearest even; without saturation an overflow becomes NaN
// (E4M3) or Inf (E5M2), with it +-max.
float fp8_max(DType format);  // 448 (E4M3) or 57344 (E5M2)
float fp8_to_float(uint8_t code, DType format);
uint8_t float_to_fp8(float value, DType format, bool saturate);
// E8M0: the power-of-two block scale of MXFP8 (bias 127, 0xFF = NaN).
float e8m0_to_float(uint8_t code);
// Smallest power of two >= value (so that value / 2^e never exceeds the FP8 maximum).
uint8_t float_to_e8m0_ceil(float value);

// OCP FP4 E2M1 (src/core/fp4_format.cpp): a 4-bit code S.EE.M, bias 1, no Inf or NaN; the
// magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Encoding saturates (anything past 6, infinities
// included, becomes +-6; NaN becomes +-6 too, so quantizers report NaN through their amax).
inline constexpr float kE2M1Max = 6.0f;
float e2m1_to_float(uint8_t code);   // the low 4 bits
uint8_t float_to_e2m1(float value);  // round to nearest, ties to even
// Stochastic rounding: one of the two neighbours of |value|, the upper one with probability
// (|value| - lower) / (upper - lower) for a uniform u in [0, 1) (exact values stay exact).
uint8_t float_to_e2m1_stochastic(float value, float u);

// Storage types for the 16- and 8-bit formats: raw bits, no arithmetic.
struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};
struct float8_e4m3 {
  uint8_t bits;
};
struct float8_e5m2 {
  uint8_t bits;
};

template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr DType value = DType::BF16;
};
template <>
struct dtype_of<float16> {
  static constexpr DType value = DType::F16;
};
template <>
struct dtype_of<float8_e4m3> {
  static constexpr DType value = DType::E4M3;
};
template <>
struct dtype_of<float8_e5m2> {
  static constexpr DType value = DType::E5M2;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::U8;
};

// Scalar conversions (the reference). Round to nearest even; NaN stays NaN (quieted). The BF16
// ones are inline: kernels storing element by element (epilogues, the few-rows GEMM's stores:
// 83,000 per GPT-2 124M decode step) call them in their loops.
inline float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(uint32_t{bits} << 16);
}
inline uint16_t float_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t lsb = (bits >> 16) & 1u;  // ties go to the even neighbour
  bits += 0x7fffu + lsb;
  return static_cast<uint16_t>(bits >> 16);
}
float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);

}  // namespace octet
