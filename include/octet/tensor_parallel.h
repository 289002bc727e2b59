// Tensor- and sequence-parallel modules (Megatron-Core's tensor_parallel layers) over a
// tensor-parallel Communicator of TP ranks, built on the paired region mappings of
// octet/mappings.h (the comm layer).
//
// Parallel modules (Linear with parallel_mode column / row, the MLP and self-attention
// blocks) hold the shards
// of the single-process module's parameters made with the same options and seed, so a TP run
// computes what a TP = 1 run does (up to FP32 rounding of split sums). Under sequence
// parallelism the replicated parameters applied to token shards (norms, the row layer's bias)
// get partial gradients on each rank: all_reduce_sequence_parallel_gradients sums them over
// the tensor group once per step, before the optimizer (Megatron does this in
// finalize_model_grads).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "octet/comm.h"
#include "octet/mappings.h"
#include "octet/modules.h"

namespace octet {

// Sums the gradients of parameters replicated across the tensor group but applied to token
// shards (sequence parallelism) over the group, in place. Call once per step, after every
// backward of the step and before gradient clipping and the optimizer.
void all_reduce_sequence_parallel_gradients(const std::vector<Parameter*>& parameters,
                                            Communicator& tp);

// Column- and row-parallel Linear: Linear itself, given the group and parallel_mode
// (octet/modules.h).

// ---------------------------------------------------------------------------------------------
// Blocks.

// LayerNormMLP split across the tensor group: norm -> column FC1 (its bias shard fused into
// the activation) -> activation -> row FC2. The same options (and seed) give the shards of
// LayerNormMLP(options). Gated activations split both halves [a | b] of FC1's output.
// Input x [N, C] replicated, or the token shard [N/TP, C] with sequence_parallel (the norm
// runs on the shard) -> output of the same shape. FP8 is not supported yet.
class TensorParallelLayerNormMLP : public Module {
 public:
  struct Context {
    Norm::Context norm;
    Linear::Context fc1;  // column-parallel
    Linear::Context fc2;  // row-parallel
    Tensor fc1_output;    // [N, F/TP] pre-activation, before FC1's bias
  };
  TensorParallelLayerNormMLP(const LayerNormMLPOptions& options, bool sequence_parallel,
                             Communicator& tp);
  Tensor forward(const Tensor& x, Context& ctx);
  Tensor backward(const Tensor& dy, Context& ctx);
  // Loads the shards from the whole module (same options).
  void load_full(LayerNormMLP& full);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> sequence_parallel_parameters();

  Norm norm;
  Linear fc1;  // column-parallel
  Linear fc2;  // row-parallel

 private:
  LayerNormMLPOptions options_;
  bool sequence_parallel_;
  Communicator* tp_;
};

// Self-attention with heads split across the tensor group: norm -> column QKV (rank r's
// heads from each of the q, k and v blocks) -> DotProductAttention on H/TP query heads and
// Hkv/TP kv heads -> row projection. Options as MultiheadAttention's (input_layernorm must be
// on; no RoPE, QK-norm or attention dropout yet); the same options give the shards of
// MultiheadAttention(options). x [B*T, C], or the token shard [B*T/TP, C] with
// sequence_parallel -> output of the same shape.
class TensorParallelSelfAttention : public Module {
 public:
  struct Context {
    Norm::Context norm;
    Linear::Context qkv;  // column-parallel
    DotProductAttention::Context core;
    Linear::Context proj;  // row-parallel
    int64_t batch = 0, seq = 0;
  };
  TensorParallelSelfAttention(const MultiheadAttentionOptions& options, bool sequence_parallel,
                              Communicator& tp);
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, Context& ctx);
  Tensor backward(const Tensor& dy, Context& ctx);
  // Loads the shards from the whole module (same options; layernorm_qkv and proj).
  void load_full(MultiheadAttention& full);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  std::vector<Parameter*> sequence_parallel_parameters();

  Norm norm;
  Linear qkv;  // column-parallel
  DotProductAttention core_attention;
  Linear proj;  // row-parallel

 private:
  MultiheadAttentionOptions options_;
  bool sequence_parallel_;
  Communicator* tp_;
  int64_t local_heads_, local_kv_heads_, head_dim_;
};

}  // namespace octet
