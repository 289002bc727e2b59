// The attention operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/attention.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse) {
  const profile::Scope scope(profile::Category::Attention);
  const Device device =
      device_of("flash_attention_forward", {&q, &k, &v, &out, &lse, options.bias});
  if (device == Device::CPU) return cpu::flash_attention_forward(q, k, v, options, out, lse);
  no_kernel("flash_attention_forward", device);
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout,
                              const AttentionOptions& options, Tensor& dq, Tensor& dk, Tensor& dv) {
  const profile::Scope scope(profile::Category::Attention);
  const Device device =
      device_of("flash_attention_backward",
                {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, options.bias, options.dbias});
  if (device == Device::CPU)
    return cpu::flash_attention_backward(q, k, v, out, lse, dout, options, dq, dk, dv);
  no_kernel("flash_attention_backward", device);
}

}  // namespace octet::ops
