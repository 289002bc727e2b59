// Scaled masked softmax, the oracle: plain loops in double, one row at a time.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/softmax/checks.h"

namespace octet::ops::reference {

using softmax_detail::SoftmaxShape;

void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y) {
  SoftmaxShape s = softmax_detail::check_forward("scaled_masked_softmax_forward", x, mask, y);
  std::vector<float> in = x.to_floats();
  std::vector<float> out(in.size());
  std::vector<double> row(static_cast<size_t>(s.keys));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.queries; ++i) {
        const int64_t base = ((b * s.heads + h) * s.queries + i) * s.keys;
        const int64_t limit = softmax_detail::key_limit(s, mask, b, i);
        const uint8_t* masked = softmax_detail::mask_row(s, mask, b, i);
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < s.keys; ++j) {
          bool off = j >= limit || (masked != nullptr && masked[j] != 0);
          row[j] = off ? -std::numeric_limits<double>::infinity()
                       : static_cast<double>(scale) * in[base + j];
          max = std::max(max, row[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < s.keys; ++j) {
          row[j] = std::isinf(max) && max < 0 ? 0.0 : std::exp(row[j] - max);
          sum += row[j];
        }
        for (int64_t j = 0; j < s.keys; ++j) {
          out[base + j] = sum > 0 ? static_cast<float>(row[j] / sum) : 0.0f;
        }
      }
    }
  }
  Tensor result = Tensor::from_floats(y.shape(), out);
  y.copy_from(y.dtype() == DType::F32 ? result : result.to(y.dtype()));
}

void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx) {
  SoftmaxShape s = softmax_detail::check_backward("scaled_masked_softmax_backward", y, dy, dx);
  std::vector<float> probs = y.to_floats();
  std::vector<float> grads = dy.to_floats();
  std::vector<float> out(probs.size());
  const int64_t rows = s.batch * s.heads * s.queries;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * s.keys;
    double dot = 0.0;
    for (int64_t j = 0; j < s.keys; ++j) dot += double{probs[base + j]} * grads[base + j];
    for (int64_t j = 0; j < s.keys; ++j) {
      out[base + j] = static_cast<float>(scale * probs[base + j] * (grads[base + j] - dot));
    }
  }
  Tensor result = Tensor::from_floats(dx.shape(), out);
  dx.copy_from(dx.dtype() == DType::F32 ? result : result.to(dx.dtype()));
}

}  // namespace octet::ops::reference
