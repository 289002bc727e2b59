// Context-parallel attention (TransformerEngine's cp_comm_type p2p / a2a) behind
// DotProductAttention: q, k and v hold this rank's T / CP tokens of each sequence, chunks r and
// 2CP-1-r of its 2CP equal chunks (the causal load balance), and the result is the attention
// over the whole sequence.
#pragma once

#include <cstdint>

#include "octet/comm.h"
#include "octet/modules.h"
#include "octet/ops/attention.h"

namespace octet::modules_detail {

inline int64_t cp_chunk(int rank, int size, int half) {
  return context_parallel_chunk(rank, size, half);
}

// a: the kernel options of the whole-sequence attention (causal or not; no window, padding,
// bias or FP8, checked by the caller). Fills ctx (q, k, v, out, lse) for the backward.
Tensor cp_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                            const ops::AttentionOptions& a, Communicator& group, CpCommType type,
                            DotProductAttention::Context& ctx);
void cp_attention_backward(const Tensor& dout, DotProductAttention::Context& ctx,
                           const ops::AttentionOptions& a, Communicator& group, CpCommType type,
                           Tensor& dq, Tensor& dk, Tensor& dv);

// Ulysses' exchanges: x [B, T/CP, H, D] (this rank's tokens, every head) -> [B, T, H/CP, D]
// (the whole sequence in order, this rank's heads), and back.
Tensor cp_heads_to_sequence(const Tensor& x, Communicator& group);
Tensor cp_sequence_to_heads(const Tensor& y, Communicator& group);

}  // namespace octet::modules_detail
