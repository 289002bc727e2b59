// `octet bench parallel`: the same GPT and global batch trained in several parallel layouts,
// each a real multi-process run (`mpirun -np N octet train ...`, one OpenMP thread per rank
// so N ranks share N cores as one process with N threads would). Reports tokens/s against
// the single process, the data-parallel gradient communication per step, and how much of it
// backward hid. Then the pipeline layouts, each run by a dedicated worker (`octet bench
// pipeline-worker` under mpirun) that times every action of the executor: its measured bubble
// beside simulate()'s prediction from the forward / backward times it measured. Last, the
// pipeline schedule table of the simulator. The PyTorch peer (bench/peers/torch_ddp.py: one
// process, and DistributedDataParallel over gloo) trains the same model and global batch in
// the same run; its tokens/s and octet's ratio to it are printed beside.
// The layouts and the peer run in rounds (every octet layout then the peer, the peer first in
// odd rounds): on a loaded machine two identical runs differ by up to 2x, so every ratio is
// the median of per-round ratios (both sides measured within the same minutes), with its spread.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/comm.h"
#include "octet/error.h"
#include "octet/model.h"
#include "octet/pipeline.h"
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
  int rounds = 2;  // each round runs every layout and the peer: a few multi-second runs
  std::string precision = "bf16";
  int pipeline_ranks = 4;
  int micro_batches = 8;
  // The measured pipeline layouts: PP = ranks, micro_batches micro-batches of the same global
  // batch, on gpt-mini cut to `pipeline_layers` layers (a multiple of 2 x ranks stages, for
  // interleaved and DualPipeV) and a `pipeline_vocab` vocabulary (so the output layer on the
  // last stage costs little next to a layer and the stages are balanced, as simulate assumes).
  std::string pipeline_schedules = "1f1b,interleaved,zb1p,dualpipe,dualpipev";
  int virtual_stages = 2;
  int64_t pipeline_layers = 4;
  int64_t pipeline_vocab = 256;
  int pipeline_iters = 4;
  int pipeline_warmup = 1;
  bool pipeline_only = false;
  bool no_torch = false;
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

std::string config_path(const std::string& config) {
  return resolve_config(config).string();
}

// Whether the layout reduces gradients over data-parallel ranks (its grad comm figures count).
bool is_data_parallel(const Layout& layout) {
  return (layout.processes > 1 || layout.flags.find("distributed") != std::string::npos) &&
         layout.flags.find("tensor-model-parallel") == std::string::npos;
}

Measured run_layout(const Options& o, const Layout& layout, double peak_gflops) {
  Measured m;
  m.layout = layout;
  m.data_parallel = is_data_parallel(layout);
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
  command += bench::self_exe() + " train --config " + config_path(o.config) +
             " --mock-data --precision " + o.precision + " --micro-batch-size " +
             std::to_string(o.micro_batch_size) + " --global-batch-size " +
             std::to_string(o.micro_batch_size * o.ranks) + " --seq-length " +
             std::to_string(o.seq_length) + " --train-iters " + std::to_string(o.iters) +
             " --eval-iters 0 --log-interval 0 --peak-gflops " + std::to_string(peak_gflops) +
             " --metrics " + metrics + " " + layout.flags + " > " + log + " 2>&1";
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

// ---- the PyTorch peer: the same model and global batch, one process and DDP over gloo -----

// One JSON object per torch layout (torch_single, torch_ddp); empty with a note when the peer
// cannot run. FP8 has no torch 1.13 counterpart: its peer is bf16 autocast.
std::vector<nlohmann::json> measure_torch(const Options& o) {
  const std::filesystem::path script = bench::find_peer_script("torch_ddp.py");
  if (script.empty()) {
    std::fprintf(stderr, "bench parallel: bench/peers/torch_ddp.py not found; no torch figures\n");
    return {};
  }
  const std::string precision = o.precision == "fp32" ? "fp32" : "bf16";
  // Bounded: the DDP peer was seen to hang in its teardown after printing both results (19 min
  // at 26 s of CPU); its lines are read as they come, so killing it then loses nothing.
  const std::string command =
      "timeout -s KILL 900 /usr/bin/python3 '" + script.string() + "' --config '" +
      config_path(o.config) + "' --precision " + precision + " --micro-batch-size " +
      std::to_string(o.micro_batch_size) + " --seq-length " + std::to_string(o.seq_length) +
      " --global-batch-size " + std::to_string(o.micro_batch_size * o.ranks) + " --ranks " +
      std::to_string(o.ranks) + " --steps " + std::to_string(o.iters - o.warmup) + " --warmup " +
      std::to_string(o.warmup) + " 2>/dev/null";
  std::fflush(nullptr);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {};
  std::vector<nlohmann::json> out;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded() && parsed.contains("tokens_per_s")) out.push_back(parsed);
  }
  const int status = pclose(pipe);
  if (status != 0) {
    std::fprintf(stderr, "bench parallel: '%s' failed (status %d); torch figures may be missing\n",
                 command.c_str(), status);
  }
  return out;
}

