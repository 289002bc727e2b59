// The dropout operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/dropout.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& dropout, Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("bias_dropout_add_forward", {&x, bias, &residual, &out});
  if (device == Device::CPU) return cpu::bias_dropout_add_forward(x, bias, residual, dropout, out);
  no_kernel("bias_dropout_add_forward", device);
}

void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& dropout, Tensor& dx,
                               Tensor* dbias) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("bias_dropout_add_backward", {&dout, &dx, dbias});
  if (device == Device::CPU) return cpu::bias_dropout_add_backward(dout, dropout, dx, dbias);
  no_kernel("bias_dropout_add_backward", device);
}

}  // namespace octet::ops
