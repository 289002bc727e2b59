// `octet bench converge`: the convergence report. One model trained on the same tokens, with
// the same seed and data order, once per numeric format (FP32, BF16, the four FP8 recipes, FP8
// attention, NVFP4, MXFP4); a table of final train and validation loss with each one's gap to
// BF16 and its tokens/s, and one SVG with every validation curve overlaid.
//
// Resumable and appendable: each variant lives in OUT/VARIANT (metrics, a checkpoint every
// --eval-interval steps while it runs, result.json when it is done). A variant whose
// result.json was made with the same settings is reused; an interrupted one continues from its
// checkpoint; so a report can be built over several invocations, a few variants at a time.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "octet/error.h"
#include "octet/files.h"
#include "octet/train.h"

namespace octet::cli {
namespace {

namespace fs = std::filesystem;

struct Variant {
  const char* name;
  const char* precision;
  const char* fp8_recipe;  // "" unless fp8
  bool fp8_dpa;
  const char* fp4_recipe;  // "" unless fp4
  double goal_percent;     // allowed validation-loss gap to BF16 (0: no goal)
};

constexpr Variant kVariants[] = {
    {"fp32", "fp32", "", false, "", 0},
    {"bf16", "bf16", "", false, "", 0},
    {"fp8-delayed", "fp8", "delayed", false, "", 1},
    {"fp8-current", "fp8", "current", false, "", 1},
    {"fp8-mxfp8", "fp8", "mxfp8", false, "", 1},
    {"fp8-block", "fp8", "block", false, "", 1},
    {"fp8-dpa", "fp8", "delayed", true, "", 1},
    {"nvfp4", "fp4", "", false, "nvfp4", 2},
    {"mxfp4", "fp4", "", false, "mxfp4", 0},
};

const Variant& find_variant(const std::string& name) {
  for (const Variant& v : kVariants) {
    if (name == v.name) return v;
  }
  std::string known;
  for (const Variant& v : kVariants) known += std::string(known.empty() ? "" : ", ") + v.name;
  fail(detail::concat("--variants: unknown variant '", name, "'; expected some of ", known));
}

struct Options {
  std::string config = "gpt-mini";
  std::string train_data, valid_data;
  bool mock_data = false;
  std::string vocab_dir;  // the tokenizer the shards were made with (sets the vocabulary)
  std::string out = "out/converge";
  std::string variants =
      "fp32,bf16,fp8-delayed,fp8-current,fp8-mxfp8,fp8-block,fp8-dpa,nvfp4,mxfp4";
  int64_t train_iters = 500;
  int64_t micro_batch_size = 8;
  int64_t seq_length = 256;
  double lr = 1e-3, min_lr = 1e-4;
  int64_t lr_warmup_iters = 20;
  int64_t eval_interval = 50;
  int64_t eval_iters = 8;
  uint64_t seed = 1234;
  double peak_gflops = 0;  // 0 = measure once, for every variant's MFU
};

// Everything a variant's numbers depend on besides its format: results made with other
// settings are not reused.
nlohmann::json settings_of(const Options& o) {
  return {{"config", fs::absolute(o.config).string()},
          {"train_data", o.mock_data ? "mock" : fs::absolute(o.train_data).string()},
          {"valid_data", o.valid_data.empty() ? "" : fs::absolute(o.valid_data).string()},
          {"vocab_dir", o.vocab_dir.empty() ? "" : fs::absolute(o.vocab_dir).string()},
          {"train_iters", o.train_iters},
          {"micro_batch_size", o.micro_batch_size},
          {"seq_length", o.seq_length},
          {"lr", o.lr},
          {"min_lr", o.min_lr},
          {"lr_warmup_iters", o.lr_warmup_iters},
          {"eval_interval", o.eval_interval},
          {"eval_iters", o.eval_iters},
          {"seed", o.seed}};
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  OCTET_CHECK(in.good(), "bench converge: cannot read '", path.string(), "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(detail::concat("bench converge: '", path.string(), "' is not valid JSON (", e.what(),
                        "); delete it to rerun that variant"));
  }
}

// Written as PATH.tmp and renamed: a result file is whole or absent.
void write_json(const fs::path& path, const nlohmann::json& value) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << value.dump(2) << "\n";
    OCTET_CHECK(out.good(), "bench converge: cannot write '", tmp.string(), "'");
  }
  fs::rename(tmp, path);
}

