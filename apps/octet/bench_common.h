// What the `octet bench` operator benchmarks share: median timing after warm-up, a parallel
// loop whose body the compiler vectorizes for the processor's instruction set (the same run-time
// choice the operator kernels make, so a baseline differs from a fast op by its passes, not by
// its ISA), and a PyTorch peer kept running beside octet to answer case by case.
#pragma once

#include <fcntl.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/dtype.h"

namespace octet::cli::bench {

// ---- timing ------------------------------------------------------------------------------

inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// "median (min..max)" of per-round figures, the form every ratio of `octet bench` takes (the
// machine's load moves single runs up to 2x; a round times both sides within the same minute).
inline std::string median_range(const std::vector<double>& v, const char* format = "%.2fx") {
  if (v.empty()) return "-";
  char median_text[32], low[32], high[32], text[112];
  std::snprintf(median_text, sizeof median_text, format, median(v));
  std::snprintf(low, sizeof low, "%.2f", *std::min_element(v.begin(), v.end()));
  std::snprintf(high, sizeof high, "%.2f", *std::max_element(v.begin(), v.end()));
  std::snprintf(text, sizeof text, "%s (%s..%s)", median_text, low, high);
  return text;
}

// Per-round figures: a failed side (NaN) is left out of the median and the spread.
inline void push_finite(std::vector<double>& values, double value) {
  if (std::isfinite(value)) values.push_back(value);
}
inline double median_or_nan(const std::vector<double>& values) {
  return values.empty() ? NAN : median(values);
}
// A JSON number, or null for NaN / Inf (which JSON cannot hold).
inline nlohmann::json json_number(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

inline double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

// Medians over repeats (after warm-up runs) of forward, backward, and forward + backward taken
// within one repeat (the headline: not the sum of the two medians).
struct FwdBwdTiming {
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
  double ms = 0.0;
  int repeats = 0;
};

// At least `repeats` timed runs, and more (up to max_repeats) until they add up to min_total_ms:
// short cases then get enough runs for a median that a busy machine's stalls do not move.
template <typename Forward, typename Backward>
FwdBwdTiming time_forward_backward(Forward&& forward, Backward&& backward, int warmup, int repeats,
                                   double min_total_ms = 0.0, int max_repeats = 50) {
  std::vector<double> fwd, bwd, total;
  double total_ms = 0.0;
  for (int rep = 0; rep < warmup + repeats ||
                    (total_ms < min_total_ms && static_cast<int>(total.size()) < max_repeats);
       ++rep) {
    const auto start = std::chrono::steady_clock::now();
    forward();
    const double forward_ms = elapsed_ms(start);
    const auto middle = std::chrono::steady_clock::now();
    backward();
    const double backward_ms = elapsed_ms(middle);
    if (rep < warmup) continue;
    fwd.push_back(forward_ms);
    bwd.push_back(backward_ms);
    total.push_back(forward_ms + backward_ms);
    total_ms += forward_ms + backward_ms;
  }
  return {median(fwd), median(bwd), median(total), static_cast<int>(total.size())};
}

// ---- vectorized parallel loops -------------------------------------------------------------

#define OCTET_BENCH_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")))
#define OCTET_BENCH_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// Put on a loop body lambda (after its parameter list) so that it is compiled inside, and for
// the instruction set of, the wrapper that calls it.
#define OCTET_BENCH_INLINE __attribute__((always_inline))

inline __attribute__((always_inline)) float load(float value) {
  return value;
}
inline __attribute__((always_inline)) float load(bfloat16 value) {
  return std::bit_cast<float>(uint32_t{value.bits} << 16);
}
inline __attribute__((always_inline)) void store(float value, float* out) {
  *out = value;
}
// Round to nearest even (finite values; the benchmark has no NaN), branch-free to vectorize.
inline __attribute__((always_inline)) void store(float value, bfloat16* out) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  out->bits = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename Body>
OCTET_BENCH_TARGET_AVX512 void run_avx512(const Body& body, int64_t begin, int64_t end,
                                          int thread) {
  body(begin, end, thread);
}
template <typename Body>
OCTET_BENCH_TARGET_AVX2 void run_avx2(const Body& body, int64_t begin, int64_t end, int thread) {
  body(begin, end, thread);
}

// body(begin, end, thread) over an even static split of [0, count) across the OpenMP threads,
// the split the kernels use for rows; `thread` indexes per-thread partial sums.
template <typename Body>
void parallel_for(int64_t count, const Body& body) {
  const Isa isa = active_isa();
#pragma omp parallel
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = count * thread / threads, end = count * (thread + 1) / threads;
    if (isa == Isa::Avx512) {
      run_avx512(body, begin, end, thread);
    } else if (isa == Isa::Avx2) {
      run_avx2(body, begin, end, thread);
    } else {
      body(begin, end, thread);
    }
  }
}

// ---- the PyTorch peer ----------------------------------------------------------------------

// bench/peers/<name> beside the source tree, or above the running binary.
// This octet executable (a bench that runs `octet train` or a worker under mpirun).
inline std::string self_exe() {
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) {
    std::fprintf(stderr, "octet bench: cannot find the octet executable (/proc/self/exe)\n");
    std::exit(1);
  }
  return exe.string();
}

