// Activation fast path: OpenMP over rows; each row's loop vectorized for the active ISA with
// the bias add, the gate product, and (backward) the bias-gradient sum in the same pass.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "octet/fp8.h"
#include "ops/activation/checks.h"
#include "ops/activation/math.h"

namespace octet::ops::cpu {
namespace {

// Forward passes below this many elements run on the calling thread: a decode step's row or
// two is done before a second thread would have woken.
constexpr int64_t kParallelMinElements = int64_t{1} << 14;

struct RowParams {
  ActivationKind kind = ActivationKind::GeluTanh;
  const float* bias = nullptr;  // [F_in], zeros when the op has no bias
  int64_t out_cols = 0;
};

// y[c] = f(x[c] + bias[c]) for the plain kinds; y[c] = f(a) * b with [a|b] for gated ones.
template <typename In, typename Out, typename F>
OCTET_ALWAYS_INLINE void map_row(const In* x, Out* y, const float* bias, int64_t n, F f) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) simd::store(f(simd::load(x[c]) + bias[c]), &y[c]);
}
template <typename In, typename Out, typename F>
OCTET_ALWAYS_INLINE void map_gated_row(const In* x, Out* y, const float* bias, int64_t n, F f) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float a = simd::load(x[c]) + bias[c];
    float b = simd::load(x[c + n]) + bias[c + n];
    simd::store(f(a) * b, &y[c]);
  }
}

template <typename In, typename Out>
OCTET_ALWAYS_INLINE void forward_row(const In* x, Out* y, const RowParams& p) {
  const int64_t n = p.out_cols;
  const float* bias = p.bias;
  switch (p.kind) {
    case ActivationKind::GeluTanh:
      return map_row(x, y, bias, n, math::GeluTanh{});
    case ActivationKind::GeluErf:
      return map_row(x, y, bias, n, math::GeluErf{});
    case ActivationKind::Relu:
      return map_row(x, y, bias, n, math::Relu{});
    case ActivationKind::Silu:
      return map_row(x, y, bias, n, math::Silu{});
    case ActivationKind::SwiGlu:
      return map_gated_row(x, y, bias, n, math::Silu{});
    case ActivationKind::GeGlu:
      return map_gated_row(x, y, bias, n, math::GeluTanh{});
  }
}

// dx[c] = dy[c] * f'(a); gated: da = dy * b * f'(a), db = dy * f(a). dbias accumulates dx.
template <typename In, typename Grad, typename Out, typename F>
OCTET_ALWAYS_INLINE void grad_row(const In* x, const Grad* dy, Out* dx, float* dbias,
                                  const float* bias, int64_t n, F f) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float g = simd::load(dy[c]) * f.grad(simd::load(x[c]) + bias[c]);
    simd::store(g, &dx[c]);
    dbias[c] += g;
  }
}
template <typename In, typename Grad, typename Out, typename F>
OCTET_ALWAYS_INLINE void grad_gated_row(const In* x, const Grad* dy, Out* dx, float* dbias,
                                        const float* bias, int64_t n, F f) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float a = simd::load(x[c]) + bias[c];
    float b = simd::load(x[c + n]) + bias[c + n];
    float d = simd::load(dy[c]);
    float ga = d * b * f.grad(a);
    float gb = d * f(a);
    simd::store(ga, &dx[c]);
    simd::store(gb, &dx[c + n]);
    dbias[c] += ga;
    dbias[c + n] += gb;
  }
}

template <typename In, typename Grad, typename Out>
OCTET_ALWAYS_INLINE void backward_row(const In* x, const Grad* dy, Out* dx, float* dbias,
                                      const RowParams& p) {
  const int64_t n = p.out_cols;
  const float* b = p.bias;
  switch (p.kind) {
    case ActivationKind::GeluTanh:
      return grad_row(x, dy, dx, dbias, b, n, math::GeluTanh{});
    case ActivationKind::GeluErf:
      return grad_row(x, dy, dx, dbias, b, n, math::GeluErf{});
    case ActivationKind::Relu:
      return grad_row(x, dy, dx, dbias, b, n, math::Relu{});
    case ActivationKind::Silu:
      return grad_row(x, dy, dx, dbias, b, n, math::Silu{});
    case ActivationKind::SwiGlu:
      return grad_gated_row(x, dy, dx, dbias, b, n, math::Silu{});
    case ActivationKind::GeGlu:
      return grad_gated_row(x, dy, dx, dbias, b, n, math::GeluTanh{});
  }
}

