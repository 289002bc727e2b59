// F32 <-> BF16 / F16: rounding anchors for the scalar reference, and the bulk conversions
// against it, bit for bit, on every instruction-set path this processor has.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/convert.h"
#include "octet/cpu_features.h"
#include "octet/dtype.h"
#include "test_util.h"

namespace octet {
namespace {

using octet::testing::available_isas;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits_of(float value) {
  return std::bit_cast<uint32_t>(value);
}
float from_bits(uint32_t bits) {
  return std::bit_cast<float>(bits);
}

struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

// Bulk conversion of one value on the active path, padded so vector blocks see it too.
uint16_t bulk_to_bf16(float value) {
  std::vector<float> in(37, value);
  std::vector<bfloat16> out(in.size());
  convert_f32_to_bf16(in.data(), out.data(), in.size());
  for (const bfloat16& o : out) EXPECT_EQ(o.bits, out[0].bits);
  return out[0].bits;
}

uint16_t bulk_to_f16(float value) {
  std::vector<float> in(37, value);
  std::vector<float16> out(in.size());
  convert_f32_to_f16(in.data(), out.data(), in.size());
  for (const float16& o : out) EXPECT_EQ(o.bits, out[0].bits);
  return out[0].bits;
}

TEST(Convert, Bf16RoundingAnchors) {
  IsaGuard guard;
  const float one = 1.0f;
  const float half_ulp = std::ldexp(1.0f, -8);  // half a BF16 ulp at 1.0
  struct Case {
    float value;
    uint16_t expected;
  };
  const Case cases[] = {
      {one, 0x3F80},
      {one + half_ulp, 0x3F80},                          // tie -> even (0x3F80)
      {one + 3 * half_ulp, 0x3F82},                      // tie -> even (0x3F82)
      {one + half_ulp + std::ldexp(1.0f, -20), 0x3F81},  // just past the tie
      {-(one + half_ulp), 0xBF80},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {from_bits(0x00018000), 0x0002},  // subnormal tie, odd -> up
      {FLT_MAX, 0x7F80},                // rounds past the largest BF16: Inf
      {from_bits(0x7F7F7FFF), 0x7F7F},
      {kInf, 0x7F80},
      {-kInf, 0xFF80},
  };
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    for (const Case& c : cases) {
      EXPECT_EQ(float_to_bf16(c.value), c.expected) << c.value;
      EXPECT_EQ(bulk_to_bf16(c.value), c.expected) << c.value << " " << isa_name(isa);
    }
    for (float nan : {kNaN, -kNaN, from_bits(0x7F800001u)}) {  // the last is signalling
      const uint16_t bits = bulk_to_bf16(nan);
      EXPECT_EQ(bits, float_to_bf16(nan));
      EXPECT_TRUE(std::isnan(bf16_to_float(bits)));
      EXPECT_EQ(bits & 0x0040, 0x0040) << "quiet";
      EXPECT_EQ(std::signbit(bf16_to_float(bits)), std::signbit(nan));
    }
  }
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xC000), -2.0f);
  EXPECT_EQ(bf16_to_float(0x7F80), kInf);
  EXPECT_EQ(bf16_to_float(0x0001), from_bits(0x00010000));
}

