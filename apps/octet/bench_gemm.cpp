// `octet bench gemm`: GFLOP/s of every GEMM precision beside PyTorch's torch.matmul, measured
// in the same invocation (bench/peers/torch_gemm.py, kept running), shape by shape in rounds
// (ours then the peer's, the peer's then ours, ...), with the ratios the goals speak of as
// medians of per-round ratios.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/cpu_features.h"
#include "octet/gemm.h"
#include "octet/recipe.h"

namespace octet::cli {
namespace {

// Square shapes, a Transformer FFN, then gpt-mini (hidden 384) and GPT-2 small (hidden 768)
// Linear layers at 2048 tokens: qkv, attention out, FFN up, FFN down, LM head.
constexpr const char* kDefaultShapes =
    "512x512x512,1024x1024x1024,2048x2048x2048,4096x4096x4096,8192x3072x768,"
    "2048x1152x384,2048x384x384,2048x1536x384,2048x384x1536,2048x50257x384,"
    "2048x2304x768,2048x768x768,2048x3072x768,2048x768x3072,2048x50257x768";
constexpr double kNaiveSliceFlops = 0.4e9;  // naive_f32 times only this much of a big GEMM
constexpr double kTorchF32SliceGflop = 2.0;

struct Options {
  std::string shapes = kDefaultShapes;
  int rounds = 3;
  int repeats = 3;
  int warmup = 1;
  bool json = false;
  bool no_torch = false;
};

struct GemmSize {
  int64_t m, n, k;
  double flops() const { return 2.0 * static_cast<double>(m) * n * k; }
  std::string name() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  }
};

struct Result {
  double gflops = 0.0;
  double median_ms = 0.0;
  int repeats = 0;
  int64_t rows = 0;  // rows of M timed (less than M for sliced baselines)
};

// results[shape name][dtype]: medians over the rounds
using Results = std::map<std::string, std::map<std::string, Result>>;
// ratios[shape name][ratio name]: one per round ("b/tb": bf16 / torch_bf16, ...)
using Ratios = std::map<std::string, std::map<std::string, std::vector<double>>>;

// Ratios of one round's figures: numerator dtype / denominator dtype.
struct RatioSpec {
  const char* name;
  const char* numerator;
  const char* denominator;
};
constexpr RatioSpec kRatios[] = {{"b/tb", "bf16", "torch_bf16"},  {"f/tf", "f32", "torch_f32"},
                                 {"dl/b", "fp8_delayed", "bf16"}, {"mx/b", "fp8_mxfp8", "bf16"},
                                 {"bk/b", "fp8_block", "bf16"},   {"b/naive", "bf16", "naive_f32"}};

std::vector<GemmSize> parse_shapes(const std::string& text) {
  std::vector<GemmSize> sizes;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    begin = end + 1;
    if (item.empty()) continue;
    int64_t dims[3] = {0, 0, 0};
    size_t pos = 0;
    for (int d = 0; d < 3; ++d) {
      size_t used = 0;
      try {
        dims[d] = std::stoll(item.substr(pos), &used);
      } catch (const std::exception&) {
        used = 0;
      }
      pos += used;
      const bool separator_ok =
          d == 2 ? pos == item.size() : pos < item.size() && (item[pos] == 'x' || item[pos] == 'X');
      OCTET_CHECK(used > 0 && dims[d] > 0 && separator_ok,
                  "bench gemm: --shapes expected MxNxK[,MxNxK...] with positive sizes, got '", item,
                  "'");
      ++pos;
    }
    sizes.push_back({dims[0], dims[1], dims[2]});
  }
  OCTET_CHECK(!sizes.empty(), "bench gemm: --shapes is empty");
  return sizes;
}

// Fewer repeats for big GEMMs keep the default run within a few minutes on two cores.
int repeats_for(const GemmSize& size, int repeats) {
  if (size.flops() > 3e10) return std::min(repeats, 2);
  if (size.flops() > 4e9) return std::min(repeats, 3);
  return repeats;
}

template <typename Run>
Result time_median(Run&& run, int warmup, int repeats, double flops) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> seconds;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const size_t mid = seconds.size() / 2;
  const double median =
      seconds.size() % 2 == 1 ? seconds[mid] : 0.5 * (seconds[mid - 1] + seconds[mid]);
  return {flops / median / 1e9, median * 1e3, repeats, 0};
}

