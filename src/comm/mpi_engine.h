// The one thread that makes every MPI call of the process (MPI_THREAD_FUNNELED: it also
// initializes and finalizes MPI). Callers hand it operations; it starts them, polls their
// requests while the callers compute, and completes their Work handles.
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/work.h"

namespace octet::parallel_detail {

class MpiEngine {
 public:
  // The process's engine; the first call starts the thread and initializes MPI.
  static MpiEngine& instance();
  // Whether instance() was called (MPI is initialized), without initializing it.
  static bool started();
  ~MpiEngine();  // finalizes MPI (at exit)

  // Runs `call` on the MPI thread and waits for it; its exception is rethrown here.
  void run(const std::function<void()>& call);
  // start() runs on the MPI thread and returns the requests to poll (none = complete);
  // finish() runs there once they all completed, with their statuses (e.g. to check a
  // received size).
  // `peers` (world ranks) are roll-called when a wait on the operation times out.
  Work submit(std::string description, std::function<std::vector<MPI_Request>()> start,
              std::function<void(std::span<MPI_Status>)> finish = {}, std::vector<int> peers = {});

  // Liveness. Every engine keeps a receive posted on a private duplicate of the world
  // communicator and echoes what arrives, whatever its own caller is doing; a roll call sends
  // to each peer and names those that do not echo within `seconds` (a stopped or hung
  // process, a lost host). Runs on the caller's thread.
  std::string roll_call(const std::vector<int>& peers, double seconds);
  // "rank 3 (pid 4242 on node7)"
  std::string describe_rank(int world_rank) const;
  // MPI_Abort on the MPI thread; if that thread does not take it within a few seconds (it is
  // inside a blocking call), the process ends itself and the launcher ends the rest.
  [[noreturn]] void abort(int status);

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // MPI ops for BF16 (carried as MPI_UINT16_T) and NaN-propagating F32 max/min.
  MPI_Op bf16_op(ReduceOp op) const;
  MPI_Op f32_op(ReduceOp op) const;

 private:
  struct Operation {
    std::shared_ptr<detail::WorkState> state;
    std::function<std::vector<MPI_Request>()> start;
    std::function<void(std::span<MPI_Status>)> finish;
    std::vector<MPI_Request> requests;
    std::vector<MPI_Status> statuses;
  };

  MpiEngine();
  void loop();
  void initialize();
  bool progress(std::vector<Operation>& active);
  void answer_roll_calls();
  void stop_listening();

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_, ready_;
  std::deque<Operation> queue_;
  bool stop_ = false, initialized_ = false;
  std::string init_error_;
  int world_rank_ = 0, world_size_ = 1;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL, bf16_min_ = MPI_OP_NULL;
  MPI_Op f32_max_ = MPI_OP_NULL, f32_min_ = MPI_OP_NULL;
  // Liveness listener (MPI thread only) and who each world rank is.
  MPI_Comm liveness_ = MPI_COMM_NULL;
  MPI_Request listener_ = MPI_REQUEST_NULL;
  int roll_call_in_ = 0;
  struct Identity {
    int pid = 0;
    char host[64] = {};
  };
  std::vector<Identity> identities_;
};

// "MPI_Isend: MPI_ERR_RANK: invalid rank" from a return code.
void check_mpi(int code, const char* call);

}  // namespace octet::parallel_detail
