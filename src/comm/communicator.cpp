// Work handles, the blocking forms of the collectives, argument checks, and the
// communicator of a world of one.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/work.h"
#include "octet/error.h"
#include "octet/profile.h"

namespace octet {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

namespace {

std::atomic<double> g_communication_timeout{-1};  // < 0: not set, read the environment

}  // namespace

void set_communication_timeout(double seconds) {
  OCTET_CHECK(std::isfinite(seconds) && seconds >= 0,
              "communication timeout expected a finite number of seconds >= 0 (0: wait forever), "
              "got ",
              seconds);
  g_communication_timeout = seconds;
}

double communication_timeout() {
  const double set = g_communication_timeout.load();
  if (set >= 0) return set;
  // First use: the environment's value or the default, kept (every wait asks).
  double seconds = kDefaultCommunicationTimeout;
  if (const char* text = std::getenv("OCTET_COMM_TIMEOUT")) {
    char* end = nullptr;
    seconds = std::strtod(text, &end);
    OCTET_CHECK(end != text && *end == 0 && std::isfinite(seconds) && seconds >= 0,
                "OCTET_COMM_TIMEOUT expected seconds >= 0 (0: wait forever), got '", text, "'");
  }
  g_communication_timeout = seconds;
  return seconds;
}

void Work::wait() {
  wait(communication_timeout());
}

void Work::wait(double timeout_seconds) {
  if (!state_) return;
  const profile::Scope scope(profile::Category::Communication);
  const auto start = detail::WorkState::Clock::now();
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (timeout_seconds > 0) {
    const auto limit = std::chrono::duration<double>(timeout_seconds);
    if (!state_->finished.wait_for(lock, limit, [&] { return state_->done; })) {
      lock.unlock();
      std::string peers = state_->diagnose ? state_->diagnose() : std::string();
      if (peers.empty()) {
        peers = "a peer that never sent, never received or took another collective path?";
      }
      fail(detail::concat(state_->description, ": still pending after ", timeout_seconds, " s (",
                          peers, ")"));
    }
  } else {
    state_->finished.wait(lock, [&] { return state_->done; });
  }
  state_->waited_seconds +=
      std::chrono::duration<double>(detail::WorkState::Clock::now() - start).count();
  if (!state_->error.empty()) fail(state_->description + ": " + state_->error);
}

bool Work::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

double Work::transfer_seconds() const {
  if (!state_) return 0;
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->done) return 0;
  return std::chrono::duration<double>(state_->completed - state_->submitted).count();
}

double Work::waited_seconds() const {
  if (!state_) return 0;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->waited_seconds;
}

const std::string& Work::description() const {
  static const std::string complete = "completed operation";
  return state_ ? state_->description : complete;
}

namespace parallel_detail {

void check_contiguous_cpu(const Tensor& tensor, const std::string& what) {
  OCTET_CHECK(tensor.defined(), what, ": expected a tensor, got an undefined one");
  OCTET_CHECK(tensor.device() == Device::CPU, what, ": expected a CPU tensor");
}

void check_reducible(const Tensor& tensor, ReduceOp op, const std::string& what) {
  const DType d = tensor.dtype();
  OCTET_CHECK(d == DType::F32 || d == DType::BF16 || d == DType::I32 || d == DType::I64, what, ": ",
              reduce_op_name(op), " expected f32, bf16, i32 or i64, got ", dtype_name(d),
              " (FP8 codes are gathered, never reduced)");
}

int64_t rows_of(const Tensor& tensor) {
  return tensor.ndim() == 0 ? 1 : tensor.dim(0);
}

size_t row_bytes(const Tensor& tensor) {
  const int64_t rows = rows_of(tensor);
  return rows == 0 ? 0 : tensor.nbytes() / static_cast<size_t>(rows);
}

}  // namespace parallel_detail

using parallel_detail::rows_of;

namespace {

Shape with_rows(const Shape& shape, int64_t rows) {
  Shape out = shape.empty() ? Shape{1} : shape;
  out[0] = rows;
  return out;
}

}  // namespace

Tensor Communicator::all_gather(const Tensor& input) {
  if (size() == 1) return input;
  Tensor output = Tensor::empty(with_rows(input.shape(), rows_of(input) * size()), input.dtype());
  iall_gather(input, output).wait();
  return output;
}

Tensor Communicator::reduce_scatter(const Tensor& input, ReduceOp op) {
  if (size() == 1) return input;
  OCTET_CHECK(rows_of(input) % size() == 0, name(), ": reduce_scatter expected rows divisible by ",
              size(), ", got ", shape_str(input.shape()));
  Tensor output = Tensor::empty(with_rows(input.shape(), rows_of(input) / size()), input.dtype());
  ireduce_scatter(input, output, op).wait();
  return output;
}

Tensor Communicator::all_to_all(const Tensor& input) {
  if (size() == 1) return input;
  Tensor output = Tensor::empty(input.shape(), input.dtype());
  iall_to_all(input, output).wait();
  return output;
}

double Communicator::all_reduce(double value, ReduceOp op) {
  return size() == 1 ? value : all_reduce_scalar(value, op);
}

}  // namespace octet
