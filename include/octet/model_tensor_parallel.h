// GPT split across a tensor-parallel group (Megatron's GPTModel with TP > 1, PP = 1): a
// vocabulary-parallel token embedding and tied output layer, TensorParallelSelfAttention and
// TensorParallelLayerNormMLP layers, and a vocabulary-parallel cross-entropy that never
// gathers the logits. Optional sequence parallelism keeps the residual stream, the norms and
// the position embedding on token shards [B*T/TP, C].
//
// The vocabulary V is split in contiguous row ranges of ceil(V/TP) rows (the last range is
// shorter when TP does not divide V): no padding rows, so the softmax runs over exactly V
// logits and the loss equals the single-process GPT's.
//
// Parameters are the shards of GPT(config, seed)'s, under the same names; state_dict()
// gathers them into GPT's whole-model tensors and load_state_dict() takes this rank's slices
// of them, so checkpoints load at any layout.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "octet/model.h"
#include "octet/tensor_parallel.h"

namespace octet {

// The rows [begin, end) of a V-row vocabulary that rank `rank` of `size` holds.
struct VocabRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
VocabRange vocab_range(int64_t vocab, int rank, int size);

// Vocabulary-parallel embedding. ids [N] I32 (whole vocabulary), table [range.size(), C] F32
// -> partial rows [N, C] F32: table[id - begin] where this rank owns id, zeros elsewhere (the
// sum over the group is the embedding).
Tensor vocab_parallel_embedding_forward(const Tensor& ids, const Tensor& table, VocabRange range);
// table_grad [range.size(), C] += dx [N, C] F32 rows of the owned ids.
void vocab_parallel_embedding_backward(const Tensor& ids, const Tensor& dx, Tensor& table_grad,
                                       VocabRange range);

// Vocabulary-parallel cross-entropy over the group (collective). logits [N, range.size()]
// F32: this rank's columns of the whole [N, V]; targets [N] I32 (whole-vocabulary ids, -100
// ignored). Writes losses [N] F32 (the same on every rank; 0 for ignored rows). With
// `backward`, overwrites logits with grad_scale x (softmax - onehot) of this rank's columns.
void vocab_parallel_cross_entropy(Tensor& logits, const Tensor& targets, VocabRange range,
                                  Tensor& losses, bool backward, float grad_scale,
                                  Communicator& tp);

// How a parameter is split across the tensor group.
struct ShardSpec {
  enum class Kind { Replicated, Rows, Columns };
  Kind kind = Kind::Replicated;
  Shape full_shape;
  // Rows: the whole dimension 0 is made of these blocks, rank r holding the r-th 1/TP of
  // each (empty: one block). Columns: dimension 1 in equal 1/TP parts.
  std::vector<int64_t> blocks;
  bool vocabulary = false;  // Rows by vocab_range (uneven) instead of blocks
};

class TensorParallelGPT : public Module {
 public:
  // Needs PP = 1, no dropout, learned positions (no RoPE), heads divisible by TP; with
  // sequence_parallel, B*T divisible by TP at run time. Clear errors otherwise.
  TensorParallelGPT(const GPTConfig& config, uint64_t seed, bool sequence_parallel,
                    Communicator& tp);

  // One micro-batch as GPT::train_step: ids, targets [B,T] I32, dtype F32|BF16. Gradients
  // accumulate (scaled by grad_scale); under sequence parallelism the replicated parameters'
  // gradients are partial until all_reduce_sequence_parallel_gradients. Returns the
  // micro-batch's mean loss (equal on every rank).
  float train_step(const Tensor& ids, const Tensor& targets, DType dtype, float grad_scale);
  float evaluate(const Tensor& ids, const Tensor& targets, DType dtype);

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  // Replicated parameters applied to token shards: partial gradients under SP (else empty).
  std::vector<Parameter*> sequence_parallel_parameters();
  // sqrt of the sum of squared gradients of the whole model: sharded parameters counted on
  // every rank, replicated ones on tensor rank 0, summed over `model_group` (collective).
  double grad_norm(Communicator& model_group);

  // GPT's whole-model tensors (collective over the tensor group).
  TensorMap state_dict();
  // This rank's slices of a whole-model map (GPT names); missing / mismatched are errors.
  void load_state_dict(const TensorMap& tensors);
  // The whole tensor of parameter p from every rank's `local` (shaped like p.value; e.g. its
  // optimizer state): collective. And this rank's slice of a whole tensor.
  Tensor gather(const Parameter& p, const Tensor& local);
  Tensor shard(const Parameter& p, const Tensor& full) const;
  const ShardSpec& spec(const Parameter& p) const;

  const GPTConfig& config() const { return config_; }
  VocabRange vocab() const { return vocab_; }
  bool sequence_parallel() const { return sequence_parallel_; }

  Parameter wte;  // [vocab().size(), C]: whole-vocabulary rows vocab().begin ..
  Parameter wpe;  // [max_seq_len, C], replicated

 private:
  // One TransformerLayer: x + attention(x), then h + mlp(h).
  struct Layer {
    TensorParallelSelfAttention attention;
    TensorParallelLayerNormMLP mlp;
  };
  struct LayerContext {
    TensorParallelSelfAttention::Context attention;
    TensorParallelLayerNormMLP::Context mlp;
  };
  // ids [B,T] -> hidden after the final norm [B*T(/TP), C] in dtype.
  Tensor forward_hidden(const Tensor& ids, DType dtype, std::vector<LayerContext>* contexts,
                        Norm::Context* final_context);
  // The tied output layer + loss over hidden [N(/TP), C]; dhidden shaped like hidden.
  float output_loss(const Tensor& hidden, const Tensor& targets, DType dtype, float grad_scale,
                    Tensor* dhidden);
  void register_specs();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> segments(const ShardSpec& spec) const;

  GPTConfig config_;
  bool sequence_parallel_;
  Communicator* tp_;
  VocabRange vocab_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Norm final_norm_;
  TiedOutputCache output_cache_;
  std::map<std::string, ShardSpec> specs_;
};

}  // namespace octet
