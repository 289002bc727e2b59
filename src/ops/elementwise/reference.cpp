// Elementwise reference: plain loops in F32. The oracle.
#include "ops/elementwise/checks.h"

namespace octet::ops::reference {
namespace {

float read(const Tensor& t, int64_t index) {
  return t.dtype() == DType::F32 ? t.data<float>()[index]
                                 : bf16_to_float(t.data<bfloat16>()[index].bits);
}

}  // namespace

void add_scaled(const Tensor& x, float alpha, Tensor& out) {
  elementwise_detail::check_add_scaled(x, out);
  float* o = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    const float product = alpha * read(x, i);  // rounded before the add (no FMA)
    o[i] += product;
  }
}

void scale(std::span<Tensor> tensors, float factor) {
  elementwise_detail::check_scale(tensors);
  for (Tensor& t : tensors) {
    float* v = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) v[i] *= factor;
  }
}

void add_bias(Tensor& y, const Tensor& bias) {
  const int64_t cols = elementwise_detail::check_bias("add_bias", y, "y", bias, "bias");
  const float* b = bias.data<float>();
  for (int64_t i = 0; i < y.numel(); ++i) {
    const float sum = read(y, i) + b[i % cols];
    if (y.dtype() == DType::F32) {
      y.data<float>()[i] = sum;
    } else {
      y.data<bfloat16>()[i].bits = float_to_bf16(sum);
    }
  }
}

void add_column_sums(const Tensor& x, Tensor& out) {
  const int64_t cols = elementwise_detail::check_bias("add_column_sums", x, "x", out, "out");
  float* o = out.data<float>();
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < x.rows(); ++r) o[c] += read(x, r * cols + c);
  }
}

}  // namespace octet::ops::reference
