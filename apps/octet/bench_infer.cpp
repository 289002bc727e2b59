// `octet bench infer`: the inference engine on a GPT with random weights — prefill tokens/s,
// decode tokens/s at several batch sizes, time to first token and inter-token latency with
// concurrent requests, KV-cache waste — beside the same model generating with its own KV
// cache in PyTorch 1.13 (bench/peers/torch_infer.py, in the precision and with the linear
// layers that run fastest on the processor, unless told), alternating ours and the peer's run of
// each case round by round and reporting the median per-round ratio. The machine's memory
// bandwidth, measured before every batch-1 decode step, gives that step's roofline (weight
// bytes read per token / bandwidth); each case also prints where its decode step goes.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/engine.h"
#include "octet/profile.h"

namespace octet::cli {
namespace {

struct Options {
  std::string config = "gpt2-124m";
  std::string precision = "bf16";
  std::string peer_precision = "auto";  // the PyTorch peer's (auto: its fastest here)
  std::vector<int64_t> batches = {1, 8, 32, 64};
  int64_t prompt = 128;
  int64_t steps = 64;  // timed decode steps per case (the median step: 16 read FP8 low)
  int rounds = 3;
  int64_t clients = 32;  // the latency case: requests arriving together
  int64_t block_size = EngineOptions{}.block_size;
  uint64_t seed = 1234;
  bool json = false;
  bool no_torch = false;
  bool fp8_weights = false;  // also each case with weight-only FP8, beside the BF16 weights
  std::string fp8_weight_scaling = "channel";
  bool fp8_kv = false;  // the KV cache in E4M3 (every case)
};

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double at = p * static_cast<double>(values.size() - 1);
  const size_t low = static_cast<size_t>(at);
  const size_t high = std::min(low + 1, values.size() - 1);
  return values[low] + (values[high] - values[low]) * (at - static_cast<double>(low));
}

// Streaming read bandwidth: sums over a buffer far larger than the caches (integer sums:
// they vectorize without reassociation flags, so the loop is memory-bound), 256 bytes per
// iteration into four independent vector sums, every line prefetched 8 KiB ahead: on the AMD
// EPYC VM a plain one-sum loop read 52 GB/s where this one read 66-71 (and the decode GEMMs
// 65-70: a roofline from the plain loop put them above 1). On a shared
// machine the bandwidth moves from second to second (20 to 45 GB/s within a minute on one
// VM), so the batch-1 roofline is measured step by step: before every timed decode step, one
// read of as many bytes as the step's weights.
class Bandwidth {
 public:
  // Seconds to read `bytes` (at most the buffer) once, on every thread.
  double stream_seconds(double bytes) {
    const int64_t count = std::min(count_, static_cast<int64_t>(bytes / 4.0));
    const auto start = Clock::now();
    bench::parallel_for(count, [&](int64_t begin, int64_t end, int thread) OCTET_BENCH_INLINE {
      constexpr int64_t kWords = 64, kAhead = 2048;  // 256 bytes per step, 8 KiB ahead
      uint32_t sums[kWords] = {};
      const uint32_t* data = buffer_.data();
      int64_t i = begin;
      for (; i + kWords <= end; i += kWords) {
        for (int64_t line = 0; line < kWords; line += 16) {
          __builtin_prefetch(data + i + kAhead + line);
        }
        for (int64_t j = 0; j < kWords; ++j) sums[j] += data[i + j];
      }
      uint32_t sum = 0;
      for (uint32_t s : sums) sum += s;
      for (; i < end; ++i) sum += data[i];
      partial_[static_cast<size_t>(thread)] = sum;
    });
    const double s = seconds_since(start);
    uint32_t total = 0;
    for (uint32_t p : partial_) total += p;
    if (total == 1) std::printf("?");  // keeps the sums alive
    return s;
  }

