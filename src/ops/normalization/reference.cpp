// LayerNorm / RMSNorm reference: one row at a time, FP64 statistics. The oracle.
#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/fp8.h"
#include "ops/normalization/checks.h"

namespace octet::ops::reference {
namespace {

std::vector<double> row_values(const Tensor& t, int64_t row, int64_t cols) {
  std::vector<double> out(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    out[c] = t.dtype() == DType::F32 ? t.data<float>()[row * cols + c]
                                     : bf16_to_float(t.data<bfloat16>()[row * cols + c].bits);
  }
  return out;
}

void write(Tensor& t, int64_t index, double value) {
  if (t.dtype() == DType::F32) {
    t.data<float>()[index] = static_cast<float>(value);
  } else {
    t.data<bfloat16>()[index].bits = float_to_bf16(static_cast<float>(value));
  }
}

void norm_forward(bool rms, const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                  bool zero_centered_gamma, Tensor& y, Tensor* mean, Tensor& rstd, Fp8Store* fp8) {
  auto s = norm_detail::check_norm_forward(rms ? "rmsnorm_forward" : "layernorm_forward", x, gamma,
                                           beta, y, mean, rstd, fp8);
  float amax = 0.0f;
  for (int64_t r = 0; r < s.rows; ++r) {
    std::vector<double> v = row_values(x, r, s.cols);
    double mu = 0.0;
    if (!rms) {
      for (double value : v) mu += value;
      mu /= static_cast<double>(s.cols);
    }
    double variance = 0.0;
    for (double value : v) variance += (value - mu) * (value - mu);
    variance /= static_cast<double>(s.cols);
    double inv = 1.0 / std::sqrt(variance + eps);
    if (mean) mean->data<float>()[r] = static_cast<float>(mu);
    rstd.data<float>()[r] = static_cast<float>(inv);
    for (int64_t c = 0; c < s.cols; ++c) {
      double w = gamma.data<float>()[c] + (zero_centered_gamma ? 1.0 : 0.0);
      double out = (v[c] - mu) * inv * w + (beta ? beta->data<float>()[c] : 0.0);
      if (y.defined()) write(y, r * s.cols + c, out);
      if (fp8) {
        float out_f = static_cast<float>(out);
        amax = std::isnan(out_f) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(out_f));
        fp8->codes[r * s.cols + c] = float_to_fp8(out_f * fp8->scale, fp8->format, true);
      }
    }
  }
  if (fp8) fp8->amax = amax;
}

void norm_backward(bool rms, const Tensor& dy, const Tensor& x, const Tensor* mean,
                   const Tensor& rstd, const Tensor& gamma, bool zero_centered_gamma, Tensor& dx,
                   Tensor& dgamma, Tensor* dbeta) {
  auto s = norm_detail::check_norm_backward(rms ? "rmsnorm_backward" : "layernorm_backward", dy, x,
                                            mean, rstd, gamma, dx, dgamma, dbeta);
  std::vector<double> dgamma_sum(static_cast<size_t>(s.cols), 0.0);
  std::vector<double> dbeta_sum(static_cast<size_t>(s.cols), 0.0);
  for (int64_t r = 0; r < s.rows; ++r) {
    std::vector<double> v = row_values(x, r, s.cols);
    std::vector<double> g = row_values(dy, r, s.cols);
    double mu = mean ? mean->data<float>()[r] : 0.0;
    double inv = rstd.data<float>()[r];
    double mean_dyw = 0.0, mean_dyw_xhat = 0.0;
    for (int64_t c = 0; c < s.cols; ++c) {
      double w = gamma.data<float>()[c] + (zero_centered_gamma ? 1.0 : 0.0);
      double xhat = (v[c] - mu) * inv;
      mean_dyw += g[c] * w;
      mean_dyw_xhat += g[c] * w * xhat;
      dgamma_sum[c] += g[c] * xhat;
      dbeta_sum[c] += g[c];
    }
    mean_dyw /= static_cast<double>(s.cols);
    mean_dyw_xhat /= static_cast<double>(s.cols);
    if (rms) mean_dyw = 0.0;  // RMSNorm does not subtract the mean
    for (int64_t c = 0; c < s.cols; ++c) {
      double w = gamma.data<float>()[c] + (zero_centered_gamma ? 1.0 : 0.0);
      double xhat = (v[c] - mu) * inv;
      write(dx, r * s.cols + c, inv * (g[c] * w - mean_dyw - xhat * mean_dyw_xhat));
    }
  }
  for (int64_t c = 0; c < s.cols; ++c) {
    dgamma.data<float>()[c] = static_cast<float>(dgamma_sum[c]);
    if (dbeta) dbeta->data<float>()[c] = static_cast<float>(dbeta_sum[c]);
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

}  // namespace octet::ops::reference