template <typename In, typename Out>
using ForwardRow = void (*)(const In*, Out*, const RowParams&);
template <typename In, typename Out>
OCTET_TARGET_AVX512 void forward_avx512(const In* x, Out* y, const RowParams& p) {
  forward_row(x, y, p);
}
template <typename In, typename Out>
OCTET_TARGET_AVX2 void forward_avx2(const In* x, Out* y, const RowParams& p) {
  forward_row(x, y, p);
}
template <typename In, typename Out>
void forward_scalar(const In* x, Out* y, const RowParams& p) {
  forward_row(x, y, p);
}
template <typename In, typename Out>
ForwardRow<In, Out> pick_forward() {
  switch (active_isa()) {
    case Isa::Avx512:
      return forward_avx512<In, Out>;
    case Isa::Avx2:
      return forward_avx2<In, Out>;
    case Isa::Scalar:
      break;
  }
  return forward_scalar<In, Out>;
}

template <typename In, typename Grad, typename Out>
using BackwardRow = void (*)(const In*, const Grad*, Out*, float*, const RowParams&);
template <typename In, typename Grad, typename Out>
OCTET_TARGET_AVX512 void backward_avx512(const In* x, const Grad* dy, Out* dx, float* db,
                                         const RowParams& p) {
  backward_row(x, dy, dx, db, p);
}
template <typename In, typename Grad, typename Out>
OCTET_TARGET_AVX2 void backward_avx2(const In* x, const Grad* dy, Out* dx, float* db,
                                     const RowParams& p) {
  backward_row(x, dy, dx, db, p);
}
template <typename In, typename Grad, typename Out>
void backward_scalar(const In* x, const Grad* dy, Out* dx, float* db, const RowParams& p) {
  backward_row(x, dy, dx, db, p);
}
template <typename In, typename Grad, typename Out>
BackwardRow<In, Grad, Out> pick_backward() {
  switch (active_isa()) {
    case Isa::Avx512:
      return backward_avx512<In, Grad, Out>;
    case Isa::Avx2:
      return backward_avx2<In, Grad, Out>;
    case Isa::Scalar:
      break;
  }
  return backward_scalar<In, Grad, Out>;
}

// Quantizes one staged F32 row and writes it to `out` too when the caller wants both.
template <typename Out>
float finish_fp8_row(const float* staged, int64_t n, Fp8Store* fp8, int64_t offset, Out* out) {
  float amax =
      quantize_fp8(staged, static_cast<size_t>(n), fp8->scale, fp8->format, fp8->codes + offset);
  if (out) {
    for (int64_t c = 0; c < n; ++c) simd::store(staged[c], &out[c]);
  }
  return amax;
}

void merge_amax(float row_amax, float& amax, bool& saw_nan) {
  if (std::isnan(row_amax)) {
    saw_nan = true;
  } else {
    amax = std::max(amax, row_amax);
  }
}

template <typename In, typename Out>
void run_forward(const Tensor& x, Tensor& y, const RowParams& p, int64_t in_cols, Fp8Store* fp8) {
  const int64_t rows = x.rows(), n = p.out_cols;
  const In* xs = x.data<In>();
  Out* ys = y.defined() ? y.data<Out>() : nullptr;
  ForwardRow<In, Out> row = pick_forward<In, Out>();
  ForwardRow<In, float> row_f32 = pick_forward<In, float>();
  float amax = 0.0f;
  bool saw_nan = false;
  // The rows on the calling thread (an orphaned `omp for`: inside a region they are shared).
  auto rows_body = [&](float& amax_out, bool& nan_out) {
    std::vector<float> staged(fp8 ? static_cast<size_t>(n) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (!fp8) {
        row(xs + r * in_cols, ys + r * n, p);
        continue;
      }
      row_f32(xs + r * in_cols, staged.data(), p);
      merge_amax(finish_fp8_row(staged.data(), n, fp8, r * n, ys ? ys + r * n : nullptr), amax_out,
                 nan_out);
    }
  };
  // Small inputs never enter a parallel region (even an `if (false)` one wakes the pool).
  if (rows * n < kParallelMinElements) {
    rows_body(amax, saw_nan);
  } else {
#pragma omp parallel reduction(max : amax) reduction(|| : saw_nan)
    rows_body(amax, saw_nan);
  }
  if (fp8) fp8->amax = saw_nan ? NAN : amax;
}