TEST(Convert, F16RoundingAnchors) {
  IsaGuard guard;
  struct Case {
    float value;
    uint16_t expected;
  };
  const Case cases[] = {
      {1.0f, 0x3C00},
      {1.0f + std::ldexp(1.0f, -11), 0x3C00},      // tie -> even
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02},  // tie -> even
      {1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -22), 0x3C01},
      {-2.5f, 0xC100},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {65504.0f, 0x7BFF},
      {65519.996f, 0x7BFF},
      {65520.0f, 0x7C00},  // the tie with 2^16: 65504 has an odd mantissa, so Inf
      {-65520.0f, 0xFC00},
      {1e10f, 0x7C00},
      {-1e10f, 0xFC00},
      {FLT_MAX, 0x7C00},
      {kInf, 0x7C00},
      {-kInf, 0xFC00},
      {std::ldexp(1.0f, -14), 0x0400},  // smallest normal
      {std::ldexp(1023.0f, -24), 0x03FF},
      {std::ldexp(1.0f, -24), 0x0001},                          // smallest subnormal
      {std::ldexp(1.0f, -25), 0x0000},                          // tie with 0 -> 0
      {std::ldexp(1.0f + std::ldexp(1.0f, -10), -25), 0x0001},  // just past that tie
      {std::ldexp(3.0f, -25), 0x0002},                          // tie 1|2 -> 2
      {std::ldexp(5.0f, -25), 0x0002},                          // tie 2|3 -> 2
      {-std::ldexp(3.0f, -25), 0x8002},
      {std::ldexp(2047.0f, -25), 0x0400},  // tie at the subnormal/normal seam -> 0x400
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {-1e-30f, 0x8000},
  };
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    for (const Case& c : cases) {
      EXPECT_EQ(float_to_f16(c.value), c.expected) << c.value;
      EXPECT_EQ(bulk_to_f16(c.value), c.expected) << c.value << " " << isa_name(isa);
    }
    for (float nan : {kNaN, -kNaN, from_bits(0x7F800001u)}) {
      const uint16_t bits = bulk_to_f16(nan);
      EXPECT_EQ(bits, float_to_f16(nan));
      EXPECT_TRUE(std::isnan(f16_to_float(bits)));
      EXPECT_EQ(bits & 0x0200, 0x0200) << "quiet";
      EXPECT_EQ(std::signbit(f16_to_float(bits)), std::signbit(nan));
    }
  }
  EXPECT_EQ(f16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(bits_of(f16_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(f16_to_float(0x7C00), kInf);
  EXPECT_EQ(f16_to_float(0xFC00), -kInf);
  EXPECT_TRUE(std::isnan(f16_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(f16_to_float(0x7C01)));
}

// Every 16-bit code: widening equals the scalar bit for bit, and narrowing it back returns the
// code (NaN stays NaN). Offsets shift the codes across vector lanes and scalar tails.
template <typename Half>
void expect_all_codes_round_trip(float (*widen)(uint16_t), uint16_t (*narrow)(float),
                                 void (*bulk_widen)(const Half*, float*, size_t),
                                 void (*bulk_narrow)(const float*, Half*, size_t),
                                 uint16_t exponent_mask) {
  IsaGuard guard;
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    for (size_t offset : {size_t{0}, size_t{5}}) {
      SCOPED_TRACE(::testing::Message() << isa_name(isa) << " offset " << offset);
      const size_t n = 65536 + offset;
      std::vector<Half> codes(n);
      for (size_t i = 0; i < n; ++i) codes[i].bits = uint16_t(i < offset ? 0x3C00 : i - offset);
      std::vector<float> wide(n);
      bulk_widen(codes.data(), wide.data(), n);
      std::vector<Half> narrow_back(n);
      bulk_narrow(wide.data(), narrow_back.data(), n);
      size_t mismatches = 0;
      for (size_t i = 0; i < n; ++i) {
        const uint16_t code = codes[i].bits;
        const bool is_nan =
            (code & exponent_mask) == exponent_mask && (code & ~exponent_mask & 0x7FFF);
        const bool ok = bits_of(wide[i]) == bits_of(widen(code)) &&
                        narrow_back[i].bits == narrow(wide[i]) &&
                        (is_nan ? std::isnan(wide[i]) : narrow_back[i].bits == code);
        if (!ok && ++mismatches < 10) {
          ADD_FAILURE() << "code 0x" << std::hex << code << " wide 0x" << bits_of(wide[i])
                        << " back 0x" << narrow_back[i].bits;
        }
      }
      EXPECT_EQ(mismatches, 0u);
    }
  }
}

TEST(Convert, AllBf16CodesRoundTripOnEveryIsa) {
  expect_all_codes_round_trip<bfloat16>(bf16_to_float, float_to_bf16, convert_bf16_to_f32,
                                        convert_f32_to_bf16, 0x7F80);
}

TEST(Convert, AllF16CodesRoundTripOnEveryIsa) {
  expect_all_codes_round_trip<float16>(f16_to_float, float_to_f16, convert_f16_to_f32,
                                       convert_f32_to_f16, 0x7C00);
}

// Random bit patterns, wide-range normals and values next to BF16 / F16 rounding ties.
std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t r = rng();
    switch (r % 4) {
      case 0:
        values[i] = from_bits(uint32_t(rng()));
        break;
      case 1: {  // on or next to a BF16 tie (low 16 bits near 0x8000)
        const uint32_t base = uint32_t(rng()) & 0xFFFF0000u;
        values[i] = from_bits(base | (0x8000u + (r >> 8) % 3 - 1));
        break;
      }
      case 2: {  // on or next to an F16 tie (low 13 bits near 0x1000), F16 range
        const uint32_t base = (uint32_t(rng()) & 0x8000E000u) | (uint32_t(rng() % 40 + 100) << 23);
        values[i] = from_bits(base | (0x1000u + (r >> 8) % 3 - 1));
        break;
      }
      default:
        values[i] = std::ldexp(normal(rng), exponent(rng));
    }
  }
  return values;
}

