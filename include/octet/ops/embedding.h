// Token embedding: a row gather forward, a deterministic scatter-add backward.
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

// ids [*] I32|I64 (N = ids.numel(), each in [0,V), else an error naming the id);
// table [V,C] F32|BF16; out [*ids.shape, C] F32|BF16 (written): out[n] = table[ids[n]].
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);

// ids as above; dout [*ids.shape, C] F32|BF16; dtable [V,C] F32, accumulated (not zeroed):
// dtable[ids[n]] += dout[n]. Repeated ids add in the order of n, so the result is the same
// bit for bit whatever the thread count (no atomics).
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

namespace reference {
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);
}  // namespace reference

}  // namespace octet::ops
