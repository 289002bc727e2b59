// Bias + dropout + residual reference: one element at a time, the RNG called per element.
#include <vector>

#include "octet/rng.h"
#include "ops/dropout/checks.h"

namespace octet::ops::reference {
namespace {

double read(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F32 ? t.data<float>()[i] : bf16_to_float(t.data<bfloat16>()[i].bits);
}

void write(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::F32) {
    t.data<float>()[i] = static_cast<float>(v);
  } else {
    t.data<bfloat16>()[i].bits = float_to_bf16(static_cast<float>(v));
  }
}

double keep_scale(const DropoutParams& d, int64_t i) {
  if (d.probability == 0.0f) return 1.0;
  bool keep = philox_uniform(d.seed, d.offset, static_cast<uint64_t>(i)) >= d.probability;
  return keep ? 1.0 / (1.0 - d.probability) : 0.0;
}

}  // namespace

void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& d, Tensor& out) {
  dropout_detail::check_forward(x, bias, residual, d, out);
  const int64_t cols = x.cols();
  for (int64_t i = 0; i < x.numel(); ++i) {
    double h = read(x, i) + (bias ? bias->data<float>()[i % cols] : 0.0);
    write(out, i, read(residual, i) + h * keep_scale(d, i));
  }
}

void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& d, Tensor& dx,
                               Tensor* dbias) {
  dropout_detail::check_backward(dout, d, dx, dbias);
  const int64_t cols = dout.cols();
  std::vector<double> sums(static_cast<size_t>(cols), 0.0);
  for (int64_t i = 0; i < dout.numel(); ++i) {
    double g = read(dout, i) * keep_scale(d, i);
    write(dx, i, g);
    sums[i % cols] += g;
  }
  if (dbias) {
    for (int64_t c = 0; c < cols; ++c) dbias->data<float>()[c] = static_cast<float>(sums[c]);
  }
}

}  // namespace octet::ops::reference
