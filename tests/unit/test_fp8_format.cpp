// OCP FP8 formats: every code against values computed from its bit fields, encoding (ties,
// subnormals, saturation, overflow, NaN), E8M0, and every bulk kernel against the scalar
// reference on every instruction-set path this processor has.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/error.h"
#include "octet/fp8.h"
#include "test_util.h"

namespace octet {
namespace {

using octet::testing::available_isas;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DType kFormats[] = {DType::E4M3, DType::E5M2};

uint32_t bits_of(float value) {
  return std::bit_cast<uint32_t>(value);
}
float next_up(float value) {
  return std::nextafter(value, kInf);
}
float next_down(float value) {
  return std::nextafter(value, -kInf);
}

// Restores the active instruction set when a test that switches it ends.
struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

// The OCP value of a code, straight from its sign, exponent and mantissa fields.
float ocp_value(uint8_t code, DType format) {
  const bool e4m3 = format == DType::E4M3;
  const int mantissa_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int exponent = (code & 0x7F) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int top_exponent = e4m3 ? 15 : 31;
  if (e4m3 && exponent == top_exponent && mantissa == 7) return kNaN;
  if (!e4m3 && exponent == top_exponent) return mantissa == 0 ? float(sign * kInf) : kNaN;
  const double fraction = double(mantissa) / double(1 << mantissa_bits);
  if (exponent == 0) return float(sign * std::ldexp(fraction, 1 - bias));
  return float(sign * std::ldexp(1.0 + fraction, exponent - bias));
}

bool is_nan_code(uint8_t code, DType format) {
  return std::isnan(ocp_value(code, format));
}

void expect_decodes_all_codes(DType format) {
  for (int code = 0; code < 256; ++code) {
    const float expected = ocp_value(uint8_t(code), format);
    const float got = fp8_to_float(uint8_t(code), format);
    SCOPED_TRACE(::testing::Message() << dtype_name(format) << " code 0x" << std::hex << code);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(got, expected);
    }
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0);  // -0 and NaN keep the sign too
  }
}

TEST(Fp8Format, DecodesAllE4M3Codes) {
  expect_decodes_all_codes(DType::E4M3);
}
TEST(Fp8Format, DecodesAllE5M2Codes) {
  expect_decodes_all_codes(DType::E5M2);
}

