// RoPE, fast path: cos/sin tables once per call, then OpenMP over (batch, position) rows,
// each head's pairs rotated by a vectorized loop for the active instruction set.
#include "ops/rope/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

// Rotates the heads of one position; sin already carries the sign (backward negates it).
template <typename T>
OCTET_ALWAYS_INLINE void rotate_position(T* x, const float* cos, const float* sin, int64_t heads,
                                         int64_t head_dim, int64_t half, bool interleaved) {
  for (int64_t h = 0; h < heads; ++h) {
    T* row = x + h * head_dim;
    if (interleaved) {
#pragma omp simd
      for (int64_t k = 0; k < half; ++k) {
        const float a = simd::load(row[2 * k]), b = simd::load(row[2 * k + 1]);
        simd::store(a * cos[k] - b * sin[k], &row[2 * k]);
        simd::store(b * cos[k] + a * sin[k], &row[2 * k + 1]);
      }
    } else {
#pragma omp simd
      for (int64_t k = 0; k < half; ++k) {
        const float a = simd::load(row[k]), b = simd::load(row[k + half]);
        simd::store(a * cos[k] - b * sin[k], &row[k]);
        simd::store(b * cos[k] + a * sin[k], &row[k + half]);
      }
    }
  }
}

template <typename T>
OCTET_TARGET_AVX512 void rotate_avx512(T* x, const float* cos, const float* sin, int64_t heads,
                                       int64_t head_dim, int64_t half, bool interleaved) {
  rotate_position(x, cos, sin, heads, head_dim, half, interleaved);
}
template <typename T>
OCTET_TARGET_AVX2 void rotate_avx2(T* x, const float* cos, const float* sin, int64_t heads,
                                   int64_t head_dim, int64_t half, bool interleaved) {
  rotate_position(x, cos, sin, heads, head_dim, half, interleaved);
}
template <typename T>
void rotate_scalar(T* x, const float* cos, const float* sin, int64_t heads, int64_t head_dim,
                   int64_t half, bool interleaved) {
  rotate_position(x, cos, sin, heads, head_dim, half, interleaved);
}

template <typename T>
void rotate_typed(Tensor& x, const rope_detail::RopeShape& s, const RopeOptions& o, float sign) {
  const int64_t half = s.rotary_dim / 2;
  Tensor cos = Tensor::empty({s.positions, half}, DType::F32);
  Tensor sin = Tensor::empty({s.positions, half}, DType::F32);
  rope_tables(s.positions, s.rotary_dim, o, cos, sin);
  if (sign < 0) {
    float* values = sin.data<float>();
    for (int64_t n = 0; n < sin.numel(); ++n) values[n] = -values[n];
  }
  auto fn = rotate_scalar<T>;
  if (active_isa() == Isa::Avx512) fn = rotate_avx512<T>;
  if (active_isa() == Isa::Avx2) fn = rotate_avx2<T>;
  T* data = x.data<T>();
  const float* cos_table = cos.data<float>();
  const float* sin_table = sin.data<float>();
  const bool interleaved = o.layout == RopeLayout::Interleaved;
  const int64_t rows = s.batch * s.positions;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row % s.positions;
    fn(data + row * s.heads * s.head_dim, cos_table + t * half, sin_table + t * half, s.heads,
       s.head_dim, half, interleaved);
  }
}

void rotate(Tensor& x, const RopeOptions& o, float sign, const char* op) {
  rope_detail::RopeShape s = rope_detail::check_rope(op, x, o);
  if (x.dtype() == DType::F32) {
    rotate_typed<float>(x, s, o, sign);
  } else {
    rotate_typed<bfloat16>(x, s, o, sign);
  }
}

}  // namespace

void rope_forward(Tensor& x, const RopeOptions& options) {
  rotate(x, options, 1.0f, "rope_forward");
}

void rope_backward(Tensor& dx, const RopeOptions& options) {
  rotate(dx, options, -1.0f, "rope_backward");
}

}  // namespace octet::ops::cpu
