// Scaled masked softmax, fast path: OpenMP over rows; each row is staged once in a per-thread
// F32 buffer padded to whole vectors (masked keys = -inf), then max, exp2 and the normalized
// store run as vector loops for the active instruction set (src/ops/README.md).
//
// The row maximum is subtracted from the inputs as they are, before any scaling: x - max is
// exact where it matters (near the maximum), so the probabilities keep F32 accuracy however
// large |x| is. Scaling first (x * scale * log2 e, then - max) would round the product to
// |x| * 2^-24 and lose ~4e-3 relative at |x| = 1e5.
#include <omp.h>

#include <cmath>
#include <limits>

#include "ops/attention/vec.h"
#include "ops/softmax/checks.h"

namespace octet::ops::cpu {
namespace {

using softmax_detail::SoftmaxShape;

constexpr int64_t kPad = 16;  // rows are padded to the widest vector
constexpr float kLog2e = 1.4426950408889634f;

struct RowArgs {
  int64_t keys = 0;
  int64_t padded = 0;
  float sign = 1.0f;        // the sign of scale: rows are staged as sign * x
  float scale_log2 = 0.0f;  // |scale| * log2(e): exp2((sign * x - max) * scale_log2)
};

template <int W, typename In, typename Out>
OCTET_ALWAYS_INLINE void forward_row(const In* x, Out* y, int64_t limit, const uint8_t* masked,
                                     const RowArgs& a, float* buf) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const float sign = a.sign;
#pragma omp simd
  for (int64_t j = 0; j < limit; ++j) buf[j] = simd::load(x[j]) * sign;
  for (int64_t j = limit; j < a.padded; ++j) buf[j] = minus_inf;
  if (masked != nullptr) {
    for (int64_t j = 0; j < limit; ++j) buf[j] = masked[j] != 0 ? minus_inf : buf[j];
  }
  vec::F<W> max_v = vec::splat<W>(minus_inf);
  for (int64_t j = 0; j < a.padded; j += W) {
    const vec::F<W> v = vec::load<W>(buf + j);
    max_v = v > max_v ? v : max_v;
  }
  const float max = vec::reduce_max<W>(max_v);
  if (max == minus_inf) {  // fully masked row
    for (int64_t j = 0; j < a.keys; ++j) simd::store(0.0f, &y[j]);
    return;
  }
  vec::F<W> sum_v{};
  const vec::F<W> scale = vec::splat<W>(a.scale_log2);
  const vec::F<W> masked_v = vec::splat<W>(minus_inf);
  for (int64_t j = 0; j < a.padded; j += W) {
    const vec::F<W> d = vec::load<W>(buf + j) - max;
    // -inf stays -inf (a zero scale would make it NaN): masked keys get exactly 0.
    const vec::F<W> e = vec::exp2<W>(d == masked_v ? masked_v : d * scale);
    vec::store<W>(buf + j, e);
    sum_v += e;
  }
  const float inv = 1.0f / vec::reduce_sum<W>(sum_v);
#pragma omp simd
  for (int64_t j = 0; j < a.keys; ++j) simd::store(buf[j] * inv, &y[j]);
}

template <typename In, typename Out>
OCTET_TARGET_AVX512 void forward_row_avx512(const In* x, Out* y, int64_t limit,
                                            const uint8_t* masked, const RowArgs& a, float* buf) {
  forward_row<16>(x, y, limit, masked, a, buf);
}
template <typename In, typename Out>
OCTET_TARGET_AVX2 void forward_row_avx2(const In* x, Out* y, int64_t limit, const uint8_t* masked,
                                        const RowArgs& a, float* buf) {
  forward_row<8>(x, y, limit, masked, a, buf);
}
template <typename In, typename Out>
void forward_row_scalar(const In* x, Out* y, int64_t limit, const uint8_t* masked, const RowArgs& a,
                        float* buf) {
  forward_row<4>(x, y, limit, masked, a, buf);
}

template <typename Y, typename G, typename Out>
OCTET_ALWAYS_INLINE void backward_row(const Y* y, const G* dy, Out* dx, int64_t n, float scale) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < n; ++j) dot += simd::load(y[j]) * simd::load(dy[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float p = simd::load(y[j]);
    simd::store(scale * p * (simd::load(dy[j]) - dot), &dx[j]);
  }
}

