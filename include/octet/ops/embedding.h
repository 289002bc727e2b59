// Token embedding: a row gather forward, a deterministic scatter-add backward; and learned
// position embeddings added to token rows.
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

// Vocabulary parallelism: table [Vp, C] holds rows [first, first + Vp) of a vocabulary of
// `vocab` ids; ids [*] I32|I64 each in [0, vocab) (else an error naming the id). forward:
// out [*ids.shape, C] (written), out[n] = table[ids[n] - first] where this part holds ids[n],
// zeros elsewhere (the sum over the parts is the whole embedding). backward: dtable [Vp, C]
// F32 += dout[n] of the held ids, repeated ids in the order of n (the same bits whatever the
// thread count).
void embedding_part_forward(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                            Tensor& out);
void embedding_part_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                             Tensor& dtable);

// Learned positions over token rows. x [R, C] F32 holds R consecutive rows of a whole
// [B*T, C] token matrix starting at row first_row (a sequence-parallel shard starts past 0),
// so row r is at position p(r) = position_offset + (first_row + r) % seq_len (position_offset:
// tokens already in a KV cache). table [P, C] F32 with position_offset + seq_len <= P.
// forward: x[r] += table[p(r)], in place.
void position_embedding_forward(Tensor& x, const Tensor& table, int64_t seq_len,
                                int64_t first_row = 0, int64_t position_offset = 0);
// dx [R, C] F32|BF16 rows as above; dtable [P, C] F32, accumulated:
// dtable[p(r)] += dx[r], each position's rows added in row order (the same bits whatever the
// thread count).
void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row = 0, int64_t position_offset = 0);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);
void embedding_part_forward(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                            Tensor& out);
void embedding_part_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                             Tensor& dtable);
void position_embedding_forward(Tensor& x, const Tensor& table, int64_t seq_len,
                                int64_t first_row = 0, int64_t position_offset = 0);
void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row = 0, int64_t position_offset = 0);
}  // namespace cpu

namespace reference {
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);
void embedding_part_forward(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                            Tensor& out);
void embedding_part_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                             Tensor& dtable);
void position_embedding_forward(Tensor& x, const Tensor& table, int64_t seq_len,
                                int64_t first_row = 0, int64_t position_offset = 0);
void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row = 0, int64_t position_offset = 0);
}  // namespace reference

}  // namespace octet::ops
