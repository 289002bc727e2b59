// `octet bench train`: timed training steps of a GPT on mock tokens — tokens/s, MFU against
// the measured BF16 GEMM peak, peak memory, saved activations — beside the same GPT in eager
// PyTorch 1.13 (bench/peers/torch_gpt.py: fp32, and bf16 autocast) run in the same
// invocation, back to back with ours, with the ratios the goals speak of.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/cpu_features.h"
#include "octet/model.h"
#include "octet/recipe.h"
#include "octet/train.h"

namespace octet::cli {
namespace {

struct Options {
  std::string config = "gpt-mini";
  std::string precision = "bf16,fp8";
  int steps = 5;
  int warmup = 1;
  int torch_steps = 2;  // a torch bf16 gpt-mini step takes ~10 s on two cores
  int64_t micro_batch_size = 8;
  // Debian's torch runs FP32 GEMMs on a generic BLAS (~2 GFLOP/s): a full gpt-mini micro-batch
  // would take minutes per step, so torch fp32 times fewer sequences (tokens/s is per token).
  int64_t torch_fp32_micro_batch_size = 1;
  int64_t seq_length = 256;
  double peak_gflops = 0;  // 0 = measure
  uint64_t seed = 1234;
  bool json = false;
  bool no_torch = false;
};

struct Result {
  std::string impl;  // octet | torch_fp32 | torch_bf16
  std::string precision;
  int64_t micro_batch_size = 0;
  int steps = 0;
  int warmup = 0;
  double step_ms = 0;  // median over the timed steps
  double cpu_ms = 0;   // median process CPU time per step: steadier than wall time when
                       // other work shares the cores (2 busy threads = 2x step_ms)
  double tokens_per_s = 0;
  double mfu = 0;
  int64_t peak_bytes = 0;       // octet: Tensor storage; torch: resident-memory growth
  int64_t step_peak_bytes = 0;  // octet: peak during train_step above what it started with
  int64_t saved_activation_bytes = 0;
  double loss = NAN;
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    if (end > begin) items.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return items;
}

double process_cpu_seconds() {
  timespec time{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &time);
  return static_cast<double>(time.tv_sec) + 1e-9 * static_cast<double>(time.tv_nsec);
}

// Mock tokens [B,T] from a xorshift stream: ids and next-token targets of one window.
void mock_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed, Tensor& ids, Tensor& targets) {
  ids = Tensor::empty({B, T}, DType::I32);
  targets = Tensor::empty({B, T}, DType::I32);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t <= T; ++t) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      const int32_t token = static_cast<int32_t>(state % static_cast<uint64_t>(vocab));
      if (t > 0) targets.data<int32_t>()[b * T + t - 1] = token;
      if (t < T) ids.data<int32_t>()[b * T + t] = token;
    }
  }
}

// Bytes the layer stack's contexts keep from forward to backward: one forward of [B,T,C]
// hidden states (created inside the window, as the embedding output is) with every context
// held, after a first forward that built the weight caches (BF16 / FP8 copies live until the
// next optimizer step and are not activations).
int64_t saved_activation_bytes(GPT& model, int64_t B, int64_t T, DType dtype, bool fp8,
                               const recipe::Recipe& recipe) {
  const int64_t C = model.config().hidden;
  auto forward = [&](std::vector<TransformerLayer::Context>& contexts) {
    Tensor x = Tensor::zeros({B, T, C}, DType::F32);
    float* values = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) values[i] = 0.02f * static_cast<float>(i % 97 - 48);
    Tensor h = dtype == DType::F32 ? x : x.to(dtype);
    x = Tensor();
    fp8_autocast scope(fp8, recipe);
    contexts.assign(model.layers().size(), TransformerLayer::Context{});
    for (size_t i = 0; i < model.layers().size(); ++i)
      h = model.layers()[i].forward(h, contexts[i]);
    return h;  // the final norm's input: saved too
  };
  {
    std::vector<TransformerLayer::Context> warm;
    forward(warm);
  }
  const int64_t before = memory_stats().current_bytes;
  std::vector<TransformerLayer::Context> contexts;
  Tensor out = forward(contexts);
  return memory_stats().current_bytes - before;
}

