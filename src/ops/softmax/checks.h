// Argument checks and mask rules shared by the reference and fast softmax kernels.
#pragma once

#include <algorithm>

#include "octet/ops/softmax.h"

namespace octet::ops::softmax_detail {

struct SoftmaxShape {
  int64_t batch = 0, heads = 0, queries = 0, keys = 0;
};

inline SoftmaxShape check_scores(const char* op, const Tensor& x, const char* name) {
  OCTET_CHECK(x.defined() && x.ndim() == 4, op, ": ", name, " expected [B,H,Tq,Tk], got ",
              x.defined() ? shape_str(x.shape()) : "an undefined tensor");
  check_dtype_in(x, {DType::F32, DType::BF16}, octet::detail::concat(op, ": ", name));
  return {x.dim(0), x.dim(1), x.dim(2), x.dim(3)};
}

inline SoftmaxShape check_forward(const char* op, const Tensor& x, const SoftmaxMask& mask,
                                  const Tensor& y) {
  SoftmaxShape s = check_scores(op, x, "x");
  check_shape(y, x.shape(), octet::detail::concat(op, ": y"), "B,H,Tq,Tk");
  check_dtype_in(y, {DType::F32, DType::BF16}, octet::detail::concat(op, ": y"));
  if (mask.kind == SoftmaxMaskKind::Padding) {
    OCTET_CHECK(mask.key_lengths != nullptr, op, ": padding mask needs key_lengths [B] I32");
    check_shape(*mask.key_lengths, {s.batch}, octet::detail::concat(op, ": key_lengths"), "B");
    check_dtype(*mask.key_lengths, DType::I32, octet::detail::concat(op, ": key_lengths"));
    const int32_t* lengths = mask.key_lengths->data<int32_t>();
    for (int64_t b = 0; b < s.batch; ++b) {
      OCTET_CHECK(lengths[b] >= 0 && lengths[b] <= s.keys, op, ": key_lengths[", b,
                  "] expected in [0,", s.keys, "], got ", lengths[b]);
    }
  }
  if (mask.kind == SoftmaxMaskKind::Arbitrary) {
    OCTET_CHECK(mask.mask != nullptr, op, ": arbitrary mask needs mask [B,1,Tq,Tk] U8");
    int64_t mask_batch = mask.mask->ndim() == 4 && mask.mask->dim(0) == 1 ? 1 : s.batch;
    check_shape(*mask.mask, {mask_batch, 1, s.queries, s.keys}, octet::detail::concat(op, ": mask"),
                "B,1,Tq,Tk");
    check_dtype(*mask.mask, DType::U8, octet::detail::concat(op, ": mask"));
  }
  return s;
}

inline SoftmaxShape check_backward(const char* op, const Tensor& y, const Tensor& dy,
                                   const Tensor& dx) {
  SoftmaxShape s = check_scores(op, y, "y");
  check_shape(dy, y.shape(), octet::detail::concat(op, ": dy"), "B,H,Tq,Tk");
  check_dtype_in(dy, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dy"));
  check_shape(dx, y.shape(), octet::detail::concat(op, ": dx"), "B,H,Tq,Tk");
  check_dtype_in(dx, {DType::F32, DType::BF16}, octet::detail::concat(op, ": dx"));
  return s;
}

// Keys j >= key_limit(...) are masked for row (b, i) by the causal and padding kinds.
inline int64_t key_limit(const SoftmaxShape& s, const SoftmaxMask& mask, int64_t b, int64_t i) {
  switch (mask.kind) {
    case SoftmaxMaskKind::Causal:
      return std::clamp<int64_t>(i + (s.keys - s.queries) + 1, 0, s.keys);
    case SoftmaxMaskKind::Padding:
      return mask.key_lengths->data<int32_t>()[b];
    default:
      return s.keys;
  }
}

// The U8 mask row for (b, i), or null when the kind is not Arbitrary.
inline const uint8_t* mask_row(const SoftmaxShape& s, const SoftmaxMask& mask, int64_t b,
                               int64_t i) {
  if (mask.kind != SoftmaxMaskKind::Arbitrary) return nullptr;
  int64_t mb = mask.mask->dim(0) == 1 ? 0 : b;
  return mask.mask->data<uint8_t>() + (mb * s.queries + i) * s.keys;
}

}  // namespace octet::ops::softmax_detail