TEST(Fp8Format, DecodeAnchors) {
  EXPECT_EQ(fp8_max(DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_max(DType::E5M2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x7E, DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_to_float(0xFE, DType::E4M3), -448.0f);
  EXPECT_EQ(fp8_to_float(0x08, DType::E4M3), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_to_float(0x07, DType::E4M3), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_to_float(0x01, DType::E4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_to_float(0x38, DType::E4M3), 1.0f);
  EXPECT_EQ(fp8_to_float(0x78, DType::E4M3), 256.0f);  // E4M3 has no infinity: 1111.000 is finite
  EXPECT_TRUE(std::isnan(fp8_to_float(0x7F, DType::E4M3)));
  EXPECT_TRUE(std::isnan(fp8_to_float(0xFF, DType::E4M3)));
  EXPECT_EQ(fp8_to_float(0x7B, DType::E5M2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x7C, DType::E5M2), kInf);
  EXPECT_EQ(fp8_to_float(0xFC, DType::E5M2), -kInf);
  EXPECT_EQ(fp8_to_float(0x01, DType::E5M2), std::ldexp(1.0f, -16));
  EXPECT_EQ(fp8_to_float(0x04, DType::E5M2), std::ldexp(1.0f, -14));
  EXPECT_EQ(fp8_to_float(0x3C, DType::E5M2), 1.0f);
  for (uint8_t code : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
    EXPECT_TRUE(std::isnan(fp8_to_float(code, DType::E5M2))) << int(code);
  }
  EXPECT_EQ(bits_of(fp8_to_float(0x80, DType::E4M3)), 0x80000000u);
  EXPECT_EQ(bits_of(fp8_to_float(0x80, DType::E5M2)), 0x80000000u);
}

TEST(Fp8Format, RoundTripsEveryCode) {
  for (DType format : kFormats) {
    for (bool saturate : {false, true}) {
      for (int code = 0; code < 256; ++code) {
        if (is_nan_code(uint8_t(code), format)) continue;
        const float value = fp8_to_float(uint8_t(code), format);
        uint8_t expected = uint8_t(code);
        if (std::isinf(value) && saturate) expected = (code & 0x80) | 0x7B;  // Inf -> +-max
        EXPECT_EQ(float_to_fp8(value, format, saturate), expected)
            << dtype_name(format) << " code " << code << " saturate " << saturate;
      }
    }
  }
}

// Between every two adjacent finite codes: the midpoint goes to the even code, a hair off
// it to the nearer code. Covers subnormals, the subnormal/normal seam and zero.
TEST(Fp8Format, TiesRoundToEven) {
  for (DType format : kFormats) {
    const int max_code = format == DType::E4M3 ? 0x7E : 0x7B;
    for (int low = 0; low < max_code; ++low) {
      const int high = low + 1;
      const float a = fp8_to_float(uint8_t(low), format);
      const float b = fp8_to_float(uint8_t(high), format);
      const float mid = (a + b) / 2;  // exact in F32
      const int even = (low % 2 == 0) ? low : high;
      for (int sign : {0x00, 0x80}) {
        const float s = sign ? -1.0f : 1.0f;
        SCOPED_TRACE(::testing::Message() << dtype_name(format) << " between codes " << low
                                          << " and " << high << " sign " << sign);
        EXPECT_EQ(float_to_fp8(s * mid, format, false), sign | even);
        EXPECT_EQ(float_to_fp8(s * next_down(mid), format, false), sign | low);
        EXPECT_EQ(float_to_fp8(s * next_up(mid), format, false), sign | high);
      }
    }
  }
  // Spot checks written out: 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39).
  EXPECT_EQ(float_to_fp8(1.0625f, DType::E4M3, false), 0x38);
  EXPECT_EQ(float_to_fp8(1.1875f, DType::E4M3, false), 0x3A);
  EXPECT_EQ(float_to_fp8(std::ldexp(3.0f, -10), DType::E4M3, false), 0x02);   // 1.5 quanta
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0f, -10), DType::E4M3, false), 0x00);   // 0.5 quanta
  EXPECT_EQ(float_to_fp8(std::ldexp(15.0f, -10), DType::E4M3, false), 0x08);  // to min normal
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0f, -17), DType::E5M2, false), 0x00);
  EXPECT_EQ(float_to_fp8(std::ldexp(3.0f, -17), DType::E5M2, false), 0x02);
}

