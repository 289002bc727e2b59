// Process groups: a Communicator (collectives and point-to-point, each blocking or
// non-blocking) and a ParallelState that splits the world into tensor-, data- and
// pipeline-parallel groups in Megatron's order (tensor innermost).
//
// The CPU implementation is MPI (OpenMPI). One progress thread per process owns every MPI
// call: a non-blocking operation returns at once with a Work handle and moves data while the
// caller computes. A world of one (no launcher: MPI's singleton mode) moves nothing: its
// collectives return without copying when the output is the input.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "octet/tensor.h"

namespace octet {

enum class ReduceOp { Sum, Max, Min };
const char* reduce_op_name(ReduceOp op);

namespace detail {
struct WorkState;
}

// A pending operation. Tensors handed to it must stay alive and untouched until wait().
class Work {
 public:
  Work() = default;  // an operation that is already complete
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
  // Blocks until the operation completes; rethrows its error (octet::Error). An operation
  // still pending after communication_timeout() seconds is an error naming it and the peers
  // that do not answer a roll call (a stopped or hung rank): never a silent hang.
  void wait();
  // The same with this timeout in seconds; 0 waits forever.
  void wait(double timeout_seconds);
  bool done() const;
  // Seconds from submission to completion (0 for a completed-at-once Work; valid after wait).
  double transfer_seconds() const;
  // Seconds the caller spent blocked in wait(): the communication compute did not hide.
  double waited_seconds() const;
  const std::string& description() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// Tensors are contiguous CPU tensors. Reductions support F32, BF16 (summed in FP32 pair by
// pair), I32 and I64; gathers, all-to-all, broadcast and point-to-point move any dtype.
// "Rows" are the first dimension: all_gather concatenates along it, reduce_scatter splits it.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // e.g. "world", "tensor[0,1]"

  // In place: every rank's tensor becomes the elementwise reduction over ranks.
  virtual Work iall_reduce(Tensor& tensor, ReduceOp op) = 0;
  // input [R, ...] -> output [size*R, ...], rank i's rows at [i*R, (i+1)*R).
  virtual Work iall_gather(const Tensor& input, Tensor& output) = 0;
  // input [size*R, ...] -> output [R, ...]: rank i gets the reduction of every rank's block i.
  virtual Work ireduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // input [size*R, ...]: block j goes to rank j; output block i came from rank i.
  virtual Work iall_to_all(const Tensor& input, Tensor& output) = 0;
  // Rows per peer: send_rows[j] rows of input (in order) go to rank j; recv_rows[i] rows from
  // rank i land in output in rank order. Both sizes equal size(); the sums match the tensors.
  virtual Work iall_to_allv(const Tensor& input, std::span<const int64_t> send_rows, Tensor& output,
                            std::span<const int64_t> recv_rows) = 0;
  virtual Work ibroadcast(Tensor& tensor, int root) = 0;
  virtual Work isend(const Tensor& tensor, int peer, int tag) = 0;
  virtual Work irecv(Tensor& tensor, int peer, int tag) = 0;
  virtual Work ibarrier() = 0;
  // FP64 reduction of one value (losses, norms), blocking.
  virtual double all_reduce_scalar(double value, ReduceOp op) = 0;
  // Ranks with equal color form one new communicator, ordered by key (then by rank).
  // Collective over this communicator.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // Blocking forms.
  void all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::Sum) { iall_reduce(tensor, op).wait(); }
  // Allocates the output; in a world of one it is the input itself (no copy).
  Tensor all_gather(const Tensor& input);
  Tensor reduce_scatter(const Tensor& input, ReduceOp op = ReduceOp::Sum);
  Tensor all_to_all(const Tensor& input);
  void broadcast(Tensor& tensor, int root) { ibroadcast(tensor, root).wait(); }
  void send(const Tensor& tensor, int peer, int tag) { isend(tensor, peer, tag).wait(); }
  void recv(Tensor& tensor, int peer, int tag) { irecv(tensor, peer, tag).wait(); }
  void barrier() { ibarrier().wait(); }
  // Scalars, for losses and norms.
  double all_reduce(double value, ReduceOp op = ReduceOp::Sum);
};

// How long a wait on a pending operation may block before it is an error (NCCL's and
// Megatron's collective timeout; octet train --comm-timeout). Default 60 s, or the
// environment's OCTET_COMM_TIMEOUT; 0 waits forever. Process-wide.
inline constexpr double kDefaultCommunicationTimeout = 60;
void set_communication_timeout(double seconds);
double communication_timeout();

// Ends every process of the job with `status` (MPI_Abort): after an error on one rank the
// others may wait in a collective for a peer that will never come. Returns only in a world of
// one. The CLI calls it for an error under a launcher.
void abort_job(int status);

