// The embedding operators' public entry points: every tensor argument on one device, then that
// device's kernels (ops::cpu, which picks the instruction set; a CUDA build adds ops::cuda
// here without touching a caller).
#include "octet/ops/embedding.h"
#include "octet/profile.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("embedding_forward", {&ids, &table, &out});
  if (device == Device::CPU) return cpu::embedding_forward(ids, table, out);
  no_kernel("embedding_forward", device);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("embedding_backward", {&ids, &dout, &dtable});
  if (device == Device::CPU) return cpu::embedding_backward(ids, dout, dtable);
  no_kernel("embedding_backward", device);
}

void embedding_part_forward(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                            Tensor& out) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("embedding_part_forward", {&ids, &table, &out});
  if (device == Device::CPU) return cpu::embedding_part_forward(ids, table, first, vocab, out);
  no_kernel("embedding_part_forward", device);
}

void embedding_part_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                             Tensor& dtable) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("embedding_part_backward", {&ids, &dout, &dtable});
  if (device == Device::CPU) return cpu::embedding_part_backward(ids, dout, first, vocab, dtable);
  no_kernel("embedding_part_backward", device);
}

void position_embedding_forward(Tensor& x, const Tensor& table, int64_t seq_len, int64_t first_row,
                                int64_t position_offset) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("position_embedding_forward", {&x, &table});
  if (device == Device::CPU)
    return cpu::position_embedding_forward(x, table, seq_len, first_row, position_offset);
  no_kernel("position_embedding_forward", device);
}

void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row, int64_t position_offset) {
  const profile::Scope scope(profile::Category::NormActivation);
  const Device device = device_of("position_embedding_backward", {&dx, &dtable});
  if (device == Device::CPU)
    return cpu::position_embedding_backward(dx, seq_len, dtable, first_row, position_offset);
  no_kernel("position_embedding_backward", device);
}

}  // namespace octet::ops
