// The rope operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/rope.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void rope_forward(Tensor& x, const RopeOptions& options) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("rope_forward", {&x});
  if (device == Device::CPU) return cpu::rope_forward(x, options);
  no_kernel("rope_forward", device);
}

void rope_backward(Tensor& dx, const RopeOptions& options) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("rope_backward", {&dx});
  if (device == Device::CPU) return cpu::rope_backward(dx, options);
  no_kernel("rope_backward", device);
}

}  // namespace octet::ops
