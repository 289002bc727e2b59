// FP4 block-scaled quantization (NVFP4, MXFP4) and the 16-point random Hadamard transform,
// scalar loops over the element conversions of src/core/fp4_format.cpp (include/octet/fp4.h
// gives the recipes' formulas).
#include "octet/fp4.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "octet/error.h"
#include "octet/profile.h"
#include "octet/rng.h"

namespace octet {
namespace {

constexpr float kE4M3Max = 448.0f;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// x as F32 rows [rows, cols]: F32 input is read in place, BF16 widened once.
class F32Rows {
 public:
  F32Rows(const Tensor& x, const char* op) {
    OCTET_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, op,
                ": x expected f32 or bf16, got ", dtype_name(x.dtype()));
    OCTET_CHECK(x.ndim() >= 1 && x.numel() > 0, op, ": x expected [*, cols] with elements, got ",
                shape_str(x.shape()));
    cols = x.dim(-1);
    rows = x.numel() / cols;
    if (x.dtype() == DType::F32) {
      data = x.data<float>();
    } else {
      widened_ = x.to_floats();
      data = widened_.data();
    }
  }
  int64_t rows = 0, cols = 0;
  const float* data = nullptr;

 private:
  std::vector<float> widened_;
};

// max |x| over the whole tensor, NaN if any element is NaN.
float tensor_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  bool nan = false;
#pragma omp parallel for reduction(max : amax) reduction(|| : nan) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan = nan || std::isnan(a);
    amax = std::max(amax, a);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// max |x| over a block (NaN if any element is NaN).
float block_amax(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float a = std::fabs(x[r * cols + c]);
      if (std::isnan(a)) return a;
      amax = std::max(amax, a);
    }
  }
  return amax;
}

// float_to_e2m1 without branches: the magnitude code counts the rounding thresholds passed
// (ties go to the even code: 0.25, 1.25 and 2.5 stay below, 0.75, 1.75, 3.5 go up, 5 stays
// at 4), NaN saturates to 7 as the scalar conversion does. test_fp4 holds it to the table.
inline uint8_t e2m1_nearest(float value) {
  const float m = std::fabs(value);
  const int code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) +
                   (m >= 3.5f) + (m > 5.0f);
  const uint8_t magnitude = std::isnan(m) ? 7 : static_cast<uint8_t>(code);
  return static_cast<uint8_t>((std::signbit(value) ? 0x8 : 0x0) | magnitude);
}

// float_to_e2m1_stochastic: up from the representable value below |v| with probability
// (|v| - low) / (high - low), as the scalar conversion decides it.
inline uint8_t e2m1_stochastic(float value, float u) {
  constexpr float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const uint8_t sign = std::signbit(value) ? 0x8 : 0x0;
  const float m = std::fabs(value);
  if (!(m < 6.0f)) return sign | 7;
  const int lower =
      (m >= 0.5f) + (m >= 1.0f) + (m >= 1.5f) + (m >= 2.0f) + (m >= 3.0f) + (m >= 4.0f);
  const float low = kValues[lower], high = kValues[lower + 1];
  const bool up = u * (high - low) < m - low;
  return static_cast<uint8_t>(sign | (up ? lower + 1 : lower));
}

struct Fp4Scope {
  bool enabled;
  Fp4Options options;
};

std::vector<Fp4Scope>& fp4_scopes() {
  thread_local std::vector<Fp4Scope> stack;
  return stack;
}

}  // namespace

fp4_autocast::fp4_autocast(bool enabled, Fp4Options options) {
  fp4_scopes().push_back({enabled, options});
}

fp4_autocast::~fp4_autocast() {
  if (!fp4_scopes().empty()) fp4_scopes().pop_back();
}

bool fp4_enabled() {
  return !fp4_scopes().empty() && fp4_scopes().back().enabled;
}

const Fp4Options& fp4_options() {
  static const Fp4Options kDefault{};
  return fp4_scopes().empty() ? kDefault : fp4_scopes().back().options;
}

const char* fp4_recipe_name(Fp4Recipe recipe) {
  return recipe == Fp4Recipe::NVFP4 ? "nvfp4" : "mxfp4";
}

Fp4Recipe parse_fp4_recipe(const std::string& name) {
  if (name == "nvfp4") return Fp4Recipe::NVFP4;
  if (name == "mxfp4") return Fp4Recipe::MXFP4;
  throw Error("fp4 recipe expected nvfp4 or mxfp4, got '" + name + "'");
}

