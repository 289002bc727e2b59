// Shape checks, mask rules and the dropout RNG shared by the reference and fast attention.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "octet/ops/attention.h"
#include "octet/rng.h"

namespace octet::ops::attention_detail {

struct AttentionShape {
  int64_t batch = 0, queries = 0, keys = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t group = 1;   // query heads per kv head
  float scale = 0.0f;  // the softmax scale actually used
};

inline constexpr int64_t kMaxHeadDim = 256;

inline void check_lengths(const char* op, const Tensor* lengths, const char* name, int64_t batch,
                          int64_t limit) {
  if (lengths == nullptr) return;
  check_shape(*lengths, {batch}, octet::detail::concat(op, ": ", name), "B");
  check_dtype(*lengths, DType::I32, octet::detail::concat(op, ": ", name));
  for (int64_t b = 0; b < batch; ++b) {
    int32_t n = lengths->data<int32_t>()[b];
    OCTET_CHECK(n >= 0 && n <= limit, op, ": ", name, "[", b, "] expected in [0,", limit, "], got ",
                n);
  }
}

// A bias or dbias tensor: [H,T,S] F32, and not with FP8 attention (whose dS would be rounded).
inline void check_bias_tensor(const char* op, const Tensor& t, const char* name,
                              const AttentionOptions& o, const AttentionShape& s) {
  const std::string what = octet::detail::concat(op, ": ", name);
  check_shape(t, {s.heads, s.queries, s.keys}, what, "H,T,S");
  check_dtype(t, DType::F32, what);
  OCTET_CHECK(!o.fp8.enabled(), what, " expected no FP8 attention (fp8 scales 0), got p_scale ",
              o.fp8.p_scale, ", ds_scale ", o.fp8.ds_scale);
}

// options.bias, when given: check_bias_tensor, and bias / scale finite (the fast kernels add
// bias * (1 / scale) to unscaled scores; a row whose every key had a -inf bias would have no
// softmax, and masking is the masks' job).
inline void check_bias(const char* op, const AttentionOptions& o, const AttentionShape& s) {
  if (o.bias == nullptr) return;
  check_bias_tensor(op, *o.bias, "bias", o, s);
  const float* bias = o.bias->data<float>();
  const int64_t n = o.bias->numel();
  const float inv_scale = 1.0f / s.scale;
  bool finite = true;
  for (int64_t x = 0; x < n; ++x) finite &= std::isfinite(bias[x] * inv_scale);
  for (int64_t x = 0; !finite && x < n; ++x) {
    OCTET_CHECK(std::isfinite(bias[x] * inv_scale), op,
                ": bias / softmax_scale expected finite, got ", bias[x], " / ", s.scale,
                " at [h,i,j]=[", x / (s.queries * s.keys), ",", x / s.keys % s.queries, ",",
                x % s.keys, "]");
  }
}

// options.dbias (backward), when given; not the bias's storage (it is zeroed before the bias
// is read).
inline void check_dbias(const char* op, const AttentionOptions& o, const AttentionShape& s) {
  if (o.dbias == nullptr) return;
  check_bias_tensor(op, *o.dbias, "dbias", o, s);
  OCTET_CHECK(o.bias == nullptr || o.bias->raw() != o.dbias->raw(), op,
              ": dbias expected its own storage, got the bias's");
}

inline AttentionShape check_inputs(const char* op, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const AttentionOptions& o) {
  OCTET_CHECK(q.defined() && q.ndim() == 4, op, ": q expected [B,T,H,D], got ",
              q.defined() ? shape_str(q.shape()) : "an undefined tensor");
  OCTET_CHECK(k.defined() && k.ndim() == 4, op, ": k expected [B,S,Hkv,D], got ",
              k.defined() ? shape_str(k.shape()) : "an undefined tensor");
  check_dtype_in(q, {DType::F32, DType::BF16}, octet::detail::concat(op, ": q"));
  check_dtype(k, q.dtype(), octet::detail::concat(op, ": k"));
  check_dtype(v, q.dtype(), octet::detail::concat(op, ": v"));
  AttentionShape s;
  s.batch = q.dim(0);
  s.queries = q.dim(1);
  s.heads = q.dim(2);
  s.head_dim = q.dim(3);
  s.keys = k.dim(1);
  s.kv_heads = k.dim(2);
  OCTET_CHECK(s.batch > 0 && s.queries > 0 && s.heads > 0 && s.keys > 0 && s.kv_heads > 0, op,
              ": empty dimensions, q ", shape_str(q.shape()), ", k ", shape_str(k.shape()));
  OCTET_CHECK(s.head_dim >= 1 && s.head_dim <= kMaxHeadDim, op, ": head dim D expected in [1,",
              kMaxHeadDim, "], got ", s.head_dim);
  check_shape(k, {s.batch, s.keys, s.kv_heads, s.head_dim}, octet::detail::concat(op, ": k"),
              "B,S,Hkv,D");
  check_shape(v, k.shape(), octet::detail::concat(op, ": v"), "B,S,Hkv,D");
  OCTET_CHECK(s.heads % s.kv_heads == 0, op, ": H=", s.heads,
              " expected a multiple of Hkv=", s.kv_heads);
  s.group = s.heads / s.kv_heads;
  OCTET_CHECK(o.softmax_scale >= 0.0f && std::isfinite(o.softmax_scale), op,
              ": softmax_scale expected >= 0 (0 = 1/sqrt(D)), got ", o.softmax_scale);
  s.scale =
      o.softmax_scale > 0.0f ? o.softmax_scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  OCTET_CHECK(o.window_left >= -1 && o.window_right >= -1, op,
              ": window sizes expected >= -1, got (", o.window_left, ",", o.window_right, ")");
  OCTET_CHECK(o.dropout >= 0.0f && o.dropout < 1.0f, op, ": dropout expected in [0,1), got ",
              o.dropout);
  check_lengths(op, o.q_lengths, "q_lengths", s.batch, s.queries);
  check_lengths(op, o.kv_lengths, "kv_lengths", s.batch, s.keys);
  for (auto [name, format, scale] : {std::tuple{"fp8.p", o.fp8.p_format, o.fp8.p_scale},
                                     std::tuple{"fp8.ds", o.fp8.ds_format, o.fp8.ds_scale}}) {
    OCTET_CHECK(format == DType::E4M3 || format == DType::E5M2, op, ": ", name,
                "_format expected E4M3 or E5M2, got ", dtype_name(format));
    OCTET_CHECK(scale >= 0.0f && std::isfinite(scale), op, ": ", name,
                "_scale expected finite and >= 0 (0 = no FP8), got ", scale);
  }
  check_bias(op, o, s);
  return s;
}

// Rounds x * scale to the nearest FP8 value (ties to even, saturating at the largest finite
// value, NaN kept) and divides by scale again: float_to_fp8(x * scale, format, true) decoded and
// descaled, in a few branch-free operations that vectorize.
struct Fp8Rounder {
  float scale = 0.0f, inv_scale = 0.0f, max = 0.0f;
  int mantissa_bits = 0, min_exponent = 0;  // the format's smallest normal exponent
  Fp8Rounder() = default;
  Fp8Rounder(DType format, float s)
      : scale(s),
        inv_scale(s > 0.0f ? 1.0f / s : 0.0f),
        max(fp8_max(format)),
        mantissa_bits(format == DType::E4M3 ? 3 : 2),
        min_exponent(format == DType::E4M3 ? -6 : -14) {}
  bool active() const { return scale > 0.0f; }
  float operator()(float x) const {
    const float a = std::min(std::fabs(x * scale), max);  // NaN stays NaN
    int e = static_cast<int>(std::bit_cast<uint32_t>(a) >> 23) - 127;
    e = std::max(e, min_exponent);  // subnormals share the smallest normal's spacing
    // big's spacing is 2^(e - mantissa_bits), the FP8 spacing at a's exponent: a + big rounds
    // a to it (ties to even), and subtracting big is exact.
    const float big = std::bit_cast<float>(static_cast<uint32_t>(e - mantissa_bits + 150) << 23);
    return std::copysign((a + big) - big, x) * inv_scale;
  }
};

inline void check_output(const char* op, const Tensor& t, const Tensor& like, const char* name,
                         const char* names) {
  check_shape(t, like.shape(), octet::detail::concat(op, ": ", name), names);
  check_dtype(t, like.dtype(), octet::detail::concat(op, ": ", name));
}

// Returns how many F32 values hold each row's lse: 1 ([B,H,T]) or 2 ([B,H,T,2], hi + lo).
inline int64_t check_lse(const char* op, const Tensor& lse, const AttentionShape& s) {
  const std::string what = octet::detail::concat(op, ": lse");
  check_dtype(lse, DType::F32, what);
  if (lse.ndim() == 4) {
    check_shape(lse, {s.batch, s.heads, s.queries, 2}, what, "B,H,T,2");
    return 2;
  }
  check_shape(lse, {s.batch, s.heads, s.queries}, what, "B,H,T (or B,H,T,2)");
  return 1;
}

// Row `row`'s lse written as one F32, or as hi + lo.
inline void write_lse(float* lse, int64_t parts, int64_t row, double value) {
  const float hi = static_cast<float>(value);
  if (parts == 1) {
    lse[row] = hi;
    return;
  }
  lse[2 * row] = hi;
  lse[2 * row + 1] = std::isfinite(value) ? static_cast<float>(value - hi) : 0.0f;
}
inline double read_lse(const float* lse, int64_t parts, int64_t row) {
  return parts == 1 ? double{lse[row]} : double{lse[2 * row]} + double{lse[2 * row + 1]};
}

// The keys [lo, hi) query i of batch b sees; empty (lo >= hi) for padded or fully masked rows.
struct KeyRange {
  int64_t lo = 0, hi = 0;
  bool empty() const { return lo >= hi; }
};

inline KeyRange visible_keys(const AttentionShape& s, const AttentionOptions& o, int64_t b,
                             int64_t i) {
  const int64_t q_len = o.q_lengths ? o.q_lengths->data<int32_t>()[b] : s.queries;
  const int64_t kv_len = o.kv_lengths ? o.kv_lengths->data<int32_t>()[b] : s.keys;
  if (i >= q_len) return {};
  const int64_t diagonal = i + kv_len - q_len;  // bottom-right alignment
  KeyRange r{0, kv_len};
  int64_t right = o.causal ? 0 : o.window_right;
  if (o.causal && o.window_right >= 0) right = std::min<int64_t>(0, o.window_right);
  if (right >= 0) r.hi = std::min(r.hi, diagonal + right + 1);
  if (o.window_left >= 0) r.lo = std::max<int64_t>(0, diagonal - o.window_left);
  if (r.empty()) return {};
  return r;
}

// Four 32-bit words of Philox4x32-10 (include/octet/rng.h).
struct Philox {
  uint32_t word[4];
};

// The four dropout words of keys j4 .. j4+3 (j4 a multiple of 4) for row i of head (b, h).
inline Philox dropout_words(uint64_t seed, uint64_t offset, int64_t bh, int64_t i, int64_t j4) {
  // Counter words (j4 / 4, i, bh, offset), as the 128-bit counter rng.h takes.
  const uint64_t low =
      uint64_t{static_cast<uint32_t>(j4 >> 2)} | (uint64_t{static_cast<uint32_t>(i)} << 32);
  const uint64_t high =
      uint64_t{static_cast<uint32_t>(bh)} | (uint64_t{static_cast<uint32_t>(offset)} << 32);
  const std::array<uint32_t, 4> words = philox4x32(seed, low, high);
  return {{words[0], words[1], words[2], words[3]}};
}

// A word keeps its element when word >= threshold.
inline uint32_t dropout_threshold(float p) {
  const double t = std::ldexp(static_cast<double>(p), 32);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace octet::ops::attention_detail