// Every metrics record of a variant by step: the files of earlier, interrupted attempts
// (metrics.N.jsonl) first, so the records of the attempt that resumed replace theirs.
std::map<int64_t, nlohmann::json> read_metrics(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("metrics.", 0) == 0 && name.size() > 14 &&
        name.compare(name.size() - 6, 6, ".jsonl") == 0 && name != "metrics.jsonl") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
    auto attempt = [](const fs::path& p) {
      const std::string n = p.filename().string();
      return std::stoll(n.substr(8, n.size() - 14));
    };
    return attempt(a) < attempt(b);
  });
  if (fs::exists(dir / "metrics.jsonl")) files.push_back(dir / "metrics.jsonl");
  std::map<int64_t, nlohmann::json> by_step;
  for (const fs::path& file : files) {
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_discarded() || !record.contains("step")) continue;  // a torn last line
      by_step[record["step"].get<int64_t>()] = record;
    }
  }
  return by_step;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The result of a finished variant, from its metrics: final train loss (mean of the last 10
// steps), final validation loss, median tokens/s, and both curves.
nlohmann::json summarize(const fs::path& dir, const nlohmann::json& settings) {
  const std::map<int64_t, nlohmann::json> metrics = read_metrics(dir);
  std::vector<double> losses, speeds;
  nlohmann::json train_curve = nlohmann::json::array(), val_curve = nlohmann::json::array();
  double val = NAN;
  for (const auto& [step, record] : metrics) {
    if (record.contains("loss")) {
      losses.push_back(record["loss"].get<double>());
      train_curve.push_back({step, record["loss"]});
    }
    if (record.contains("tokens_per_s")) speeds.push_back(record["tokens_per_s"].get<double>());
    if (record.contains("val_loss")) {
      val = record["val_loss"].get<double>();
      val_curve.push_back({step, val});
    }
  }
  double train = NAN;
  if (!losses.empty()) {
    const size_t n = std::min<size_t>(10, losses.size());
    train = 0;
    for (size_t i = losses.size() - n; i < losses.size(); ++i) train += losses[i];
    train /= static_cast<double>(n);
  }
  return {{"settings", settings},
          {"steps", metrics.empty() ? 0 : metrics.rbegin()->first},
          {"train_loss", train},
          {"val_loss", val},
          {"tokens_per_s", median(speeds)},
          {"train_curve", train_curve},
          {"val_curve", val_curve}};
}

nlohmann::json run_variant(const Options& o, const Variant& v, const nlohmann::json& settings) {
  const fs::path dir = fs::path(o.out) / v.name;
  const fs::path result_path = dir / "result.json";
  if (fs::exists(result_path)) {
    nlohmann::json result = read_json(result_path);
    if (result.value("settings", nlohmann::json()) == settings) {
      std::printf("bench converge: %s: reusing %s\n", v.name, result_path.string().c_str());
      return result;
    }
    std::printf("bench converge: %s: %s was made with other settings; training again\n", v.name,
                result_path.string().c_str());
  }
  const fs::path ckpt = dir / "checkpoint";
  const fs::path settings_path = dir / "settings.json";
  bool resume =
      fs::exists(ckpt) && fs::exists(settings_path) && read_json(settings_path) == settings;
  if (!resume && fs::exists(dir)) fs::remove_all(dir);
  fs::create_directories(dir);
  write_json(settings_path, settings);
  if (resume && fs::exists(dir / "metrics.jsonl")) {
    int attempt = 0;
    while (fs::exists(dir / ("metrics." + std::to_string(attempt) + ".jsonl"))) ++attempt;
    fs::rename(dir / "metrics.jsonl", dir / ("metrics." + std::to_string(attempt) + ".jsonl"));
  }

  TrainOptions t;
  t.config_path = o.config;
  t.train_data = o.mock_data ? "" : o.train_data;
  t.valid_data = o.valid_data;
  t.mock_data = o.mock_data;
  t.vocab_dir = o.vocab_dir;
  t.micro_batch_size = o.micro_batch_size;
  t.global_batch_size = o.micro_batch_size;
  t.seq_length = o.seq_length;
  t.train_iters = o.train_iters;
  t.lr = static_cast<float>(o.lr);
  t.min_lr = static_cast<float>(o.min_lr);
  t.lr_warmup_iters = o.lr_warmup_iters;
  t.eval_interval = o.valid_data.empty() ? 0 : o.eval_interval;
  t.eval_iters = o.valid_data.empty() ? 0 : o.eval_iters;
  t.log_interval = std::max<int64_t>(1, o.eval_interval / 5);
  t.seed = o.seed;
  t.peak_gflops = o.peak_gflops;
  t.precision = v.precision;
  if (*v.fp8_recipe) t.fp8_recipe = v.fp8_recipe;
  t.fp8_dpa = v.fp8_dpa;
  if (*v.fp4_recipe) t.fp4_recipe = v.fp4_recipe;
  t.save = ckpt.string();
  t.save_interval = std::max<int64_t>(1, o.eval_interval);
  if (resume) t.load = ckpt.string();
  t.metrics = (dir / "metrics.jsonl").string();
  std::printf("bench converge: %s: %s %d steps%s\n", v.name, resume ? "resuming" : "training",
              static_cast<int>(o.train_iters), resume ? " (from its checkpoint)" : "");
  std::fflush(stdout);
  const TrainResult r = train_gpt(t);
  OCTET_CHECK(r.stop_signal == 0, "bench converge: ", v.name, " stopped by signal ", r.stop_signal,
              "; run the same command again to resume it");
  nlohmann::json result = summarize(dir, settings);
  write_json(result_path, result);
  fs::remove_all(ckpt);  // done: the metrics and result hold the report's numbers
  return result;
}

std::string format_number(double x, const char* format) {
  if (!std::isfinite(x)) return "-";
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, x);
  return buffer;
}