// One precision's model, optimizer and mock batches, timed one training step at a time.
class OctetRun {
 public:
  OctetRun(const GPTConfig& config, const std::string& precision, const Options& o)
      : constructed_from_bytes_(memory_stats().current_bytes),
        fp8_(precision == "fp8"),
        dtype_(precision == "fp32" ? DType::F32 : DType::BF16),
        model_(config, o.seed),
        optimizer_(model_.parameters(), AdamWOptions{}),
        batches_(4) {
    recipe::DelayedScaling delayed;  // trainer.cpp's make_recipe: delayed, HYBRID, history 16
    delayed.fp8_format = recipe::Format::HYBRID;
    delayed.amax_history_len = 16;
    recipe_ = delayed;
    for (size_t i = 0; i < batches_.size(); ++i) {
      mock_batch(o.micro_batch_size, o.seq_length, config.vocab_size, o.seed + i, batches_[i].first,
                 batches_[i].second);
    }
    result_.impl = "octet";
    result_.precision = precision;
    result_.micro_batch_size = o.micro_batch_size;
    result_.steps = o.steps;
    result_.warmup = o.warmup;
    held_bytes_ = memory_stats().current_bytes - constructed_from_bytes_;
  }

  // zero_grad + train_step + AdamW + on_parameters_updated; timed unless `warmup`.
  void step(bool warmup) {
    const auto& [ids, targets] = batches_[static_cast<size_t>(step_++) % batches_.size()];
    const int64_t start_bytes = memory_stats().current_bytes;
    reset_peak_memory();
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = process_cpu_seconds();
    model_.zero_grad();
    float loss = 0;
    {
      fp8_autocast scope(fp8_, recipe_);
      loss = model_.train_step(ids, targets, dtype_, 1.0f);
    }
    const int64_t train_step_peak = memory_stats().peak_bytes - start_bytes;
    optimizer_.step(6e-4f);
    model_.on_parameters_updated();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu_elapsed = process_cpu_seconds() - cpu_start;
    // The other precisions' models are alive too: count only this run's bytes.
    const int64_t others_bytes = start_bytes - held_bytes_;
    const int64_t peak = memory_stats().peak_bytes - others_bytes;
    held_bytes_ = memory_stats().current_bytes - others_bytes;
    if (warmup) return;
    seconds_.push_back(elapsed);
    cpu_seconds_.push_back(cpu_elapsed);
    result_.peak_bytes = std::max(result_.peak_bytes, peak);
    result_.step_peak_bytes = std::max(result_.step_peak_bytes, train_step_peak);
    result_.loss = loss;
  }

  Result finish(int64_t B, int64_t T) {
    result_.step_ms = bench::median(seconds_) * 1e3;
    result_.cpu_ms = bench::median(cpu_seconds_) * 1e3;
    result_.tokens_per_s = static_cast<double>(B * T) / (result_.step_ms / 1e3);
    result_.saved_activation_bytes = saved_activation_bytes(model_, B, T, dtype_, fp8_, recipe_);
    return result_;
  }

 private:
  int64_t constructed_from_bytes_;
  int64_t held_bytes_ = 0;  // what this run keeps between steps (model, optimizer, caches)
  bool fp8_;
  DType dtype_;
  recipe::Recipe recipe_;
  GPT model_;
  AdamW optimizer_;
  std::vector<std::pair<Tensor, Tensor>> batches_;
  Result result_;
  std::vector<double> seconds_, cpu_seconds_;
  int step_ = 0;
};

