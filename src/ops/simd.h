// What the vectorized operator kernels share: the target attributes of the per-ISA wrappers
// (see src/ops/README.md), and loads/stores that widen BF16 to F32 and round back.
#pragma once

#include <bit>
#include <cstdint>

#include "octet/cpu_features.h"
#include "octet/dtype.h"

#define OCTET_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")))
#define OCTET_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define OCTET_ALWAYS_INLINE inline __attribute__((always_inline))

namespace octet::simd {

OCTET_ALWAYS_INLINE float load(float value) {
  return value;
}
OCTET_ALWAYS_INLINE float load(bfloat16 value) {
  return std::bit_cast<float>(uint32_t{value.bits} << 16);
}

// condition ? if_true : if_false through a bit mask: GCC 12 does not if-convert some ?:
// forms inside vectorized loops (the loop then stays scalar); this always vectorizes.
OCTET_ALWAYS_INLINE float select(bool condition, float if_true, float if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(if_true) & mask) |
                              (std::bit_cast<uint32_t>(if_false) & ~mask));
}

OCTET_ALWAYS_INLINE void store(float value, float* out) {
  *out = value;
}
// Round to nearest even, NaN kept quiet: the same result as float_to_bf16, branch-free so
// that it vectorizes.
OCTET_ALWAYS_INLINE void store(float value, bfloat16* out) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t nan = (bits >> 16) | 0x40u;
  out->bits = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace octet::simd
