// `octet bench moe`: expert parallelism measured against its peers in one run.
//  1. The token exchange: ExpertDispatcher's dispatch + combine (the layout pass, the
//     all-to-all-v there and back, the reordering by expert; BF16 and FP8 rows) against raw
//     MPI all-to-all-v of the same BF16 rows there and back, timed by a worker under mpirun
//     (`octet bench moe-worker`), the sides alternated within each round.
//  2. Training moe-mini with the experts split over the ranks (EP = ranks) against the same
//     model data-parallel (every rank all experts), each a real `mpirun octet train` run,
//     alternated in rounds: tokens/s, and the share of the expert all-to-all that compute hid.
//     Then the pipelines, EP x PP=2: 1F1B, DualPipe with its F&B pairs in turn, and DualPipe
//     with them overlapped (two threads): tokens/s and the share of the all-to-all hidden.
//  3. Context parallelism's attention (the same workers): forward + backward of causal
//     attention over a T-token sequence split over the ranks (ring p2p and Ulysses a2a)
//     against one process of one thread doing the whole sequence, alternated in rounds.
//  4. The single-process peers (`octet bench train --config moe-mini`): PyTorch 1.13's MoE of
//     the same routing, and the dense model of the same active size.
// Every ratio is the median of per-round ratios, with its spread.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/comm.h"
#include "octet/error.h"
#include "octet/modules.h"

