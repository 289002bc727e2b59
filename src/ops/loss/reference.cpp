// Cross-entropy reference: one row at a time, FP64 throughout, no chunking. The oracle.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/loss/checks.h"

namespace octet::ops {

int64_t count_valid_targets(const Tensor& targets, int64_t ignore_index) {
  check_dtype_in(targets, {DType::I32, DType::I64}, "count_valid_targets: targets");
  int64_t count = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) {
    count += loss_detail::target_at(targets, i) != ignore_index;
  }
  return count;
}

namespace reference {
namespace {

double read(const Tensor& t, int64_t index) {
  return t.dtype() == DType::F32 ? double{t.data<float>()[index]}
                                 : double{bf16_to_float(t.data<bfloat16>()[index].bits)};
}

void write(Tensor& t, int64_t index, double value) {
  if (t.dtype() == DType::F32) {
    t.data<float>()[index] = static_cast<float>(value);
  } else {
    t.data<bfloat16>()[index].bits = float_to_bf16(static_cast<float>(value));
  }
}

}  // namespace

float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options) {
  const auto s =
      loss_detail::check_cross_entropy("cross_entropy", logits, targets, losses, dlogits, options);
  const double smoothing = options.label_smoothing;
  const double scale = options.grad_scale;
  const double vocab = static_cast<double>(s.vocab);
  double loss_sum = 0.0;
  int64_t valid = 0;
  std::vector<double> x(static_cast<size_t>(s.vocab));
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t target = loss_detail::target_at(targets, row);
    const int64_t base = row * s.vocab;
    if (target == options.ignore_index) {
      losses.data<float>()[row] = 0.0f;
      if (dlogits) {
        for (int64_t j = 0; j < s.vocab; ++j) write(*dlogits, base + j, 0.0);
      }
      continue;
    }
    double max = -std::numeric_limits<double>::infinity();
    double sum = 0.0;
    for (int64_t j = 0; j < s.vocab; ++j) {
      x[j] = read(logits, base + j);
      max = std::fmax(max, x[j]);
      sum += x[j];
    }
    double sum_exp = 0.0;
    for (int64_t j = 0; j < s.vocab; ++j) sum_exp += std::exp(x[j] - max);
    const double lse = max + std::log(sum_exp);
    // -log p_j = lse - x_j, so the smoothed loss is lse - (1-eps) x_t - eps mean_j x_j.
    const double loss = lse - (1.0 - smoothing) * x[target] - smoothing * sum / vocab;
    losses.data<float>()[row] = static_cast<float>(loss);
    loss_sum += loss;
    ++valid;
    if (dlogits) {
      for (int64_t j = 0; j < s.vocab; ++j) {
        const double onehot = j == target ? 1.0 - smoothing : 0.0;
        write(*dlogits, base + j, scale * (std::exp(x[j] - lse) - onehot - smoothing / vocab));
      }
    }
  }
  return static_cast<float>(loss_sum / static_cast<double>(valid));
}

}  // namespace reference
}  // namespace octet::ops
