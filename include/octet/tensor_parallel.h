// Tensor- and sequence-parallel pieces the parallel-aware modules (Linear, LayerNormLinear,
// LayerNormMLP, MultiheadAttention, TransformerLayer given a tensor-parallel group, in
// octet/modules.h) and the models built from them share: the sequence-parallel gradient sum,
// vocabulary parallelism (Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy)
// and moving whole tensors to and from the shards each parameter's TensorShard describes.
//
// Parallel modules hold the shards of the single-process module's parameters made with the
// same options and seed, so a TP run computes what a TP = 1 run does (up to FP32 rounding of
// split sums). Under sequence parallelism the replicated parameters applied to token shards
// (norms, a row layer's bias, position embeddings) get partial gradients on each rank:
// all_reduce_sequence_parallel_gradients sums them over the tensor group once per step, before
// the optimizer (Megatron does this in finalize_model_grads).
#pragma once

#include <cstdint>
#include <vector>

#include "octet/comm.h"
#include "octet/mappings.h"
#include "octet/module.h"

namespace octet {

// The parameters of `parameters` marked TensorShard::sequence_parallel.
std::vector<Parameter*> sequence_parallel_parameters(const std::vector<Parameter*>& parameters);
// Sums the gradients of parameters replicated across the tensor group but applied to token
// shards (sequence parallelism) over the group, in place. Call once per step, after every
// backward of the step and before gradient clipping and the optimizer.
void all_reduce_sequence_parallel_gradients(const std::vector<Parameter*>& parameters,
                                            Communicator& tp);

// ---------------------------------------------------------------------------------------------
// Shards of whole tensors.

// The whole tensor of p (shaped p.shard.whole_shape) from every rank's `local` (shaped like
// p.value, e.g. its optimizer state): collective over the group; `local` itself when
// replicated.
Tensor gather_shards(const Parameter& p, const Tensor& local, Communicator& tp);
// This rank's part of p's whole tensor (a copy).
Tensor shard_of(const Parameter& p, const Tensor& whole, Communicator& tp);
// The parameters of `candidates` this rank counts in a norm over the model group, so each
// element counts once: split ones on every rank, replicated ones on tensor rank 0 only.
std::vector<Parameter*> counted_once(const std::vector<Parameter*>& candidates, Communicator& tp);
// sqrt of the sum of squared gradients of `parameters` over `group` (tensor x pipeline ranks),
// each rank passing the ones it counts (counted_once): collective.
double grad_norm_over(const std::vector<Parameter*>& parameters, Communicator& group);

// ---------------------------------------------------------------------------------------------
// Vocabulary parallelism. The vocabulary V is split in contiguous row ranges of ceil(V/TP)
// rows (the last range is shorter when TP does not divide V): no padding rows, so the softmax
// runs over exactly V logits and the loss equals the single-process one.

// The rows [begin, end) of a V-row vocabulary that rank `rank` of `size` holds.
struct VocabRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
VocabRange vocab_range(int64_t vocab, int rank, int size);

// Vocabulary-parallel embedding: ops::embedding_part_forward / backward of this rank's range
// (the partial rows summed over the group, as Megatron's VocabParallelEmbedding).

// Vocabulary-parallel cross-entropy over the group (collective). logits [N, range.size()]
// F32: this rank's columns of the whole [N, V]; targets [N] I32 (whole-vocabulary ids, -100
// ignored). Writes losses [N] F32 (the same on every rank; 0 for ignored rows). With
// `backward`, overwrites logits with grad_scale x (softmax - onehot) of this rank's columns.
void vocab_parallel_cross_entropy(Tensor& logits, const Tensor& targets, VocabRange range,
                                  Tensor& losses, bool backward, float grad_scale,
                                  Communicator& tp);

}  // namespace octet