// Every octet precision, their steps interleaved (bf16 step, fp8 step, bf16 step ...), so
// that load from other work on the machine falls on all of them alike and their ratios hold.
std::vector<Result> measure_octet(const GPTConfig& config,
                                  const std::vector<std::string>& precisions, const Options& o) {
  std::vector<std::unique_ptr<OctetRun>> runs;
  for (const std::string& precision : precisions) {
    runs.push_back(std::make_unique<OctetRun>(config, precision, o));
  }
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    for (auto& run : runs) run->step(i < o.warmup);
  }
  std::vector<Result> results;
  for (auto& run : runs) results.push_back(run->finish(o.micro_batch_size, o.seq_length));
  return results;
}

// One peer process per precision, so that its resident-memory high-water mark is that
// precision's. Returns nothing (with a note) when the peer cannot run.
std::optional<Result> measure_torch(const std::filesystem::path& config_path,
                                    const std::string& precision, const Options& o) {
  const int64_t micro_batch = precision == "fp32"
                                  ? std::min(o.torch_fp32_micro_batch_size, o.micro_batch_size)
                                  : o.micro_batch_size;
  const std::filesystem::path script = bench::find_peer_script("torch_gpt.py");
  if (script.empty()) {
    std::fprintf(stderr, "bench train: bench/peers/torch_gpt.py not found; no torch figures\n");
    return std::nullopt;
  }
  const std::string command =
      "/usr/bin/python3 '" + script.string() + "' --config '" + config_path.string() +
      "' --precision " + precision + " --micro-batch-size " + std::to_string(micro_batch) +
      " --seq-length " + std::to_string(o.seq_length) + " --steps " +
      std::to_string(o.torch_steps) + " --warmup " + std::to_string(o.warmup) + " --threads " +
      std::to_string(num_threads()) + " --seed " + std::to_string(o.seed);
  std::fflush(nullptr);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::optional<Result> result;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    const auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !parsed.contains("tokens_per_s")) continue;
    Result r;
    r.impl = parsed.at("impl").get<std::string>();
    r.precision = precision;
    r.micro_batch_size = micro_batch;
    r.steps = parsed.at("steps").get<int>();
    r.warmup = parsed.at("warmup").get<int>();
    r.step_ms = parsed.at("step_ms").get<double>();
    r.cpu_ms = parsed.at("cpu_ms").get<double>();
    r.tokens_per_s = parsed.at("tokens_per_s").get<double>();
    r.peak_bytes = parsed.at("peak_bytes").get<int64_t>();
    r.saved_activation_bytes = parsed.at("saved_activation_bytes").get<int64_t>();
    r.loss = parsed.at("loss").get<double>();
    result = r;
  }
  const int status = pclose(pipe);
  if (status != 0 || !result) {
    std::fprintf(stderr, "bench train: '%s' failed (status %d); no torch %s figures\n",
                 command.c_str(), status, precision.c_str());
    return std::nullopt;
  }
  return result;
}

const Result* find(const std::vector<Result>& results, const std::string& impl,
                   const std::string& precision) {
  for (const Result& r : results) {
    if (r.impl == impl && r.precision == precision) return &r;
  }
  return nullptr;
}

double tokens_per_cpu_second(const Result& r) {
  return r.cpu_ms > 0 ? r.tokens_per_s * r.step_ms / r.cpu_ms : NAN;  // tokens/step / CPU s
}

// Ratios the goals speak of, NaN where a side is missing.
struct Ratios {
  double fp32_vs_torch = NAN, bf16_vs_torch = NAN, fp8_vs_torch_bf16 = NAN;
  double fp8_vs_bf16_tokens = NAN, fp8_vs_bf16_saved = NAN;
  // The same, per CPU-second (what a loaded machine disturbs least).
  double bf16_vs_torch_cpu = NAN, fp8_vs_bf16_cpu = NAN;
};

