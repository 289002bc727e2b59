// Argument checks shared by the reference and fast RoPE kernels.
#pragma once

#include <cmath>

#include "octet/ops/rope.h"

namespace octet::ops::rope_detail {

struct RopeShape {
  int64_t batch = 0, positions = 0, heads = 0, head_dim = 0, rotary_dim = 0;
};

inline RopeShape check_rope(const char* op, const Tensor& x, const RopeOptions& o) {
  OCTET_CHECK(x.defined() && x.ndim() == 4, op, ": x expected [B,T,H,D], got ",
              x.defined() ? shape_str(x.shape()) : "an undefined tensor");
  check_dtype_in(x, {DType::F32, DType::BF16}, octet::detail::concat(op, ": x"));
  RopeShape s{x.dim(0), x.dim(1), x.dim(2), x.dim(3), o.rotary_dim == 0 ? x.dim(3) : o.rotary_dim};
  OCTET_CHECK(s.rotary_dim > 0 && s.rotary_dim % 2 == 0 && s.rotary_dim <= s.head_dim, op,
              ": rotary_dim expected even and in [2, D=", s.head_dim, "], got ", s.rotary_dim);
  OCTET_CHECK(std::isfinite(o.theta) && o.theta > 0.0f, op, ": theta expected > 0, got ", o.theta);
  OCTET_CHECK(o.position_offset >= 0, op, ": position_offset expected >= 0, got ",
              o.position_offset);
  return s;
}

}  // namespace octet::ops::rope_detail
