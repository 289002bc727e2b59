// What every operator's public entry point (src/ops/<family>/dispatch.cpp) does before it calls
// a device's kernels: find the one device its tensor arguments live on, and say clearly when no
// kernel exists there.
#pragma once

#include <initializer_list>
#include <optional>
#include <span>

#include "octet/error.h"
#include "octet/tensor.h"

namespace octet::ops {

// The device of every defined tensor among `tensors` (null pointers and undefined tensors are
// optional arguments left out); tensors on two devices are an error naming the op. CPU when
// none is defined.
inline Device device_of(const char* op, std::initializer_list<const Tensor*> tensors) {
  std::optional<Device> device;
  for (const Tensor* t : tensors) {
    if (t == nullptr || !t->defined()) continue;
    if (!device) device = t->device();
    OCTET_CHECK(t->device() == *device, op, ": every tensor expected on one device, got ",
                device_name(*device), " and ", device_name(t->device()));
  }
  return device.value_or(Device::CPU);
}

template <class T>
Device device_of(const char* op, std::span<T> tensors) {
  std::optional<Device> device;
  for (const Tensor& t : tensors) {
    const Device d = device_of(op, {&t});
    if (!device) device = d;
    OCTET_CHECK(d == *device, op, ": every tensor expected on one device, got ",
                device_name(*device), " and ", device_name(d));
  }
  return device.value_or(Device::CPU);
}

[[noreturn]] inline void no_kernel(const char* op, Device device) {
  fail(detail::concat(op, ": no ", device_name(device), " kernel in this build"));
}

}  // namespace octet::ops
