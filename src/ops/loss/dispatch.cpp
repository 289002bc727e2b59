// The loss operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/loss.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options) {
  const profile::Scope scope(profile::Category::CrossEntropy);
  const Device device =
      device_of("cross_entropy_forward_backward", {&logits, &targets, &losses, dlogits});
  if (device == Device::CPU)
    return cpu::cross_entropy_forward_backward(logits, targets, losses, dlogits, options);
  no_kernel("cross_entropy_forward_backward", device);
}

}  // namespace octet::ops
