// GPT's pieces: layer options and seeds (the same in every layout, so every layout builds the
// single-process GPT's parameters), embeddings and the fused tied output layer.
#pragma once

#include <functional>

#include "octet/model.h"

namespace octet::gpt_parts {

// Layer `index` (0 .. num_layers-1, global) of a GPT seeded with `seed`.
TransformerLayerOptions layer_options(const GPTConfig& config, int64_t index, uint64_t seed,
                                      bool recompute);
NormOptions final_norm_options(const GPTConfig& config);
Parameter token_embedding(const GPTConfig& config, uint64_t seed);     // wte [V,C]
Parameter position_embedding(const GPTConfig& config, uint64_t seed);  // wpe [max_seq_len,C]

// Token + learned position embeddings of ids [B,T] at positions offset + t: [B*T, C] F32.
// wpe may be undefined (RoPE).
Tensor embed(const Tensor& ids, const Parameter& wte, const Parameter& wpe,
             int64_t position_offset);

// wte in the compute dtype (F32: the master itself; BF16: a copy cached until invalidate()).
const Tensor& tied_weight_as(Parameter& wte, DType dtype, TiedOutputCache& cache);
// That weight packed for the output GEMM ([V,C], used transposed), cached likewise.
PackedWeight& tied_packed_as(Parameter& wte, DType dtype, TiedOutputCache& cache);
// The loss of one chunk of rows: logits [rows, V] F32 (this rank's vocabulary columns),
// targets [rows] I32, losses [rows] F32 written; with backward, logits are overwritten by
// scale x the loss gradient.
using ChunkLoss = std::function<void(Tensor& logits, const Tensor& targets, Tensor& losses,
                                     bool backward, float scale)>;
// The fused, chunked output layer + loss: hidden [N,C] (after the final norm, in dtype),
// targets [N] I32. Returns the mean loss over valid targets; with dhidden, writes dhidden
// [N,C] in dtype and adds grad_scale x the output layer's gradient into wte.grad. The loss
// is the fused cross-entropy unless `loss` is given; chunks are sized for `chunk_vocab`
// columns (0: wte's rows), which must be the same on every rank that shares the loss. With
// `bias` ([V] F32, wte's rows) the logits are hidden x wte^T + bias (BERT's decoder), its
// gradient added into bias->grad.
float tied_output_loss(const Tensor& hidden, const Tensor& targets, Parameter& wte, DType dtype,
                       float grad_scale, Tensor* dhidden, TiedOutputCache& cache,
                       const ChunkLoss& loss = {}, int64_t chunk_vocab = 0,
                       Parameter* bias = nullptr);

// The id each row of hidden [N,C] (in dtype) predicts: the argmax over the whole vocabulary of
// hidden x weight^T (+ bias), where weight [V_local, C] (and bias [V_local]) hold this rank's
// vocabulary rows `vocab`; under a tensor group each rank's best are compared over the group
// (collective: every rank of tp calls it), so every rank returns the same ids.
std::vector<int64_t> vocab_argmax(const Tensor& hidden, Parameter& weight, DType dtype,
                                  TiedOutputCache& cache, VocabRange vocab, Communicator* tp,
                                  const Parameter* bias = nullptr);

}  // namespace octet::gpt_parts
