// Argument checks shared by the reference and fast elementwise kernels.
#pragma once

#include <string>

#include "octet/ops/elementwise.h"

namespace octet::ops::elementwise_detail {

inline void check_add_scaled(const Tensor& x, const Tensor& out) {
  check_dtype_in(x, {DType::F32, DType::BF16}, "add_scaled: x");
  check_dtype(out, DType::F32, "add_scaled: out");
  OCTET_CHECK(x.numel() == out.numel(),
              "add_scaled: x and out expected the same number of "
              "elements, got ",
              shape_str(x.shape()), " and ", shape_str(out.shape()));
}

inline void check_scale(std::span<Tensor> tensors) {
  for (const Tensor& t : tensors) check_dtype(t, DType::F32, "scale: tensor");
}

// -> C
inline int64_t check_bias(const char* op, const Tensor& rows, const char* rows_name,
                          const Tensor& bias, const char* bias_name) {
  const std::string name(op);
  check_dtype_in(rows, {DType::F32, DType::BF16}, name + ": " + rows_name);
  check_dtype(bias, DType::F32, name + ": " + bias_name);
  OCTET_CHECK(rows.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == rows.cols(), op, ": ",
              rows_name, " [N, C] and ", bias_name, " [C] expected, got ", shape_str(rows.shape()),
              " and ", shape_str(bias.shape()));
  return bias.dim(0);
}

}  // namespace octet::ops::elementwise_detail
