// Fused scaled dot-product attention, FlashAttention-2 style: tiled, online softmax, the
// T x S score matrix never stored; backward recomputes each tile's probabilities from the
// saved log-sum-exp. Layout bshd: q [B,T,H,D], k and v [B,S,Hkv,D].
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

// FP8 attention (TransformerEngine's fp8_dpa), emulated exactly on any processor: the two
// operands that exist only inside the kernel are rounded to FP8 before their GEMMs, as an FP8
// tensor core would read them. The probabilities P (with dropout applied), before P V in the
// forward and P^T dO in the backward, become q(P * p_scale) / p_scale in p_format; the score
// gradients dS, before dS K and dS^T Q, become q(dS * ds_scale) / ds_scale in ds_format
// (q = round to nearest even, saturating at the format's largest value). The forward's P is
// each 64-key tile's, relative to the running row maximum (values <= 1), as FlashAttention's
// FP8 kernels quantize it; the row sums stay F32. Q, K, V and dO are quantized by the caller
// (DotProductAttention), which passes their FP8 values. A scale of 0 leaves that operand in
// F32. p_amax / ds_amax, when given, receive max |P| (forward) and max |dS| (backward) before
// scaling: the amaxes delayed scaling needs for the next step's scales.
struct AttentionFp8 {
  DType p_format = DType::E4M3;
  float p_scale = 0.0f;
  DType ds_format = DType::E5M2;
  float ds_scale = 0.0f;
  float* p_amax = nullptr;
  float* ds_amax = nullptr;
  bool enabled() const { return p_scale > 0.0f || ds_scale > 0.0f; }
};

// Masks combine: a key is visible to a query only when every enabled rule allows it.
// Alignment is bottom-right, as in flash-attn: with the batch's valid lengths Tq (queries)
// and Tk (keys), query i sits on key diagonal i + Tk - Tq, so the last query sees the last key.
struct AttentionOptions {
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(D)
  bool causal = false;         // key j visible when j <= i + Tk - Tq
  // Sliding window (flash-attn's window_size); -1 = unbounded on that side. Key j visible when
  // i + Tk - Tq - window_left <= j <= i + Tk - Tq + window_right. causal = window_right 0.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // Padding: valid queries / keys per batch, [B] I32 (null = all T / all S). Queries past
  // q_lengths[b] get out = 0, lse = +inf and zero gradients; keys past kv_lengths[b] are masked.
  const Tensor* q_lengths = nullptr;
  const Tensor* kv_lengths = nullptr;
  // Dropout on the attention probabilities, keep probability 1 - p, kept values scaled by
  // 1 / (1 - p). The mask is a function of (seed, offset, b, h, i, j) (see
  // attention_dropout_keep), so backward regenerates it instead of storing it.
  float dropout = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;  // lets successive calls with one seed draw different masks
  AttentionFp8 fp8;     // off by default
  // Additive score bias (T5's relative position bias; TransformerEngine's "post_scale_bias"):
  // [H,T,S] F32 with bias / softmax_scale finite, shared by every batch entry (with GQA one per
  // query head). Scores are softmax_scale * q_i . k_j + bias[h,i,j], then masked: a masked key
  // stays masked, a fully masked row stays out = 0, lse = +inf. The backward takes the
  // forward's bias (it recomputes the probabilities). Refused with FP8 attention (as in TE).
  const Tensor* bias = nullptr;
  // Backward only (forward ignores it): when given, [H,T,S] F32, written (not accumulated) with
  // sum over b of dS[b,h,i,j], the loss's gradient w.r.t. the biased scores (through dropout's
  // kept and scaled probabilities, as dq and dk; 0 where masked). Needs no bias to be given.
  // Scratch: up to about 2 * threads / Hkv more [H,T,S] F32 buffers (per-chunk partial sums).
  Tensor* dbias = nullptr;
};

// q [B,T,H,D], k and v [B,S,Hkv,D], F32|BF16 (k, v the same dtype), H % Hkv == 0 (grouped-query
// attention: query head h reads kv head h / (H / Hkv)), 1 <= D <= 256.
// out [B,T,H,D], dtype of q; lse [B,H,T] F32: log-sum-exp of each row's scaled, biased, masked
// scores (+inf for a fully masked row), all backward needs besides q, k, v and out. Or lse
// [B,H,T,2] F32: the same value as an unevaluated sum hi + lo (hi = its F32 rounding), which
// keeps the backward's probabilities at F32 accuracy however large the scores are (one F32 lse
// is off by |lse| * 2^-24, ~0.4% of every probability at scores of 1e5).
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse);
// dout [B,T,H,D] dtype of q; dq, dk, dv the shapes and dtypes of q, k, v (written; dk and dv
// summed over each kv head's query group); options.dbias [H,T,S] F32 when given (written).
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout,
                              const AttentionOptions& options, Tensor& dq, Tensor& dk, Tensor& dv);

// Decode attention over a paged KV cache (vLLM's PagedAttention): q [S,H,D] holds one query
// per sequence, the last of its context_lens[s] tokens; k_pool and v_pool [blocks, block_size,
// Hkv, D] (the dtype of q, F32|BF16) hold token p of sequence s in block
// block_tables[s, p / block_size] at slot p % block_size; block_tables [S, max_blocks] I32,
// context_lens [S] I32 >= 1. The query sees all its keys (causal: it is the last), or the last
// window_left + 1 of them when options.window_left >= 0; softmax_scale as above (no other
// option is read: bias and masks do not apply to decode). out [S,H,D].
// Long contexts are split into partitions merged by log-sum-exp. FP8 pools: k_pool and v_pool
// E4M3 codes with k_scale and v_scale [blocks, block_size, Hkv] F32, real = code * scale.
void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out,
                            const Tensor* k_scale = nullptr, const Tensor* v_scale = nullptr);
// Whether dropout keeps probability (b, h, i, j): Philox4x32-10 keyed by the seed, counter
// (j / 4, i, b * H + h, offset), word j % 4, kept when the word >= p * 2^32.
bool attention_dropout_keep(uint64_t seed, uint64_t offset, int64_t b, int64_t h, int64_t num_heads,
                            int64_t i, int64_t j, float p);
// The whole mask for tests and peers: keep [B,H,T,S] U8, 1 = kept.
void attention_dropout_mask(uint64_t seed, uint64_t offset, float p, Tensor& keep);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out,
                            const Tensor* k_scale = nullptr, const Tensor* v_scale = nullptr);
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse);
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout,
                              const AttentionOptions& options, Tensor& dq, Tensor& dk, Tensor& dv);
// Whether flash attention's tile products run in BF16 pairs (VDPBF16PS; P and dS rounded to
// BF16 as their operands) for these options and input dtype: BF16 inputs, AVX-512 BF16 at least
// 0.75x the F32 FMA's flops (bf16_dot_rate()), no FP8 attention; OCTET_ATTENTION_TILES=bf16|f32
// forces it where the processor allows. Otherwise F32 tiles.
bool flash_attention_bf16_tiles(const AttentionOptions& options, DType dtype);
}  // namespace cpu

namespace reference {
void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out,
                            const Tensor* k_scale = nullptr, const Tensor* v_scale = nullptr);
// The oracle: materializes each head's T x S scores, double accumulation.
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse);
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout,
                              const AttentionOptions& options, Tensor& dq, Tensor& dk, Tensor& dv);
}  // namespace reference

}  // namespace octet::ops