Float4Tensor quantize_fp4(const Tensor& x, const Fp4Options& options) {
  const profile::Scope scope(profile::Category::Fp8Cast);
  const char* op = "quantize_fp4";
  Float4Tensor t;
  const F32Rows values(x, op);
  t.rows = values.rows;
  t.cols = values.cols;
  OCTET_CHECK(!options.block_2d || options.recipe == Fp4Recipe::NVFP4, op,
              ": 2-D (16x16) blocks expected with nvfp4 only, got mxfp4");
  const bool nv = options.recipe == Fp4Recipe::NVFP4;
  t.recipe = options.recipe;
  t.block_rows = options.block_2d ? 16 : 1;
  t.block_cols = nv ? 16 : 32;
  const int64_t rows = t.rows, cols = t.cols, packed_cols = ceil_div(cols, 2);
  const int64_t block_row_count = ceil_div(rows, t.block_rows);
  const int64_t block_col_count = ceil_div(cols, t.block_cols);
  t.data = Tensor::zeros({rows, packed_cols}, DType::U8);
  t.scale = Tensor::empty({block_row_count, block_col_count}, DType::U8);
  t.amax = tensor_amax(values.data, rows * cols);

  // NVFP4's tensor scale; an all-zero tensor keeps 1, an infinite or NaN amax propagates.
  float global_encode = 1.0f;
  if (nv && t.amax > 0.0f) {
    global_encode = std::min(kE4M3Max * kE2M1Max / t.amax, std::numeric_limits<float>::max());
  }
  if (nv && !std::isfinite(t.amax)) global_encode = std::numeric_limits<float>::quiet_NaN();
  t.global_scale_inv = nv ? 1.0f / global_encode : 1.0f;

  const float* x_data = values.data;
  uint8_t* codes = t.data.data<uint8_t>();
  uint8_t* scales = t.scale.data<uint8_t>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t br = 0; br < block_row_count; ++br) {
    for (int64_t bc = 0; bc < block_col_count; ++bc) {
      const int64_t r0 = br * t.block_rows, r1 = std::min(rows, r0 + t.block_rows);
      const int64_t c0 = bc * t.block_cols, c1 = std::min(cols, c0 + t.block_cols);
      const float a = block_amax(x_data, cols, r0, r1, c0, c1);
      uint8_t scale_code;
      float encode;  // the factor taking x to E2M1's range
      if (nv) {
        scale_code = float_to_fp8(a / kE2M1Max * global_encode, DType::E4M3, true);
        const float decoded = fp8_to_float(scale_code, DType::E4M3);
        encode = decoded > 0.0f ? global_encode / decoded : 0.0f;
      } else {
        scale_code = float_to_e8m0_ceil(a / kE2M1Max);
        encode = 1.0f / e8m0_to_float(scale_code);
      }
      scales[br * block_col_count + bc] = scale_code;
      for (int64_t r = r0; r < r1; ++r) {
        // Stochastic rounding draws element i's number from word i % 4 of Philox block i / 4
        // (philox_uniform): one block serves four neighbours.
        uint64_t block = std::numeric_limits<uint64_t>::max();
        std::array<uint32_t, 4> words{};
        for (int64_t c = c0; c < c1; ++c) {
          const float v = x_data[r * cols + c] * encode;
          uint8_t code;
          if (options.stochastic) {
            const uint64_t index = static_cast<uint64_t>(r * cols + c);
            if (index / 4 != block) {
              block = index / 4;
              words = philox4x32(options.seed, options.offset + block);
            }
            code = e2m1_stochastic(v, uniform_from_bits(words[index % 4]));
          } else {
            code = e2m1_nearest(v);
          }
          // Blocks start at even columns, so each byte belongs to one block: no two threads
          // write the same byte.
          uint8_t& byte = codes[r * packed_cols + c / 2];
          byte = static_cast<uint8_t>((c % 2 == 0) ? ((byte & 0xF0) | code)
                                                   : ((byte & 0x0F) | (code << 4)));
        }
      }
    }
  }
  return t;
}

uint8_t Float4Tensor::code(int64_t r, int64_t c) const {
  const uint8_t byte = data.data<uint8_t>()[r * ceil_div(cols, 2) + c / 2];
  return c % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
}