TEST(Fp8Format, MaximaSaturationAndOverflow) {
  const DType e4m3 = DType::E4M3;
  const DType e5m2 = DType::E5M2;
  // E4M3: 448 = 1.110 x 2^8; 464 is the tie with 480 (the NaN pattern) and goes to 448.
  for (bool saturate : {false, true}) {
    EXPECT_EQ(float_to_fp8(448.0f, e4m3, saturate), 0x7E);
    EXPECT_EQ(float_to_fp8(460.0f, e4m3, saturate), 0x7E);
    EXPECT_EQ(float_to_fp8(464.0f, e4m3, saturate), 0x7E);
    EXPECT_EQ(float_to_fp8(-464.0f, e4m3, saturate), 0xFE);
    EXPECT_EQ(float_to_fp8(57344.0f, e5m2, saturate), 0x7B);
    EXPECT_EQ(float_to_fp8(61439.996f, e5m2, saturate), 0x7B);
  }
  EXPECT_EQ(float_to_fp8(next_up(464.0f), e4m3, false), 0x7F);
  EXPECT_EQ(float_to_fp8(next_up(464.0f), e4m3, true), 0x7E);
  EXPECT_EQ(float_to_fp8(-next_up(464.0f), e4m3, false), 0xFF);
  EXPECT_EQ(float_to_fp8(-next_up(464.0f), e4m3, true), 0xFE);
  // E5M2: 57344 = 1.11 x 2^15 has an odd mantissa, so the tie 61440 rounds up, to Inf.
  EXPECT_EQ(float_to_fp8(61440.0f, e5m2, false), 0x7C);
  EXPECT_EQ(float_to_fp8(61440.0f, e5m2, true), 0x7B);
  EXPECT_EQ(float_to_fp8(-61440.0f, e5m2, false), 0xFC);
  EXPECT_EQ(float_to_fp8(-61440.0f, e5m2, true), 0xFB);
  for (float big : {1e6f, FLT_MAX}) {
    EXPECT_EQ(float_to_fp8(big, e4m3, false), 0x7F);
    EXPECT_EQ(float_to_fp8(big, e4m3, true), 0x7E);
    EXPECT_EQ(float_to_fp8(-big, e4m3, false), 0xFF);
    EXPECT_EQ(float_to_fp8(-big, e4m3, true), 0xFE);
    EXPECT_EQ(float_to_fp8(big, e5m2, false), 0x7C);
    EXPECT_EQ(float_to_fp8(big, e5m2, true), 0x7B);
    EXPECT_EQ(float_to_fp8(-big, e5m2, false), 0xFC);
    EXPECT_EQ(float_to_fp8(-big, e5m2, true), 0xFB);
  }
  // Infinities: E4M3 has none (NaN without saturation), E5M2 keeps them; saturation -> max.
  EXPECT_EQ(float_to_fp8(kInf, e4m3, false), 0x7F);
  EXPECT_EQ(float_to_fp8(-kInf, e4m3, false), 0xFF);
  EXPECT_EQ(float_to_fp8(kInf, e4m3, true), 0x7E);
  EXPECT_EQ(float_to_fp8(-kInf, e4m3, true), 0xFE);
  EXPECT_EQ(float_to_fp8(kInf, e5m2, false), 0x7C);
  EXPECT_EQ(float_to_fp8(-kInf, e5m2, false), 0xFC);
  EXPECT_EQ(float_to_fp8(kInf, e5m2, true), 0x7B);
  EXPECT_EQ(float_to_fp8(-kInf, e5m2, true), 0xFB);
}

TEST(Fp8Format, ZerosSubnormalsAndNaN) {
  for (DType format : kFormats) {
    for (bool saturate : {false, true}) {
      EXPECT_EQ(float_to_fp8(0.0f, format, saturate), 0x00);
      EXPECT_EQ(float_to_fp8(-0.0f, format, saturate), 0x80);
      EXPECT_EQ(float_to_fp8(1e-30f, format, saturate), 0x00);
      EXPECT_EQ(float_to_fp8(-1e-30f, format, saturate), 0x80);
      EXPECT_EQ(float_to_fp8(std::numeric_limits<float>::denorm_min(), format, saturate), 0x00);
      EXPECT_EQ(float_to_fp8(-FLT_MIN, format, saturate), 0x80);
      const uint8_t nan = format == DType::E4M3 ? 0x7F : 0x7E;
      EXPECT_EQ(float_to_fp8(kNaN, format, saturate), nan);
      EXPECT_EQ(float_to_fp8(-kNaN, format, saturate), 0x80 | nan);
      EXPECT_EQ(float_to_fp8(std::bit_cast<float>(0x7F800001u), format, saturate), nan);  // sNaN
    }
  }
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0f, -9), DType::E4M3, false), 0x01);
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0001f, -10), DType::E4M3, false), 0x01);
  EXPECT_EQ(float_to_fp8(std::ldexp(5.0f, -9), DType::E4M3, false), 0x05);
  EXPECT_EQ(float_to_fp8(-std::ldexp(5.0f, -9), DType::E4M3, false), 0x85);
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0f, -16), DType::E5M2, false), 0x01);
  EXPECT_EQ(float_to_fp8(std::ldexp(3.0f, -16), DType::E5M2, false), 0x03);
  EXPECT_EQ(float_to_fp8(std::ldexp(1.0001f, -17), DType::E5M2, false), 0x01);
}

