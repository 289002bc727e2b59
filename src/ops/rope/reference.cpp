// RoPE, the oracle: every pair rotated in double, angles from the same table function.
#include <cmath>
#include <vector>

#include "ops/rope/checks.h"

namespace octet::ops {

void rope_tables(int64_t T, int64_t rotary_dim, const RopeOptions& options, Tensor& cos,
                 Tensor& sin) {
  const int64_t half = rotary_dim / 2;
  check_shape(cos, {T, half}, "rope_tables: cos", "T,rotary_dim/2");
  check_shape(sin, {T, half}, "rope_tables: sin", "T,rotary_dim/2");
  check_dtype(cos, DType::F32, "rope_tables: cos");
  check_dtype(sin, DType::F32, "rope_tables: sin");
  for (int64_t k = 0; k < half; ++k) {
    const double inv_freq =
        std::pow(static_cast<double>(options.theta),
                 -2.0 * static_cast<double>(k) / static_cast<double>(rotary_dim));
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(options.position_offset + t) * inv_freq;
      cos.data<float>()[t * half + k] = static_cast<float>(std::cos(angle));
      sin.data<float>()[t * half + k] = static_cast<float>(std::sin(angle));
    }
  }
}

namespace reference {
namespace {

// Rotates every pair by sign * angle, in double, from the F32 tables.
void rotate(Tensor& x, const RopeOptions& o, double sign, const char* op) {
  rope_detail::RopeShape s = rope_detail::check_rope(op, x, o);
  const int64_t half = s.rotary_dim / 2;
  Tensor cos = Tensor::empty({s.positions, half}, DType::F32);
  Tensor sin = Tensor::empty({s.positions, half}, DType::F32);
  rope_tables(s.positions, s.rotary_dim, o, cos, sin);
  std::vector<float> values = x.to_floats();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.positions; ++t) {
      for (int64_t h = 0; h < s.heads; ++h) {
        float* row = values.data() + ((b * s.positions + t) * s.heads + h) * s.head_dim;
        for (int64_t k = 0; k < half; ++k) {
          const bool interleaved = o.layout == RopeLayout::Interleaved;
          const int64_t first = interleaved ? 2 * k : k;
          const int64_t second = interleaved ? 2 * k + 1 : k + half;
          const double c = cos.data<float>()[t * half + k];
          const double sn = sign * sin.data<float>()[t * half + k];
          const double a = row[first], bb = row[second];
          row[first] = static_cast<float>(a * c - bb * sn);
          row[second] = static_cast<float>(bb * c + a * sn);
        }
      }
    }
  }
  Tensor result = Tensor::from_floats(x.shape(), values);
  x.copy_from(x.dtype() == DType::F32 ? result : result.to(x.dtype()));
}

}  // namespace

void rope_forward(Tensor& x, const RopeOptions& options) {
  rotate(x, options, 1.0, "rope_forward");
}

void rope_backward(Tensor& dx, const RopeOptions& options) {
  rotate(dx, options, -1.0, "rope_backward");
}

}  // namespace reference
}  // namespace octet::ops
