// `octet bench parallel`: the same GPT and global batch trained in several parallel layouts,
// each a real multi-process run (`mpirun -np N octet train ...`, one OpenMP thread per rank
// so N ranks share N cores as one process with N threads would). Reports tokens/s against
// the single process, the data-parallel gradient communication per step, and how much of it
// backward hid; then the pipeline schedule table of the simulator.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/error.h"
#include "octet/train.h"

namespace octet::cli {

namespace {

struct Options {
  std::string config = "gpt-mini";
  int ranks = 2;
  int64_t micro_batch_size = 8;
  int64_t seq_length = 256;
  int64_t iters = 6;
  int64_t warmup = 2;
  std::string precision = "bf16";
  int pipeline_ranks = 4;
  int micro_batches = 8;
  bool json = false;
};

struct Layout {
  std::string name;
  int processes = 1;
  std::string flags;
};

struct Measured {
  Layout layout;
  double tokens_per_s = NAN;
  double grad_comm_ms = 0, grad_exposed_ms = 0, param_gather_ms = 0;
  double loss = NAN;
  bool data_parallel = false;
  std::string error;
};

std::string self_exe() {
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  OCTET_CHECK(!error, "bench parallel: cannot find the octet executable (/proc/self/exe)");
  return exe.string();
}

std::string config_path(const std::string& config) {
  if (std::filesystem::exists(config)) return config;
  return (std::filesystem::path(OCTET_SOURCE_DIR) / "configs" / (config + ".json")).string();
}

Measured run_layout(const Options& o, const Layout& layout, double peak_gflops) {
  Measured m;
  m.layout = layout;
  m.data_parallel = layout.processes > 1 || layout.flags.find("distributed") != std::string::npos;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("octet-bench-parallel-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string metrics = (dir / "metrics.jsonl").string(), log = (dir / "log.txt").string();
  std::filesystem::remove(metrics);
  const int total_threads = o.ranks;
  std::string command = "OMP_WAIT_POLICY=passive OMP_NUM_THREADS=" +
                        std::to_string(total_threads / layout.processes) + " ";
  if (layout.processes > 1) {
    if (::geteuid() == 0) {
      command += "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
    }
    command += "mpirun -np " + std::to_string(layout.processes) + " --oversubscribe ";
  }
  command += self_exe() + " train --config " + config_path(o.config) + " --mock-data --precision " +
             o.precision + " --micro-batch-size " + std::to_string(o.micro_batch_size) +
             " --global-batch-size " + std::to_string(o.micro_batch_size * o.ranks) +
             " --seq-length " + std::to_string(o.seq_length) + " --train-iters " +
             std::to_string(o.iters) + " --eval-iters 0 --log-interval 0 --peak-gflops " +
             std::to_string(peak_gflops) + " --metrics " + metrics + " " + layout.flags + " > " +
             log + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    std::ifstream in(log);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    m.error =
        "failed: " + command + "\n" + text.substr(text.size() > 2000 ? text.size() - 2000 : 0);
    return m;
  }
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> tokens;
  int64_t steps = 0;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || record.value("step", 0) <= o.warmup) continue;
    tokens.push_back(record.value("tokens_per_s", 0.0));
    m.grad_comm_ms += 1e3 * record.value("grad_comm_s", 0.0);
    m.grad_exposed_ms += 1e3 * record.value("grad_comm_exposed_s", 0.0);
    m.param_gather_ms += 1e3 * record.value("param_gather_s", 0.0);
    m.loss = record.value("loss", NAN);
    ++steps;
  }
  if (steps == 0) {
    m.error = "no measured steps in " + metrics;
    return m;
  }
  m.tokens_per_s = bench::median(tokens);
  m.grad_comm_ms /= static_cast<double>(steps);
  m.grad_exposed_ms /= static_cast<double>(steps);
  m.param_gather_ms /= static_cast<double>(steps);
  std::filesystem::remove_all(dir);
  return m;
}

