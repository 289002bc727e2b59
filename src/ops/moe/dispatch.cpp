// The routing operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu; a CUDA build adds ops::cuda here without touching a caller).
#include <cmath>

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

int64_t moe_capacity(int64_t tokens, int64_t topk, int64_t num_experts, double capacity_factor) {
  OCTET_CHECK(tokens >= 0 && topk >= 1 && num_experts >= 1, "moe_capacity: tokens (", tokens,
              ") >= 0, topk (", topk, ") and num_experts (", num_experts, ") >= 1 expected");
  OCTET_CHECK(std::isfinite(capacity_factor) && capacity_factor > 0,
              "moe_capacity: capacity_factor expected > 0, got ", capacity_factor);
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens) * static_cast<double>(topk) /
                                        static_cast<double>(num_experts) * capacity_factor));
}

void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept) {
  const Device device = device_of("moe_capacity_drop", {&experts, &probs, &dispatch, &kept});
  if (device == Device::CPU) {
    return cpu::moe_capacity_drop(experts, probs, num_experts, capacity, policy, dispatch, kept);
  }
  no_kernel("moe_capacity_drop", device);
}

}  // namespace octet::ops