 private:
  int64_t count_ = int64_t{512} << 20 >> 2;  // 512 MiB of 32-bit words
  std::vector<uint32_t> buffer_ = std::vector<uint32_t>(static_cast<size_t>(count_), 1u);
  std::vector<uint32_t> partial_ = std::vector<uint32_t>(256, 0);
};

std::vector<int32_t> random_ids(int64_t count, int64_t vocab, std::mt19937& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return ids;
}

struct CaseResult {
  double prefill_ms = 0;  // all B prompts
  double decode_ms = 0;   // median per step of B sequences
  double kv_waste = 0;    // 1 - KV utilization while decoding
  // With a roofline asked for: the median over steps of (time to stream the weight bytes /
  // the decode step after it), and the bandwidth those reads measured (GB/s, median).
  double roofline_share = 0;
  double bandwidth_gbs = 0;
  // Where a decode step goes: mean ms per step in each profile::Category (the engine's
  // thread; the operators' OpenMP workers run inside its scopes), and the whole step.
  std::array<double, profile::kCategories> breakdown_ms{}, breakdown_calls{};
  double step_mean_ms = 0;
};

EngineOptions engine_options(const Options& o, DType dtype, int64_t batch, int64_t tokens) {
  EngineOptions e;
  e.block_size = o.block_size;
  e.num_blocks = batch * ((tokens + o.block_size - 1) / o.block_size) + 1;
  e.max_num_seqs = batch;
  e.max_num_batched_tokens = std::max<int64_t>(2048, batch);
  e.max_waiting = std::max<int64_t>(batch, 256);
  e.dtype = dtype;
  e.fp8_kv = o.fp8_kv;
  return e;
}

// B prompts prefilled, then `steps` decode steps timed one by one; with `bandwidth`, each
// step after a timed read of `weight_bytes` (the step's roofline, measured beside it).
CaseResult run_ours(GPT& model, const Options& o, DType dtype, int64_t batch, std::mt19937& rng,
                    Bandwidth* bandwidth = nullptr, double weight_bytes = 0) {
  Engine engine(model, engine_options(o, dtype, batch, o.prompt + o.steps + 2));
  std::vector<int64_t> produced(static_cast<size_t>(batch), 0);
  int64_t started = 0;
  for (int64_t b = 0; b < batch; ++b) {
    GenerationRequest request;
    request.prompt = random_ids(o.prompt, model.config().vocab_size, rng);
    request.max_tokens = o.steps + 2;
    request.sampling.temperature = 0.0f;
    request.on_token = [&produced, &started, b](const TokenOutput&) {
      if (produced[static_cast<size_t>(b)]++ == 0) ++started;
      return true;
    };
    engine.add_request(std::move(request));
  }
  CaseResult result;
  const auto start = Clock::now();
  while (started < batch) engine.step();
  result.prefill_ms = seconds_since(start) * 1e3;
  std::vector<double> step_ms;
  std::vector<double> shares, gbs;
  double utilization = 0;  // averaged over the decode steps: sequences of every length
  profile::start();
  for (int64_t s = 0; s < o.steps; ++s) {
    double stream_s = 0;
    if (bandwidth != nullptr) {
      stream_s = bandwidth->stream_seconds(weight_bytes);
    }
    const auto step_start = Clock::now();
    engine.step();
    const double step_s = seconds_since(step_start);
    step_ms.push_back(step_s * 1e3);
    utilization += engine.stats().kv_utilization;
    if (bandwidth != nullptr) {
      shares.push_back(stream_s / step_s);
      gbs.push_back(weight_bytes / stream_s / 1e9);
    }
  }
  // The reads ran inside the profiled span but in no category, and outside the timed steps.
  const profile::Totals totals = profile::totals();
  profile::stop();
  if (bandwidth != nullptr) {
    result.roofline_share = bench::median(shares);
    result.bandwidth_gbs = bench::median(gbs);
  }
  const auto steps = static_cast<double>(o.steps);
  for (int c = 0; c < profile::kCategories; ++c) {
    result.breakdown_ms[static_cast<size_t>(c)] =
        totals.seconds[static_cast<size_t>(c)] * 1e3 / steps;
    result.breakdown_calls[static_cast<size_t>(c)] =
        static_cast<double>(totals.calls[static_cast<size_t>(c)]) / steps;
  }
  double total_ms = 0;
  for (double ms : step_ms) total_ms += ms;
  result.step_mean_ms = total_ms / steps;
  result.decode_ms = bench::median(step_ms);
  result.kv_waste = 1.0 - utilization / static_cast<double>(o.steps);
  engine.shutdown(false);
  return result;
}

struct Latency {
  double ttft_p50 = 0, ttft_p99 = 0, itl_p50 = 0, itl_p99 = 0, seconds = 0;
  int64_t tokens = 0;
};

// `clients` requests arriving together at the engine's own thread.
Latency run_latency(GPT& model, const Options& o, DType dtype, std::mt19937& rng) {
  Engine engine(model, engine_options(o, dtype, o.clients, o.prompt + o.steps));
  std::mutex mutex;
  std::condition_variable done_cv;
  int64_t done = 0;
  std::vector<double> ttft, itl;
  std::vector<Clock::time_point> last(static_cast<size_t>(o.clients));
  engine.start();
  const auto start = Clock::now();
  for (int64_t c = 0; c < o.clients; ++c) {
    GenerationRequest request;
    request.prompt = random_ids(o.prompt, model.config().vocab_size, rng);
    request.max_tokens = o.steps;
    request.sampling.temperature = 0.0f;
    const auto added = Clock::now();
    request.on_token = [&, c, added](const TokenOutput& t) {
      const auto now = Clock::now();
      std::lock_guard<std::mutex> lock(mutex);
      auto& previous = last[static_cast<size_t>(c)];
      if (t.index == 0) {
        ttft.push_back(std::chrono::duration<double>(now - added).count());
      } else {
        itl.push_back(std::chrono::duration<double>(now - previous).count());
      }
      previous = now;
      return true;
    };
    request.on_finish = [&](FinishReason, const std::string&) {
      std::lock_guard<std::mutex> lock(mutex);
      ++done;
      done_cv.notify_all();
    };
    engine.add_request(std::move(request));
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    done_cv.wait(lock, [&] { return done == o.clients; });
  }
  Latency l;
  l.seconds = seconds_since(start);
  l.tokens = o.clients * o.steps;
  engine.shutdown(true);
  l.ttft_p50 = percentile(ttft, 0.5);
  l.ttft_p99 = percentile(ttft, 0.99);
  l.itl_p50 = percentile(itl, 0.5);
  l.itl_p99 = percentile(itl, 0.99);
  return l;
}

struct Series {
  std::vector<double> ours_prefill, ours_decode, peer_prefill, peer_decode, ratio_decode,
      ratio_prefill, waste, fp8_decode, fp8_ratio, fp8_peer_ratio;
  std::vector<double> bandwidth, roofline_share, fp8_roofline_share;  // batch 1 only
  // Summed over the rounds: mean ms per decode step by category, and the whole step; with
  // BF16 (or F32) weights and with FP8 weights.
  struct Breakdown {
    std::array<double, profile::kCategories> ms{}, calls{};
    double step_mean_ms = 0;
    void add(const CaseResult& r) {
      for (size_t c = 0; c < ms.size(); ++c) {
        ms[c] += r.breakdown_ms[c];
        calls[c] += r.breakdown_calls[c];
      }
      step_mean_ms += r.step_mean_ms;
    }
  };
  Breakdown breakdown, fp8_breakdown;
};

// The PyTorch peer, asked for one case at a time; 0 when it is absent or stopped.
class Peer {
 public:
  Peer(const Options& o, const std::filesystem::path& config_path) : o_(o) {
    if (o.no_torch) return;
    const auto script = bench::find_peer_script("torch_infer.py");
    if (script.empty()) {
      std::printf("peer: bench/peers/torch_infer.py not found, skipped\n");
      return;
    }
    running_ = process_.start({"/usr/bin/python3", script.string(), "--config",
                               config_path.string(), "--precision", o.peer_precision, "--threads",
                               std::to_string(omp_get_max_threads())});
    if (!running_) {
      std::printf("peer: PyTorch did not start, skipped\n");
      return;
    }
    const nlohmann::json& ready = process_.ready();
    std::printf("peer: PyTorch 1.13, %s weights, linear layers by %s (%s), %d threads\n",
                ready.value("precision", std::string("?")).c_str(),
                ready.value("linear", std::string("?")).c_str(),
                ready.value("linear", std::string()) == "mkldnn" ? "oneDNN, torch.utils.mkldnn"
                                                                 : "aten, F.linear",
                ready.value("threads", 0));
  }
  // Milliseconds: prefill of `batch` prompts, or the median decode step of `batch` sequences.
  double ask(const char* op, int64_t batch) {
    if (!running_) return 0;
    nlohmann::json c = {{"op", op}, {"batch", batch}, {"prompt", o_.prompt}, {"steps", o_.steps}};
    auto answer = process_.ask(c.dump());
    if (!answer) {
      running_ = false;
      std::printf("peer: PyTorch stopped answering, skipped from here\n");
      return 0;
    }
    return answer->value("ms", 0.0);
  }