Ratios ratios(const std::vector<Result>& results) {
  auto tokens = [&](const char* impl, const char* precision) {
    const Result* r = find(results, impl, precision);
    return r ? r->tokens_per_s : NAN;
  };
  auto saved = [&](const char* impl, const char* precision) {
    const Result* r = find(results, impl, precision);
    return r ? static_cast<double>(r->saved_activation_bytes) : NAN;
  };
  Ratios q;
  q.fp32_vs_torch = tokens("octet", "fp32") / tokens("torch_fp32", "fp32");
  q.bf16_vs_torch = tokens("octet", "bf16") / tokens("torch_bf16", "bf16");
  q.fp8_vs_torch_bf16 = tokens("octet", "fp8") / tokens("torch_bf16", "bf16");
  q.fp8_vs_bf16_tokens = tokens("octet", "fp8") / tokens("octet", "bf16");
  q.fp8_vs_bf16_saved = saved("octet", "fp8") / saved("octet", "bf16");
  auto per_cpu = [&](const char* impl, const char* precision) {
    const Result* r = find(results, impl, precision);
    return r ? tokens_per_cpu_second(*r) : NAN;
  };
  q.bf16_vs_torch_cpu = per_cpu("octet", "bf16") / per_cpu("torch_bf16", "bf16");
  q.fp8_vs_bf16_cpu = per_cpu("octet", "fp8") / per_cpu("octet", "bf16");
  return q;
}

