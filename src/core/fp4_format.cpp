// Scalar OCP FP4 (E2M1) element conversions: the reference of the FP4 quantizers (src/fp8).
#include <cmath>
#include <cstdint>

#include "octet/dtype.h"

namespace octet {
namespace {

// Magnitudes of codes 0..7.
constexpr float kE2M1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// |value| as a magnitude code, round to nearest with ties to the even code (the code whose
// mantissa bit is 0): the midpoints 0.25, 1.25, 2.5 and 5 go down, 0.75, 1.75 and 3.5 go up.
uint8_t magnitude_code(float m) {
  if (!(m <= 5.0f)) return 7;  // past 5 (saturating), or NaN
  if (m <= 0.25f) return 0;
  if (m < 0.75f) return 1;
  if (m <= 1.25f) return 2;
  if (m < 1.75f) return 3;
  if (m <= 2.5f) return 4;
  if (m < 3.5f) return 5;
  return 6;
}

}  // namespace

float e2m1_to_float(uint8_t code) {
  const float magnitude = kE2M1Values[code & 0x7];
  return (code & 0x8) != 0 ? -magnitude : magnitude;
}

uint8_t float_to_e2m1(float value) {
  const uint8_t sign = std::signbit(value) ? 0x8 : 0x0;
  return sign | magnitude_code(std::fabs(value));
}

uint8_t float_to_e2m1_stochastic(float value, float u) {
  const uint8_t sign = std::signbit(value) ? 0x8 : 0x0;
  const float m = std::fabs(value);
  if (!(m < kE2M1Max)) return sign | 7;  // 6 and past it (saturated), NaN
  uint8_t lower = 0;
  while (kE2M1Values[lower + 1] <= m) ++lower;  // kE2M1Values[lower] <= m < next
  const float low = kE2M1Values[lower], high = kE2M1Values[lower + 1];
  const bool up = u * (high - low) < m - low;
  return sign | static_cast<uint8_t>(up ? lower + 1 : lower);
}

}  // namespace octet