 private:
  const Options& o_;
  bench::PeerProcess process_;
  bool running_ = false;
};

// Every round runs each batch size: ours (BF16 or F32 weights), ours with FP8 weights, the
// peer (first or last, alternating), and for batch 1 the bandwidth just before.
std::vector<Series> run_rounds(GPT& model, const Options& o, DType dtype, Peer& peer,
                               Bandwidth& bandwidth, std::mt19937& rng, double weight_bytes,
                               double fp8_bytes) {
  // Warm-up, untimed: weights converted and packed, primitives created, pages touched.
  run_ours(model, o, dtype, 1, rng);
  peer.ask("decode", 1);
  std::vector<Series> series(o.batches.size());
  for (int round = 0; round < o.rounds; ++round) {
    for (size_t i = 0; i < o.batches.size(); ++i) {
      const int64_t batch = o.batches[i];
      Series& s = series[i];
      double peer_decode = 0, peer_prefill = 0;
      auto run_peer = [&] {
        peer_decode = peer.ask("decode", batch);
        peer_prefill = peer.ask("prefill", batch);
      };
      if (round % 2 == 1) run_peer();  // alternate who goes first, round by round
      const bool roofline = batch == 1;
      const CaseResult ours =
          run_ours(model, o, dtype, batch, rng, roofline ? &bandwidth : nullptr, weight_bytes);
      s.ours_prefill.push_back(static_cast<double>(batch * o.prompt) / ours.prefill_ms * 1e3);
      s.ours_decode.push_back(static_cast<double>(batch) / ours.decode_ms * 1e3);
      s.waste.push_back(ours.kv_waste);
      s.breakdown.add(ours);
      if (roofline) {
        s.bandwidth.push_back(ours.bandwidth_gbs);
        s.roofline_share.push_back(ours.roofline_share);
      }
      if (o.fp8_weights) {
        model.set_inference_fp8_weights(true, parse_fp8_weight_scaling(o.fp8_weight_scaling));
        const CaseResult fp8 =
            run_ours(model, o, dtype, batch, rng, roofline ? &bandwidth : nullptr, fp8_bytes);
        model.set_inference_fp8_weights(false);
        s.fp8_decode.push_back(static_cast<double>(batch) / fp8.decode_ms * 1e3);
        s.fp8_ratio.push_back(ours.decode_ms / fp8.decode_ms);
        s.fp8_breakdown.add(fp8);
        if (roofline) s.fp8_roofline_share.push_back(fp8.roofline_share);
      }
      if (round % 2 == 0) run_peer();
      if (peer_decode > 0 && peer_prefill > 0) {
        s.peer_prefill.push_back(static_cast<double>(batch * o.prompt) / peer_prefill * 1e3);
        s.peer_decode.push_back(static_cast<double>(batch) / peer_decode * 1e3);
        s.ratio_decode.push_back(s.ours_decode.back() / s.peer_decode.back());
        s.ratio_prefill.push_back(s.ours_prefill.back() / s.peer_prefill.back());
        if (o.fp8_weights) s.fp8_peer_ratio.push_back(s.fp8_decode.back() / s.peer_decode.back());
      }
      std::fprintf(stderr, "round %d/%d batch %lld: ours decode %.1f tok/s%s\n", round + 1,
                   o.rounds, static_cast<long long>(batch), s.ours_decode.back(),
                   s.peer_decode.size() == static_cast<size_t>(round + 1)
                       ? (", peer " + std::to_string(s.peer_decode.back())).c_str()
                       : "");
    }
  }
  return series;
}

void print_cases(const Options& o, const std::vector<Series>& series) {
  std::printf(
      "\n| batch | prefill tok/s ours | peer | ratio | decode tok/s ours | peer | ratio "
      "(median, min..max) | KV waste |\n|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < o.batches.size(); ++i) {
    const Series& s = series[i];
    const bool peer_ran = !s.ratio_decode.empty();
    std::printf("| %lld | %.0f | %s | %s | %.1f | %s | %s | %.1f%% |\n",
                static_cast<long long>(o.batches[i]), bench::median(s.ours_prefill),
                peer_ran
                    ? std::to_string(static_cast<int64_t>(bench::median(s.peer_prefill))).c_str()
                    : "-",
                bench::median_range(s.ratio_prefill).c_str(), bench::median(s.ours_decode),
                peer_ran ? std::to_string(bench::median(s.peer_decode)).substr(0, 6).c_str() : "-",
                bench::median_range(s.ratio_decode).c_str(), 100.0 * bench::median(s.waste));
    if (o.json) {
      nlohmann::json line = {{"batch", o.batches[i]},
                             {"prefill_tokens_per_s", bench::median(s.ours_prefill)},
                             {"decode_tokens_per_s", bench::median(s.ours_decode)},
                             {"kv_waste", bench::median(s.waste)}};
      if (!s.roofline_share.empty()) {
        line["bandwidth_gbs"] = bench::median(s.bandwidth);
        line["roofline_share"] = bench::median(s.roofline_share);
      }
      if (peer_ran) {
        line["peer_prefill_tokens_per_s"] = bench::median(s.peer_prefill);
        line["peer_decode_tokens_per_s"] = bench::median(s.peer_decode);
        line["decode_ratio"] = bench::median(s.ratio_decode);
        line["prefill_ratio"] = bench::median(s.ratio_prefill);
      }
      if (!s.fp8_ratio.empty()) {
        line["fp8_weight_scaling"] = o.fp8_weight_scaling;
        line["fp8_decode_tokens_per_s"] = bench::median(s.fp8_decode);
        line["fp8_ratio"] = bench::median(s.fp8_ratio);
        if (!s.fp8_peer_ratio.empty()) line["fp8_decode_ratio"] = bench::median(s.fp8_peer_ratio);
      }
      std::printf("%s\n", line.dump().c_str());
    }
  }
}

void print_fp8(const Options& o, const std::vector<Series>& series, double fp8_bytes) {
  std::printf(
      "\nweight-only FP8 (E4M3, %s scales; %.1f MB read per token):\n"
      "| batch | decode tok/s FP8 | vs BF16 weights (median, min..max) | vs the peer |\n"
      "|---|---|---|---|\n",
      o.fp8_weight_scaling == "channel" ? "per-channel" : "128 x 128 block", fp8_bytes / 1e6);
  for (size_t i = 0; i < o.batches.size(); ++i) {
    const Series& s = series[i];
    std::printf("| %lld | %.1f | %s | %s |\n", static_cast<long long>(o.batches[i]),
                bench::median(s.fp8_decode), bench::median_range(s.fp8_ratio).c_str(),
                s.fp8_peer_ratio.empty() ? "-" : bench::median_range(s.fp8_peer_ratio).c_str());
  }
}

// Batch-1 decode against weight bytes / bandwidth, both measured in the same round.
void print_roofline(const Options& o, const std::vector<Series>& series, double weight_bytes,
                    double fp8_bytes) {
  for (size_t i = 0; i < o.batches.size(); ++i) {
    const Series& s = series[i];
    if (o.batches[i] != 1) continue;
    const double gbs = bench::median(s.bandwidth);
    std::printf(
        "batch-1 decode: %.1f tokens/s; bandwidth %.1f GB/s (read before each step; median) -> "
        "roofline %.1f tokens/s; share of the roofline (median over steps of the weight bytes' "
        "read time / the step) per round %s\n",
        bench::median(s.ours_decode), gbs, gbs * 1e9 / weight_bytes,
        bench::median_range(s.roofline_share, "%.2f").c_str());
    if (!s.fp8_roofline_share.empty()) {
      std::printf(
          "batch-1 decode, FP8 weights: %.1f tokens/s; roofline %.1f tokens/s; share (median "
          "over steps) per round %s\n",
          bench::median(s.fp8_decode), gbs * 1e9 / fp8_bytes,
          bench::median_range(s.fp8_roofline_share, "%.2f").c_str());
    }
  }
}

// Where the decode step goes, per batch size (means over the rounds' steps): the categories
// the engine's thread spent its time in, the rest (sampling, scheduling, the block tables,
// glue between operators) as "other".
void print_breakdown(const Options& o, const std::vector<Series>& series) {
  const double rounds = static_cast<double>(o.rounds);
  auto print = [rounds](int64_t batch, const char* weights, const Series::Breakdown& b) {
    const double step = b.step_mean_ms / rounds;
    std::printf("decode step, batch %lld%s: %.2f ms:", static_cast<long long>(batch), weights,
                step);
    double other = step;
    for (int c = 0; c < profile::kCategories; ++c) {
      const double ms = b.ms[static_cast<size_t>(c)] / rounds;
      other -= ms;
      if (ms < 0.005) continue;
      std::printf(" %s %.2f (%.0f%%, %.0f calls),",
                  profile::category_name(static_cast<profile::Category>(c)), ms, 100.0 * ms / step,
                  b.calls[static_cast<size_t>(c)] / rounds);
    }
    std::printf(" other %.2f (%.0f%%)\n", other, 100.0 * other / step);
  };
  for (size_t i = 0; i < o.batches.size(); ++i) {
    print(o.batches[i], "", series[i].breakdown);
    if (o.fp8_weights) print(o.batches[i], ", FP8 weights", series[i].fp8_breakdown);
  }
}

void print_latency(GPT& model, const Options& o, DType dtype, std::mt19937& rng) {
  const Latency l = run_latency(model, o, dtype, rng);
  std::printf(
      "%lld concurrent requests (prompt %lld, %lld tokens each): %.1f tokens/s; "
      "time to first token p50 %.0f ms p99 %.0f ms; inter-token latency p50 %.0f ms "
      "p99 %.0f ms\n",
      static_cast<long long>(o.clients), static_cast<long long>(o.prompt),
      static_cast<long long>(o.steps), static_cast<double>(l.tokens) / l.seconds, l.ttft_p50 * 1e3,
      l.ttft_p99 * 1e3, l.itl_p50 * 1e3, l.itl_p99 * 1e3);
}

void run_bench(const Options& o) {
  const std::filesystem::path config_path = resolve_config(o.config);
  GPTConfig config = GPTConfig::load(config_path.string());
  for (int64_t b : o.batches) {
    OCTET_CHECK(b >= 1 && b <= 1024, "bench infer: --batches expected in [1, 1024], got ", b);
  }
  OCTET_CHECK(o.prompt + o.steps + 2 <= config.max_seq_len, "bench infer: --prompt ", o.prompt,
              " + --steps ", o.steps, " + 2 exceed ", config.name, "'s max_seq_len ",
              config.max_seq_len);
  const DType dtype = o.precision == "bf16" ? DType::BF16 : DType::F32;
  GPT model(config, o.seed);
  std::mt19937 rng(static_cast<uint32_t>(o.seed));
  Bandwidth bandwidth;
  // Bytes read per decoded token at batch 1: every GEMM weight once (the tied output layer is
  // wte), in the compute dtype; position rows, norms and biases are noise.
  const double weight_bytes = static_cast<double>(model.inference_weight_bytes(dtype));
  double fp8_bytes = 0;
  if (o.fp8_weights) {
    fp8_bytes = static_cast<double>(
        model.set_inference_fp8_weights(true, parse_fp8_weight_scaling(o.fp8_weight_scaling)));
    model.set_inference_fp8_weights(false);
  }
  std::printf(
      "bench infer: %s (%.1fM parameters), %s, prompt %lld, %lld decode steps, %d "
      "rounds, %d threads; weights read per token %.1f MB\n",
      config.name.c_str(), static_cast<double>(config.num_parameters()) / 1e6, o.precision.c_str(),
      static_cast<long long>(o.prompt), static_cast<long long>(o.steps), o.rounds,
      omp_get_max_threads(), weight_bytes / 1e6);
  Peer peer(o, config_path);
  const std::vector<Series> series =
      run_rounds(model, o, dtype, peer, bandwidth, rng, weight_bytes, fp8_bytes);
  print_cases(o, series);
  if (o.fp8_weights) print_fp8(o, series, fp8_bytes);
  print_roofline(o, series, weight_bytes, fp8_bytes);
  print_breakdown(o, series);
  if (o.clients > 0) print_latency(model, o, dtype, rng);
}

}  // namespace

