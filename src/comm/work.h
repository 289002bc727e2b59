// What a Work handle points at: completion, error and timing of one operation, shared by
// the caller and the thread that completes it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "octet/comm.h"

namespace octet::detail {

struct WorkState {
  using Clock = std::chrono::steady_clock;
  explicit WorkState(std::string what) : description(std::move(what)), submitted(Clock::now()) {}

  // Called once by the completing thread; an empty error means success.
  void complete(std::string failure = {}) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      error = std::move(failure);
      completed = Clock::now();
      done = true;
    }
    finished.notify_all();
  }

  std::string description;
  Clock::time_point submitted, completed;
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  std::string error;
  double waited_seconds = 0;
  // Called (without the mutex) when a wait times out: what is known about the peers, e.g.
  // which of them do not answer a roll call. Empty: nothing to add.
  std::function<std::string()> diagnose;
};

}  // namespace octet::detail

namespace octet::parallel_detail {

// Element datatype checks shared by the implementations.
void check_contiguous_cpu(const Tensor& tensor, const std::string& what);
void check_reducible(const Tensor& tensor, ReduceOp op, const std::string& what);
// Bytes of one row (all but the first dimension); tensors of rank 0 are one row.
size_t row_bytes(const Tensor& tensor);
int64_t rows_of(const Tensor& tensor);

}  // namespace octet::parallel_detail