TEST(Fp8Format, RejectsNonFp8Formats) {
  EXPECT_THROW(fp8_max(DType::BF16), Error);
  EXPECT_THROW(fp8_to_float(0, DType::F32), Error);
  EXPECT_THROW(float_to_fp8(1.0f, DType::F16, true), Error);
  uint8_t code = 0;
  float x = 1.0f;
  EXPECT_THROW(quantize_fp8(&x, 1, 1.0f, DType::U8, &code), Error);
}

TEST(E8M0, DecodeAndCeilEncode) {
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(128), 2.0f);
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(e8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
  EXPECT_EQ(float_to_e8m0_ceil(1.0f), 127);
  EXPECT_EQ(float_to_e8m0_ceil(1.5f), 128);
  EXPECT_EQ(float_to_e8m0_ceil(2.0f), 128);
  EXPECT_EQ(float_to_e8m0_ceil(0.75f), 127);
  EXPECT_EQ(float_to_e8m0_ceil(0.5f), 126);
  EXPECT_EQ(float_to_e8m0_ceil(0.0f), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.5f, -127)), 1);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.0f, -126)), 1);
  EXPECT_EQ(float_to_e8m0_ceil(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(float_to_e8m0_ceil(FLT_MAX), 254);  // 2^128 does not exist: clamp
  EXPECT_EQ(float_to_e8m0_ceil(kNaN), 255);
  EXPECT_EQ(float_to_e8m0_ceil(kInf), 255);
  EXPECT_EQ(float_to_e8m0_ceil(-kInf), 255);
  for (int code = 1; code < 255; ++code) {
    const float power = e8m0_to_float(uint8_t(code));
    EXPECT_EQ(power, std::ldexp(1.0f, code - 127));
    EXPECT_EQ(float_to_e8m0_ceil(power), code);
    if (code < 254) {
      EXPECT_EQ(float_to_e8m0_ceil(next_up(power)), code + 1);
    }
    EXPECT_EQ(float_to_e8m0_ceil(next_down(power)), code);
  }
}

TEST(ScalingMode, Names) {
  EXPECT_STREQ(scaling_mode_name(ScalingMode::PerTensor), "per_tensor");
  EXPECT_STREQ(scaling_mode_name(ScalingMode::Block), "block");
  EXPECT_STREQ(scaling_mode_name(ScalingMode::MXFP8), "mxfp8");
}

// ---- bulk kernels against the scalar reference --------------------------------------------

// Random values of every kind: wide-range normals, random bit patterns (NaN, Inf, subnormals),
// and exact FP8 midpoints (the rounding ties) for both formats.
std::vector<float> special_values() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               kInf,
                               -kInf,
                               FLT_MAX,
                               -FLT_MAX,
                               FLT_MIN,
                               std::numeric_limits<float>::denorm_min(),
                               448.0f,
                               464.0f,
                               next_up(464.0f),
                               57344.0f,
                               61440.0f,
                               -61440.0f};
  for (DType format : kFormats) {
    for (int code = 0; code < 0x7F; ++code) {
      const float a = fp8_to_float(uint8_t(code), format);
      const float b = fp8_to_float(uint8_t(code + 1), format);
      if (std::isnan(a) || std::isnan(b) || std::isinf(b)) continue;
      const float mid = (a + b) / 2;
      for (float v : {a, mid, next_up(mid), next_down(mid)}) {
        values.push_back(v);
        values.push_back(-v);
      }
    }
  }
  return values;
}

std::vector<float> random_values(size_t n, bool with_nan, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-24, 20);
  const std::vector<float> specials = special_values();
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t kind = rng() % 8;
    float v;
    if (kind == 0) {
      v = std::bit_cast<float>(uint32_t(rng()));
    } else if (kind == 1) {
      v = specials[rng() % specials.size()];
    } else {
      v = std::ldexp(normal(rng), exponent(rng));
    }
    if (!with_nan && std::isnan(v)) v = 1.0f;
    values[i] = v;
  }
  if (with_nan && n > 0) values[n / 2] = kNaN;
  return values;
}

float reference_amax(const std::vector<float>& x) {
  float amax = 0.0f;
  for (float v : x) {
    if (std::isnan(v)) return kNaN;
    amax = std::max(amax, std::fabs(v));
  }
  return amax;
}