void register_bench_infer(CLI::App& bench) {
  CLI::App* cmd = bench.add_subcommand(
      "infer", "Inference engine: prefill and decode tokens/s, latency, roofline; beside PyTorch");
  auto o = std::make_shared<Options>();
  cmd->add_option("--config", o->config, "Model config JSON, or a name in configs/")
      ->capture_default_str()
      ->check(model_config_validator());
  cmd->add_option("--precision", o->precision, "fp32 | bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--peer-precision", o->peer_precision,
                  "The PyTorch peer's weights: auto (its fastest on this processor, with its "
                  "fastest linear layers) | fp32 | bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
  cmd->add_option("--batches", o->batches, "Decode batch sizes")->delimiter(',');
  cmd->add_option("--prompt", o->prompt, "Prompt tokens per sequence")
      ->capture_default_str()
      ->check(number_in(1, 1 << 20));
  cmd->add_option("--steps", o->steps, "Timed decode steps per case")
      ->capture_default_str()
      ->check(number_in(1, 1 << 20));
  cmd->add_option("--rounds", o->rounds, "Rounds alternating ours and the peer")
      ->capture_default_str()
      ->check(number_in(1, 100));
  cmd->add_option("--clients", o->clients, "Concurrent requests of the latency case (0: skip)")
      ->capture_default_str()
      ->check(number_in(0, 4096));
  cmd->add_option("--block-size", o->block_size, "KV-cache block size")
      ->capture_default_str()
      ->check(number_in(1, 4096));
  cmd->add_option("--seed", o->seed, "Seed of the weights and prompts")->capture_default_str();
  cmd->add_flag("--json", o->json, "Also one JSON object per batch size");
  cmd->add_flag("--no-torch", o->no_torch, "Skip the PyTorch peer");
  cmd->add_flag("--fp8-kv", o->fp8_kv, "KV cache in E4M3 with per-(token, head) scales");
  add_fp8_weight_flags(*cmd, o->fp8_weights, o->fp8_weight_scaling,
                       "Also run each case with weight-only FP8 weights (ratio to BF16 weights)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace octet::cli
