// The softmax operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/softmax.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void scaled_masked_softmax_forward(const Tensor& x, float scale, const SoftmaxMask& mask,
                                   Tensor& y) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("scaled_masked_softmax_forward", {&x, &y});
  if (device == Device::CPU) return cpu::scaled_masked_softmax_forward(x, scale, mask, y);
  no_kernel("scaled_masked_softmax_forward", device);
}

void scaled_masked_softmax_backward(const Tensor& y, const Tensor& dy, float scale, Tensor& dx) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("scaled_masked_softmax_backward", {&y, &dy, &dx});
  if (device == Device::CPU) return cpu::scaled_masked_softmax_backward(y, dy, scale, dx);
  no_kernel("scaled_masked_softmax_backward", device);
}

}  // namespace octet::ops
