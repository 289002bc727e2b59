// Activation reference: FP64 element functions from <cmath>, one element at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/fp8.h"
#include "ops/activation/checks.h"

namespace octet::ops {

bool is_gated(ActivationKind kind) {
  return kind == ActivationKind::SwiGlu || kind == ActivationKind::GeGlu;
}

std::string_view activation_name(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::GeluTanh:
      return "gelu";
    case ActivationKind::GeluErf:
      return "gelu_erf";
    case ActivationKind::Relu:
      return "relu";
    case ActivationKind::Silu:
      return "silu";
    case ActivationKind::SwiGlu:
      return "swiglu";
    case ActivationKind::GeGlu:
      return "geglu";
  }
  return "?";
}

ActivationKind parse_activation(std::string_view name) {
  for (ActivationKind kind :
       {ActivationKind::GeluTanh, ActivationKind::GeluErf, ActivationKind::Relu,
        ActivationKind::Silu, ActivationKind::SwiGlu, ActivationKind::GeGlu}) {
    if (activation_name(kind) == name) return kind;
  }
  fail(detail::concat("unknown activation '", name,
                      "': expected gelu, gelu_erf, relu, silu, swiglu or geglu"));
}

namespace reference {
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

constexpr double kPi = 3.14159265358979323846;

// The activated part of each kind (gated kinds: of `a`).
double act(ActivationKind kind, double x) {
  switch (kind) {
    case ActivationKind::GeluTanh:
    case ActivationKind::GeGlu:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2 / kPi) * (x + 0.044715 * x * x * x)));
    case ActivationKind::GeluErf:
      return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case ActivationKind::Relu:
      return x > 0 ? x : 0;
    case ActivationKind::Silu:
    case ActivationKind::SwiGlu:
      return x / (1 + std::exp(-x));
  }
  return 0;
}

double act_grad(ActivationKind kind, double x) {
  switch (kind) {
    case ActivationKind::GeluTanh:
    case ActivationKind::GeGlu: {
      double k = std::sqrt(2 / kPi);
      double t = std::tanh(k * (x + 0.044715 * x * x * x));
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
    }
    case ActivationKind::GeluErf:
      return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
             x * std::exp(-0.5 * x * x) / std::sqrt(2 * kPi);
    case ActivationKind::Relu:
      return x > 0 ? 1 : 0;
    case ActivationKind::Silu:
    case ActivationKind::SwiGlu: {
      double s = 1 / (1 + std::exp(-x));
      return s * (1 + x * (1 - s));
    }
  }
  return 0;
}

void store_fp8(Fp8Store* fp8, int64_t i, double v, float& amax) {
  float f = static_cast<float>(v);
  amax = std::isnan(f) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(f));
  fp8->codes[i] = float_to_fp8(f * fp8->scale, fp8->format, true);
}

}  // namespace

void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8) {
  auto s = activation_detail::check_activation("activation_forward", kind, x, bias, &y, nullptr,
                                               nullptr, nullptr, fp8);
  float amax = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.out_cols; ++c) {
      auto in = [&](int64_t col) {
        return read(x, r * s.in_cols + col) + (bias ? bias->data<float>()[col] : 0.0);
      };
      double v = act(kind, in(c));
      if (is_gated(kind)) v *= in(c + s.out_cols);
      if (y.defined()) write(y, r * s.out_cols + c, v);
      if (fp8) store_fp8(fp8, r * s.out_cols + c, v, amax);
    }
  }
  if (fp8) fp8->amax = amax;
}

void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8) {
  auto s = activation_detail::check_activation("activation_backward", kind, x, bias, nullptr, &dy,
                                               &dx, dbias, fp8);
  std::vector<double> bias_grad(static_cast<size_t>(s.in_cols), 0.0);
  float amax = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    auto in = [&](int64_t col) {
      return read(x, r * s.in_cols + col) + (bias ? bias->data<float>()[col] : 0.0);
    };
    auto emit = [&](int64_t col, double g) {
      if (dx.defined()) write(dx, r * s.in_cols + col, g);
      if (fp8) store_fp8(fp8, r * s.in_cols + col, g, amax);
      bias_grad[col] += g;
    };
    for (int64_t c = 0; c < s.out_cols; ++c) {
      double g = read(dy, r * s.out_cols + c);
      if (is_gated(kind)) {
        double a = in(c), b = in(c + s.out_cols);
        emit(c, g * b * act_grad(kind, a));
        emit(c + s.out_cols, g * act(kind, a));
      } else {
        emit(c, g * act_grad(kind, in(c)));
      }
    }
  }
  if (dbias) {
    for (int64_t c = 0; c < s.in_cols; ++c)
      dbias->data<float>()[c] = static_cast<float>(bias_grad[c]);
  }
  if (fp8) fp8->amax = amax;
}

}  // namespace reference
}  // namespace octet::ops