// ---- rounds: every octet layout, then the peer (the peer first in odd rounds) --------------

double hidden_fraction(const Measured& m) {
  return m.grad_comm_ms > 0 ? 1.0 - m.grad_exposed_ms / m.grad_comm_ms : 1.0;
}

// One octet layout over the rounds: the figures of the rounds it ran (a failed round leaves
// none), and the number and error of each round it failed.
struct LayoutRounds {
  Layout layout;
  bool data_parallel = false;
  std::vector<double> tokens_per_s;
  std::vector<double> vs_single;  // tokens/s over the same round's single process
  std::vector<double> grad_comm_ms, grad_exposed_ms, hidden_fraction, param_gather_ms;
  std::vector<int> failed_rounds;  // 1-based
  std::vector<std::string> errors;
};

// One torch layout over the rounds, beside octet's layout number `octet_layout`.
struct PeerRounds {
  std::string impl;  // torch_single | torch_ddp, as torch_ddp.py names its lines
  std::string name;  // its table row
  size_t octet_layout = 0;
  nlohmann::json last;  // the peer's latest line for it (null: never printed)
  std::vector<double> tokens_per_s, step_ms, octet_vs_torch;
};

// Adds round number `round` (0-based): `measured` in the layouts' order, `torch` the peer's
// lines of the same round.
void add_round(int round, const std::vector<Measured>& measured,
               const std::vector<nlohmann::json>& torch, std::vector<LayoutRounds>& layouts,
               std::vector<PeerRounds>& peers) {
  const double single = measured.front().tokens_per_s;  // NaN when it failed
  for (size_t i = 0; i < measured.size(); ++i) {
    const Measured& m = measured[i];
    LayoutRounds& r = layouts[i];
    if (!m.error.empty()) {
      r.failed_rounds.push_back(round + 1);
      r.errors.push_back(m.error);
      continue;
    }
    bench::push_finite(r.tokens_per_s, m.tokens_per_s);
    bench::push_finite(r.vs_single, m.tokens_per_s / single);
    if (r.data_parallel) {
      bench::push_finite(r.grad_comm_ms, m.grad_comm_ms);
      bench::push_finite(r.grad_exposed_ms, m.grad_exposed_ms);
      bench::push_finite(r.hidden_fraction, hidden_fraction(m));
      bench::push_finite(r.param_gather_ms, m.param_gather_ms);
    }
  }
  for (PeerRounds& p : peers) {
    for (const nlohmann::json& line : torch) {
      if (line.value("impl", "") != p.impl) continue;
      p.last = line;
      const double theirs = line.value("tokens_per_s", NAN);
      bench::push_finite(p.tokens_per_s, theirs);
      bench::push_finite(p.step_ms, line.value("step_ms", NAN));
      bench::push_finite(p.octet_vs_torch, measured[p.octet_layout].tokens_per_s / theirs);
    }
  }
}

// The median of the per-round ratios under `name`, its spread and the rounds' values beside.
void put_ratio(nlohmann::json& line, const std::string& name, const std::vector<double>& rounds) {
  const bool any = !rounds.empty();
  line[name] = bench::json_number(bench::median_or_nan(rounds));
  line[name + "_min"] =
      bench::json_number(any ? *std::min_element(rounds.begin(), rounds.end()) : NAN);
  line[name + "_max"] =
      bench::json_number(any ? *std::max_element(rounds.begin(), rounds.end()) : NAN);
  line[name + "_rounds"] = rounds;
}

// ---- pipeline layouts: a worker per rank, the parent compares with the simulator ----------

struct WorkerOptions {
  std::string config = "gpt-mini";
  int64_t layers = 4;
  int64_t vocab = 256;
  std::string schedule = "1f1b";
  int virtual_stages = 2;
  int micro_batches = 8;
  int64_t micro_batch_size = 2;
  int64_t seq_length = 256;
  std::string precision = "bf16";
  int steps = 5;
  uint64_t seed = 1234;
  std::string out;  // folder: one rank-R.jsonl per rank, one line per step
};

DType pipeline_dtype(const std::string& precision) {
  if (precision == "fp32") return DType::F32;
  if (precision == "bf16") return DType::BF16;
  fail(detail::concat("bench parallel: the pipeline executor runs fp32 or bf16, got --precision ",
                      precision));
}

// One-way seconds of one message of `shape` between pipeline ranks 0 and 1: half the median
// round trip, on every rank. It stands for the simulator's latency (a large message moves
// inside the receive's wait, see StepTiming).
double p2p_seconds(Communicator& pipeline, const Shape& shape, DType dtype, int repeats) {
  if (pipeline.size() < 2) return 0.0;
  Tensor buffer = Tensor::zeros(shape, dtype);
  constexpr int kTag = 30000;  // above the executor's (micro-batch, boundary) tags
  std::vector<double> round_trips;
  pipeline.barrier();
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (pipeline.rank() == 0) {
      pipeline.isend(buffer, 1, kTag).wait();
      pipeline.irecv(buffer, 1, kTag).wait();
    } else if (pipeline.rank() == 1) {
      pipeline.irecv(buffer, 0, kTag).wait();
      pipeline.isend(buffer, 0, kTag).wait();
    }
    round_trips.push_back(1e-3 * bench::elapsed_ms(start));
  }
  const double one_way = pipeline.rank() == 0 ? 0.5 * bench::median(round_trips) : 0.0;
  return pipeline.all_reduce(one_way, ReduceOp::Sum);
}