nlohmann::json json_number(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

void print_json(const std::vector<Result>& results, const GPTConfig& config, const Options& o,
                double peak_gflops) {
  const Ratios q = ratios(results);
  for (const Result& r : results) {
    nlohmann::json line = {{"impl", r.impl},
                           {"config", config.name},
                           {"precision", r.precision},
                           {"micro_batch_size", r.micro_batch_size},
                           {"seq_length", o.seq_length},
                           {"steps", r.steps},
                           {"warmup", r.warmup},
                           {"step_ms", r.step_ms},
                           {"cpu_ms", r.cpu_ms},
                           {"tokens_per_s", r.tokens_per_s},
                           {"mfu", r.mfu},
                           {"peak_gflops", peak_gflops},
                           {"peak_bytes", r.peak_bytes},
                           {"saved_activation_bytes", r.saved_activation_bytes},
                           {"loss", json_number(r.loss)},
                           {"threads", num_threads()}};
    if (r.impl == "octet") {
      line["train_step_peak_bytes"] = r.step_peak_bytes;
      if (r.precision == "fp32") line["ratio_vs_torch"] = json_number(q.fp32_vs_torch);
      if (r.precision == "bf16") line["ratio_vs_torch"] = json_number(q.bf16_vs_torch);
      if (r.precision == "fp8") {
        line["ratio_vs_torch_bf16"] = json_number(q.fp8_vs_torch_bf16);
        line["ratio_vs_bf16_tokens"] = json_number(q.fp8_vs_bf16_tokens);
        line["ratio_vs_bf16_saved_activations"] = json_number(q.fp8_vs_bf16_saved);
      }
    }
    std::printf("%s\n", line.dump().c_str());
  }
}

const char* verdict(double value, double goal, bool at_least) {
  if (!std::isfinite(value)) return "n/a";
  return (at_least ? value >= goal : value <= goal) ? "met" : "NOT met";
}

void print_table(const std::vector<Result>& results, const GPTConfig& config, const Options& o,
                 double peak_gflops) {
  const double mb = 1024.0 * 1024.0;
  std::printf(
      "octet bench train: %s (%.1fM parameters), micro-batch %lld x seq %lld = %lld "
      "tokens/step, %d threads\n",
      config.name.c_str(), config.num_parameters() / 1e6, (long long)o.micro_batch_size,
      (long long)o.seq_length, (long long)(o.micro_batch_size * o.seq_length), num_threads());
  std::printf("measured BF16 GEMM peak %.1f GFLOP/s; %.3f GFLOP per token (MFU counts these)\n",
              peak_gflops, config.train_flops_per_token(o.seq_length) / 1e9);
  std::printf("%-11s %-5s %3s %5s %9s %9s %6s %9s %9s %9s %9s %8s\n", "impl", "prec", "B", "steps",
              "step_ms", "tokens/s", "MFU%", "tok/cpu_s", "peak_MB", "step_MB", "saved_MB", "loss");
  for (const Result& r : results) {
    char step_mb[16] = "-";
    if (r.impl == "octet") std::snprintf(step_mb, sizeof step_mb, "%.1f", r.step_peak_bytes / mb);
    std::printf("%-11s %-5s %3lld %5d %9.1f %9.1f %6.2f %9.1f %9.1f %9s %9.1f %8.4f\n",
                r.impl.c_str(), r.precision.c_str(), (long long)r.micro_batch_size, r.steps,
                r.step_ms, r.tokens_per_s, 100 * r.mfu, tokens_per_cpu_second(r), r.peak_bytes / mb,
                step_mb, r.saved_activation_bytes / mb, r.loss);
  }
  const Ratios q = ratios(results);
  double best_mfu = NAN;
  for (const Result& r : results) {
    if (r.impl == "octet" && r.precision != "fp32") {
      best_mfu = std::isfinite(best_mfu) ? std::max(best_mfu, r.mfu) : r.mfu;
    }
  }
  std::printf(
      "ratios: octet/torch fp32 %.2f, bf16 %.2f, fp8/torch_bf16 %.2f; "
      "octet fp8/bf16: tokens/s %.2f, saved activations %.2f\n"
      "  per CPU-second: octet/torch bf16 %.2f, octet fp8/bf16 %.2f\n",
      q.fp32_vs_torch, q.bf16_vs_torch, q.fp8_vs_torch_bf16, q.fp8_vs_bf16_tokens,
      q.fp8_vs_bf16_saved, q.bf16_vs_torch_cpu, q.fp8_vs_bf16_cpu);
  std::printf(
      "goals: bf16 >= 6x torch bf16: %s; fp8 >= 0.9x bf16 tokens/s: %s; fp8 saved "
      "activations <= 0.6x bf16: %s; MFU >= 40%% (best of bf16/fp8 %.1f%%): %s\n",
      verdict(q.bf16_vs_torch, 6.0, true), verdict(q.fp8_vs_bf16_tokens, 0.9, true),
      verdict(q.fp8_vs_bf16_saved, 0.6, false), 100 * best_mfu, verdict(best_mfu, 0.4, true));
  std::printf(
      "step: zero_grad + train_step (forward, fused chunked cross-entropy, backward) + AdamW\n"
      "  (clip 1.0) + on_parameters_updated. octet's precisions take their steps in turn (one\n"
      "  of each), so the load of other work falls on all alike; step_ms: median over the\n"
      "  timed steps after %d warm-up; tok/cpu_s: tokens per second of process CPU time (2\n"
      "  busy threads count twice), steadier than wall time on a shared machine. torch times\n"
      "  %d steps; torch fp32 runs B=%lld sequences (Debian's torch has a generic-BLAS FP32\n"
      "  GEMM, ~2 GFLOP/s): tokens/s is per token. fp8: DelayedScaling HYBRID, amax history\n"
      "  16. MFU: train_flops_per_token x tokens/s over the best of the BF16 GEMM peaks\n"
      "  measured before and after the octet runs.\n"
      "peak_MB: octet: Tensor storage (params, grads, AdamW state, activations, workspaces);\n"
      "  torch: the peer process's resident-memory growth from before the model was built.\n"
      "step_MB: octet's peak during train_step above the bytes held before it.\n"
      "saved_MB: octet: what the layer stack's contexts hold after one forward (the BF16 or\n"
      "  FP8 weight copies, made once per optimizer step, are not counted); torch: the\n"
      "  distinct storages autograd saved in one forward (parameters excluded).\n",
      o.warmup, o.torch_steps,
      (long long)std::min(o.torch_fp32_micro_batch_size, o.micro_batch_size));
}

void run_bench(const Options& o) {
  OCTET_CHECK(o.steps >= 1, "bench train: --steps expected >= 1, got ", o.steps);
  OCTET_CHECK(o.torch_steps >= 1, "bench train: --torch-steps expected >= 1, got ", o.torch_steps);
  OCTET_CHECK(o.warmup >= 0, "bench train: --warmup expected >= 0, got ", o.warmup);
  OCTET_CHECK(o.micro_batch_size >= 1, "bench train: --micro-batch-size expected >= 1, got ",
              o.micro_batch_size);
  const std::filesystem::path config_path = resolve_config(o.config);
  const GPTConfig config = GPTConfig::load(config_path.string());
  OCTET_CHECK(o.seq_length >= 1 && o.seq_length <= config.max_seq_len,
              "bench train: ", "--seq-length expected in [1, ", config.max_seq_len, "] for ",
              config.name, ", got ", o.seq_length);
  const std::vector<std::string> precisions = split_list(o.precision);
  OCTET_CHECK(!precisions.empty(), "bench train: --precision is empty");
  for (const std::string& p : precisions) {
    OCTET_CHECK(p == "fp32" || p == "bf16" || p == "fp8",
                "bench train: --precision expected fp32, bf16 or fp8 (comma-separated), got '", p,
                "'");
  }
  // The measured peak varies with the load others put on the machine: take the best of a
  // measurement before and after each octet run (an underestimate would inflate MFU).
  double peak_gflops = o.peak_gflops;
  auto measure_peak = [&] {
    if (o.peak_gflops <= 0) peak_gflops = std::max(peak_gflops, measure_bf16_peak_gflops());
  };
  measure_peak();
  if (!o.json)
    std::fprintf(stderr, "bench train: octet %s, steps interleaved ...\n", o.precision.c_str());
  std::vector<Result> results = measure_octet(config, precisions, o);
  measure_peak();
  // Then each torch precision once (bf16 for fp8).
  std::vector<std::string> torch_done;
  for (const std::string& precision : precisions) {
    const std::string peer = precision == "fp8" ? "bf16" : precision;
    if (o.no_torch || std::find(torch_done.begin(), torch_done.end(), peer) != torch_done.end()) {
      continue;
    }
    torch_done.push_back(peer);
    if (!o.json) std::fprintf(stderr, "bench train: torch %s ...\n", peer.c_str());
    if (auto r = measure_torch(config_path, peer, o)) results.push_back(*r);
  }
  const double flops_per_token = config.train_flops_per_token(o.seq_length);
  for (Result& r : results) r.mfu = flops_per_token * r.tokens_per_s / (peak_gflops * 1e9);

  if (o.json) {
    print_json(results, config, o, peak_gflops);
  } else {
    print_table(results, config, o, peak_gflops);
  }
}

}  // namespace

void register_bench_train(CLI::App& bench) {
  CLI::App* cmd = bench.add_subcommand(
      "train", "GPT training steps: tokens/s, MFU, memory; beside PyTorch fp32 and bf16");
  auto o = std::make_shared<Options>();
  cmd->add_option("--config", o->config, "Model config JSON, or a name in configs/")
      ->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32 | bf16 | fp8, comma-separated")
      ->capture_default_str();
  cmd->add_option("--steps", o->steps, "Timed steps (median)")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--warmup", o->warmup, "Untimed steps first")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--torch-steps", o->torch_steps, "Timed PyTorch steps")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--torch-fp32-micro-batch-size", o->torch_fp32_micro_batch_size,
                  "Sequences per torch fp32 step (its generic-BLAS GEMMs are slow)")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per step")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--peak-gflops", o->peak_gflops, "BF16 GEMM peak for MFU (0: measure)")
      ->check(at_least(0));
  cmd->add_option("--seed", o->seed, "Seed for the weights and mock tokens")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object per line");
  cmd->add_flag("--no-torch", o->no_torch, "Skip the PyTorch peer");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace octet::cli
