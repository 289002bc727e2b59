// The normalization operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/normalization.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor* beta, float eps,
                       bool zero_centered_gamma, Tensor& y, Tensor& mean, Tensor& rstd,
                       Fp8Store* fp8) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("layernorm_forward", {&x, &gamma, beta, &y, &mean, &rstd});
  if (device == Device::CPU)
    return cpu::layernorm_forward(x, gamma, beta, eps, zero_centered_gamma, y, mean, rstd, fp8);
  no_kernel("layernorm_forward", device);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                        const Tensor& gamma, bool zero_centered_gamma, Tensor& dx, Tensor& dgamma,
                        Tensor* dbeta) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device =
      device_of("layernorm_backward", {&dy, &x, &mean, &rstd, &gamma, &dx, &dgamma, dbeta});
  if (device == Device::CPU)
    return cpu::layernorm_backward(dy, x, mean, rstd, gamma, zero_centered_gamma, dx, dgamma,
                                   dbeta);
  no_kernel("layernorm_backward", device);
}

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, bool zero_centered_gamma,
                     Tensor& y, Tensor& rstd, Fp8Store* fp8) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("rmsnorm_forward", {&x, &gamma, &y, &rstd});
  if (device == Device::CPU)
    return cpu::rmsnorm_forward(x, gamma, eps, zero_centered_gamma, y, rstd, fp8);
  no_kernel("rmsnorm_forward", device);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      bool zero_centered_gamma, Tensor& dx, Tensor& dgamma) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("rmsnorm_backward", {&dy, &x, &rstd, &gamma, &dx, &dgamma});
  if (device == Device::CPU)
    return cpu::rmsnorm_backward(dy, x, rstd, gamma, zero_centered_gamma, dx, dgamma);
  no_kernel("rmsnorm_backward", device);
}

}  // namespace octet::ops