// Uniform [-1, 1) from a xorshift generator: fast enough for the 38M-element LM head.
Tensor random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  float* data = t.data<float>();
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    data[i] = static_cast<float>(state >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
  return t;
}

float max_abs(const Tensor& t) {
  float amax = 0.0f;
  for (float v : t.to_floats()) amax = std::max(amax, std::fabs(v));
  return amax;
}

std::map<std::string, Result> measure_ours(const GemmSize& size, const Options& options) {
  const int repeats = repeats_for(size, options.repeats);
  const double flops = size.flops();
  const Tensor a = random_matrix(size.m, size.k, 1);
  const Tensor w = random_matrix(size.n, size.k, 2);  // a Linear weight [out, in] = [N, K]
  Tensor c = Tensor::empty({size.m, size.n}, DType::F32);
  std::map<std::string, Result> row;

  row["f32"] = time_median([&] { gemm(a, w, c, false, true); }, options.warmup, repeats, flops);
  {
    const Tensor a16 = a.to(DType::BF16);
    PackedWeight packed(w.to(DType::BF16), true);
    gemm(a16, packed, c, false);  // packs the weight, outside the timed loop
    row["bf16"] = time_median([&] { gemm(a16, packed, c, false); }, options.warmup, repeats, flops);
  }
  // FP8: each weight is quantized and packed once (once per optimizer step in training) and
  // the activation is quantized once, both outside the timed loop; the timed call widens the
  // FP8 activation to BF16 (exact) and runs the matmul against the packed weight.
  struct Fp8Case {
    const char* dtype;
    Quantizer activation;
    Quantizer weight;
  };
  const Fp8Case cases[] = {
      {"fp8_delayed", Quantizer::fixed(DType::E4M3, fp8_max(DType::E4M3) / max_abs(a)),
       Quantizer::fixed(DType::E4M3, fp8_max(DType::E4M3) / max_abs(w))},
      {"fp8_mxfp8", Quantizer::mxfp8(DType::E4M3), Quantizer::mxfp8(DType::E4M3)},
      {"fp8_block", Quantizer::block(DType::E4M3, 1, 128), Quantizer::block(DType::E4M3, 128, 128)},
  };
  for (const Fp8Case& fp8 : cases) {
    const Float8Tensor a8 = fp8.activation.quantize(a);
    PackedWeight packed(fp8.weight.quantize(w), true);
    gemm(a8, packed, c, false);
    row[fp8.dtype] =
        time_median([&] { gemm(a8, packed, c, false); }, options.warmup, repeats, flops);
  }
  // The naive loop on a slice of rows (the same per-row work), scaled to the whole GEMM.
  const int64_t rows = std::clamp<int64_t>(
      static_cast<int64_t>(kNaiveSliceFlops / (2.0 * size.n * size.k)), 1, size.m);
  const Tensor b_kn = random_matrix(size.k, size.n, 3);
  Result naive = time_median(
      [&] {
        gemm_naive_f32(a.data<float>(), b_kn.data<float>(), c.data<float>(), rows, size.n, size.k);
      },
      0, 1, 2.0 * rows * size.n * size.k);
  naive.rows = rows;
  row["naive_f32"] = naive;
  for (auto& [dtype, result] : row) {
    if (result.rows == 0) result.rows = size.m;
  }
  return row;
}

// The PyTorch peer, asked for one shape at a time; nothing once it is absent or stopped.
class TorchPeer {
 public:
  explicit TorchPeer(const Options& options) {
    if (options.no_torch) return;
    const std::filesystem::path script = bench::find_peer_script("torch_gemm.py");
    if (script.empty()) {
      std::fprintf(stderr, "bench gemm: bench/peers/torch_gemm.py not found; no torch figures\n");
      return;
    }
    running_ =
        process_.start({"/usr/bin/python3", script.string(), "--warmup",
                        std::to_string(options.warmup), "--threads", std::to_string(num_threads()),
                        "--f32-max-gflop", std::to_string(kTorchF32SliceGflop)});
    if (!running_) std::fprintf(stderr, "bench gemm: the torch peer did not start\n");
  }

