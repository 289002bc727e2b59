// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011, the generator cuRAND and
// PyTorch's CUDA dropout use). A (seed, counter) pair always gives the same four 32-bit
// words, so forward and backward regenerate a dropout mask instead of storing it, and any
// thread can compute any element's number without shared state.
#pragma once

#include <array>
#include <cstdint>

namespace octet {

inline std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t counter_low,
                                          uint64_t counter_high = 0) {
  uint32_t c0 = static_cast<uint32_t>(counter_low), c1 = static_cast<uint32_t>(counter_low >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_high), c3 = static_cast<uint32_t>(counter_high >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t{0xD2511F53u} * c0;
    uint64_t p1 = uint64_t{0xCD9E8D57u} * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {c0, c1, c2, c3};
}

// Uniform in [0, 1) with 24 random bits (exact in F32).
inline float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// The uniform number of element `index` of the stream (seed, offset): element i uses word
// i % 4 of the block at counter offset + i / 4.
inline float philox_uniform(uint64_t seed, uint64_t offset, uint64_t index) {
  return uniform_from_bits(philox4x32(seed, offset + index / 4)[index % 4]);
}

}  // namespace octet
