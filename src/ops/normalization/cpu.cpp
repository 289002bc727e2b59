// LayerNorm / RMSNorm fast path: OpenMP over rows, each row's loops vectorized for the
// active instruction set (src/ops/README.md); the FP8 output is cast while the row is hot.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/fp8.h"
#include "ops/normalization/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

// Forward passes below this many elements run on the calling thread: a decode step's row or
// two is done before a second thread would have woken.
constexpr int64_t kParallelMinElements = int64_t{1} << 14;

struct RowParams {
  const float* gamma = nullptr;
  const float* beta = nullptr;  // may be null
  float eps = 0.0f;
  float gamma_shift = 0.0f;  // 1 with zero-centered gamma
  bool rms = false;
  int64_t cols = 0;
};

template <typename In, typename Out>
OCTET_ALWAYS_INLINE void forward_row(const In* x, Out* y, float* mean_out, float* rstd_out,
                                     const RowParams& p) {
  const int64_t n = p.cols;
  float mu = 0.0f;
  if (!p.rms) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < n; ++c) sum += simd::load(x[c]);
    mu = sum / static_cast<float>(n);
  }
  float squares = 0.0f;  // second pass over the (cached) row: no cancellation of E[x^2]-mu^2
#pragma omp simd reduction(+ : squares)
  for (int64_t c = 0; c < n; ++c) {
    float d = simd::load(x[c]) - mu;
    squares += d * d;
  }
  float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + p.eps);
  if (mean_out) *mean_out = mu;
  *rstd_out = inv;
  const float* gamma = p.gamma;
  const float shift = p.gamma_shift;
  if (p.beta) {
    const float* beta = p.beta;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      simd::store((simd::load(x[c]) - mu) * inv * (gamma[c] + shift) + beta[c], &y[c]);
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      simd::store((simd::load(x[c]) - mu) * inv * (gamma[c] + shift), &y[c]);
    }
  }
}

// dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)); RMSNorm drops the mean(dy*w).
template <typename In, typename Grad>
OCTET_ALWAYS_INLINE void backward_row(const In* x, const Grad* dy, float mu, float inv, Grad* dx,
                                      float* dgamma, float* dbeta, const RowParams& p) {
  const int64_t n = p.cols;
  const float* gamma = p.gamma;
  const float shift = p.gamma_shift;
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
  for (int64_t c = 0; c < n; ++c) {
    float xhat = (simd::load(x[c]) - mu) * inv;
    float d = simd::load(dy[c]);
    float g = d * (gamma[c] + shift);
    sum_g += g;
    sum_g_xhat += g * xhat;
    dgamma[c] += d * xhat;
    dbeta[c] += d;
  }
  float a = p.rms ? 0.0f : sum_g / static_cast<float>(n);
  float b = sum_g_xhat / static_cast<float>(n);
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float xhat = (simd::load(x[c]) - mu) * inv;
    float g = simd::load(dy[c]) * (gamma[c] + shift);
    simd::store(inv * (g - a - xhat * b), &dx[c]);
  }
}

template <typename In, typename Out>
using ForwardRow = void (*)(const In*, Out*, float*, float*, const RowParams&);
template <typename In, typename Out>
OCTET_TARGET_AVX512 void forward_avx512(const In* x, Out* y, float* m, float* r,
                                        const RowParams& p) {
  forward_row(x, y, m, r, p);
}
template <typename In, typename Out>
OCTET_TARGET_AVX2 void forward_avx2(const In* x, Out* y, float* m, float* r, const RowParams& p) {
  forward_row(x, y, m, r, p);
}
template <typename In, typename Out>
void forward_scalar(const In* x, Out* y, float* m, float* r, const RowParams& p) {
  forward_row(x, y, m, r, p);
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

template <typename In, typename Grad>
using BackwardRow = void (*)(const In*, const Grad*, float, float, Grad*, float*, float*,
                             const RowParams&);
template <typename In, typename Grad>
OCTET_TARGET_AVX512 void backward_avx512(const In* x, const Grad* dy, float mu, float inv, Grad* dx,
                                         float* dg, float* db, const RowParams& p) {
  backward_row(x, dy, mu, inv, dx, dg, db, p);
}
template <typename In, typename Grad>
OCTET_TARGET_AVX2 void backward_avx2(const In* x, const Grad* dy, float mu, float inv, Grad* dx,
                                     float* dg, float* db, const RowParams& p) {
  backward_row(x, dy, mu, inv, dx, dg, db, p);
}
template <typename In, typename Grad>
void backward_scalar(const In* x, const Grad* dy, float mu, float inv, Grad* dx, float* dg,
                     float* db, const RowParams& p) {
  backward_row(x, dy, mu, inv, dx, dg, db, p);
}
template <typename In, typename Grad>
BackwardRow<In, Grad> pick_backward() {
  switch (active_isa()) {
    case Isa::Avx512:
      return backward_avx512<In, Grad>;
    case Isa::Avx2:
      return backward_avx2<In, Grad>;
    case Isa::Scalar:
      break;
  }
  return backward_scalar<In, Grad>;
}

float nan_max(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b);
}