Tensor mock_tokens(int64_t batch, int64_t seq, int64_t vocab, std::mt19937_64& rng) {
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  int32_t* data = tokens.data<int32_t>();
  for (int64_t i = 0; i < batch * seq; ++i) data[i] = token(rng);
  return tokens;
}

GPTConfig pipeline_config(const std::string& config, int64_t layers, int64_t vocab) {
  GPTConfig c = GPTConfig::load(config_path(config));
  c.num_layers = layers;
  c.vocab_size = vocab;
  return c;
}

// `octet bench pipeline-worker`, one per rank under mpirun: GPT stages + PipelineExecutor on
// mock tokens, a barrier before each step so the ranks' timings share a start.
void run_pipeline_worker(const WorkerOptions& o) {
  std::shared_ptr<Communicator> world = world_communicator();
  ParallelState parallel(world, 1, world->size());
  const GPTConfig config = pipeline_config(o.config, o.layers, o.vocab);
  const DType dtype = pipeline_dtype(o.precision);
  const pipeline::Schedule schedule =
      pipeline::make_schedule(pipeline::parse_schedule_kind(o.schedule), parallel.pipeline_size(),
                              o.micro_batches, o.virtual_stages);
  const int rank = parallel.pipeline_rank();
  GPT stage(config, o.seed, GPTLayout{schedule.stages, pipeline::stages_of_rank(schedule, rank)});
  pipeline::ExecutorOptions options;
  options.dtype = dtype;
  pipeline::PipelineExecutor executor(schedule, stage, parallel, options);
  std::mt19937_64 rng(o.seed);  // the same tokens on every rank
  std::vector<Tensor> ids, targets;
  for (int m = 0; m < o.micro_batches; ++m) {
    ids.push_back(mock_tokens(o.micro_batch_size, o.seq_length, o.vocab, rng));
    targets.push_back(mock_tokens(o.micro_batch_size, o.seq_length, o.vocab, rng));
  }
  const double latency = p2p_seconds(parallel.pipeline(),
                                     {o.micro_batch_size, o.seq_length, config.hidden}, dtype, 20);
  std::ofstream out(std::filesystem::path(o.out) / ("rank-" + std::to_string(rank) + ".jsonl"));
  OCTET_CHECK(out.good(), "bench pipeline-worker: cannot write into '", o.out, "'");
  for (int step = 1; step <= o.steps; ++step) {
    stage.zero_grad();
    parallel.pipeline().barrier();
    const float loss = executor.train_step(gpt_micro_batches(ids, targets),
                                           1.0f / static_cast<float>(o.micro_batches));
    const pipeline::StepTiming& t = executor.last_step_timing();
    const nlohmann::json line = {{"rank", rank},
                                 {"step", step},
                                 {"loss", loss},
                                 {"p2p_s", latency},
                                 {"step_s", t.step_seconds},
                                 {"schedule_s", t.schedule_seconds},
                                 {"forward_s", t.forward_seconds},
                                 {"backward_s", t.backward_seconds},
                                 {"weight_s", t.weight_seconds},
                                 {"wait_s", t.wait_seconds},
                                 {"reduce_s", t.reduce_seconds},
                                 {"forward_samples_s", t.forward_samples},
                                 {"backward_samples_s", t.backward_samples},
                                 {"backward_input_samples_s", t.backward_input_samples},
                                 {"weight_samples_s", t.weight_samples}};
    out << line.dump() << "\n";
  }
  OCTET_CHECK(out.good(), "bench pipeline-worker: writing into '", o.out, "' failed");
}

struct PipelineMeasured {
  std::string name;
  pipeline::Schedule schedule;
  pipeline::BubbleComparison comparison;
  double latency_s = 0.0;
  double tokens_per_s = NAN;
  double wait_s = 0.0;  // median over steps of the longest wait of any rank
  std::vector<double> rank_forward_ms, rank_backward_ms;  // medians per rank: the balance
  std::string error;
};

std::string read_tail(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.substr(text.size() > 2000 ? text.size() - 2000 : 0);
}