template <typename In, typename Grad, typename Out>
void run_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* dbias, const RowParams& p,
                  int64_t in_cols, Fp8Store* fp8) {
  const int64_t rows = x.rows(), n = p.out_cols;
  const In* xs = x.data<In>();
  const Grad* dys = dy.data<Grad>();
  Out* dxs = dx.defined() ? dx.data<Out>() : nullptr;
  BackwardRow<In, Grad, Out> row = pick_backward<In, Grad, Out>();
  BackwardRow<In, Grad, float> row_f32 = pick_backward<In, Grad, float>();
  const int threads = omp_get_max_threads();
  // Per-thread bias-gradient partials, reduced in a fixed order: deterministic.
  Tensor partial = Tensor::zeros({threads, in_cols}, DType::F32);
  float* partial_data = partial.data<float>();
  float amax = 0.0f;
  bool saw_nan = false;
#pragma omp parallel num_threads(threads) reduction(max : amax) reduction(|| : saw_nan)
  {
    float* db = partial_data + static_cast<int64_t>(omp_get_thread_num()) * in_cols;
    std::vector<float> staged(fp8 ? static_cast<size_t>(in_cols) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (!fp8) {
        row(xs + r * in_cols, dys + r * n, dxs + r * in_cols, db, p);
        continue;
      }
      row_f32(xs + r * in_cols, dys + r * n, staged.data(), db, p);
      merge_amax(finish_fp8_row(staged.data(), in_cols, fp8, r * in_cols,
                                dxs ? dxs + r * in_cols : nullptr),
                 amax, saw_nan);
    }
  }
  if (dbias) {
    float* out = dbias->data<float>();
    for (int64_t c = 0; c < in_cols; ++c) {
      float sum = 0.0f;
      for (int t = 0; t < threads; ++t) sum += partial_data[static_cast<int64_t>(t) * in_cols + c];
      out[c] = sum;
    }
  }
  if (fp8) fp8->amax = saw_nan ? NAN : amax;
}

template <typename In>
void forward_for_input(const Tensor& x, Tensor& y, const RowParams& p, int64_t in_cols,
                       Fp8Store* fp8) {
  if (y.defined() && y.dtype() == DType::BF16) {
    run_forward<In, bfloat16>(x, y, p, in_cols, fp8);
  } else {
    run_forward<In, float>(x, y, p, in_cols, fp8);
  }
}

template <typename In, typename Grad>
void backward_for(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* dbias, const RowParams& p,
                  int64_t in_cols, Fp8Store* fp8) {
  if (dx.defined() && dx.dtype() == DType::BF16) {
    run_backward<In, Grad, bfloat16>(dy, x, dx, dbias, p, in_cols, fp8);
  } else {
    run_backward<In, Grad, float>(dy, x, dx, dbias, p, in_cols, fp8);
  }
}

}  // namespace

void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8) {
  auto s = activation_detail::check_activation("activation_forward", kind, x, bias, &y, nullptr,
                                               nullptr, nullptr, fp8);
  if (s.rows == 0 || s.out_cols == 0) return;
  std::vector<float> zeros(bias ? 0 : static_cast<size_t>(s.in_cols), 0.0f);
  RowParams p{kind, bias ? bias->data<float>() : zeros.data(), s.out_cols};
  if (x.dtype() == DType::F32) {
    forward_for_input<float>(x, y, p, s.in_cols, fp8);
  } else {
    forward_for_input<bfloat16>(x, y, p, s.in_cols, fp8);
  }
}

void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8) {
  auto s = activation_detail::check_activation("activation_backward", kind, x, bias, nullptr, &dy,
                                               &dx, dbias, fp8);
  if (dbias) dbias->zero_();
  if (s.rows == 0 || s.out_cols == 0) return;
  std::vector<float> zeros(bias ? 0 : static_cast<size_t>(s.in_cols), 0.0f);
  RowParams p{kind, bias ? bias->data<float>() : zeros.data(), s.out_cols};
  bool x_f32 = x.dtype() == DType::F32, g_f32 = dy.dtype() == DType::F32;
  if (x_f32 && g_f32) {
    backward_for<float, float>(dy, x, dx, dbias, p, s.in_cols, fp8);
  } else if (x_f32) {
    backward_for<float, bfloat16>(dy, x, dx, dbias, p, s.in_cols, fp8);
  } else if (g_f32) {
    backward_for<bfloat16, float>(dy, x, dx, dbias, p, s.in_cols, fp8);
  } else {
    backward_for<bfloat16, bfloat16>(dy, x, dx, dbias, p, s.in_cols, fp8);
  }
}

}  // namespace octet::ops::cpu
