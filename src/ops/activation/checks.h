// Argument checks and names shared by the reference and fast activation kernels.
#pragma once

#include <cmath>

#include "octet/ops/activation.h"

namespace octet::ops::activation_detail {

struct ActShape {
  int64_t rows = 0;
  int64_t in_cols = 0;   // F_in
  int64_t out_cols = 0;  // F
};

inline ActShape check_activation(const char* op, ActivationKind kind, const Tensor& x,
                                 const Tensor* bias, const Tensor* y, const Tensor* dy,
                                 const Tensor* dx, const Tensor* dbias, const Fp8Store* fp8) {
  check_dtype_in(x, {DType::F32, DType::BF16}, octet::detail::concat(op, ": x"));
  ActShape s{x.rows(), x.cols(), x.cols()};
  if (is_gated(kind)) {
    OCTET_CHECK(s.in_cols % 2 == 0, op, ": ", activation_name(kind),
                " expects an even last dimension [a|b], got ", shape_str(x.shape()));
    s.out_cols = s.in_cols / 2;
  }
  Shape out_shape = x.shape();
  if (!out_shape.empty()) out_shape.back() = s.out_cols;
  if (bias) {
    check_shape(*bias, {s.in_cols}, octet::detail::concat(op, ": bias"), "F_in");
    check_dtype(*bias, DType::F32, octet::detail::concat(op, ": bias"));
  }
  if (y && (fp8 == nullptr || y->defined())) {
    check_shape(*y, out_shape, octet::detail::concat(op, ": y"));
    check_dtype_in(*y, {DType::F32, DType::BF16}, octet::detail::concat(op, ": y"));
  }
  if (dy) {
    check_shape(*dy, out_shape, octet::detail::concat(op, ": dy"));
    check_dtype_in(*dy, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dy"));
  }
  if (dx && (fp8 == nullptr || dx->defined())) {
    check_shape(*dx, x.shape(), octet::detail::concat(op, ": dx"));
    check_dtype_in(*dx, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dx"));
  }
  if (dbias) {
    check_shape(*dbias, {s.in_cols}, octet::detail::concat(op, ": dbias"), "F_in");
    check_dtype(*dbias, DType::F32, octet::detail::concat(op, ": dbias"));
  }
  if (fp8) {
    OCTET_CHECK(is_fp8(fp8->format) && fp8->codes != nullptr, op,
                ": fp8 output needs an e4m3/e5m2 format and a codes buffer");
    OCTET_CHECK(std::isfinite(fp8->scale) && fp8->scale > 0, op,
                ": fp8 scale must be positive and finite, got ", fp8->scale);
  }
  return s;
}

}  // namespace octet::ops::activation_detail