void expect_same_amax(float got, float expected) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(got));
  } else {
    EXPECT_EQ(bits_of(got), bits_of(expected));
  }
}

std::vector<bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<bfloat16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i].bits = float_to_bf16(x[i]);
  return out;
}

std::vector<float> from_bf16(const std::vector<bfloat16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_float(x[i].bits);
  return out;
}

// Scalar reference of quantize_fp8: codes and amax.
std::vector<uint8_t> reference_codes(const std::vector<float>& x, float scale, DType format) {
  std::vector<uint8_t> codes(x.size());
  for (size_t i = 0; i < x.size(); ++i) codes[i] = float_to_fp8(x[i] * scale, format, true);
  return codes;
}

const size_t kLengths[] = {0, 1, 7, 33, 1000, 1000003};

TEST(Fp8Kernels, QuantizeMatchesScalarOnEveryIsa) {
  IsaGuard guard;
  for (size_t n : kLengths) {
    for (bool with_nan : {false, true}) {
      const std::vector<float> x = random_values(n, with_nan, uint32_t(n * 2 + with_nan));
      const std::vector<bfloat16> x16 = to_bf16(x);
      const std::vector<float> x16_wide = from_bf16(x16);
      for (DType format : kFormats) {
        for (float scale : {1.0f, 0.37f, 1024.0f}) {
          if (n > 100000 && scale != 0.37f) continue;  // the long case once is enough
          const std::vector<uint8_t> expected = reference_codes(x, scale, format);
          const std::vector<uint8_t> expected16 = reference_codes(x16_wide, scale, format);
          for (Isa isa : available_isas()) {
            set_active_isa(isa);
            SCOPED_TRACE(::testing::Message() << isa_name(isa) << " " << dtype_name(format) << " n "
                                              << n << " scale " << scale << " nan " << with_nan);
            std::vector<uint8_t> codes(n, 0xAA);
            expect_same_amax(quantize_fp8(x.data(), n, scale, format, codes.data()),
                             reference_amax(x));
            EXPECT_EQ(codes, expected);
            std::vector<uint8_t> codes16(n, 0xAA);
            expect_same_amax(quantize_fp8(x16.data(), n, scale, format, codes16.data()),
                             reference_amax(x16_wide));
            EXPECT_EQ(codes16, expected16);
          }
        }
      }
    }
  }
}

TEST(Fp8Kernels, DequantizeAndWidenMatchScalarOnEveryIsa) {
  IsaGuard guard;
  std::mt19937 rng(7);
  for (size_t n : kLengths) {
    std::vector<uint8_t> codes(n);
    for (size_t i = 0; i < n; ++i) codes[i] = i < 256 ? uint8_t(255 - i) : uint8_t(rng());
    for (DType format : kFormats) {
      for (float scale_inv : {1.0f, 0.125f, 3.0f}) {
        std::vector<uint32_t> expected(n);
        for (size_t i = 0; i < n; ++i)
          expected[i] = bits_of(fp8_to_float(codes[i], format) * scale_inv);
        std::vector<uint16_t> expected16(n);
        for (size_t i = 0; i < n; ++i) {
          const float value = fp8_to_float(codes[i], format);
          expected16[i] = float_to_bf16(value);
          if (!std::isnan(value)) {
            ASSERT_EQ(bf16_to_float(expected16[i]), value);  // exact
          }
        }
        for (Isa isa : available_isas()) {
          set_active_isa(isa);
          SCOPED_TRACE(::testing::Message() << isa_name(isa) << " " << dtype_name(format) << " n "
                                            << n << " scale_inv " << scale_inv);
          std::vector<float> out(n, -1.0f);
          dequantize_fp8(codes.data(), n, format, scale_inv, out.data());
          std::vector<uint32_t> got(n);
          for (size_t i = 0; i < n; ++i) got[i] = bits_of(out[i]);
          EXPECT_EQ(got, expected);
          std::vector<bfloat16> wide(n, bfloat16{0x1234});
          fp8_to_bf16(codes.data(), n, format, wide.data());
          std::vector<uint16_t> got16(n);
          for (size_t i = 0; i < n; ++i) got16[i] = wide[i].bits;
          EXPECT_EQ(got16, expected16);
        }
      }
    }
  }
}