  std::map<std::string, Result> measure(const GemmSize& size, int repeats) {
    std::map<std::string, Result> row;
    if (!running_) return row;
    const nlohmann::json request = {
        {"m", size.m}, {"n", size.n}, {"k", size.k}, {"repeats", repeats}};
    const auto answer = process_.ask(request.dump());
    if (!answer || !answer->is_object()) {
      running_ = false;
      std::fprintf(stderr, "bench gemm: the torch peer stopped; no more torch figures\n");
      return row;
    }
    for (const auto& [dtype, r] : answer->items()) {
      row[dtype] = {r.at("gflops").get<double>(), r.at("median_ms").get<double>(),
                    r.at("repeats").get<int>(), r.value("rows", size.m)};
    }
    return row;
  }

 private:
  bench::PeerProcess process_;
  bool running_ = false;
};

const char* const kDtypes[] = {"f32",       "bf16",      "fp8_delayed", "fp8_mxfp8",
                               "fp8_block", "naive_f32", "torch_f32",   "torch_bf16"};

void print_json(const std::vector<GemmSize>& sizes, Results& results, Ratios& ratios) {
  for (const GemmSize& size : sizes) {
    for (const char* dtype : kDtypes) {
      auto& row = results[size.name()];
      if (!row.count(dtype)) continue;
      const Result& r = row[dtype];
      const nlohmann::json line = {
          {"m", size.m},          {"n", size.n},          {"k", size.k},
          {"dtype", dtype},       {"gflops", r.gflops},   {"median_ms", r.median_ms},
          {"repeats", r.repeats}, {"rows_timed", r.rows}, {"threads", num_threads()}};
      std::printf("%s\n", line.dump().c_str());
    }
    // The ratios: medians of the per-round ratios, and the rounds'.
    for (const RatioSpec& spec : kRatios) {
      const std::vector<double>& rounds = ratios[size.name()][spec.name];
      if (rounds.empty()) continue;
      const nlohmann::json line = {{"m", size.m},
                                   {"n", size.n},
                                   {"k", size.k},
                                   {"ratio", spec.name},
                                   {"median", bench::median(rounds)},
                                   {"rounds", rounds}};
      std::printf("%s\n", line.dump().c_str());
    }
  }
}

void print_table(const std::vector<GemmSize>& sizes, Results& results, Ratios& ratios,
                 const Options& options) {
  auto value = [&](const GemmSize& size, const char* dtype) {
    auto& row = results[size.name()];
    return row.count(dtype) ? row[dtype].gflops : NAN;
  };
  auto ratio = [&](const GemmSize& size, const char* name) {
    const std::vector<double>& rounds = ratios[size.name()][name];
    return rounds.empty() ? NAN : bench::median(rounds);
  };
  std::printf(
      "GFLOP/s, %d threads: median over %d rounds (ours and torch in turn, who goes first\n"
      "alternating) of the median of repeats after warmup (fewer repeats above 4 GFLOP);\n"
      "ratios: medians of per-round ratios\n",
      num_threads(), options.rounds);
  std::printf("%-18s %7s %7s %7s %7s %7s %6s %7s %7s | %6s %6s %6s %6s %6s %7s\n", "MxNxK", "f32",
              "bf16", "fp8_dl", "fp8_mx", "fp8_bk", "naive", "t_f32", "t_bf16", "b/tb", "f/tf",
              "dl/b", "mx/b", "bk/b", "b/naive");
  double peak = 0.0;
  std::string peak_shape;
  for (const GemmSize& size : sizes) {
    const double bf16 = value(size, "bf16");
    if (bf16 > peak) {
      peak = bf16;
      peak_shape = size.name();
    }
    std::printf(
        "%-18s %7.1f %7.1f %7.1f %7.1f %7.1f %6.2f %7.1f %7.1f | %6.2f %6.2f %6.2f %6.2f %6.2f "
        "%7.0f\n",
        size.name().c_str(), value(size, "f32"), bf16, value(size, "fp8_delayed"),
        value(size, "fp8_mxfp8"), value(size, "fp8_block"), value(size, "naive_f32"),
        value(size, "torch_f32"), value(size, "torch_bf16"), ratio(size, "b/tb"),
        ratio(size, "f/tf"), ratio(size, "dl/b"), ratio(size, "mx/b"), ratio(size, "bk/b"),
        ratio(size, "b/naive"));
  }
  // The spread of the headline ratio, shape by shape.
  std::printf("b/tb per shape, median (min..max) over rounds:");
  for (const GemmSize& size : sizes) {
    const std::vector<double>& rounds = ratios[size.name()]["b/tb"];
    if (!rounds.empty()) {
      std::printf(" %s %s;", size.name().c_str(), bench::median_range(rounds).c_str());
    }
  }
  std::printf("\n");
  std::printf("measured BF16 peak: %.1f GFLOP/s (%s)\n", peak, peak_shape.c_str());
  std::printf(
      "f32: gemm(A, W^T), plain weight. bf16: A bf16 x PackedWeight bf16 -> f32.\n"
      "fp8_dl (per-tensor E4M3, delayed-style fixed scales), fp8_mx (MXFP8 E4M3), fp8_bk\n"
      "(1x128 x 128x128 E4M3): FP8 A x FP8 PackedWeight -> f32; the weight is quantized and\n"
      "packed and A quantized once outside the timed loop; timed: widening A + matmul.\n"
      "naive: gemm_naive_f32 timed once on a slice of rows (%.1f GFLOP) and scaled.\n"
      "t_f32 / t_bf16: PyTorch torch.matmul in this run (t_f32 on a row slice above %.0f "
      "GFLOP).\n",
      kNaiveSliceFlops / 1e9, kTorchF32SliceGflop);
}