void run(const Options& o) {
  OCTET_CHECK(o.ranks >= 2, "--ranks expected >= 2, got ", o.ranks);
  OCTET_CHECK(o.iters > o.warmup, "--iters (", o.iters, ") must exceed --warmup (", o.warmup, ")");
  const double peak = measure_bf16_peak_gflops();
  const std::string n = std::to_string(o.ranks);
  const std::vector<Layout> layouts = {
      {"1 process x " + n + " threads", 1, ""},
      {"DP=" + n + ", reduce after backward", o.ranks, "--no-overlap-grad-reduce"},
      {"DP=" + n + ", overlapped", o.ranks, ""},
      {"DP=" + n + ", ZeRO-1, overlapped", o.ranks, "--use-distributed-optimizer"},
  };
  std::vector<Measured> results;
  for (const Layout& layout : layouts) {
    if (!o.json) std::fprintf(stderr, "bench parallel: %s ...\n", layout.name.c_str());
    results.push_back(run_layout(o, layout, peak));
  }
  const double base = results.front().tokens_per_s;
  if (o.json) {
    for (const Measured& m : results) {
      nlohmann::json line = {{"impl", "octet"},
                             {"config", o.config},
                             {"precision", o.precision},
                             {"layout", m.layout.name},
                             {"processes", m.layout.processes}};
      if (!m.error.empty()) {
        line["error"] = m.error;
      } else {
        line["tokens_per_s"] = m.tokens_per_s;
        line["ratio_vs_single_process"] = m.tokens_per_s / base;
        if (m.data_parallel) {
          line["grad_comm_ms_per_step"] = m.grad_comm_ms;
          line["grad_comm_exposed_ms_per_step"] = m.grad_exposed_ms;
          line["grad_comm_hidden_fraction"] =
              m.grad_comm_ms > 0 ? 1.0 - m.grad_exposed_ms / m.grad_comm_ms : 1.0;
          line["param_gather_ms_per_step"] = m.param_gather_ms;
        }
      }
      std::printf("%s\n", line.dump().c_str());
    }
  } else {
    std::printf(
        "bench parallel: %s, %s, micro-batch %lld x seq %lld, global batch %lld, %d "
        "cores; medians over steps %lld..%lld\n",
        o.config.c_str(), o.precision.c_str(), (long long)o.micro_batch_size,
        (long long)o.seq_length, (long long)(o.micro_batch_size * o.ranks), o.ranks,
        (long long)o.warmup + 1, (long long)o.iters);
    std::printf("%-34s %10s %8s %14s %14s %8s %12s\n", "layout", "tokens/s", "vs 1 proc",
                "grad comm ms", "exposed ms", "hidden", "gather ms");
    for (const Measured& m : results) {
      if (!m.error.empty()) {
        std::printf("%-34s %s\n", m.layout.name.c_str(), m.error.c_str());
        continue;
      }
      std::printf("%-34s %10.0f %8.2fx", m.layout.name.c_str(), m.tokens_per_s,
                  m.tokens_per_s / base);
      if (m.data_parallel) {
        std::printf(" %14.1f %14.1f %7.0f%% %12.1f\n", m.grad_comm_ms, m.grad_exposed_ms,
                    100.0 * (m.grad_comm_ms > 0 ? 1.0 - m.grad_exposed_ms / m.grad_comm_ms : 1.0),
                    m.param_gather_ms);
      } else {
        std::printf(" %14s %14s %8s %12s\n", "-", "-", "-", "-");
      }
    }
    std::printf("\n");
    std::fflush(stdout);
    // The pipeline schedules, from the simulator.
    const std::string command = self_exe() + " schedule --pipeline-model-parallel-size " +
                                std::to_string(o.pipeline_ranks) + " --num-microbatches " +
                                std::to_string(o.micro_batches);
    if (std::system(command.c_str()) != 0) {
      std::printf("(octet schedule failed: %s)\n", command.c_str());
    }
  }
}

}  // namespace

void register_bench_parallel(CLI::App& bench) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "parallel", "Parallel layouts of one GPT training run: tokens/s, communication hidden");
  cmd->add_option("--config", o->config, "Config name in configs/ or a JSON path");
  cmd->add_option("--ranks", o->ranks, "Processes (and cores) per layout");
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per micro-batch");
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence");
  cmd->add_option("--iters", o->iters, "Training steps per layout");
  cmd->add_option("--warmup", o->warmup, "Steps left out of the figures");
  cmd->add_option("--precision", o->precision, "fp32 | bf16 | fp8");
  cmd->add_option("--pipeline-model-parallel-size", o->pipeline_ranks,
                  "Ranks of the simulated pipeline schedule table");
  cmd->add_option("--num-microbatches", o->micro_batches, "Micro-batches of that table");
  cmd->add_flag("--json", o->json, "One JSON object per layout");
  cmd->callback([o] { run(*o); });
}

}  // namespace octet::cli
