// Vectorizable element functions (exp, tanh, erf) and the activations built on them.
// Plain arithmetic and bit casts only, so GCC vectorizes loops that call them; accuracy is
// a few F32 ulps for exp and ~2e-7 absolute for tanh and erf, checked against std:: in tests.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "octet/ops/activation.h"
#include "ops/simd.h"

namespace octet::ops::math {

OCTET_ALWAYS_INLINE float exp(float x) {
  x = simd::select(x < -87.0f, -87.0f, x);
  x = simd::select(x > 88.0f, 88.0f, x);
  // n = round(x / ln 2): adding 1.5 * 2^23 leaves n in the low mantissa bits (no floor or
  // float-to-int conversion, which keep GCC from vectorizing).
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const uint32_t n_bits = std::bit_cast<uint32_t>(shifted) - 0x4B400000u;
  float r = x - n * 0.693359375f;  // ln 2 split in two so r stays exact
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((n_bits + 127u) << 23);
}

OCTET_ALWAYS_INLINE float tanh(float x) {
  return 1.0f - 2.0f / (math::exp(2.0f * x) + 1.0f);
}

OCTET_ALWAYS_INLINE float sigmoid(float x) {
  return 1.0f / (1.0f + math::exp(-x));
}

// Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), odd extension.
OCTET_ALWAYS_INLINE float erf(float x) {
  float a = std::fabs(x);
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  float y = 1.0f - p * t * math::exp(-a * a);
  return simd::select(x < 0.0f, -y, y);
}

inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr float kInvSqrt2 = 0.7071067811865476f;
inline constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// value and derivative of the elementwise part of each activation
OCTET_ALWAYS_INLINE float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + math::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
}
OCTET_ALWAYS_INLINE float gelu_tanh_grad(float x) {
  float t = math::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
}
OCTET_ALWAYS_INLINE float gelu_erf(float x) {
  return 0.5f * x * (1.0f + math::erf(x * kInvSqrt2));
}
OCTET_ALWAYS_INLINE float gelu_erf_grad(float x) {
  return 0.5f * (1.0f + math::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * math::exp(-0.5f * x * x);
}
OCTET_ALWAYS_INLINE float relu(float x) {
  return x > 0.0f ? x : 0.0f;
}
OCTET_ALWAYS_INLINE float relu_grad(float x) {
  return x > 0.0f ? 1.0f : 0.0f;
}
OCTET_ALWAYS_INLINE float silu(float x) {
  return x * math::sigmoid(x);
}
OCTET_ALWAYS_INLINE float silu_grad(float x) {
  float s = math::sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// Each activation as a value type with operator() and grad(), for the row kernels.
struct GeluTanh {
  OCTET_ALWAYS_INLINE float operator()(float x) const { return gelu_tanh(x); }
  OCTET_ALWAYS_INLINE float grad(float x) const { return gelu_tanh_grad(x); }
};
struct GeluErf {
  OCTET_ALWAYS_INLINE float operator()(float x) const { return gelu_erf(x); }
  OCTET_ALWAYS_INLINE float grad(float x) const { return gelu_erf_grad(x); }
};
struct Relu {
  OCTET_ALWAYS_INLINE float operator()(float x) const { return relu(x); }
  OCTET_ALWAYS_INLINE float grad(float x) const { return relu_grad(x); }
};
struct Silu {
  OCTET_ALWAYS_INLINE float operator()(float x) const { return silu(x); }
  OCTET_ALWAYS_INLINE float grad(float x) const { return silu_grad(x); }
};

}  // namespace octet::ops::math