void run_bench(const Options& options) {
  OCTET_CHECK(options.rounds >= 1, "bench gemm: --rounds expected >= 1, got ", options.rounds);
  OCTET_CHECK(options.repeats >= 1, "bench gemm: --repeats expected >= 1, got ", options.repeats);
  OCTET_CHECK(options.warmup >= 0, "bench gemm: --warmup expected >= 0, got ", options.warmup);
  const std::vector<GemmSize> sizes = parse_shapes(options.shapes);
  Results results;
  Ratios ratios;
  TorchPeer peer(options);
  for (const GemmSize& size : sizes) {
    std::map<std::string, std::vector<Result>> rounds;  // by dtype
    for (int round = 0; round < options.rounds; ++round) {
      std::map<std::string, Result> row;
      auto run_peer = [&] {
        for (auto& [dtype, r] : peer.measure(size, repeats_for(size, options.repeats))) {
          row[dtype] = r;
        }
      };
      if (round % 2 == 1) run_peer();
      for (auto& [dtype, r] : measure_ours(size, options)) row[dtype] = r;
      if (round % 2 == 0) run_peer();
      for (const RatioSpec& spec : kRatios) {
        if (row.count(spec.numerator) && row.count(spec.denominator)) {
          ratios[size.name()][spec.name].push_back(row[spec.numerator].gflops /
                                                   row[spec.denominator].gflops);
        }
      }
      for (auto& [dtype, r] : row) rounds[dtype].push_back(r);
    }
    for (auto& [dtype, list] : rounds) {  // each figure's median over the rounds
      std::vector<double> gflops, ms;
      Result median = list.front();
      median.repeats = 0;
      for (const Result& r : list) {
        gflops.push_back(r.gflops);
        ms.push_back(r.median_ms);
        median.repeats += r.repeats;
      }
      median.gflops = bench::median(gflops);
      median.median_ms = bench::median(ms);
      results[size.name()][dtype] = median;
    }
    if (!options.json) std::fprintf(stderr, "measured %s\n", size.name().c_str());
  }
  if (options.json) {
    print_json(sizes, results, ratios);
  } else {
    print_table(sizes, results, ratios, options);
  }
}

}  // namespace

void register_bench_gemm(CLI::App& bench) {
  CLI::App* gemm_command =
      bench.add_subcommand("gemm", "GEMM GFLOP/s: f32, bf16, fp8 recipes, naive, PyTorch");
  auto options = std::make_shared<Options>();
  gemm_command->add_option("--shapes", options->shapes, "MxNxK[,MxNxK...]")->capture_default_str();
  gemm_command->add_option("--rounds", options->rounds, "rounds per shape, ours and torch in turn")
      ->capture_default_str()
      ->check(at_least(1));
  gemm_command->add_option("--repeats", options->repeats, "timed runs per case and round (median)")
      ->capture_default_str()
      ->check(at_least(1));
  gemm_command->add_option("--warmup", options->warmup, "untimed runs first")
      ->capture_default_str()
      ->check(at_least(0));
  gemm_command->add_flag("--json", options->json, "one JSON object per line");
  gemm_command->add_flag("--no-torch", options->no_torch, "skip the PyTorch peer");
  gemm_command->callback([options] { run_bench(*options); });
}

}  // namespace octet::cli
