// AdamW and gradient-norm reference: one element at a time, torch's FP32 order of operations
// for AdamW, FP64 for the norm. The oracle.
#include <cmath>

#include "octet/fp8.h"
#include "ops/optimizer/checks.h"

namespace octet::ops::reference {
namespace {

float read(const Tensor& t, int64_t index) {
  return t.dtype() == DType::F32 ? t.data<float>()[index]
                                 : bf16_to_float(t.data<bfloat16>()[index].bits);
}

void write(Tensor& t, int64_t index, float value) {
  if (t.dtype() == DType::F32) {
    t.data<float>()[index] = value;
  } else {
    t.data<bfloat16>()[index].bits = float_to_bf16(value);
  }
}

}  // namespace

void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper) {
  const auto k = optimizer_detail::adamw_coefficients(hyper);
  for (size_t i = 0; i < tensors.size(); ++i) optimizer_detail::check_adamw_tensor(tensors[i], i);
  for (AdamWTensor& t : tensors) {
    const float decay = optimizer_detail::decay_factor(hyper, t.weight_decay);
    float* param = t.param.data<float>();
    float* m = t.exp_avg.data<float>();
    float* v = t.exp_avg_sq.data<float>();
    const bool fp8_model = t.model.defined() && is_fp8(t.model.dtype());
    float amax = 0.0f;
    for (int64_t j = 0; j < t.param.numel(); ++j) {
      const float g = read(t.grad, j);
      float p = param[j] * decay;
      m[j] = m[j] * k.beta1 + k.one_minus_beta1 * g;
      v[j] = v[j] * k.beta2 + k.one_minus_beta2 * g * g;
      const float denom = std::sqrt(v[j]) / k.bias_correction2_sqrt + k.eps;
      p = p - k.step_size * (m[j] / denom);
      param[j] = p;
      if (fp8_model) {
        amax = optimizer_detail::nan_max(amax, std::fabs(p));
        static_cast<uint8_t*>(t.model.raw())[j] =
            float_to_fp8(p * t.model_scale, t.model.dtype(), /*saturate=*/true);
      } else if (t.model.defined()) {
        write(t.model, j, p);
      }
    }
    if (fp8_model) t.model_amax = amax;
  }
}

double global_grad_norm(std::span<const Tensor> grads) {
  optimizer_detail::check_grads(grads, "global_grad_norm");
  double sum = 0.0;
  for (const Tensor& g : grads) {
    for (int64_t j = 0; j < g.numel(); ++j) {
      const double value = read(g, j);
      sum += value * value;
    }
  }
  return std::sqrt(sum);
}

double clip_grad_norm(std::span<Tensor> grads, double max_norm) {
  const double norm = reference::global_grad_norm(grads);
  const float coefficient = optimizer_detail::clip_coefficient(norm, max_norm);
  if (coefficient == 1.0f) return norm;
  for (Tensor& g : grads) {
    for (int64_t j = 0; j < g.numel(); ++j) write(g, j, read(g, j) * coefficient);
  }
  return norm;
}

}  // namespace octet::ops::reference