void run(Options o) {
  o.config = resolve_config(o.config).string();
  OCTET_CHECK(o.mock_data || !o.train_data.empty(),
              "bench converge: give --train-data SHARD (and --valid-data SHARD), or --mock-data");
  std::vector<const Variant*> variants;
  std::stringstream list(o.variants);
  for (std::string name; std::getline(list, name, ',');) {
    if (!name.empty()) variants.push_back(&find_variant(name));
  }
  OCTET_CHECK(!variants.empty(), "bench converge: --variants is empty");
  check_writable_file((fs::path(o.out) / "converge.md").string(), "--out");
  const nlohmann::json settings = settings_of(o);
  if (o.peak_gflops <= 0) o.peak_gflops = measure_bf16_peak_gflops();

  std::map<std::string, nlohmann::json> results;
  for (const Variant* v : variants) results[v->name] = run_variant(o, *v, settings);
  // Earlier invocations' variants with the same settings join the report.
  for (const Variant& v : kVariants) {
    const fs::path path = fs::path(o.out) / v.name / "result.json";
    if (results.count(v.name) || !fs::exists(path)) continue;
    nlohmann::json result = read_json(path);
    if (result.value("settings", nlohmann::json()) == settings) results[v.name] = result;
  }

  const bool validated = !o.valid_data.empty();
  const char* metric = validated ? "val_loss" : "train_loss";
  const double bf16 =
      results.count("bf16") ? results["bf16"][metric].get<double>() : static_cast<double>(NAN);
  std::ostringstream table;
  table << "| variant | steps | train loss | val loss | gap to BF16 ("
        << (validated ? "val" : "train")
        << ") | goal | tokens/s |\n|---|---|---|---|---|---|---|\n";
  nlohmann::json report = nlohmann::json::object();
  std::vector<std::pair<std::string, std::vector<CurvePoint>>> curves;
  for (const Variant& v : kVariants) {
    if (!results.count(v.name)) continue;
    const nlohmann::json& r = results[v.name];
    const double value = r[metric].is_number() ? r[metric].get<double>() : NAN;
    const double gap = 100.0 * (value / bf16 - 1.0);
    std::string goal = "-";
    if (v.goal_percent > 0 && std::isfinite(gap)) {
      goal = std::string(std::fabs(gap) <= v.goal_percent ? "met" : "missed") + " (" +
             format_number(v.goal_percent, "%.0f") + "%)";
    }
    auto number = [&](const char* key, const char* format) {
      return format_number(r[key].is_number() ? r[key].get<double>() : NAN, format);
    };
    table << "| " << v.name << " | " << r["steps"].get<int64_t>() << " | "
          << number("train_loss", "%.4f") << " | " << number("val_loss", "%.4f") << " | "
          << format_number(gap, "%+.2f%%") << " | " << goal << " | "
          << number("tokens_per_s", "%.0f") << " |\n";
    report[v.name] = {{"steps", r["steps"]},
                      {"train_loss", r["train_loss"]},
                      {"val_loss", r["val_loss"]},
                      {"gap_to_bf16_percent", gap},
                      {"goal_percent", v.goal_percent},
                      {"tokens_per_s", r["tokens_per_s"]}};
    std::vector<CurvePoint> points;
    for (const auto& p : r[validated ? "val_curve" : "train_curve"]) {
      points.push_back({p[0].get<double>(), p[1].get<double>()});
    }
    curves.emplace_back(v.name, std::move(points));
  }
  const fs::path out(o.out);
  std::printf("\n%s", table.str().c_str());
  {
    std::ofstream md(out / "converge.md.tmp");
    md << "# Convergence: " << fs::path(o.config).stem().string() << ", " << o.train_iters
       << " steps of " << o.micro_batch_size << " x " << o.seq_length << " tokens, seed " << o.seed
       << "\n\n"
       << table.str();
  }
  fs::rename(out / "converge.md.tmp", out / "converge.md");
  write_json(out / "converge.json", {{"settings", settings}, {"variants", report}});
  write_loss_svg((out / "converge.svg").string(),
                 std::string(validated ? "validation" : "train") + " loss by step, " +
                     fs::path(o.config).stem().string(),
                 curves);
  std::printf("\ntable: %s, curves: %s, numbers: %s\n", (out / "converge.md").string().c_str(),
              (out / "converge.svg").string().c_str(), (out / "converge.json").string().c_str());
}

}  // namespace

