// The MPI progress thread. MPI does not move data for a non-blocking operation unless some
// MPI call is running, so this thread polls the pending requests (MPI_Testall) while the
// compute threads work; when nothing completed it naps briefly to leave the cores to them.
#include "comm/mpi_engine.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "octet/dtype.h"
#include "octet/error.h"

namespace octet::parallel_detail {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  fail(detail::concat(call, ": ", std::string(text, static_cast<size_t>(length))));
}

namespace {

// Tags on the liveness communicator.
constexpr int kRollCallTag = 1, kAnswerTag = 2;
// How often an idle MPI thread looks for roll calls.
constexpr auto kIdlePoll = std::chrono::milliseconds(5);

template <typename Combine>
void combine_bf16(void* in, void* inout, int* length, Combine combine) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    b[i] = float_to_bf16(combine(bf16_to_float(a[i]), bf16_to_float(b[i])));
  }
}

float nan_max(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b);
}
float nan_min(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? NAN : std::min(a, b);
}

void bf16_sum(void* in, void* inout, int* length, MPI_Datatype*) {
  combine_bf16(in, inout, length, [](float a, float b) { return a + b; });
}
void bf16_max(void* in, void* inout, int* length, MPI_Datatype*) {
  combine_bf16(in, inout, length, nan_max);
}
void bf16_min(void* in, void* inout, int* length, MPI_Datatype*) {
  combine_bf16(in, inout, length, nan_min);
}
void f32_max(void* in, void* inout, int* length, MPI_Datatype*) {
  const float* a = static_cast<const float*>(in);
  float* b = static_cast<float*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = nan_max(a[i], b[i]);
}
void f32_min(void* in, void* inout, int* length, MPI_Datatype*) {
  const float* a = static_cast<const float*>(in);
  float* b = static_cast<float*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = nan_min(a[i], b[i]);
}

}  // namespace

namespace {
std::atomic<bool> g_started{false};
}

MpiEngine& MpiEngine::instance() {
  static MpiEngine engine;
  return engine;
}

bool MpiEngine::started() {
  return g_started.load();
}

MpiEngine::MpiEngine() {
  g_started = true;
  thread_ = std::thread([this] { loop(); });
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait(lock, [&] { return initialized_; });
  if (!init_error_.empty()) fail("MPI: " + init_error_);
}

MpiEngine::~MpiEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MpiEngine::initialize() {
  int provided = 0;
  int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (code != MPI_SUCCESS) {
    init_error_ = "MPI_Init_thread failed";
    return;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  MPI_Op_create(bf16_sum, 1, &bf16_sum_);
  MPI_Op_create(bf16_max, 1, &bf16_max_);
  MPI_Op_create(bf16_min, 1, &bf16_min_);
  MPI_Op_create(f32_max, 1, &f32_max_);
  MPI_Op_create(f32_min, 1, &f32_min_);
  if (world_size_ == 1) return;
  // Who is who, for messages naming a peer; then the liveness listener.
  Identity mine;
  mine.pid = static_cast<int>(getpid());
  gethostname(mine.host, sizeof(mine.host) - 1);
  identities_.resize(static_cast<size_t>(world_size_));
  MPI_Allgather(&mine, sizeof(Identity), MPI_BYTE, identities_.data(), sizeof(Identity), MPI_BYTE,
                MPI_COMM_WORLD);
  MPI_Comm_dup(MPI_COMM_WORLD, &liveness_);
  MPI_Comm_set_errhandler(liveness_, MPI_ERRORS_RETURN);
  MPI_Irecv(&roll_call_in_, 1, MPI_INT, MPI_ANY_SOURCE, kRollCallTag, liveness_, &listener_);
}

void MpiEngine::answer_roll_calls() {
  static const int kPresent = 1;
  while (listener_ != MPI_REQUEST_NULL) {
    int arrived = 0;
    MPI_Status status;
    if (MPI_Test(&listener_, &arrived, &status) != MPI_SUCCESS || !arrived) return;
    MPI_Request answer = MPI_REQUEST_NULL;
    if (MPI_Isend(&kPresent, 1, MPI_INT, status.MPI_SOURCE, kAnswerTag, liveness_, &answer) ==
        MPI_SUCCESS) {
      MPI_Request_free(&answer);  // completes on its own; the buffer is static
    }
    MPI_Irecv(&roll_call_in_, 1, MPI_INT, MPI_ANY_SOURCE, kRollCallTag, liveness_, &listener_);
  }
}

void MpiEngine::stop_listening() {
  if (listener_ == MPI_REQUEST_NULL) return;
  MPI_Cancel(&listener_);
  MPI_Wait(&listener_, MPI_STATUS_IGNORE);
}

std::string MpiEngine::describe_rank(int world_rank) const {
  if (world_rank < 0 || world_rank >= static_cast<int>(identities_.size())) {
    return detail::concat("rank ", world_rank);
  }
  const Identity& who = identities_[static_cast<size_t>(world_rank)];
  return detail::concat("rank ", world_rank, " (pid ", who.pid, " on ",
                        std::string(who.host, strnlen(who.host, sizeof(who.host))), ")");
}

std::string MpiEngine::roll_call(const std::vector<int>& peers, double seconds) {
  if (liveness_ == MPI_COMM_NULL || peers.empty()) return {};
  std::vector<Work> calls;
  for (int peer : peers) {
    // The buffers live as long as the operation: one whose peer never answers stays pending.
    auto call = std::make_shared<int>(world_rank_);
    auto answer = std::make_shared<int>(0);
    calls.push_back(submit(detail::concat("roll call of ", describe_rank(peer)), [=, this] {
      std::vector<MPI_Request> requests(2);
      check_mpi(MPI_Irecv(answer.get(), 1, MPI_INT, peer, kAnswerTag, liveness_, &requests[0]),
                "MPI_Irecv");
      check_mpi(MPI_Isend(call.get(), 1, MPI_INT, peer, kRollCallTag, liveness_, &requests[1]),
                "MPI_Isend");
      return requests;
    }));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::string> silent, present;
  for (size_t i = 0; i < calls.size(); ++i) {
    const double left =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    bool answered = false;
    try {
      calls[i].wait(std::max(left, 1e-3));
      answered = true;
    } catch (const Error&) {
    }
    (answered ? present : silent).push_back(describe_rank(peers[i]));
  }
  auto join = [](const std::vector<std::string>& names) {
    std::string text;
    for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
    return text;
  };
  if (silent.empty()) {
    return detail::concat("every peer answered a roll call (", join(present),
                          "): alive, but not in this operation: a slow rank (raise "
                          "--comm-timeout) or another collective order");
  }
  return detail::concat("no answer to a roll call within ", seconds, " s from ", join(silent),
                        ": stopped, hung or unreachable",
                        present.empty() ? std::string() : "; answered: " + join(present));
}

void MpiEngine::abort(int status) {
  if (world_size_ > 1) {
    auto state = std::make_shared<detail::WorkState>("MPI_Abort");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Operation{state,
                                 [status]() -> std::vector<MPI_Request> {
                                   MPI_Abort(MPI_COMM_WORLD, status);
                                   std::_Exit(status);
                                 },
                                 {},
                                 {},
                                 {}});
    }
    wake_.notify_one();
    std::this_thread::sleep_for(std::chrono::seconds(5));
  }
  std::_Exit(status);
}

