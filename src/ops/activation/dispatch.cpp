// The activation operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/activation.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void activation_forward(ActivationKind kind, const Tensor& x, const Tensor* bias, Tensor& y,
                        Fp8Store* fp8) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("activation_forward", {&x, bias, &y});
  if (device == Device::CPU) return cpu::activation_forward(kind, x, bias, y, fp8);
  no_kernel("activation_forward", device);
}

void activation_backward(ActivationKind kind, const Tensor& dy, const Tensor& x, const Tensor* bias,
                         Tensor& dx, Tensor* dbias, Fp8Store* fp8) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("activation_backward", {&dy, &x, bias, &dx, dbias});
  if (device == Device::CPU) return cpu::activation_backward(kind, dy, x, bias, dx, dbias, fp8);
  no_kernel("activation_backward", device);
}

}  // namespace octet::ops
