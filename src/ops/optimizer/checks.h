// Argument checks and scalar coefficients shared by the reference and fast optimizer kernels.
#pragma once

#include <cmath>
#include <limits>
#include <string>

#include "octet/ops/optimizer.h"

namespace octet::ops::optimizer_detail {

// The per-step scalars of AdamW, computed once in FP64 and rounded to FP32 as torch does.
struct AdamWCoefficients {
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float one_minus_beta1 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float step_size = 0.0f;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 0.0f;  // sqrt(1 - beta2^step)
  float eps = 0.0f;
};

inline AdamWCoefficients adamw_coefficients(const AdamWHyper& h) {
  OCTET_CHECK(h.step >= 1, "adamw_step: step expected >= 1, got ", h.step);
  OCTET_CHECK(h.lr >= 0.0f && std::isfinite(h.lr), "adamw_step: lr expected finite >= 0, got ",
              h.lr);
  OCTET_CHECK(h.beta1 >= 0.0f && h.beta1 < 1.0f && h.beta2 >= 0.0f && h.beta2 < 1.0f,
              "adamw_step: betas expected in [0,1), got (", h.beta1, ", ", h.beta2, ")");
  OCTET_CHECK(h.eps >= 0.0f, "adamw_step: eps expected >= 0, got ", h.eps);
  const double step = static_cast<double>(h.step);
  AdamWCoefficients k;
  k.beta1 = h.beta1;
  k.beta2 = h.beta2;
  k.one_minus_beta1 = static_cast<float>(1.0 - double{h.beta1});
  k.one_minus_beta2 = static_cast<float>(1.0 - double{h.beta2});
  k.step_size = static_cast<float>(double{h.lr} / (1.0 - std::pow(double{h.beta1}, step)));
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double{h.beta2}, step)));
  k.eps = h.eps;
  return k;
}

inline float decay_factor(const AdamWHyper& h, float weight_decay) {
  return static_cast<float>(1.0 - double{h.lr} * double{weight_decay});
}

inline void check_adamw_tensor(const AdamWTensor& t, size_t index) {
  const std::string name = "adamw_step: tensor " + std::to_string(index) + " ";
  check_dtype(t.param, DType::F32, name + "param");
  check_dtype_in(t.grad, {DType::F32, DType::BF16}, name + "grad");
  check_dtype(t.exp_avg, DType::F32, name + "exp_avg");
  check_dtype(t.exp_avg_sq, DType::F32, name + "exp_avg_sq");
  const int64_t n = t.param.numel();
  for (const Tensor* other : {&t.grad, &t.exp_avg, &t.exp_avg_sq}) {
    OCTET_CHECK(other->numel() == n, name, "expected grad, exp_avg, exp_avg_sq of ", n,
                " elements like param ", shape_str(t.param.shape()), ", got ",
                shape_str(other->shape()));
  }
  if (t.model.defined()) {
    check_dtype_in(t.model, {DType::BF16, DType::E4M3, DType::E5M2}, name + "model");
    OCTET_CHECK(t.model.numel() == n, name, "model expected ", n, " elements like param, got ",
                shape_str(t.model.shape()));
    if (is_fp8(t.model.dtype())) {
      OCTET_CHECK(std::isfinite(t.model_scale) && t.model_scale > 0.0f, name,
                  "model_scale expected finite > 0, got ", t.model_scale);
    }
  }
}

inline void check_grads(std::span<const Tensor> grads, const char* op) {
  for (size_t i = 0; i < grads.size(); ++i) {
    check_dtype_in(grads[i], {DType::F32, DType::BF16},
                   std::string(op) + ": grad " + std::to_string(i));
  }
}

// torch.clamp(max_norm / (norm + 1e-6), max=1): NaN stays NaN (and then poisons the grads).
inline float clip_coefficient(double norm, double max_norm) {
  OCTET_CHECK(max_norm > 0.0, "clip_grad_norm: max_norm expected > 0, got ", max_norm);
  const float coefficient = static_cast<float>(max_norm / (norm + 1e-6));
  return coefficient < 1.0f || std::isnan(coefficient) ? coefficient : 1.0f;
}

inline float nan_max(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<float>::quiet_NaN() : (a > b ? a : b);
}

}  // namespace octet::ops::optimizer_detail