float Float4Tensor::block_scale(int64_t r, int64_t c) const {
  const uint8_t s =
      scale.data<uint8_t>()[(r / block_rows) * ceil_div(cols, block_cols) + c / block_cols];
  return recipe == Fp4Recipe::NVFP4 ? fp8_to_float(s, DType::E4M3) : e8m0_to_float(s);
}

namespace {

// A table of convert(E2M1 value x block scale) for every (scale code, E2M1 code), built once
// per call; then every byte is two lookups, rows in parallel.
template <typename Out, typename Convert>
void expand_fp4(const Float4Tensor& t, Out* out, Convert convert) {
  const int64_t rows = t.rows, cols = t.cols, packed_cols = ceil_div(cols, 2);
  const int64_t block_col_count = ceil_div(cols, t.block_cols);
  const uint8_t* codes = t.data.data<uint8_t>();
  const uint8_t* scales = t.scale.data<uint8_t>();
  const bool nv = t.recipe == Fp4Recipe::NVFP4;
  std::vector<Out> table(256 * 16);
  for (int s = 0; s < 256; ++s) {
    const auto code = static_cast<uint8_t>(s);
    const float scale = nv ? fp8_to_float(code, DType::E4M3) : e8m0_to_float(code);
    for (uint8_t e = 0; e < 16; ++e) table[s * 16 + e] = convert(e2m1_to_float(e) * scale);
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row_codes = codes + r * packed_cols;
    const uint8_t* row_scales = scales + (r / t.block_rows) * block_col_count;
    Out* o = out + r * cols;
    for (int64_t bc = 0; bc < block_col_count; ++bc) {
      const Out* values = table.data() + row_scales[bc] * 16;
      const int64_t c0 = bc * t.block_cols, c1 = std::min(cols, c0 + t.block_cols);
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t byte = row_codes[c / 2];
        o[c] = values[c % 2 == 0 ? (byte & 0x0F) : (byte >> 4)];
      }
    }
  }
}

}  // namespace

Tensor Float4Tensor::dequantize() const {
  const profile::Scope scope(profile::Category::Fp8Cast);
  Tensor out = Tensor::empty({rows, cols}, DType::F32);
  const float global = global_scale_inv;
  expand_fp4(*this, out.data<float>(), [global](float v) { return v * global; });
  return out;
}

Tensor Float4Tensor::widen_bf16() const {
  const profile::Scope scope(profile::Category::Fp8Cast);
  Tensor out = Tensor::empty({rows, cols}, DType::BF16);
  expand_fp4(*this, out.data<bfloat16>(), [](float v) {
    bfloat16 b;
    b.bits = float_to_bf16(v);
    return b;
  });
  return out;
}

Tensor random_hadamard_transform(const Tensor& x, uint64_t seed, bool inverse) {
  const char* op = "random_hadamard_transform";
  const F32Rows input(x, op);
  const int64_t rows = input.rows, cols = input.cols;
  const float* values = input.data;
  OCTET_CHECK(cols % 16 == 0, op, ": the last dimension expected a multiple of 16, got ", cols);
  float signs[16];
  for (int i = 0; i < 16; ++i) {
    signs[i] = (philox4x32(seed, static_cast<uint64_t>(i / 4))[i % 4] & 1u) != 0 ? -1.0f : 1.0f;
  }
  Tensor out = Tensor::empty(x.shape(), DType::F32);
  float* o = out.data<float>();
  const int64_t blocks = rows * cols / 16;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    float v[16];
    for (int i = 0; i < 16; ++i) v[i] = values[b * 16 + i];
    // Forward: y = (x * D) H / 4. Inverse: x = (y H / 4) * D (H is symmetric, H H = 16 I).
    if (!inverse) {
      for (int i = 0; i < 16; ++i) v[i] *= signs[i];
    }
    for (int half = 1; half < 16; half *= 2) {  // the fast Walsh-Hadamard butterflies
      for (int i = 0; i < 16; i += 2 * half) {
        for (int j = i; j < i + half; ++j) {
          const float a = v[j], c = v[j + half];
          v[j] = a + c;
          v[j + half] = a - c;
        }
      }
    }
    for (int i = 0; i < 16; ++i) {
      v[i] *= 0.25f;
      if (inverse) v[i] *= signs[i];
      o[b * 16 + i] = v[i];
    }
  }
  return out;
}

}  // namespace octet
