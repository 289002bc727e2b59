// The random words of one training sample (BERT's and T5's batchers): drawn in order from
// Philox blocks at counters position * 2^20 + block under (seed, stream), so that each sample of
// the whole data stream has its own blocks and the same (seed, stream, position) always gives
// the same sample.
#pragma once

#include <array>
#include <cstdint>

#include "octet/rng.h"

namespace octet::train_detail {

class SampleDraws {
 public:
  // Words one sample may draw without reaching the next sample's blocks.
  static constexpr int64_t kMaxWords = int64_t{4} << 20;

  SampleDraws(uint64_t seed, uint64_t position, uint64_t stream)
      : seed_(seed), counter_(position << 20), stream_(stream) {}

  uint32_t word() {
    if (used_ == 4) {
      block_ = philox4x32(seed_, counter_++, stream_);
      used_ = 0;
    }
    return block_[used_++];
  }
  // Uniform in [0, 1).
  double uniform() { return word() * (1.0 / 4294967296.0); }
  // Uniform in [0, count) from 64 random bits (the modulo bias is below count / 2^64).
  int64_t below(int64_t count) {
    const uint64_t random = (uint64_t{word()} << 32) | word();
    return static_cast<int64_t>(random % static_cast<uint64_t>(count));
  }
  // Uniform in [low, high].
  int64_t between(int64_t low, int64_t high) { return low + below(high - low + 1); }

 private:
  uint64_t seed_, counter_, stream_;
  std::array<uint32_t, 4> block_{};
  int used_ = 4;
};

}  // namespace octet::train_detail