TEST(Convert, RandomFloatsMatchScalarOnEveryIsa) {
  IsaGuard guard;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{33}, size_t{1000003}}) {
    const std::vector<float> x = random_floats(n, uint32_t(n + 11));
    std::vector<uint16_t> expected_bf16(n), expected_f16(n);
    for (size_t i = 0; i < n; ++i) {
      expected_bf16[i] = float_to_bf16(x[i]);
      expected_f16[i] = float_to_f16(x[i]);
    }
    for (Isa isa : available_isas()) {
      set_active_isa(isa);
      SCOPED_TRACE(::testing::Message() << isa_name(isa) << " n " << n);
      std::vector<bfloat16> bf16(n, bfloat16{0x1234});
      convert_f32_to_bf16(x.data(), bf16.data(), n);
      std::vector<float16> f16(n, float16{0x1234});
      convert_f32_to_f16(x.data(), f16.data(), n);
      std::vector<uint16_t> got_bf16(n), got_f16(n);
      for (size_t i = 0; i < n; ++i) {
        got_bf16[i] = bf16[i].bits;
        got_f16[i] = f16[i].bits;
      }
      EXPECT_EQ(got_bf16, expected_bf16);
      EXPECT_EQ(got_f16, expected_f16);
    }
  }
}

// In-place rounding to BF16 values kept in F32 (the widened GEMMs' operands): the scalar
// round trip, bit for bit, on every path, across chunk and block boundaries.
TEST(Convert, RoundF32ToBf16EqualsTheRoundTripOnEveryIsa) {
  IsaGuard guard;
  for (size_t n : {size_t{0}, size_t{5}, size_t{2049}, size_t{70001}}) {
    std::vector<float> x = random_floats(n, uint32_t(n + 29));
    for (size_t i = 0; i < n && i < 8; ++i)
      x[i] = std::vector<float>{kInf, -kInf, kNaN, 0.0f, -0.0f, FLT_MIN, FLT_MAX, 1e-40f}[i];
    std::vector<uint32_t> expected(n);
    for (size_t i = 0; i < n; ++i) expected[i] = bits_of(bf16_to_float(float_to_bf16(x[i])));
    for (Isa isa : available_isas()) {
      set_active_isa(isa);
      SCOPED_TRACE(::testing::Message() << isa_name(isa) << " n " << n);
      std::vector<float> y = x;
      round_f32_to_bf16(y.data(), n);
      std::vector<uint32_t> got(n);
      for (size_t i = 0; i < n; ++i) got[i] = bits_of(y[i]);
      EXPECT_EQ(got, expected);
    }
  }
}

}  // namespace
}  // namespace octet
