#include "octet/profile.h"

#include <mutex>
#include <thread>
#include <vector>

namespace octet::profile {

namespace {

struct Frame {
  Category category;
  std::chrono::steady_clock::time_point start;
  double child_seconds = 0;  // inner scopes' inclusive time, taken off this one's
};

std::mutex mutex;  // guards `sums` and `profiled` against totals() from another thread
Totals sums;
std::thread::id profiled;
thread_local std::vector<Frame> stack;  // open scopes (only the profiled thread pushes)

}  // namespace

namespace detail {

std::atomic<bool> enabled{false};

bool on_profiled_thread() {
  const std::lock_guard<std::mutex> lock(mutex);
  return std::this_thread::get_id() == profiled;
}

void begin(Category category, std::chrono::steady_clock::time_point now) {
  stack.push_back(Frame{category, now});
}

void end(std::chrono::steady_clock::time_point now) {
  if (stack.empty()) return;  // profiling restarted inside the scope
  const Frame frame = stack.back();
  stack.pop_back();
  const double inclusive = std::chrono::duration<double>(now - frame.start).count();
  if (!stack.empty()) stack.back().child_seconds += inclusive;
  const int index = static_cast<int>(frame.category);
  const std::lock_guard<std::mutex> lock(mutex);
  sums.seconds[index] += inclusive - frame.child_seconds;
  sums.calls[index] += 1;
}

}  // namespace detail

const char* category_name(Category category) {
  switch (category) {
    case Category::Gemm:
      return "GEMMs";
    case Category::Attention:
      return "attention";
    case Category::NormActivation:
      return "norms+activations";
    case Category::CrossEntropy:
      return "cross-entropy";
    case Category::Optimizer:
      return "optimizer";
    case Category::Fp8Cast:
      return "FP8 casts";
    case Category::Communication:
      return "communication";
    case Category::kCount:
      break;
  }
  return "?";
}

void start() {
  const std::lock_guard<std::mutex> lock(mutex);
  sums = Totals{};
  stack.clear();
  profiled = std::this_thread::get_id();
  detail::enabled.store(true, std::memory_order_relaxed);
}

void stop() {
  const std::lock_guard<std::mutex> lock(mutex);
  detail::enabled.store(false, std::memory_order_relaxed);
  profiled = std::thread::id();
}

Totals totals() {
  const std::lock_guard<std::mutex> lock(mutex);
  return sums;
}

}  // namespace octet::profile
