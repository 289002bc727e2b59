// Argument checks shared by the reference and fast dropout kernels.
#pragma once

#include "octet/ops/dropout.h"

namespace octet::ops::dropout_detail {

inline void check_probability(const char* op, const DropoutParams& d) {
  OCTET_CHECK(d.probability >= 0.0f && d.probability < 1.0f, op,
              ": dropout probability expected in [0, 1), got ", d.probability);
}

inline void check_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                          const DropoutParams& d, const Tensor& out) {
  const char* op = "bias_dropout_add_forward";
  check_probability(op, d);
  check_dtype_in(x, {DType::F32, DType::BF16}, "bias_dropout_add_forward: x");
  check_shape(residual, x.shape(), "bias_dropout_add_forward: residual");
  check_dtype_in(residual, {DType::F32, DType::BF16}, "bias_dropout_add_forward: residual");
  check_shape(out, x.shape(), "bias_dropout_add_forward: out");
  check_dtype_in(out, {DType::F32, DType::BF16}, "bias_dropout_add_forward: out");
  if (bias) {
    check_shape(*bias, {x.cols()}, "bias_dropout_add_forward: bias", "C");
    check_dtype(*bias, DType::F32, "bias_dropout_add_forward: bias");
  }
}

inline void check_backward(const Tensor& dout, const DropoutParams& d, const Tensor& dx,
                           const Tensor* dbias) {
  check_probability("bias_dropout_add_backward", d);
  check_dtype_in(dout, {DType::F32, DType::BF16}, "bias_dropout_add_backward: dout");
  check_shape(dx, dout.shape(), "bias_dropout_add_backward: dx");
  check_dtype_in(dx, {DType::F32, DType::BF16}, "bias_dropout_add_backward: dx");
  if (dbias) {
    check_shape(*dbias, {dout.cols()}, "bias_dropout_add_backward: dbias", "C");
    check_dtype(*dbias, DType::F32, "bias_dropout_add_backward: dbias");
  }
}

}  // namespace octet::ops::dropout_detail
