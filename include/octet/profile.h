// Where a training step's time goes: each operator's public entry point (GEMMs, attention,
// norms, activations, the loss, the optimizer, FP8 casts, collectives) opens a Scope of its
// category, and while profiling is on the calling thread's exclusive time per category is
// summed (a scope inside another, as a GEMM inside a fused module, counts for itself only).
// Off, a scope costs one relaxed atomic load. `octet bench train` prints the sums per step.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace octet::profile {

enum class Category : int {
  Gemm,            // every GEMM (BF16, F32, FP8, FP4, grouped)
  Attention,       // fused (flash) attention, forward and backward
  NormActivation,  // norms, activations, softmax, dropout, RoPE, elementwise, embeddings
  CrossEntropy,    // the loss (fused chunked cross-entropy: its GEMMs count as GEMMs)
  Optimizer,       // AdamW, gradient norms and clipping
  Fp8Cast,         // FP8 / FP4 quantization, casts and transposes outside the GEMMs
  Communication,   // collectives and point-to-point, waits included
  kCount
};
constexpr int kCategories = static_cast<int>(Category::kCount);

const char* category_name(Category category);

struct Totals {
  std::array<double, kCategories> seconds{};
  std::array<int64_t, kCategories> calls{};
};

// Starts (clearing the sums) or stops profiling; only the thread that starts it is timed (the
// operators' own OpenMP workers run inside its scopes).
void start();
void stop();
// The sums since start() (they keep counting until stop()).
Totals totals();

namespace detail {
extern std::atomic<bool> enabled;
void begin(Category category, std::chrono::steady_clock::time_point now);
void end(std::chrono::steady_clock::time_point now);
bool on_profiled_thread();
}  // namespace detail

class Scope {
 public:
  explicit Scope(Category category) {
    if (detail::enabled.load(std::memory_order_relaxed) && detail::on_profiled_thread()) {
      active_ = true;
      detail::begin(category, std::chrono::steady_clock::now());
    }
  }
  ~Scope() {
    if (active_) detail::end(std::chrono::steady_clock::now());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool active_ = false;
};

}  // namespace octet::profile
