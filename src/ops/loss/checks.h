// Argument checks shared by the reference and fast cross-entropy kernels.
#pragma once

#include <cmath>
#include <string>

#include "octet/ops/loss.h"

namespace octet::ops::loss_detail {

struct LossShape {
  int64_t rows = 0;
  int64_t vocab = 0;
};

inline int64_t target_at(const Tensor& targets, int64_t row) {
  return targets.dtype() == DType::I32 ? int64_t{targets.data<int32_t>()[row]}
                                       : targets.data<int64_t>()[row];
}

// Checks every argument, targets included, before anything is written: a bad call must not
// leave in-place logits half overwritten.
inline LossShape check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets,
                                     const Tensor& losses, const Tensor* dlogits,
                                     const CrossEntropyOptions& options) {
  const std::string name(op);
  check_dtype_in(logits, {DType::F32, DType::BF16}, name + ": logits");
  OCTET_CHECK(logits.ndim() >= 1, op, ": logits expected [N,V], got a scalar");
  LossShape s{logits.rows(), logits.cols()};
  OCTET_CHECK(s.vocab > 0, op, ": logits expected [N,V] with V > 0, got ",
              shape_str(logits.shape()));
  check_shape(targets, {s.rows}, name + ": targets", "N");
  check_dtype_in(targets, {DType::I32, DType::I64}, name + ": targets");
  check_shape(losses, {s.rows}, name + ": losses", "N");
  check_dtype(losses, DType::F32, name + ": losses");
  if (dlogits) {
    check_shape(*dlogits, logits.shape(), name + ": dlogits");
    check_dtype(*dlogits, logits.dtype(), name + ": dlogits");
  }
  OCTET_CHECK(options.label_smoothing >= 0.0f && options.label_smoothing <= 1.0f, op,
              ": label_smoothing expected in [0,1], got ", options.label_smoothing);
  OCTET_CHECK(std::isfinite(options.grad_scale), op, ": grad_scale expected finite, got ",
              options.grad_scale);
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t target = target_at(targets, row);
    OCTET_CHECK(target == options.ignore_index || (target >= 0 && target < s.vocab), op,
                ": target id ", target, " at row ", row, " is out of range [0,V) with V=", s.vocab,
                " (ignore_index=", options.ignore_index, ")");
  }
  return s;
}

}  // namespace octet::ops::loss_detail
