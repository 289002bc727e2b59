// Argument checks shared by the reference and fast normalization kernels.
#pragma once

#include <cmath>

#include "octet/ops/normalization.h"

namespace octet::ops::norm_detail {

struct NormShape {
  int64_t rows = 0;
  int64_t cols = 0;
};

inline NormShape check_norm_forward(const char* op, const Tensor& x, const Tensor& gamma,
                                    const Tensor* beta, const Tensor& y, const Tensor* mean,
                                    const Tensor& rstd, const Fp8Store* fp8) {
  check_dtype_in(x, {DType::F32, DType::BF16}, octet::detail::concat(op, ": x"));
  NormShape s{x.rows(), x.cols()};
  check_shape(gamma, {s.cols}, octet::detail::concat(op, ": gamma"), "C");
  check_dtype(gamma, DType::F32, octet::detail::concat(op, ": gamma"));
  if (beta) {
    check_shape(*beta, {s.cols}, octet::detail::concat(op, ": beta"), "C");
    check_dtype(*beta, DType::F32, octet::detail::concat(op, ": beta"));
  }
  if (fp8 == nullptr || y.defined()) {
    check_shape(y, x.shape(), octet::detail::concat(op, ": y"));
    check_dtype_in(y, {DType::F32, DType::BF16}, octet::detail::concat(op, ": y"));
  }
  if (fp8) {
    OCTET_CHECK(is_fp8(fp8->format) && fp8->codes != nullptr, op,
                ": fp8 output needs an e4m3/e5m2 format and a codes buffer");
    OCTET_CHECK(std::isfinite(fp8->scale) && fp8->scale > 0, op,
                ": fp8 scale must be positive and finite, got ", fp8->scale);
  }
  if (mean) {
    check_shape(*mean, {s.rows}, octet::detail::concat(op, ": mean"), "N");
    check_dtype(*mean, DType::F32, octet::detail::concat(op, ": mean"));
  }
  check_shape(rstd, {s.rows}, octet::detail::concat(op, ": rstd"), "N");
  check_dtype(rstd, DType::F32, octet::detail::concat(op, ": rstd"));
  return s;
}

inline NormShape check_norm_backward(const char* op, const Tensor& dy, const Tensor& x,
                                     const Tensor* mean, const Tensor& rstd, const Tensor& gamma,
                                     const Tensor& dx, const Tensor& dgamma, const Tensor* dbeta) {
  check_dtype_in(x, {DType::F32, DType::BF16}, octet::detail::concat(op, ": x"));
  NormShape s{x.rows(), x.cols()};
  check_shape(dy, x.shape(), octet::detail::concat(op, ": dy"));
  check_dtype_in(dy, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dy"));
  check_shape(dx, x.shape(), octet::detail::concat(op, ": dx"));
  check_dtype_in(dx, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dx"));
  for (const Tensor* t : {&gamma, &dgamma, dbeta}) {
    if (t == nullptr) continue;
    check_shape(*t, {s.cols}, octet::detail::concat(op, ": gamma/dgamma/dbeta"), "C");
    check_dtype(*t, DType::F32, octet::detail::concat(op, ": gamma/dgamma/dbeta"));
  }
  if (mean) check_shape(*mean, {s.rows}, octet::detail::concat(op, ": mean"), "N");
  check_shape(rstd, {s.rows}, octet::detail::concat(op, ": rstd"), "N");
  return s;
}

}  // namespace octet::ops::norm_detail