// A world of one without MPI: every collective is the identity, point-to-point is an error.
std::shared_ptr<Communicator> self_communicator();

// Every process of the job (MPI_COMM_WORLD). MPI is initialized on the first call (a process
// started without mpirun is a world of one) and finalized at exit.
std::shared_ptr<Communicator> world_communicator();
// The number of processes the launcher started, without initializing MPI (1 without one).
int launcher_world_size();

// Megatron's layout: rank = tp_rank + TP * (dp_rank + DP * pp_rank). Tensor groups are
// consecutive ranks (fastest interconnect), pipeline groups the farthest apart.
class ParallelState {
 public:
  // data parallel size = world size / (tensor * pipeline); sizes that do not divide the
  // world are errors naming every size.
  // expert_size (--expert-model-parallel-size) divides the data-parallel size: the experts of
  // a mixture of experts are split over EP consecutive data ranks (Megatron's parallel
  // folding with expert TP = TP: attention TP x DP, experts TP x EP x EDP, EDP = DP / EP).
  // context_size (--context-parallel-size) divides the data-parallel size too: the sequence of
  // each sample is split over CP consecutive data ranks (Megatron's order tp-cp-dp-pp), which
  // read the same samples; the data group (DP x CP ranks) still reduces every gradient.
  ParallelState(std::shared_ptr<Communicator> world, int tensor_size, int pipeline_size,
                int expert_size = 1, int context_size = 1);
  // A world of one: every group is the world.
  static ParallelState single();

  int world_size() const { return world_->size(); }
  int rank() const { return world_->rank(); }
  int tensor_size() const { return tensor_size_; }
  int data_size() const { return data_size_; }
  int pipeline_size() const { return pipeline_size_; }
  int tensor_rank() const { return tensor_rank_; }
  int data_rank() const { return data_rank_; }
  int pipeline_rank() const { return pipeline_rank_; }
  int expert_size() const { return expert_size_; }
  int expert_rank() const { return data_rank_ % expert_size_; }
  int expert_data_size() const { return data_size_ / expert_size_; }
  int expert_data_rank() const { return data_rank_ / expert_size_; }
  int context_size() const { return context_size_; }
  int context_rank() const { return data_rank_ % context_size_; }
  // The data ranks that read different samples: DP / CP of them, this one's index among them.
  int sample_size() const { return data_size_ / context_size_; }
  int sample_rank() const { return data_rank_ / context_size_; }
  bool first_stage() const { return pipeline_rank_ == 0; }
  bool last_stage() const { return pipeline_rank_ == pipeline_size_ - 1; }
  // World rank of the process with these coordinates.
  int world_rank_of(int tensor_rank, int data_rank, int pipeline_rank) const;

  Communicator& world() { return *world_; }
  Communicator& tensor() { return *tensor_; }
  Communicator& data() { return *data_; }
  Communicator& pipeline() { return *pipeline_; }
  // Tensor x data ranks of one pipeline stage: FP8 amax values are reduced over it.
  Communicator& tensor_and_data() { return *tensor_and_data_; }
  // Tensor x pipeline ranks of one data replica: a model's gradient norm sums over it.
  Communicator& model() { return *model_; }
  // Megatron's embedding group: the first and the last pipeline rank of this rank's pipeline
  // (they both hold the tied word embedding and sum its gradient). A middle stage's group is
  // itself alone; with one stage, the group is that rank.
  Communicator& embedding() { return *embedding_; }
  // Expert parallelism: the EP data ranks of one block (same tensor and pipeline rank) that
  // split the experts and exchange tokens (all-to-all); the expert-data group, the EDP ranks
  // holding the same experts, over which the experts' gradients are reduced. With EP = 1 the
  // expert group is this rank alone and the expert-data group the data group.
  Communicator& expert() { return *expert_; }
  Communicator& expert_data() { return *expert_data_; }
  // Context parallelism: the CP data ranks (same tensor and pipeline rank, same samples) that
  // split each sequence and exchange keys and values in attention; this rank alone at CP = 1.
  Communicator& context() { return *context_; }
  // "TP=2 x DP=1 x PP=2 (rank 3: tp 1, dp 0, pp 1)", EP and CP when > 1
  std::string describe() const;

 private:
  ParallelState() = default;
  std::shared_ptr<Communicator> world_, tensor_, data_, pipeline_, tensor_and_data_, model_,
      embedding_, expert_, expert_data_, context_;
  int tensor_size_ = 1, data_size_ = 1, pipeline_size_ = 1, expert_size_ = 1, context_size_ = 1;
  int tensor_rank_ = 0, data_rank_ = 0, pipeline_rank_ = 0;
};

}  // namespace octet