PipelineMeasured run_pipeline_layout(const Options& o, const std::string& schedule_text) {
  PipelineMeasured m;
  m.name = "PP=" + std::to_string(o.ranks) + " " + schedule_text;
  const int64_t sequences = o.micro_batch_size * o.ranks;  // the DP rows' global batch
  try {
    m.schedule = pipeline::make_schedule(pipeline::parse_schedule_kind(schedule_text), o.ranks,
                                         o.micro_batches, o.virtual_stages);
    OCTET_CHECK(sequences % o.micro_batches == 0, "the global batch (", sequences,
                " sequences) is not a multiple of --num-microbatches (", o.micro_batches, ")");
    OCTET_CHECK(o.pipeline_layers % m.schedule.stages == 0, "--pipeline-layers (",
                o.pipeline_layers, ") is not a multiple of the ", m.schedule.stages, " stages");
  } catch (const Error& e) {
    m.error = std::string("skipped: ") + e.what();
    return m;
  }
  m.name = "PP=" + std::to_string(o.ranks) + " " + pipeline::schedule_name(m.schedule.kind);
  if (m.schedule.kind == pipeline::ScheduleKind::Interleaved) {
    m.name += " v=" + std::to_string(o.virtual_stages);
  }
  const int64_t micro_batch_size = sequences / o.micro_batches;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("octet-bench-pipeline-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string log = (dir / "log.txt").string();
  std::string command = "OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 ";
  if (::geteuid() == 0) command += "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  command += "mpirun -np " + std::to_string(o.ranks) + " --oversubscribe " + bench::self_exe() +
             " bench pipeline-worker --config " + o.config + " --layers " +
             std::to_string(o.pipeline_layers) + " --vocab " + std::to_string(o.pipeline_vocab) +
             " --schedule " + schedule_text + " --virtual-stages " +
             std::to_string(o.virtual_stages) + " --micro-batches " +
             std::to_string(o.micro_batches) + " --micro-batch-size " +
             std::to_string(micro_batch_size) + " --seq-length " + std::to_string(o.seq_length) +
             " --precision " + o.precision + " --steps " + std::to_string(o.pipeline_iters) +
             " --out " + dir.string() + " > " + log + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    m.error = "failed: " + command + "\n" + read_tail(log);
    return m;
  }
  // steps[step][rank], the warm-up left out.
  const int measured = o.pipeline_iters - o.pipeline_warmup;
  std::vector<std::vector<pipeline::StepTiming>> steps(static_cast<size_t>(measured),
                                                       std::vector<pipeline::StepTiming>(o.ranks));
  // Per rank: whole backwards, or (split schedules) BackwardInput and W, summed as medians.
  std::vector<std::vector<double>> rank_forward(o.ranks), rank_backward(o.ranks),
      rank_input(o.ranks), rank_weight(o.ranks);
  std::vector<std::vector<double>> waits(static_cast<size_t>(measured));
  for (int rank = 0; rank < o.ranks; ++rank) {
    std::ifstream in(dir / ("rank-" + std::to_string(rank) + ".jsonl"));
    std::string text;
    int lines = 0;
    while (std::getline(in, text)) {
      const auto line = nlohmann::json::parse(text);
      const int step = line.at("step").get<int>() - o.pipeline_warmup - 1;
      m.latency_s = line.at("p2p_s").get<double>();
      if (step < 0 || step >= measured) continue;
      pipeline::StepTiming& t = steps[static_cast<size_t>(step)][static_cast<size_t>(rank)];
      t.step_seconds = line.at("step_s").get<double>();
      t.schedule_seconds = line.at("schedule_s").get<double>();
      t.forward_seconds = line.at("forward_s").get<double>();
      t.backward_seconds = line.at("backward_s").get<double>();
      t.weight_seconds = line.at("weight_s").get<double>();
      t.wait_seconds = line.at("wait_s").get<double>();
      t.reduce_seconds = line.at("reduce_s").get<double>();
      t.forward_samples = line.at("forward_samples_s").get<std::vector<double>>();
      t.backward_samples = line.at("backward_samples_s").get<std::vector<double>>();
      t.backward_input_samples = line.at("backward_input_samples_s").get<std::vector<double>>();
      t.weight_samples = line.at("weight_samples_s").get<std::vector<double>>();
      for (double v : t.forward_samples) rank_forward[rank].push_back(1e3 * v);
      for (double v : t.backward_samples) rank_backward[rank].push_back(1e3 * v);
      for (double v : t.backward_input_samples) rank_input[rank].push_back(1e3 * v);
      for (double v : t.weight_samples) rank_weight[rank].push_back(1e3 * v);
      waits[static_cast<size_t>(step)].push_back(t.wait_seconds);
      ++lines;
    }
    if (lines != measured) {
      m.error = "rank " + std::to_string(rank) + " wrote " + std::to_string(lines) + " of " +
                std::to_string(measured) + " measured steps; log:\n" + read_tail(log);
      return m;
    }
  }
  m.comparison = pipeline::compare_bubble(m.schedule, steps, m.latency_s);
  m.tokens_per_s = static_cast<double>(sequences * o.seq_length) / m.comparison.measured_step;
  std::vector<double> longest_waits;
  for (const auto& w : waits) longest_waits.push_back(*std::max_element(w.begin(), w.end()));
  m.wait_s = bench::median(longest_waits);
  for (int rank = 0; rank < o.ranks; ++rank) {
    m.rank_forward_ms.push_back(bench::median(rank_forward[rank]));
    m.rank_backward_ms.push_back(rank_backward[rank].empty() ? bench::median(rank_input[rank]) +
                                                                   bench::median(rank_weight[rank])
                                                             : bench::median(rank_backward[rank]));
  }
  std::filesystem::remove_all(dir);
  return m;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

std::string join_ms(const std::vector<double>& values) {
  std::string text;
  char buffer[32];
  for (double v : values) {
    std::snprintf(buffer, sizeof(buffer), "%s%.1f", text.empty() ? "" : "/", v);
    text += buffer;
  }
  return text;
}

void print_pipeline_json(const Options& o, const PipelineMeasured& m) {
  nlohmann::json line = {{"impl", "octet"},
                         {"config", o.config},
                         {"layers", o.pipeline_layers},
                         {"vocab", o.pipeline_vocab},
                         {"precision", o.precision},
                         {"layout", m.name},
                         {"processes", o.ranks},
                         {"micro_batches", o.micro_batches}};
  if (!m.error.empty()) {
    line["error"] = m.error;
  } else {
    const pipeline::BubbleComparison& c = m.comparison;
    line["tokens_per_s"] = m.tokens_per_s;
    line["forward_ms"] = 1e3 * c.forward_seconds;
    line["backward_ms"] = 1e3 * c.backward_seconds;
    line["rank_forward_ms"] = m.rank_forward_ms;
    line["rank_backward_ms"] = m.rank_backward_ms;
    line["p2p_latency_ms"] = 1e3 * m.latency_s;
    line["wait_ms"] = 1e3 * m.wait_s;
    line["measured_makespan_ms"] = 1e3 * c.measured_makespan;
    line["measured_bubble_ms"] = 1e3 * c.measured_bubble;
    line["measured_bubble_fraction"] = c.measured_bubble_fraction;
    line["replayed_makespan_ms"] = 1e3 * c.replayed_makespan;
    line["replayed_bubble_ms"] = 1e3 * c.replayed_bubble;
    line["simulated_makespan_ms"] = 1e3 * c.simulated.makespan;
    line["simulated_bubble_ms"] = 1e3 * c.simulated.bubble;
    line["simulated_bubble_fraction"] = c.simulated.bubble_fraction;
    line["uniform_simulated_bubble_ms"] = 1e3 * c.uniform.bubble;
    line["bubble_ratio_measured_vs_simulated"] = c.bubble_ratio;
    line["bubble_fraction_difference"] = c.measured_bubble_fraction - c.simulated.bubble_fraction;
  }
  std::printf("%s\n", line.dump().c_str());
}

void print_pipeline_table(const Options& o, const std::vector<PipelineMeasured>& rows) {
  std::printf(
      "pipeline: %s cut to %lld layers, vocab %lld, %s, %d ranks x 1 thread, %d micro-batches "
      "of %lld x %lld (the same global batch); medians over steps %d..%d, a barrier before each\n",
      o.config.c_str(), (long long)o.pipeline_layers, (long long)o.pipeline_vocab,
      o.precision.c_str(), o.ranks, o.micro_batches,
      (long long)(o.micro_batch_size * o.ranks / o.micro_batches), (long long)o.seq_length,
      o.pipeline_warmup + 1, o.pipeline_iters);
  std::printf(
      "simulated with what the executor runs: measured F, B, W per stage (medians; ZB1P and "
      "DualPipe defer W), F&B = F + B, latency = measured one-way p2p of one activation\n");
  std::printf("%-22s %9s %13s %13s %7s %17s %29s %15s %8s %7s\n", "layout", "tokens/s",
              "F ms by rank", "B ms by rank", "p2p ms", "makespan ms m/s",
              "bubble ms m/replay/s/uniform", "bubble % m/s", "m/s", "m-s");
  for (const PipelineMeasured& m : rows) {
    if (!m.error.empty()) {
      std::printf("%-22s %s\n", m.name.c_str(), m.error.c_str());
      continue;
    }
    const pipeline::BubbleComparison& c = m.comparison;
    std::printf(
        "%-22s %9.0f %13s %13s %7.2f %8.0f/%-8.0f %6.0f/%6.0f/%6.0f/%-8.0f %6.1f/%-8.1f %7.2fx "
        "%6.1f\n",
        m.name.c_str(), m.tokens_per_s, join_ms(m.rank_forward_ms).c_str(),
        join_ms(m.rank_backward_ms).c_str(), 1e3 * m.latency_s, 1e3 * c.measured_makespan,
        1e3 * c.simulated.makespan, 1e3 * c.measured_bubble, 1e3 * c.replayed_bubble,
        1e3 * c.simulated.bubble, 1e3 * c.uniform.bubble, 100 * c.measured_bubble_fraction,
        100 * c.simulated.bubble_fraction, c.bubble_ratio,
        100 * (c.measured_bubble_fraction - c.simulated.bubble_fraction));
  }
  std::printf(
      "m = measured (the longest rank's schedule time minus the least compute of a rank), s = "
      "simulated with per-stage costs, uniform = simulated with one F, B, W for all stages, "
      "replay = the schedule replayed with each action's measured duration; m-s in points of "
      "bubble %%\n");
  std::printf("\n");
  std::fflush(stdout);
}

void print_layouts_json(const Options& o, const std::vector<LayoutRounds>& layouts,
                        const std::vector<PeerRounds>& peers) {
  for (const LayoutRounds& r : layouts) {
    nlohmann::json line = {{"impl", "octet"},
                           {"config", o.config},
                           {"precision", o.precision},
                           {"layout", r.layout.name},
                           {"processes", r.layout.processes},
                           {"rounds", o.rounds}};
    if (r.tokens_per_s.empty()) {
      line["error"] = r.errors.empty() ? std::string("no measured round") : r.errors.front();
      std::printf("%s\n", line.dump().c_str());
      continue;
    }
    if (!r.errors.empty()) {
      line["failed_rounds"] = r.failed_rounds;
      line["round_errors"] = r.errors;
    }
    line["tokens_per_s"] = bench::median(r.tokens_per_s);
    line["tokens_per_s_rounds"] = r.tokens_per_s;
    put_ratio(line, "ratio_vs_single_process", r.vs_single);
    if (r.data_parallel) {
      line["grad_comm_ms_per_step"] = bench::json_number(bench::median_or_nan(r.grad_comm_ms));
      line["grad_comm_exposed_ms_per_step"] =
          bench::json_number(bench::median_or_nan(r.grad_exposed_ms));
      line["grad_comm_hidden_fraction"] =
          bench::json_number(bench::median_or_nan(r.hidden_fraction));
      line["param_gather_ms_per_step"] =
          bench::json_number(bench::median_or_nan(r.param_gather_ms));
    }
    std::printf("%s\n", line.dump().c_str());
  }
  for (const PeerRounds& p : peers) {
    if (p.last.is_null()) continue;  // the peer never measured this layout
    nlohmann::json line = p.last;    // its fields of the last round, figures as medians
    line["tokens_per_s"] = bench::json_number(bench::median_or_nan(p.tokens_per_s));
    line["tokens_per_s_rounds"] = p.tokens_per_s;
    if (!p.step_ms.empty()) line["step_ms"] = bench::median(p.step_ms);
    line["rounds"] = o.rounds;
    line["octet_tokens_per_s"] =
        bench::json_number(bench::median_or_nan(layouts[p.octet_layout].tokens_per_s));
    put_ratio(line, "octet_vs_torch", p.octet_vs_torch);
    std::printf("%s\n", line.dump().c_str());
  }
}

std::string join_rounds(const std::vector<int>& rounds) {
  std::string text;
  for (int r : rounds) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

void print_layouts_table(const Options& o, const std::vector<LayoutRounds>& layouts,
                         const std::vector<PeerRounds>& peers) {
  std::printf(
      "bench parallel: %s, %s, micro-batch %lld x seq %lld, global batch %lld, %d cores; %d "
      "rounds (octet's layouts, then the peer; the peer first in odd rounds)\n"
      "tokens/s: median over rounds of each run's median over steps %lld..%lld; ratios: median "
      "(min..max) of per-round ratios; comm: medians over rounds of per-step means\n",
      o.config.c_str(), o.precision.c_str(), (long long)o.micro_batch_size, (long long)o.seq_length,
      (long long)(o.micro_batch_size * o.ranks), o.ranks, o.rounds, (long long)o.warmup + 1,
      (long long)o.iters);
  std::printf("%-34s %10s %21s %14s %14s %8s %12s\n", "layout", "tokens/s", "vs 1 proc",
              "grad comm ms", "exposed ms", "hidden", "gather ms");
  for (const LayoutRounds& r : layouts) {
    if (r.tokens_per_s.empty()) {
      std::printf("%-34s %s\n", r.layout.name.c_str(),
                  r.errors.empty() ? "no measured round" : r.errors.front().c_str());
      continue;
    }
    std::printf("%-34s %10.0f %21s", r.layout.name.c_str(), bench::median(r.tokens_per_s),
                bench::median_range(r.vs_single).c_str());
    if (r.data_parallel) {
      std::printf(" %14.1f %14.1f %7.0f%% %12.1f\n", bench::median_or_nan(r.grad_comm_ms),
                  bench::median_or_nan(r.grad_exposed_ms),
                  100.0 * bench::median_or_nan(r.hidden_fraction),
                  bench::median_or_nan(r.param_gather_ms));
    } else {
      std::printf(" %14s %14s %8s %12s\n", "-", "-", "-", "-");
    }
  }
  // A layout that failed in some rounds only: its figures are the other rounds'.
  for (const LayoutRounds& r : layouts) {
    if (r.tokens_per_s.empty() || r.errors.empty()) continue;
    std::printf("%s failed in round(s) %s of %d, its figures are the other rounds': %s\n",
                r.layout.name.c_str(), join_rounds(r.failed_rounds).c_str(), o.rounds,
                r.errors.front().c_str());
  }
  std::printf("\n");
  const PeerRounds* measured_peer = nullptr;
  for (const PeerRounds& p : peers) {
    if (!p.last.is_null() && measured_peer == nullptr) measured_peer = &p;
  }
  if (measured_peer != nullptr) {
    std::printf("PyTorch 1.13 peer, same model and global batch (%s), in the same rounds:\n",
                measured_peer->last.value("precision", "").c_str());
    std::printf("%-34s %11s %12s %21s\n", "layout", "torch tok/s", "octet tok/s", "octet/torch");
    for (const PeerRounds& p : peers) {
      std::printf("%-34s %11.0f %12.0f %21s\n", p.name.c_str(),
                  bench::median_or_nan(p.tokens_per_s),
                  bench::median_or_nan(layouts[p.octet_layout].tokens_per_s),
                  bench::median_range(p.octet_vs_torch).c_str());
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

void run(const Options& o) {
  OCTET_CHECK(o.ranks >= 2, "--ranks expected >= 2, got ", o.ranks);
  OCTET_CHECK(o.rounds >= 1, "--rounds expected >= 1, got ", o.rounds);
  OCTET_CHECK(o.iters > o.warmup, "--iters (", o.iters, ") must exceed --warmup (", o.warmup, ")");
  OCTET_CHECK(o.pipeline_iters > o.pipeline_warmup, "--pipeline-iters (", o.pipeline_iters,
              ") must exceed --pipeline-warmup (", o.pipeline_warmup, ")");
  const std::string n = std::to_string(o.ranks);
  std::vector<LayoutRounds> layouts;
  std::vector<PeerRounds> peers;
  if (!o.pipeline_only) {
    const Layout all[] = {
        {"1 process x " + n + " threads", 1, ""},
        {"DP=" + n + ", reduce after backward", o.ranks, "--no-overlap-grad-reduce"},
        {"DP=" + n + ", overlapped", o.ranks, ""},
        {"DP=" + n + ", ZeRO-1, overlapped", o.ranks, "--use-distributed-optimizer"},
        {"TP=" + n + ", sequence-parallel", o.ranks,
         "--tensor-model-parallel-size " + n + " --sequence-parallel"},
        {"CP=" + n + ", ring attention (p2p)", o.ranks, "--context-parallel-size " + n},
        {"CP=" + n + ", Ulysses (a2a)", o.ranks,
         "--context-parallel-size " + n + " --cp-comm-type a2a"},
    };
    for (const Layout& layout : all) {
      LayoutRounds r;
      r.layout = layout;
      r.data_parallel = is_data_parallel(layout);
      layouts.push_back(r);
    }
    // octet's layout beside each torch one: the single process, and DP overlapped (as DDP).
    auto add_peer = [&](const std::string& impl, const std::string& name, size_t octet_layout) {
      PeerRounds p;
      p.impl = impl;
      p.name = name;
      p.octet_layout = octet_layout;
      peers.push_back(p);
    };
    if (!o.no_torch) {
      add_peer("torch_single", "1 process x " + n + " threads", 0);
      for (size_t i = 0; i < layouts.size(); ++i) {
        const Layout& layout = layouts[i].layout;
        if (layout.flags.empty() && layout.processes > 1) {
          add_peer("torch_ddp", "DP=" + n + " overlapped (torch DDP, gloo)", i);
        }
      }
    }
  }
  const double peak = layouts.empty() ? 0.0 : measure_bf16_peak_gflops();
  for (int round = 0; !layouts.empty() && round < o.rounds; ++round) {
    std::vector<Measured> measured;
    std::vector<nlohmann::json> torch;
    auto run_octet = [&] {
      for (const LayoutRounds& r : layouts) {
        if (!o.json) {
          std::fprintf(stderr, "bench parallel: round %d/%d: %s ...\n", round + 1, o.rounds,
                       r.layout.name.c_str());
        }
        measured.push_back(run_layout(o, r.layout, peak));
        if (!measured.back().error.empty()) {
          std::fprintf(stderr, "bench parallel: round %d/%d: %s failed\n", round + 1, o.rounds,
                       r.layout.name.c_str());
        }
      }
    };
    auto run_peer = [&] {
      if (peers.empty()) return;
      if (!o.json) {
        std::fprintf(stderr, "bench parallel: round %d/%d: PyTorch peer (1 process, DDP) ...\n",
                     round + 1, o.rounds);
      }
      torch = measure_torch(o);
    };
    if (round % 2 == 1) run_peer();  // who goes first alternates round by round
    run_octet();
    if (round % 2 == 0) run_peer();
    add_round(round, measured, torch, layouts, peers);
    if (!o.json) {
      std::fprintf(stderr, "bench parallel: round %d/%d tokens/s:", round + 1, o.rounds);
      for (const Measured& m : measured) {
        std::fprintf(stderr, " %s %.0f;", m.layout.name.c_str(), m.tokens_per_s);
      }
      for (const nlohmann::json& t : torch) {
        std::fprintf(stderr, " %s %.0f;", t.value("impl", "").c_str(),
                     t.value("tokens_per_s", NAN));
      }
      std::fprintf(stderr, "\n");
    }
  }
  // The pipeline layouts have no peer: one run each, after the rounds.
  std::vector<PipelineMeasured> pipelines;
  for (const std::string& schedule : split_list(o.pipeline_schedules)) {
    if (!o.json) std::fprintf(stderr, "bench parallel: PP=%d %s ...\n", o.ranks, schedule.c_str());
    pipelines.push_back(run_pipeline_layout(o, schedule));
  }
  if (o.json) {
    print_layouts_json(o, layouts, peers);
    for (const PipelineMeasured& m : pipelines) print_pipeline_json(o, m);
    return;
  }
  if (!layouts.empty()) print_layouts_table(o, layouts, peers);
  print_pipeline_table(o, pipelines);
  // The pipeline schedules, from the simulator.
  const std::string command = bench::self_exe() + " schedule --pipeline-model-parallel-size " +
                              std::to_string(o.pipeline_ranks) + " --num-microbatches " +
                              std::to_string(o.micro_batches);
  if (std::system(command.c_str()) != 0) {
    std::printf("(octet schedule failed: %s)\n", command.c_str());
  }
}

}  // namespace

void register_bench_parallel(CLI::App& bench) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd =
      bench.add_subcommand("parallel",
                           "Parallel layouts of one GPT training run: tokens/s, communication "
                           "hidden, pipeline bubbles measured vs simulated");
  cmd->add_option("--config", o->config, "Config name in configs/ or a JSON path");
  cmd->add_option("--ranks", o->ranks, "Processes (and cores) per layout")->check(at_least(1));
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per micro-batch")
      ->check(at_least(1));
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence")->check(at_least(1));
  cmd->add_option("--iters", o->iters, "Training steps per layout")->check(at_least(1));
  cmd->add_option("--warmup", o->warmup, "Steps left out of the figures")->check(at_least(0));
  cmd->add_option("--rounds", o->rounds,
                  "Rounds, each running every layout and the PyTorch peer in turn (ratios: "
                  "median and spread of per-round ratios; default 2, as each layout is a "
                  "multi-second mpirun run)")
      ->check(at_least(1));
  cmd->add_option("--precision", o->precision, "fp32 | bf16 | fp8");
  cmd->add_option("--pipeline-model-parallel-size", o->pipeline_ranks,
                  "Ranks of the simulated pipeline schedule table")
      ->check(at_least(1));
  cmd->add_option("--num-microbatches", o->micro_batches, "Micro-batches of that table")
      ->check(at_least(1));
  cmd->add_option("--pipeline-schedules", o->pipeline_schedules,
                  "Measured pipeline layouts (PP = --ranks), comma-separated");
  cmd->add_option("--virtual-pipeline-model-parallel-size", o->virtual_stages,
                  "Chunks per rank of the interleaved layout")
      ->check(at_least(1));
  cmd->add_option("--pipeline-layers", o->pipeline_layers,
                  "Layers of the pipelined model (a multiple of its stages)")
      ->check(at_least(1));
  cmd->add_option("--pipeline-vocab", o->pipeline_vocab,
                  "Vocabulary of the pipelined model (small: balanced stages)")
      ->check(at_least(1));
  cmd->add_option("--pipeline-iters", o->pipeline_iters, "Steps per pipeline layout")
      ->check(at_least(1));
  cmd->add_option("--pipeline-warmup", o->pipeline_warmup, "Pipeline steps left out")
      ->check(at_least(0));
  cmd->add_flag("--pipeline-only", o->pipeline_only, "Skip the data-parallel layouts");
  cmd->add_flag("--no-torch", o->no_torch, "Skip the PyTorch peer (bench/peers/torch_ddp.py)");
  cmd->add_flag("--json", o->json, "One JSON object per layout");
  cmd->callback([o] { run(*o); });

  // The per-rank driver of the pipeline layouts, started by `bench parallel` under mpirun.
  auto w = std::make_shared<WorkerOptions>();
  CLI::App* worker = bench.add_subcommand(
      "pipeline-worker", "One rank of a measured pipeline layout (run by `bench parallel`)");
  worker->group("");  // hidden
  worker->add_option("--config", w->config, "Config name in configs/ or a JSON path");
  worker->add_option("--layers", w->layers, "Layers (override the config's)");
  worker->add_option("--vocab", w->vocab, "Vocabulary (override the config's)");
  worker->add_option("--schedule", w->schedule, "1f1b|interleaved|zb1p|dualpipe|dualpipev");
  worker->add_option("--virtual-stages", w->virtual_stages, "Chunks per rank (interleaved)");
  worker->add_option("--micro-batches", w->micro_batches, "Micro-batches per step");
  worker->add_option("--micro-batch-size", w->micro_batch_size, "Sequences per micro-batch");
  worker->add_option("--seq-length", w->seq_length, "Tokens per sequence");
  worker->add_option("--precision", w->precision, "fp32 | bf16");
  worker->add_option("--steps", w->steps, "Steps, warm-up included");
  worker->add_option("--out", w->out, "Folder for rank-R.jsonl")->required();
  worker->callback([w] { run_pipeline_worker(*w); });
}

}  // namespace octet::cli
