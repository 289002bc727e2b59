// Data parallelism as Megatron-Core does it: parameters and gradients live in contiguous
// buckets (Parameter::value and ::grad become views into them), filled in the order backward
// finalizes gradients; a bucket starts its all-reduce, or its reduce-scatter under the
// distributed optimizer, as soon as its last gradient is final, while backward continues.
// DistributedOptimizer is ZeRO-1: each rank keeps the AdamW state of its shard of every
// bucket only, steps that shard, and all-gathers the updated parameters.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "octet/comm.h"
#include "octet/module.h"
#include "octet/ops/optimizer.h"
#include "octet/safetensors.h"

namespace octet {

struct DataParallelOptions {
  int64_t bucket_elements = int64_t{1} << 22;  // Megatron's --ddp-bucket-size
  bool overlap_grad_reduce = true;             // start each bucket in backward (else at the end)
  bool distributed_optimizer = false;          // reduce-scatter gradients (ZeRO-1)
};

// Communication of one step: wall time while any bucket was in flight, and the part of it
// the caller spent blocked waiting (not hidden behind compute).
struct CommStats {
  double total_seconds = 0;
  double exposed_seconds = 0;
  int64_t bytes = 0;  // gradient bytes each rank sent into the collectives
  int64_t operations = 0;
  double hidden_fraction() const {
    return total_seconds > 0 ? 1.0 - exposed_seconds / total_seconds : 1.0;
  }
  CommStats& operator+=(const CommStats& other);
};

// Expert parallelism: the experts' parameters (TensorShard::expert) are held by one rank of
// the expert group each and reduced over the expert-data group instead of the data group.
struct ExpertGroups {
  Communicator* expert = nullptr;       // the ranks splitting the experts (EP)
  Communicator* expert_data = nullptr;  // the ranks holding the same experts (EDP)
};

class DistributedDataParallel {
 public:
  struct Bucket {
    Communicator* group = nullptr;  // the data group, or the expert-data group
    bool expert = false;            // holds experts' parameters (reduced over expert_data)
    std::vector<Parameter*> parameters;
    std::vector<int64_t> offsets;  // element offset of each parameter in the bucket
    int64_t elements = 0;          // padded to a multiple of the data-parallel size
    Tensor values, grads;          // [elements] F32: the parameters and gradients themselves
    Tensor grad_shard;             // [elements / dp] F32: this rank's reduced shard (ZeRO-1)
    int64_t ready = 0;
    bool started = false;
    Work work;
    std::chrono::steady_clock::time_point started_at;
  };

  // `parameters` in the order backward finalizes their gradients. Their current values are
  // moved into the buckets and broadcast from data-parallel rank 0, so replicas start equal.
  // With expert groups, the experts' parameters fill buckets of their own on expert_data.
  DistributedDataParallel(std::vector<Parameter*> parameters, Communicator& data,
                          const DataParallelOptions& options, ExpertGroups experts = {});

  // Only while sync is on (the last micro-batch of a step) do final gradients start
  // reducing; earlier micro-batches just accumulate.
  void set_sync(bool on) { sync_ = on; }
  // The hook backward calls with parameters whose gradients are final.
  void grads_ready(const std::vector<Parameter*>& parameters);
  // Rows of an embedding's gradient (rows[n] adds to row ids[n] of `table`; ids [N] I32,
  // rows [N,C] F32). Outside the sync micro-batch they are added at once. In it, every
  // rank's rows are all-gathered while the table's bucket reduces, then added in rank order
  // (the same bits on every rank): megabytes of rows instead of the whole vocabulary table
  // at the end of backward.
  void add_embedding_rows(Parameter& table, const Tensor& ids, const Tensor& rows);
  // Starts any bucket not started yet and waits for all. Afterwards every gradient holds
  // the sum over data-parallel ranks (all-reduce), or, with the distributed optimizer, each
  // bucket's grad_shard holds this rank's summed shard.
  void finish_grad_sync();
  // After finish_grad_sync: every gradient holds the sum over data-parallel ranks on every
  // rank, also with the distributed optimizer (each bucket's reduced shards all-gathered into
  // its gradients; collective). For inspecting the step's gradients (octet train --dump-grads).
  void gather_grad_shards();
  void zero_grad();

  std::vector<Bucket>& buckets() { return buckets_; }
  Communicator& data() { return data_; }
  const ExpertGroups& experts() const { return experts_; }
  const DataParallelOptions& options() const { return options_; }
  CommStats take_stats();  // since the last call

 private:
  struct EmbeddingRows {
    Parameter* table;
    Tensor ids, rows;  // every rank's, stacked in rank order
    Work ids_work, rows_work;
  };
  void start(Bucket& bucket);
  void apply(EmbeddingRows& pending);
  Communicator& data_;
  DataParallelOptions options_;
  ExpertGroups experts_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> location_;  // per parameter index: bucket, slot
  std::vector<Parameter*> order_;
  bool sync_ = true;
  std::vector<EmbeddingRows> embedding_rows_;
  std::vector<Tensor> keep_alive_;  // gather inputs until their Work completes
  CommStats stats_;
  std::vector<
      std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>>
      intervals_;
};

// Which gradients the clipping norm counts, and over which ranks besides the data-parallel
// group. One model part per data-parallel replica (a pipeline stage, a tensor shard) counts
// its own parameters, each model parameter once over the whole model (a copy held twice, as
// the tied embedding on the first and last stage or a replicated norm on every tensor rank,
// counted on one of them only); the squares are then summed over the model group (tensor x
// pipeline ranks) too.
struct GradNormScope {
  // nullopt: every parameter of the buckets; a rank may count none (a DualPipe copy).
  std::optional<std::vector<Parameter*>> counted;
  Communicator* model_group = nullptr;  // null: the data-parallel group alone
};

// ZeRO-1 AdamW (torch.optim.AdamW semantics, as AdamW) over a DistributedDataParallel built
// with distributed_optimizer.
class DistributedOptimizer {
 public:
  DistributedOptimizer(DistributedDataParallel& ddp, const AdamWOptions& options,
                       GradNormScope scope = {});
  // Global-norm clipping across every rank's shard (and the scope's model group), AdamW on
  // this rank's shard, then the updated parameters all-gathered (collective over the data
  // group, and over the model group when the scope has one). Returns the norm before clipping
  // (non-finite: skipped).
  double step(float lr);
  int64_t steps() const { return steps_; }
  // The whole state by parameter name, as AdamW::state() gives it (gathered from shards:
  // collective), so a checkpoint loads at any data-parallel size.
  TensorMap state();
  void load_state(const TensorMap& state, int64_t steps);  // takes this rank's shards
  CommStats take_stats();  // the parameter all-gathers since the last call

 private:
  struct Piece {  // one parameter's part of a bucket shard
    Parameter* parameter;
    int64_t bucket_offset, shard_offset, elements, parameter_offset;
    bool counted;  // in the clipping norm (GradNormScope)
  };
  DistributedDataParallel& ddp_;
  AdamWOptions options_;
  Communicator* model_group_ = nullptr;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;  // per bucket, [shard]
  std::vector<std::vector<Piece>> pieces_;    // per bucket
  int64_t steps_ = 0;
  CommStats stats_;
};

}  // namespace octet