template <typename In, typename Out>
void run_forward(const Tensor& x, Tensor& y, float* mean, float* rstd, const RowParams& p,
                 Fp8Store* fp8) {
  const int64_t rows = x.rows(), cols = p.cols;
  const In* xs = x.data<In>();
  ForwardRow<In, Out> row = pick_forward<In, Out>();
  ForwardRow<In, float> row_f32 = pick_forward<In, float>();
  float amax = 0.0f;
  bool saw_nan = false;  // OpenMP's max reduction would drop NaN: carry it separately
  // Every row of [begin, end) on the calling thread (an orphaned `omp for`: inside a region
  // its rows are shared out, outside it takes them all).
  auto rows_body = [&](float& amax_out, bool& nan_out) {
    std::vector<float> staged(fp8 ? static_cast<size_t>(cols) : 0);
    float local_amax = 0.0f;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* mean_r = mean ? mean + r : nullptr;
      if (!fp8) {
        row(xs + r * cols, y.data<Out>() + r * cols, mean_r, rstd + r, p);
        continue;
      }
      row_f32(xs + r * cols, staged.data(), mean_r, rstd + r, p);
      float row_amax = quantize_fp8(staged.data(), static_cast<size_t>(cols), fp8->scale,
                                    fp8->format, fp8->codes + r * cols);
      local_amax = nan_max(local_amax, row_amax);
      if (y.defined()) {
        Out* out = y.data<Out>() + r * cols;
        for (int64_t c = 0; c < cols; ++c) simd::store(staged[c], &out[c]);
      }
    }
    nan_out = nan_out || std::isnan(local_amax);
    amax_out = std::isnan(local_amax) ? amax_out : std::max(amax_out, local_amax);
  };
  // Small inputs never enter a parallel region: even one whose `if` is false costs the pool a
  // wake-up (about a microsecond on these VMs, 63 times per decode step).
  if (rows * cols < kParallelMinElements) {
    rows_body(amax, saw_nan);
  } else {
#pragma omp parallel reduction(max : amax) reduction(|| : saw_nan)
    rows_body(amax, saw_nan);
  }
  if (fp8) fp8->amax = saw_nan ? NAN : amax;
}

void norm_forward(bool rms, const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                  bool zero_centered_gamma, Tensor& y, Tensor* mean, Tensor& rstd, Fp8Store* fp8) {
  auto s = norm_detail::check_norm_forward(rms ? "rmsnorm_forward" : "layernorm_forward", x, gamma,
                                           beta, y, mean, rstd, fp8);
  if (s.rows == 0 || s.cols == 0) return;
  RowParams p{gamma.data<float>(),
              beta ? beta->data<float>() : nullptr,
              eps,
              zero_centered_gamma ? 1.0f : 0.0f,
              rms,
              s.cols};
  float* mean_data = mean ? mean->data<float>() : nullptr;
  float* rstd_data = rstd.data<float>();
  bool y_bf16 = y.defined() && y.dtype() == DType::BF16;
  if (x.dtype() == DType::F32) {
    if (y_bf16) {
      run_forward<float, bfloat16>(x, y, mean_data, rstd_data, p, fp8);
    } else {
      run_forward<float, float>(x, y, mean_data, rstd_data, p, fp8);
    }
  } else {
    if (y_bf16) {
      run_forward<bfloat16, bfloat16>(x, y, mean_data, rstd_data, p, fp8);
    } else {
      run_forward<bfloat16, float>(x, y, mean_data, rstd_data, p, fp8);
    }
  }
}