namespace octet::cli {

namespace {

struct Options {
  int ranks = 2;
  int64_t tokens = 4096;  // per rank, each sent to topk experts
  int64_t hidden = 384;
  int64_t experts = 8;
  int64_t topk = 2;
  int repeats = 10;
  int rounds = 5;
  std::string config = "moe-mini";
  int64_t micro_batch_size = 4;
  int64_t seq_length = 256;
  int64_t iters = 6;
  int64_t warmup = 2;
  int train_rounds = 2;
  int64_t cp_seq = 4096;  // context parallelism's sequence; 0: not measured
  int cp_repeats = 3;
  // The pipelines: micro-batches per data rank (DualPipe's pairs are its steady state: the more
  // micro-batches, the larger its share); 0: no pipelines.
  int64_t pipeline_micro_batches = 12;
  int64_t pipeline_micro_batch_size = 2;
  int64_t pipeline_seq_length = 128;
  bool no_train = false;
  bool no_peers = false;
  bool json = false;
};

struct WorkerOptions {
  int64_t tokens = 4096, hidden = 384, experts = 8, topk = 2;
  int repeats = 10, rounds = 5;
  int64_t cp_seq = 0;
  int cp_repeats = 3;
  std::string out;
};

// Context parallelism's attention: gpt-mini's heads (6 x 64), BF16, causal, one sequence.
constexpr int64_t kCpHeads = 6, kCpHeadDim = 64;

// Forward + backward of attention over this rank's share of `whole` tokens: all of them when
// group is null, else chunks r and 2CP-1-r.
std::function<void()> cp_attention(Communicator* group, CpCommType type, int64_t whole) {
  const int64_t local = group ? whole / group->size() : whole;
  DotProductAttentionOptions o;
  o.num_attention_heads = kCpHeads;
  o.kv_channels = kCpHeadDim;
  auto module = std::make_shared<DotProductAttention>(o);
  module->set_context_parallel(group, type);
  std::mt19937 random(static_cast<uint32_t>(7 + (group ? group->rank() : 0)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto make = [&] {
    std::vector<float> values(static_cast<size_t>(local * kCpHeads * kCpHeadDim));
    for (float& v : values) v = normal(random);
    return Tensor::from_floats({1, local, kCpHeads, kCpHeadDim}, values).to(DType::BF16);
  };
  const Tensor q = make(), k = make(), v = make(), dout = make();
  return [module, q, k, v, dout] {
    DotProductAttention::Context ctx;
    module->forward(q, k, v, ctx);
    Tensor dq, dk, dv;
    module->backward(dout, ctx, dq, dk, dv);
  };
}

std::string mpirun(int ranks) {
  std::string command = "OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 ";
  if (::geteuid() == 0) command += "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  return command + "mpirun -np " + std::to_string(ranks) + " --oversubscribe ";
}

std::string read_tail(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.substr(text.size() > 2000 ? text.size() - 2000 : 0);
}

// ---- the worker: one rank of the exchange measurement ---------------------------------------

// Median over repeats of the slowest rank's seconds for `body`, a barrier before each.
template <typename Body>
double time_exchange(Communicator& world, int repeats, Body&& body) {
  body();  // warm-up
  std::vector<double> seconds;
  for (int i = 0; i < repeats; ++i) {
    world.barrier();
    const auto start = std::chrono::steady_clock::now();
    body();
    const double mine =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    seconds.push_back(world.all_reduce(mine, ReduceOp::Max));
  }
  return bench::median(seconds);
}

void run_worker(const WorkerOptions& w) {
  std::shared_ptr<Communicator> world = world_communicator();
  const int rank = world->rank();
  OCTET_CHECK(w.experts % world->size() == 0, "bench moe: --experts (", w.experts,
              ") expected a multiple of the ranks (", world->size(), ")");
  // Uniform random routing of tokens x topk pairs, grouped by expert as after the permute.
  std::mt19937 random(static_cast<uint32_t>(1234 + rank));
  std::uniform_int_distribution<int64_t> pick(0, w.experts - 1);
  Tensor counts = Tensor::zeros({w.experts}, DType::I32);
  for (int64_t i = 0; i < w.tokens * w.topk; ++i) ++counts.data<int32_t>()[pick(random)];
  Tensor rows = Tensor::empty({w.tokens * w.topk, w.hidden}, DType::BF16);
  {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(static_cast<size_t>(rows.numel()));
    for (float& v : values) v = normal(random);
    rows.copy_from(Tensor::from_floats(rows.shape(), values).to(DType::BF16));
  }
  ExpertDispatcher dispatcher(*world, w.experts);
  const ExpertDispatcher::Layout layout = dispatcher.layout(counts);
  auto raw = [&] {
    Tensor there, back;
    int64_t received = 0;
    for (int64_t n : layout.recv_rows) received += n;
    there = Tensor::empty({received, w.hidden}, DType::BF16);
    world->iall_to_allv(rows, layout.send_rows, there, layout.recv_rows).wait();
    back = Tensor::empty(rows.shape(), DType::BF16);
    world->iall_to_allv(there, layout.recv_rows, back, layout.send_rows).wait();
  };
  auto ours = [&](bool fp8) {
    const ExpertDispatcher::Layout l = dispatcher.layout(counts);
    ExpertDispatcher::Pending p = dispatcher.start_dispatch(rows, l, fp8);
    const Tensor at_experts = dispatcher.finish_dispatch(p, l);
    ExpertDispatcher::Pending c = dispatcher.start_combine(at_experts, l);
    dispatcher.finish_combine(c);
  };
  int64_t sent = 0;
  for (int64_t n : layout.send_rows) sent += n;
  nlohmann::json out = {{"ranks", world->size()},
                        {"rows_per_rank", sent},
                        {"bytes_per_rank", 2 * sent * w.hidden * 2},
                        {"raw_s", nlohmann::json::array()},
                        {"bf16_s", nlohmann::json::array()},
                        {"fp8_s", nlohmann::json::array()}};
  std::function<void()> whole, ring, ulysses;
  if (w.cp_seq > 0) {
    OCTET_CHECK(w.cp_seq % (2 * world->size()) == 0, "bench moe: --cp-seq (", w.cp_seq,
                ") expected a multiple of 2 x ranks");
    if (rank == 0) whole = cp_attention(nullptr, CpCommType::P2P, w.cp_seq);
    ring = cp_attention(world.get(), CpCommType::P2P, w.cp_seq);
    if (kCpHeads % world->size() == 0) {
      ulysses = cp_attention(world.get(), CpCommType::A2A, w.cp_seq);
    }
    out["cp_whole_s"] = out["cp_p2p_s"] = out["cp_a2a_s"] = nlohmann::json::array();
  }
  for (int round = 0; round < w.rounds; ++round) {
    if (w.cp_seq > 0) {
      // One process alone (the other ranks idle) and the sequence split, alternated.
      double whole_s = 0;
      auto measure_whole = [&] {
        whole_s = time_exchange(*world, w.cp_repeats, [&] {
          if (whole) whole();
        });
      };
      if (round % 2 == 0) measure_whole();
      out["cp_p2p_s"].push_back(time_exchange(*world, w.cp_repeats, ring));
      if (ulysses) out["cp_a2a_s"].push_back(time_exchange(*world, w.cp_repeats, ulysses));
      if (round % 2 == 1) measure_whole();
      out["cp_whole_s"].push_back(whole_s);
    }
    double raw_s = 0, bf16_s = 0, fp8_s = 0;
    auto measure_raw = [&] { raw_s = time_exchange(*world, w.repeats, raw); };
    if (round % 2 == 0) measure_raw();
    bf16_s = time_exchange(*world, w.repeats, [&] { ours(false); });
    fp8_s = time_exchange(*world, w.repeats, [&] { ours(true); });
    if (round % 2 == 1) measure_raw();
    out["raw_s"].push_back(raw_s);
    out["bf16_s"].push_back(bf16_s);
    out["fp8_s"].push_back(fp8_s);
  }
  if (rank == 0) {
    std::ofstream file(w.out);
    file << out.dump() << "\n";
    OCTET_CHECK(file.good(), "bench moe-worker: cannot write '", w.out, "'");
  }
}

// ---- part 1: the exchange ------------------------------------------------------------------

struct Exchange {
  std::vector<double> bf16_share, fp8_share;  // raw seconds / ours, per round
  // Context parallelism: whole-sequence seconds / split seconds, per round; median seconds.
  std::vector<double> p2p_speedup, a2a_speedup;
  double whole_s = NAN, p2p_s = NAN, a2a_s = NAN;
  double raw_gbps = 0, bf16_gbps = 0, fp8_gbps = 0;  // medians, BF16 bytes per second
  int64_t rows_per_rank = 0;
  std::string error;
};

Exchange measure_exchange(const Options& o) {
  Exchange e;
  const auto dir =
      std::filesystem::temp_directory_path() / ("octet-bench-moe-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string result = (dir / "exchange.json").string(), log = (dir / "log.txt").string();
  const std::string command =
      mpirun(o.ranks) + bench::self_exe() + " bench moe-worker --tokens " +
      std::to_string(o.tokens) + " --hidden " + std::to_string(o.hidden) + " --experts " +
      std::to_string(o.experts) + " --topk " + std::to_string(o.topk) + " --repeats " +
      std::to_string(o.repeats) + " --rounds " + std::to_string(o.rounds) + " --cp-seq " +
      std::to_string(o.cp_seq) + " --cp-repeats " + std::to_string(o.cp_repeats) + " --out " +
      result + " > " + log + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    e.error = "failed: " + command + "\n" + read_tail(log);
    std::filesystem::remove_all(dir);
    return e;
  }
  std::ifstream in(result);
  const nlohmann::json r = nlohmann::json::parse(in, nullptr, false);
  std::filesystem::remove_all(dir);
  if (r.is_discarded() || !r.contains("raw_s")) {
    e.error = "bench moe-worker wrote no result";
    return e;
  }
  const std::vector<double> raw = r["raw_s"], bf16 = r["bf16_s"], fp8 = r["fp8_s"];
  for (size_t i = 0; i < raw.size(); ++i) {
    bench::push_finite(e.bf16_share, raw[i] / bf16[i]);
    bench::push_finite(e.fp8_share, raw[i] / fp8[i]);
  }
  const double bytes = r["bytes_per_rank"].get<double>();
  e.raw_gbps = bytes / bench::median(raw) / 1e9;
  e.bf16_gbps = bytes / bench::median(bf16) / 1e9;
  e.fp8_gbps = bytes / bench::median(fp8) / 1e9;
  e.rows_per_rank = r["rows_per_rank"].get<int64_t>();
  if (r.contains("cp_whole_s")) {
    const std::vector<double> whole = r["cp_whole_s"], p2p = r["cp_p2p_s"], a2a = r["cp_a2a_s"];
    for (size_t i = 0; i < whole.size(); ++i) {
      if (i < p2p.size()) bench::push_finite(e.p2p_speedup, whole[i] / p2p[i]);
      if (i < a2a.size()) bench::push_finite(e.a2a_speedup, whole[i] / a2a[i]);
    }
    e.whole_s = bench::median_or_nan(whole);
    e.p2p_s = bench::median_or_nan(p2p);
    e.a2a_s = bench::median_or_nan(a2a);
  }
  return e;
}

// ---- part 2: training with the experts split, against data parallelism ---------------------

struct TrainRun {
  double tokens_per_s = NAN, a2a_ms = 0, exposed_ms = 0;
  std::string error;
};

// One `mpirun octet train` of the MoE config: `ranks` processes, the global batch
// micro-batch x data ranks x accumulation, `flags` for the layout.
struct Shape {  // sequences per micro-batch and rank, tokens per sequence
  int64_t micro_batch = 0, seq = 0;
};

TrainRun run_training(const Options& o, int ranks, Shape shape, int64_t global_batch,
                      const std::string& flags, const std::string& config) {
  TrainRun t;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("octet-bench-moe-train-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string metrics = (dir / "metrics.jsonl").string(), log = (dir / "log.txt").string();
  const std::string command =
      mpirun(ranks) + bench::self_exe() + " train --config " + config +
      " --mock-data --precision bf16 --micro-batch-size " + std::to_string(shape.micro_batch) +
      " --global-batch-size " + std::to_string(global_batch) + " --seq-length " +
      std::to_string(shape.seq) + " --train-iters " + std::to_string(o.iters) +
      " --eval-iters 0 --log-interval 0 --peak-gflops 100 --metrics " + metrics + " " + flags +
      " > " + log + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    t.error = "failed: " + command + "\n" + read_tail(log);
    std::filesystem::remove_all(dir);
    return t;
  }
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> tokens;
  int64_t steps = 0;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_discarded() || record.value("step", 0) <= o.warmup) continue;
    tokens.push_back(record.value("tokens_per_s", 0.0));
    t.a2a_ms += 1e3 * record.value("expert_a2a_s", 0.0);
    t.exposed_ms += 1e3 * record.value("expert_a2a_exposed_s", 0.0);
    ++steps;
  }
  std::filesystem::remove_all(dir);
  if (steps == 0) {
    t.error = "no measured steps in " + metrics;
    return t;
  }
  t.tokens_per_s = bench::median(tokens);
  t.a2a_ms /= static_cast<double>(steps);
  t.exposed_ms /= static_cast<double>(steps);
  return t;
}

// ---- part 2b: the pipelines ------------------------------------------------------------------

const char* const kPipelines[3] = {"1F1B", "DualPipe, F&B in turn", "DualPipe, F&B overlapped"};

struct Pipelines {
  std::vector<double> tokens[3], hidden[3];  // per round, for each of kPipelines
  std::vector<double> overlapped_over_sequential;
  int64_t layers = 0;
  std::string error;
};

// The pipelines: EP = ranks x PP = 2 (twice the ranks on the same cores), 1F1B, DualPipe with
// its F&B pairs one after the other, and DualPipe overlapped, alternated in rounds.
Pipelines measure_pipelines(const Options& o) {
  Pipelines p;
  // DualPipe cuts the model into 2 x PP = 4 stages: the config's layers rounded up to a
  // multiple of 4 (moe-mini's 6 become 8), written beside the runs.
  const auto pipe_dir = std::filesystem::temp_directory_path() /
                        ("octet-bench-moe-pipe-" + std::to_string(::getpid()));
  std::string pipe_config;
  if (!o.no_train && o.pipeline_micro_batches > 0) {
    std::ifstream in(resolve_config(o.config));
    nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
    if (config.is_discarded() || !config.contains("num_layers")) {
      p.error = "cannot read num_layers from " + resolve_config(o.config).string();
    } else {
      p.layers = (config["num_layers"].get<int64_t>() + 3) / 4 * 4;
      config["num_layers"] = p.layers;
      std::filesystem::create_directories(pipe_dir);
      pipe_config = (pipe_dir / "config.json").string();
      std::ofstream(pipe_config) << config.dump(2) << "\n";
    }
  }
  for (int round = 0; !pipe_config.empty() && p.error.empty() && round < o.train_rounds; ++round) {
    if (!o.json) {
      std::fprintf(stderr, "bench moe: round %d/%d: %s EP=%d x PP=2, 1F1B and DualPipe ...\n",
                   round + 1, o.train_rounds, o.config.c_str(), o.ranks);
    }
    const std::string flags[3] = {"--pipeline-schedule 1f1b",
                                  "--pipeline-schedule dualpipe --no-dualpipe-overlap",
                                  "--pipeline-schedule dualpipe"};
    const int64_t batch = o.pipeline_micro_batch_size * o.ranks * o.pipeline_micro_batches;
    TrainRun runs[3];
    for (int k = 0; k < 3; ++k) {
      const int i = round % 2 == 0 ? k : 2 - k;
      runs[i] =
          run_training(o, 2 * o.ranks, {o.pipeline_micro_batch_size, o.pipeline_seq_length}, batch,
                       "--expert-model-parallel-size " + std::to_string(o.ranks) +
                           " --pipeline-model-parallel-size 2 " + flags[i],
                       pipe_config);
      if (!runs[i].error.empty()) p.error = runs[i].error;
    }
    if (!p.error.empty()) continue;
    for (int i = 0; i < 3; ++i) {
      p.tokens[i].push_back(runs[i].tokens_per_s);
      bench::push_finite(p.hidden[i],
                         runs[i].a2a_ms > 0 ? 1.0 - runs[i].exposed_ms / runs[i].a2a_ms : NAN);
    }
    bench::push_finite(p.overlapped_over_sequential, runs[2].tokens_per_s / runs[1].tokens_per_s);
  }
  if (!pipe_config.empty()) std::filesystem::remove_all(pipe_dir);
  return p;
}

void print_pipelines(const Options& o, const Pipelines& pipes) {
  if (!pipes.error.empty()) {
    std::printf("pipelines: %s\n", pipes.error.c_str());
  } else {
    std::printf(
        "pipelines: %s cut to %lld layers, EP=%d x PP=2 (%d processes of one thread on the "
        "same cores), %lld micro-batches of %lld x %lld per data rank, %d rounds:\n",
        o.config.c_str(), (long long)pipes.layers, o.ranks, 2 * o.ranks,
        (long long)o.pipeline_micro_batches, (long long)o.pipeline_micro_batch_size,
        (long long)o.pipeline_seq_length, o.train_rounds);
    for (int i = 0; i < 3; ++i) {
      std::printf("  %-26s %8.0f tok/s, expert all-to-all %s hidden behind compute%s\n",
                  kPipelines[i], bench::median(pipes.tokens[i]),
                  bench::median_range(pipes.hidden[i], "%.2f").c_str(),
                  i == 2 ? " (goal >= 0.70)" : "");
    }
    std::printf("  DualPipe overlapped / in turn, tokens/s: %s\n",
                bench::median_range(pipes.overlapped_over_sequential).c_str());
  }
}

void run(const Options& o) {
  const Exchange e = measure_exchange(o);
  std::vector<double> ep_over_dp, hidden, ep_tokens, dp_tokens, a2a_ms;
  std::string train_error;
  for (int round = 0; !o.no_train && round < o.train_rounds; ++round) {
    if (!o.json) {
      std::fprintf(stderr, "bench moe: round %d/%d: %s EP=%d and DP=%d ...\n", round + 1,
                   o.train_rounds, o.config.c_str(), o.ranks, o.ranks);
    }
    TrainRun split, replicated;
    const int64_t batch = o.micro_batch_size * o.ranks;
    const std::string ep = "--expert-model-parallel-size " + std::to_string(o.ranks);
    const std::string config = resolve_config(o.config).string();
    const Shape shape{o.micro_batch_size, o.seq_length};
    if (round % 2 == 0) split = run_training(o, o.ranks, shape, batch, ep, config);
    replicated = run_training(o, o.ranks, shape, batch, "", config);
    if (round % 2 == 1) split = run_training(o, o.ranks, shape, batch, ep, config);
    if (!split.error.empty() || !replicated.error.empty()) {
      train_error = split.error.empty() ? replicated.error : split.error;
      continue;
    }
    bench::push_finite(ep_over_dp, split.tokens_per_s / replicated.tokens_per_s);
    bench::push_finite(hidden, split.a2a_ms > 0 ? 1.0 - split.exposed_ms / split.a2a_ms : NAN);
    ep_tokens.push_back(split.tokens_per_s);
    dp_tokens.push_back(replicated.tokens_per_s);
    a2a_ms.push_back(split.a2a_ms);
  }
  const Pipelines pipes = measure_pipelines(o);
  if (o.json) {
    nlohmann::json line = {
        {"bench", "moe"},
        {"ranks", o.ranks},
        {"tokens_per_rank", o.tokens},
        {"hidden", o.hidden},
        {"experts", o.experts},
        {"topk", o.topk},
        {"exchange_error", e.error},
        {"raw_gbps", e.raw_gbps},
        {"dispatch_combine_bf16_gbps", e.bf16_gbps},
        {"dispatch_combine_fp8_gbps", e.fp8_gbps},
        {"bf16_share_of_raw", bench::json_number(bench::median_or_nan(e.bf16_share))},
        {"bf16_share_rounds", e.bf16_share},
        {"fp8_vs_raw_bf16", bench::json_number(bench::median_or_nan(e.fp8_share))},
        {"fp8_rounds", e.fp8_share},
        {"cp_seq", o.cp_seq},
        {"cp_whole_ms", bench::json_number(e.whole_s * 1e3)},
        {"cp_p2p_ms", bench::json_number(e.p2p_s * 1e3)},
        {"cp_a2a_ms", bench::json_number(e.a2a_s * 1e3)},
        {"cp_p2p_speedup", bench::json_number(bench::median_or_nan(e.p2p_speedup))},
        {"cp_p2p_speedup_rounds", e.p2p_speedup},
        {"cp_a2a_speedup", bench::json_number(bench::median_or_nan(e.a2a_speedup))},
        {"cp_a2a_speedup_rounds", e.a2a_speedup},
        {"train_config", o.config},
        {"train_error", train_error},
        {"ep_tokens_per_s", bench::json_number(bench::median_or_nan(ep_tokens))},
        {"dp_tokens_per_s", bench::json_number(bench::median_or_nan(dp_tokens))},
        {"ep_over_dp", bench::json_number(bench::median_or_nan(ep_over_dp))},
        {"ep_over_dp_rounds", ep_over_dp},
        {"a2a_ms_per_step", bench::json_number(bench::median_or_nan(a2a_ms))},
        {"a2a_hidden", bench::json_number(bench::median_or_nan(hidden))},
        {"pipeline_error", pipes.error},
        {"pp_1f1b_tokens_per_s", bench::json_number(bench::median_or_nan(pipes.tokens[0]))},
        {"pp_1f1b_a2a_hidden", bench::json_number(bench::median_or_nan(pipes.hidden[0]))},
        {"dualpipe_sequential_tokens_per_s",
         bench::json_number(bench::median_or_nan(pipes.tokens[1]))},
        {"dualpipe_sequential_a2a_hidden",
         bench::json_number(bench::median_or_nan(pipes.hidden[1]))},
        {"dualpipe_overlapped_tokens_per_s",
         bench::json_number(bench::median_or_nan(pipes.tokens[2]))},
        {"dualpipe_overlapped_a2a_hidden",
         bench::json_number(bench::median_or_nan(pipes.hidden[2]))},
        {"dualpipe_overlapped_a2a_hidden_rounds", pipes.hidden[2]},
        {"overlapped_over_sequential",
         bench::json_number(bench::median_or_nan(pipes.overlapped_over_sequential))}};
    std::printf("%s\n", line.dump().c_str());
  } else {
    std::printf(
        "octet bench moe: %d ranks (one thread each), %lld tokens x top-%lld per rank, "
        "hidden %lld, %lld experts (%lld per rank)\n",
        o.ranks, (long long)o.tokens, (long long)o.topk, (long long)o.hidden, (long long)o.experts,
        (long long)(o.experts / o.ranks));
    if (!e.error.empty()) {
      std::printf("exchange: %s\n", e.error.c_str());
    } else {
      std::printf(
          "dispatch + combine, %lld rows there and back per rank (medians of %d repeats, %d "
          "rounds):\n",
          (long long)e.rows_per_rank, o.repeats, o.rounds);
      std::printf("  raw MPI all-to-all-v (BF16)      %6.2f GB/s\n", e.raw_gbps);
      std::printf("  ExpertDispatcher, BF16           %6.2f GB/s  %s of raw (goal >= 0.80x)\n",
                  e.bf16_gbps, bench::median_range(e.bf16_share).c_str());
      std::printf(
          "  ExpertDispatcher, FP8 dispatch   %6.2f GB/s  %s raw's time for the same tokens "
          "(BF16 bytes counted)\n",
          e.fp8_gbps, bench::median_range(e.fp8_share).c_str());
      if (o.cp_seq > 0) {
        std::printf(
            "context parallelism: causal attention forward + backward, T=%lld, %lld heads x "
            "%lld, BF16 (medians of %d repeats, %d rounds):\n",
            (long long)o.cp_seq, (long long)kCpHeads, (long long)kCpHeadDim, o.cp_repeats,
            o.rounds);
        std::printf("  one process, one thread      %8.1f ms\n", e.whole_s * 1e3);
        std::printf("  CP=%d ring (p2p)              %8.1f ms  %s faster (ideal %d.00x)\n", o.ranks,
                    e.p2p_s * 1e3, bench::median_range(e.p2p_speedup).c_str(), o.ranks);
        if (!e.a2a_speedup.empty()) {
          std::printf("  CP=%d Ulysses (a2a)           %8.1f ms  %s faster\n", o.ranks,
                      e.a2a_s * 1e3, bench::median_range(e.a2a_speedup).c_str());
        }
      }
    }
    if (!o.no_train) {
      if (ep_over_dp.empty()) {
        std::printf("training: %s\n", train_error.c_str());
      } else {
        std::printf(
            "training %s, bf16, micro-batch %lld x seq %lld per rank, %lld steps (first %lld "
            "left out), %d rounds:\n",
            o.config.c_str(), (long long)o.micro_batch_size, (long long)o.seq_length,
            (long long)o.iters, (long long)o.warmup, o.train_rounds);
        std::printf(
            "  EP=%d (experts split)  %8.0f tok/s, expert all-to-all %.1f ms/step, %s "
            "hidden behind compute\n",
            o.ranks, bench::median(ep_tokens), bench::median(a2a_ms),
            bench::median_range(hidden, "%.2f").c_str());
        std::printf("  DP=%d (experts copied) %8.0f tok/s\n", o.ranks, bench::median(dp_tokens));
        std::printf("  EP / DP tokens/s: %s\n", bench::median_range(ep_over_dp).c_str());
      }
      if (o.pipeline_micro_batches > 0) print_pipelines(o, pipes);
    }
  }
  if (!o.no_peers && !o.json) {
    // The single-process peers: PyTorch's MoE of the same routing, the dense model.
    std::fflush(stdout);
    const std::string command = bench::self_exe() + " bench train --config " +
                                resolve_config(o.config).string() + " --precision bf16";
    if (std::system(command.c_str()) != 0) std::printf("(%s failed)\n", command.c_str());
  }
}

}  // namespace

void register_bench_moe(CLI::App& bench) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "moe",
      "Expert parallelism: dispatch + combine against raw all-to-all-v, training with the "
      "experts split against data parallelism, and the single-process peers");
  cmd->add_option("--ranks", o->ranks, "Processes (the expert-parallel size)")->check(at_least(2));
  cmd->add_option("--tokens", o->tokens, "Tokens per rank in the exchange")->check(at_least(1));
  cmd->add_option("--hidden", o->hidden, "Row width of the exchange")->check(at_least(1));
  cmd->add_option("--experts", o->experts, "Experts (a multiple of --ranks)")->check(at_least(1));
  cmd->add_option("--topk", o->topk, "Experts per token")->check(at_least(1));
  cmd->add_option("--repeats", o->repeats, "Timed exchanges per side and round")
      ->check(at_least(1));
  cmd->add_option("--rounds", o->rounds, "Exchange rounds, the sides alternated")
      ->check(at_least(1));
  cmd->add_option("--config", o->config, "The trained MoE config (name or path)");
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per rank and step")
      ->check(at_least(1));
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence")->check(at_least(1));
  cmd->add_option("--iters", o->iters, "Training steps per run")->check(at_least(1));
  cmd->add_option("--warmup", o->warmup, "Steps left out of the figures")->check(at_least(0));
  cmd->add_option("--train-rounds", o->train_rounds, "Training rounds, EP and DP alternated")
      ->check(at_least(1));
  cmd->add_option("--cp-seq", o->cp_seq,
                  "Context parallelism's attention over this many tokens (0: not measured)")
      ->check(at_least(0));
  cmd->add_option("--cp-repeats", o->cp_repeats, "Timed attentions per side and round")
      ->check(at_least(1));
  cmd->add_option("--pipeline-micro-batches", o->pipeline_micro_batches,
                  "Micro-batches per data rank of the EP x PP=2 pipelines (0: none)")
      ->check(at_least(0));
  cmd->add_option("--pipeline-micro-batch-size", o->pipeline_micro_batch_size,
                  "Sequences per micro-batch of the pipelines")
      ->check(at_least(1));
  cmd->add_option("--pipeline-seq-length", o->pipeline_seq_length,
                  "Tokens per sequence of the pipelines")
      ->check(at_least(1));
  cmd->add_flag("--no-train", o->no_train, "Only the exchange and the attention");
  cmd->add_flag("--no-peers", o->no_peers,
                "Skip the single-process peers (octet bench train --config CONFIG)");
  cmd->add_flag("--json", o->json, "One JSON object (no peers)");
  cmd->callback([o] {
    OCTET_CHECK(o->experts % o->ranks == 0, "bench moe: --experts (", o->experts,
                ") expected a multiple of --ranks (", o->ranks, ")");
    OCTET_CHECK(o->topk <= o->experts, "bench moe: --topk (", o->topk,
                ") expected at most --experts (", o->experts, ")");
    run(*o);
  });

  auto w = std::make_shared<WorkerOptions>();
  CLI::App* worker =
      bench.add_subcommand("moe-worker", "One rank of the exchange measurement (bench moe)");
  worker->group("");  // hidden
  worker->add_option("--tokens", w->tokens, "Tokens per rank");
  worker->add_option("--hidden", w->hidden, "Row width");
  worker->add_option("--experts", w->experts, "Experts");
  worker->add_option("--topk", w->topk, "Experts per token");
  worker->add_option("--repeats", w->repeats, "Timed exchanges per side and round");
  worker->add_option("--rounds", w->rounds, "Rounds");
  worker->add_option("--cp-seq", w->cp_seq, "Context parallelism's sequence (0: none)");
  worker->add_option("--cp-repeats", w->cp_repeats, "Timed attentions per side and round");
  worker->add_option("--out", w->out, "Result JSON (rank 0)")->required();
  worker->callback([w] { run_worker(*w); });
}

}  // namespace octet::cli
