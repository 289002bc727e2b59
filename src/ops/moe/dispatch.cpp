// The routing operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu; a CUDA build adds ops::cuda here without touching a caller).
#include "octet/ops/moe.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

RouterLosses router_forward(const Tensor& logits, const RouterOptions& options, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of(
      "router_forward", {&logits, options.expert_bias, &scores, &probs, &experts, &counts});
  if (device == Device::CPU) {
    return cpu::router_forward(logits, options, scores, probs, experts, counts);
  }
  no_kernel("router_forward", device);
}

void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& options,
                     Tensor& dlogits) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device =
      device_of("router_backward", {&dprobs, &logits, &scores, &experts, &counts, &dlogits});
  if (device == Device::CPU) {
    return cpu::router_backward(dprobs, logits, scores, experts, counts, options, dlogits);
  }
  no_kernel("router_backward", device);
}

void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("moe_permute", {&tokens, &experts, &permuted, &row_map});
  if (device == Device::CPU) {
    return cpu::moe_permute(tokens, experts, num_experts, permuted, row_map);
  }
  no_kernel("moe_permute", device);
}

void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("moe_permute_backward", {&dpermuted, &row_map, &dtokens});
  if (device == Device::CPU) return cpu::moe_permute_backward(dpermuted, row_map, dtokens);
  no_kernel("moe_permute_backward", device);
}

void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("moe_unpermute", {&y, &row_map, &probs, &out});
  if (device == Device::CPU) return cpu::moe_unpermute(y, row_map, probs, out);
  no_kernel("moe_unpermute", device);
}

void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device =
      device_of("moe_unpermute_backward", {&dout, &y, &row_map, &probs, &dy, &dprobs});
  if (device == Device::CPU) {
    return cpu::moe_unpermute_backward(dout, y, row_map, probs, dy, dprobs);
  }
  no_kernel("moe_unpermute_backward", device);
}

}  // namespace octet::ops
