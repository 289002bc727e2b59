// The elementwise operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/elementwise.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void add_scaled(const Tensor& x, float alpha, Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("add_scaled", {&x, &out});
  if (device == Device::CPU) return cpu::add_scaled(x, alpha, out);
  no_kernel("add_scaled", device);
}

void scale(std::span<Tensor> tensors, float factor) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("scale", tensors);
  if (device == Device::CPU) return cpu::scale(tensors, factor);
  no_kernel("scale", device);
}

void add_bias(Tensor& y, const Tensor& bias) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("add_bias", {&y, &bias});
  if (device == Device::CPU) return cpu::add_bias(y, bias);
  no_kernel("add_bias", device);
}

void add_column_sums(const Tensor& x, Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("add_column_sums", {&x, &out});
  if (device == Device::CPU) return cpu::add_column_sums(x, out);
  no_kernel("add_column_sums", device);
}

}  // namespace octet::ops