inline std::filesystem::path find_peer_script(const std::string& name) {
  const std::filesystem::path relative = std::filesystem::path("bench/peers") / name;
  std::vector<std::filesystem::path> candidates = {std::filesystem::path(OCTET_SOURCE_DIR) /
                                                   relative};
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    for (auto dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
         dir = dir.parent_path()) {
      candidates.push_back(dir / relative);
    }
  }
  for (const auto& candidate : candidates) {
    if (std::filesystem::exists(candidate)) return candidate;
  }
  return {};
}

// A peer process that reads one case per line on stdin and answers one JSON line each, so
// that octet can time a case and PyTorch the same case back to back under the same load.
class PeerProcess {
 public:
  PeerProcess() = default;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() { stop(); }

  // Starts `argv` (argv[0] an absolute path) and waits for its first line; false on failure.
  bool start(const std::vector<std::string>& argv) {
    int to_child[2], from_child[2];
    // Close-on-exec: a peer started later must not inherit this one's pipe ends (its stdin
    // would then never see end of input when this peer is shut down).
    if (pipe2(to_child, O_CLOEXEC) != 0) return false;
    if (pipe2(from_child, O_CLOEXEC) != 0) {
      close(to_child[0]);
      close(to_child[1]);
      return false;
    }
    std::fflush(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      close(to_child[0]);
      close(to_child[1]);
      close(from_child[0]);
      close(from_child[1]);
      std::vector<char*> args;
      for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    if (pid_ < 0) {
      close(to_child[1]);
      close(from_child[0]);
      return false;
    }
    to_ = fdopen(to_child[1], "w");
    from_ = fdopen(from_child[0], "r");
    std::signal(SIGPIPE, SIG_IGN);  // a peer that died must not kill octet
    if (to_ == nullptr || from_ == nullptr) return false;
    auto first = read_line();
    if (!first) return false;
    ready_ = std::move(*first);
    return true;
  }
  // The peer's first line (its ready message: threads, the configuration it chose).
  const nlohmann::json& ready() const { return ready_; }

  // Sends one line and returns the JSON answer; nullopt once the peer is gone.
  std::optional<nlohmann::json> ask(const std::string& line) {
    if (to_ == nullptr) return std::nullopt;
    if (std::fprintf(to_, "%s\n", line.c_str()) < 0 || std::fflush(to_) != 0) {
      stop();
      return std::nullopt;
    }
    return read_line();
  }

  void stop() {
    if (to_ != nullptr) std::fclose(to_);
    if (from_ != nullptr) std::fclose(from_);
    to_ = from_ = nullptr;
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  std::optional<nlohmann::json> read_line() {
    std::string text;
    char buffer[4096];
    while (from_ != nullptr && std::fgets(buffer, sizeof(buffer), from_) != nullptr) {
      text += buffer;
      if (!text.empty() && text.back() == '\n') break;
    }
    auto parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (text.empty() || parsed.is_discarded()) {
      stop();
      return std::nullopt;
    }
    return parsed;
  }

  nlohmann::json ready_ = nlohmann::json::object();
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

}  // namespace octet::cli::bench