TEST(Fp8Kernels, AmaxPropagatesNaNOnEveryIsa) {
  IsaGuard guard;
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    SCOPED_TRACE(isa_name(isa));
    EXPECT_EQ(amax_of(static_cast<const float*>(nullptr), 0), 0.0f);
    for (size_t n : {size_t{1}, size_t{7}, size_t{33}, size_t{100000}}) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) x[i] = std::sin(float(i)) * 3.0f;
      x[n / 3] = -7.5f;
      EXPECT_EQ(amax_of(x.data(), n), 7.5f) << n;
      EXPECT_EQ(amax_of(to_bf16(x).data(), n), 7.5f) << n;
      for (size_t where : {size_t{0}, n / 2, n - 1}) {  // first lane, middle, scalar tail
        std::vector<float> y = x;
        y[where] = -kNaN;
        EXPECT_TRUE(std::isnan(amax_of(y.data(), n))) << n << " at " << where;
        EXPECT_TRUE(std::isnan(amax_of(to_bf16(y).data(), n))) << n << " at " << where;
        y[where] = -kInf;
        EXPECT_EQ(amax_of(y.data(), n), kInf);
        EXPECT_EQ(amax_of(to_bf16(y).data(), n), kInf);
      }
    }
  }
}

template <typename In>
void expect_cast_transpose_matches(const std::vector<In>& x, int64_t rows, int64_t cols,
                                   DType format, float scale) {
  const size_t n = size_t(rows * cols);
  std::vector<uint8_t> codes(n);
  const float amax = quantize_fp8(x.data(), n, scale, format, codes.data());
  std::vector<uint8_t> transposed(n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) transposed[c * rows + r] = codes[r * cols + c];
  }
  std::vector<uint8_t> got(n, 0xAA), got_t(n, 0xAA);
  expect_same_amax(
      cast_transpose_fp8(x.data(), rows, cols, scale, format, got.data(), got_t.data()), amax);
  EXPECT_EQ(got, codes);
  EXPECT_EQ(got_t, transposed);
  std::vector<uint8_t> only(n, 0xAA), only_t(n, 0xAA);
  expect_same_amax(cast_transpose_fp8(x.data(), rows, cols, scale, format, only.data(), nullptr),
                   amax);
  expect_same_amax(cast_transpose_fp8(x.data(), rows, cols, scale, format, nullptr, only_t.data()),
                   amax);
  EXPECT_EQ(only, codes);
  EXPECT_EQ(only_t, transposed);
}

TEST(Fp8Kernels, CastTransposeEqualsCastThenTransposeOnEveryIsa) {
  IsaGuard guard;
  const int64_t shapes[][2] = {{1, 1}, {7, 33}, {129, 65}, {300, 257}, {64, 128}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    for (bool with_nan : {false, true}) {
      const std::vector<float> x = random_values(size_t(rows * cols), with_nan, uint32_t(rows));
      const std::vector<bfloat16> x16 = to_bf16(x);
      for (Isa isa : available_isas()) {
        set_active_isa(isa);
        for (DType format : kFormats) {
          SCOPED_TRACE(::testing::Message() << isa_name(isa) << " " << dtype_name(format) << " ["
                                            << rows << "," << cols << "] nan " << with_nan);
          expect_cast_transpose_matches(x, rows, cols, format, 0.5f);
          expect_cast_transpose_matches(x16, rows, cols, format, 3.0f);
        }
      }
    }
  }
}

TEST(Fp8Kernels, CastTransposeRejectsBadArguments) {
  float x = 1.0f;
  uint8_t code = 0;
  EXPECT_THROW(cast_transpose_fp8(&x, -1, 1, 1.0f, DType::E4M3, &code, nullptr), Error);
  EXPECT_THROW(cast_transpose_fp8(&x, 1, 1, 1.0f, DType::BF16, &code, nullptr), Error);
}

}  // namespace
}  // namespace octet