template <typename Y, typename G, typename Out>
OCTET_TARGET_AVX512 void backward_row_avx512(const Y* y, const G* dy, Out* dx, int64_t n,
                                             float scale) {
  backward_row(y, dy, dx, n, scale);
}
template <typename Y, typename G, typename Out>
OCTET_TARGET_AVX2 void backward_row_avx2(const Y* y, const G* dy, Out* dx, int64_t n, float scale) {
  backward_row(y, dy, dx, n, scale);
}
template <typename Y, typename G, typename Out>
void backward_row_scalar(const Y* y, const G* dy, Out* dx, int64_t n, float scale) {
  backward_row(y, dy, dx, n, scale);
}

template <typename In, typename Out>
void forward_typed(const SoftmaxShape& s, const Tensor& x, float scale, const SoftmaxMask& mask,
                   Tensor& y) {
  auto row_fn = forward_row_scalar<In, Out>;
  if (active_isa() == Isa::Avx512) row_fn = forward_row_avx512<In, Out>;
  if (active_isa() == Isa::Avx2) row_fn = forward_row_avx2<In, Out>;
  RowArgs a;
  a.keys = s.keys;
  a.padded = (s.keys + kPad - 1) / kPad * kPad;
  a.sign = scale < 0.0f ? -1.0f : 1.0f;
  a.scale_log2 = std::fabs(scale) * kLog2e;
  const int threads = num_threads();
  Tensor workspace = Tensor::empty({threads, a.padded}, DType::F32);
  const In* in = x.data<In>();
  Out* out = y.data<Out>();
  const int64_t rows = s.batch * s.heads * s.queries;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (s.heads * s.queries);
    const int64_t i = r % s.queries;
    float* buf = workspace.data<float>() + omp_get_thread_num() * a.padded;
    row_fn(in + r * s.keys, out + r * s.keys, softmax_detail::key_limit(s, mask, b, i),
           softmax_detail::mask_row(s, mask, b, i), a, buf);
  }
}

template <typename Y, typename G, typename Out>
void backward_typed(const SoftmaxShape& s, const Tensor& y, const Tensor& dy, float scale,
                    Tensor& dx) {
  auto row_fn = backward_row_scalar<Y, G, Out>;
  if (active_isa() == Isa::Avx512) row_fn = backward_row_avx512<Y, G, Out>;
  if (active_isa() == Isa::Avx2) row_fn = backward_row_avx2<Y, G, Out>;
  const Y* probs = y.data<Y>();
  const G* grads = dy.data<G>();
  Out* out = dx.data<Out>();
  const int64_t rows = s.batch * s.heads * s.queries;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    row_fn(probs + r * s.keys, grads + r * s.keys, out + r * s.keys, s.keys, scale);
  }
}

template <typename T>
void with_float_type(DType dtype, T&& body) {
  if (dtype == DType::F32) {
    body(float{});
  } else {
    body(bfloat16{});
  }
}

}  // namespace

void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y) {
  SoftmaxShape s = softmax_detail::check_forward("scaled_masked_softmax_forward", x, mask, y);
  with_float_type(x.dtype(), [&](auto in) {
    with_float_type(y.dtype(), [&](auto out) {
      forward_typed<decltype(in), decltype(out)>(s, x, scale, mask, y);
    });
  });
}

void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx) {
  SoftmaxShape s = softmax_detail::check_backward("scaled_masked_softmax_backward", y, dy, dx);
  with_float_type(y.dtype(), [&](auto probs) {
    with_float_type(dy.dtype(), [&](auto grads) {
      with_float_type(dx.dtype(), [&](auto out) {
        backward_typed<decltype(probs), decltype(grads), decltype(out)>(s, y, dy, scale, dx);
      });
    });
  });
}

}  // namespace octet::ops::cpu