template <typename In, typename Grad>
void run_backward(const Tensor& dy, const Tensor& x, const float* mean, const float* rstd,
                  Tensor& dx, Tensor& dgamma, Tensor* dbeta, const RowParams& p) {
  const int64_t rows = x.rows(), cols = p.cols;
  BackwardRow<In, Grad> row = pick_backward<In, Grad>();
  const int threads = omp_get_max_threads();
  // Per-thread partial sums of dgamma and dbeta, reduced in a fixed order: deterministic.
  Tensor partial = Tensor::zeros({threads, 2, cols}, DType::F32);
  float* partial_data = partial.data<float>();
  const In* xs = x.data<In>();
  const Grad* dys = dy.data<Grad>();
  Grad* dxs = dx.data<Grad>();
#pragma omp parallel num_threads(threads)
  {
    float* dg = partial_data + static_cast<int64_t>(omp_get_thread_num()) * 2 * cols;
    float* db = dg + cols;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      row(xs + r * cols, dys + r * cols, mean ? mean[r] : 0.0f, rstd[r], dxs + r * cols, dg, db, p);
    }
  }
  float* dgamma_data = dgamma.data<float>();
  float* dbeta_data = dbeta ? dbeta->data<float>() : nullptr;
  for (int64_t c = 0; c < cols; ++c) {
    float g = 0.0f, b = 0.0f;
    for (int t = 0; t < threads; ++t) {
      g += partial_data[(static_cast<int64_t>(t) * 2) * cols + c];
      b += partial_data[(static_cast<int64_t>(t) * 2 + 1) * cols + c];
    }
    dgamma_data[c] = g;
    if (dbeta_data) dbeta_data[c] = b;
  }
}

void norm_backward(bool rms, const Tensor& dy, const Tensor& x, const Tensor* mean,
                   const Tensor& rstd, const Tensor& gamma, bool zero_centered_gamma, Tensor& dx,
                   Tensor& dgamma, Tensor* dbeta) {
  const char* op = rms ? "rmsnorm_backward" : "layernorm_backward";
  auto s = norm_detail::check_norm_backward(op, dy, x, mean, rstd, gamma, dx, dgamma, dbeta);
  OCTET_CHECK(dx.dtype() == dy.dtype(), op, ": dx expected the dtype of dy (",
              dtype_name(dy.dtype()), "), got ", dtype_name(dx.dtype()));
  dgamma.zero_();
  if (dbeta) dbeta->zero_();
  if (s.rows == 0 || s.cols == 0) return;
  RowParams p{gamma.data<float>(), nullptr, 0.0f, zero_centered_gamma ? 1.0f : 0.0f, rms, s.cols};
  const float* mean_data = mean ? mean->data<float>() : nullptr;
  const float* rstd_data = rstd.data<float>();
  bool x_f32 = x.dtype() == DType::F32, g_f32 = dy.dtype() == DType::F32;
  if (x_f32 && g_f32) {
    run_backward<float, float>(dy, x, mean_data, rstd_data, dx, dgamma, dbeta, p);
  } else if (x_f32) {
    run_backward<float, bfloat16>(dy, x, mean_data, rstd_data, dx, dgamma, dbeta, p);
  } else if (g_f32) {
    run_backward<bfloat16, float>(dy, x, mean_data, rstd_data, dx, dgamma, dbeta, p);
  } else {
    run_backward<bfloat16, bfloat16>(dy, x, mean_data, rstd_data, dx, dgamma, dbeta, p);
  }
}

}  // namespace

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                       bool zero_centered_gamma, Tensor& y, Tensor& mean, Tensor& rstd,
                       Fp8Store* fp8) {
  norm_forward(false, x, gamma, beta, eps, zero_centered_gamma, y, &mean, rstd, fp8);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& gamma, bool zero_centered_gamma, Tensor& dx, Tensor& dgamma,
                        Tensor* dbeta) {
  norm_backward(false, dy, x, &mean, rstd, gamma, zero_centered_gamma, dx, dgamma, dbeta);
}

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, bool zero_centered_gamma,
                     Tensor& y, Tensor& rstd, Fp8Store* fp8) {
  norm_forward(true, x, gamma, nullptr, eps, zero_centered_gamma, y, nullptr, rstd, fp8);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      bool zero_centered_gamma, Tensor& dx, Tensor& dgamma) {
  norm_backward(true, dy, x, nullptr, rstd, gamma, zero_centered_gamma, dx, dgamma, nullptr);
}

}  // namespace octet::ops::cpu