MPI_Op MpiEngine::bf16_op(ReduceOp op) const {
  return op == ReduceOp::Sum ? bf16_sum_ : op == ReduceOp::Max ? bf16_max_ : bf16_min_;
}

MPI_Op MpiEngine::f32_op(ReduceOp op) const {
  return op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? f32_max_ : f32_min_;
}

void MpiEngine::run(const std::function<void()>& call) {
  Work work = submit("MPI call", [&call]() {
    call();
    return std::vector<MPI_Request>();
  });
  work.wait();
}

Work MpiEngine::submit(std::string description, std::function<std::vector<MPI_Request>()> start,
                       std::function<void(std::span<MPI_Status>)> finish, std::vector<int> peers) {
  auto state = std::make_shared<detail::WorkState>(std::move(description));
  if (!peers.empty()) {
    state->diagnose = [this, peers = std::move(peers)] {
      return roll_call(peers, std::clamp(communication_timeout() / 4, 1.0, 5.0));
    };
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    OCTET_CHECK(!stop_, state->description, ": MPI is already finalized");
    queue_.push_back(Operation{state, std::move(start), std::move(finish), {}, {}});
  }
  wake_.notify_one();
  return Work(state);
}

bool MpiEngine::progress(std::vector<Operation>& active) {
  bool any = false;
  for (size_t i = 0; i < active.size();) {
    Operation& op = active[i];
    int flag = 0;
    op.statuses.resize(op.requests.size());
    int code = MPI_Testall(static_cast<int>(op.requests.size()), op.requests.data(), &flag,
                           op.statuses.data());
    if (code != MPI_SUCCESS || flag) {
      std::string error;
      try {
        check_mpi(code, "MPI_Testall");
        if (op.finish) op.finish(op.statuses);
      } catch (const std::exception& e) {
        error = e.what();
      }
      op.state->complete(std::move(error));
      active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      any = true;
    } else {
      ++i;
    }
  }
  return any;
}

void MpiEngine::loop() {
  initialize();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    initialized_ = true;
  }
  ready_.notify_all();
  std::vector<Operation> active;
  for (;;) {
    std::deque<Operation> incoming;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto ready = [&] { return stop_ || !queue_.empty(); };
      if (active.empty()) {
        // Idle: with peers, wake now and then to answer their roll calls.
        if (listener_ != MPI_REQUEST_NULL) {
          wake_.wait_for(lock, kIdlePoll, ready);
        } else {
          wake_.wait(lock, ready);
        }
      }
      // At exit, operations that never completed are abandoned: their peers are gone.
      if (stop_ && queue_.empty()) break;
      incoming.swap(queue_);
    }
    for (Operation& op : incoming) {
      try {
        op.requests = op.start();
      } catch (const std::exception& e) {
        op.state->complete(e.what());
        continue;
      }
      if (op.requests.empty()) {
        std::string error;
        try {
          if (op.finish) op.finish({});
        } catch (const std::exception& e) {
          error = e.what();
        }
        op.state->complete(std::move(error));
      } else {
        active.push_back(std::move(op));
      }
    }
    answer_roll_calls();
    if (!active.empty() && !progress(active)) {
      // Nothing completed: a short nap keeps this thread from taking a core from compute.
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  if (init_error_.empty()) {
    stop_listening();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
}

}  // namespace octet::parallel_detail
