// Megatron's --exit-signal-handler for a training run: while a StopSignals lives, the first
// SIGTERM or SIGINT only records itself (the loop finishes its step, saves and stops); a
// second one of either restores the default action and re-raises it, ending the process.
//
// The signals are taken by a thread of their own (sigtimedwait), blocked in the calling
// thread and in the OpenMP workers: a handler interrupting oneDNN's JIT kernels corrupted the
// heap (about one SIGINT in four with two OpenMP threads, found by tests/reliability/signals.sh).
// A handler stays installed for threads started elsewhere that do not block them.
#pragma once

#include <signal.h>

#include <atomic>
#include <thread>

namespace octet::train_detail {

class StopSignals {
 public:
  StopSignals();   // blocks the signals here and in the OpenMP workers, starts the thread
  ~StopSignals();  // stops it and restores the masks and the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received (SIGTERM or SIGINT) since construction, or 0.
  int received() const;

 private:
  sigset_t previous_mask_{};
  std::atomic<bool> stop_{false};
  std::thread waiter_;
};

}  // namespace octet::train_detail
