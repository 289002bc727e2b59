// Tensor- and sequence-parallel modules (Megatron-Core's tensor_parallel layers) over a
// tensor-parallel Communicator of TP ranks, built on the paired region mappings of
// octet/mappings.h (the comm layer).
//
// Parallel modules (column / row Linear, the MLP and self-attention blocks) hold the shards
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

// ---------------------------------------------------------------------------------------------
// Column- and row-parallel Linear.

struct ParallelLinearOptions {
  // The whole (unsharded) layer: in/out features, bias, return_bias, init_std, seed, name,
  // sequence_parallel. parallel_mode must be None or match the class.
  LinearOptions linear;
  // Column: the output [N, out] is made of these column blocks (widths summing to out, each
  // divisible by TP; empty = one block). Rank r holds the r-th slice of every block, so a
  // fused [q | k | v] projection splits by heads: e.g. {H*D, Hkv*D, Hkv*D}.
  std::vector<int64_t> output_blocks;
  // Column: all-gather the output's columns so every rank gets [N, out] (not with SP).
  bool gather_output = false;
  // Row: the input arrives split by columns [N, in/TP] (the column layer's output); false
  // means it is whole [N, in] and each rank takes its columns.
  bool input_is_parallel = true;
};

// y = x W^T + b with W's rows (outputs) split: rank r holds W [out/TP, in] and b [out/TP].
// Input x [N, in] (replicated), or its token shard [N/TP, in] with sequence_parallel
// (all-gathered before the GEMM, reduce-scattered in backward) -> y [N, out/TP]
// ([N, out] with gather_output). With return_bias the local bias shard is left for the caller.
class ColumnParallelLinear : public Module {
 public:
  struct Context {
    Linear::Context linear;
  };
  ColumnParallelLinear(const ParallelLinearOptions& options, Communicator& tp);
  Tensor forward(const Tensor& x, Context& ctx);
  // dy [N, out/TP] ([N, out] with gather_output) -> dx, shaped like forward's x; accumulates
  // the weight and bias shards' gradients.
  Tensor backward(const Tensor& dy, Context& ctx);
  // Sets the shards from the whole layer's tensors: weight [out, in], bias [out] (or null).
  void load_full(const Tensor& weight, const Tensor* bias);
  void collect_parameters(std::vector<Parameter*>& out) override { linear.collect_parameters(out); }
  void on_parameters_updated() override { linear.on_parameters_updated(); }
  const ParallelLinearOptions& options() const { return options_; }
  int64_t local_out_features() const { return linear.options().out_features; }
  // Under sequence parallelism (not FP8): the GEMM of this rank's own token rows runs while
  // the all-gather brings the other ranks' (Linear::forward_arriving); off: gather, then GEMM.
  void set_overlap_gather(bool on) { overlap_gather_ = on; }

  Linear linear;  // the local shard: [out/TP, in]

 private:
  ParallelLinearOptions options_;
  Communicator* tp_;
  bool overlap_gather_ = false;
};

// y = x W^T + b with W's columns (inputs) split: rank r holds W [out, in/TP]; b [out] is
// replicated and added once, after the reduction. Input x [N, in/TP] (input_is_parallel) ->
// partial products summed over ranks: y [N, out] (all-reduce), or this rank's token shard
// [N/TP, out] with sequence_parallel (reduce-scatter). Under sequence parallelism the bias
// gradient is partial: see sequence_parallel_parameters().
class RowParallelLinear : public Module {
 public:
  struct Context {
    Linear::Context linear;
  };
  RowParallelLinear(const ParallelLinearOptions& options, Communicator& tp);
  Tensor forward(const Tensor& x, Context& ctx);
  // dy [N, out] ([N/TP, out] with SP) -> dx shaped like forward's x.
  Tensor backward(const Tensor& dy, Context& ctx);
  void load_full(const Tensor& weight, const Tensor* bias);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override { linear.on_parameters_updated(); }
  // The replicated parameters whose gradients are partial under sequence parallelism.
  std::vector<Parameter*> sequence_parallel_parameters();
  const ParallelLinearOptions& options() const { return options_; }

  Linear linear;   // the local shard [out, in/TP], without bias
  Parameter bias;  // [out], replicated; undefined without bias

 private:
  ParallelLinearOptions options_;
  Communicator* tp_;
};

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
    ColumnParallelLinear::Context fc1;
    RowParallelLinear::Context fc2;
    Tensor fc1_output;  // [N, F/TP] pre-activation, before FC1's bias
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
  ColumnParallelLinear fc1;
  RowParallelLinear fc2;

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
    ColumnParallelLinear::Context qkv;
    DotProductAttention::Context core;
    RowParallelLinear::Context proj;
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
  ColumnParallelLinear qkv;
  DotProductAttention core_attention;
  RowParallelLinear proj;

 private:
  MultiheadAttentionOptions options_;
  bool sequence_parallel_;
  Communicator* tp_;
  int64_t local_heads_, local_kv_heads_, head_dim_;
};

}  // namespace octet