void register_bench_converge(CLI::App& bench) {
  CLI::App* cmd = bench.add_subcommand(
      "converge",
      "Convergence report: the same model, seed and data order in every numeric format (FP32, "
      "BF16, four FP8 recipes, FP8 attention, NVFP4, MXFP4); final losses, gap to BF16, "
      "tokens/s, and the curves as one SVG. Resumable: finished variants are reused");
  auto o = std::make_shared<Options>();
  cmd->add_option("--config", o->config, "Model config JSON, or a name in configs/")
      ->check(model_config_validator())
      ->capture_default_str();
  cmd->add_option("--train-data", o->train_data, "Token shard (octet tokenize -o)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--valid-data", o->valid_data, "Validation token shard")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--mock-data", o->mock_data, "Random tokens instead of a shard (smoke runs)");
  cmd->add_option("--vocab-dir", o->vocab_dir,
                  "Tokenizer the shards were made with (octet learn-bpe -o): sets the "
                  "vocabulary")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--out", o->out, "Report directory (one folder per variant)")
      ->capture_default_str();
  cmd->add_option("--variants", o->variants, "Comma-separated, from the default list")
      ->capture_default_str();
  cmd->add_option("--train-iters", o->train_iters, "Steps per variant")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per step")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--lr", o->lr, "Peak learning rate")
      ->check(number_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--min-lr", o->min_lr, "Final learning rate")
      ->check(number_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--lr-warmup-iters", o->lr_warmup_iters, "Linear warmup steps")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--eval-interval", o->eval_interval, "Validate (and checkpoint) every N steps")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--eval-iters", o->eval_iters, "Validation micro-batches")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--peak-gflops", o->peak_gflops, "BF16 GEMM peak for MFU (0: measure once)")
      ->check(at_least(0));
  cmd->add_option("--seed", o->seed, "Weights and data order, the same for every variant")
      ->capture_default_str();
  cmd->callback([o] { run(*o); });
}

}  // namespace octet::cli
