// `octet bench train`: timed training steps of a GPT on mock tokens, a ViT on mock images, a
// BERT on mock pretraining sequences or a T5 on mock span-corruption batches (the config's
// family) — tokens/s (and images/s), MFU against the measured BF16 GEMM peak,
// peak memory, saved activations — beside the same model in eager PyTorch 1.13
// (bench/peers/torch_train.py: fp32, and bf16 autocast) kept running beside ours.
// Both sides take their steps in rounds (ours then the peer's, the peer's then ours, ...) and
// the ratios the goals speak of are the medians of per-round ratios, with their spread: on a
// shared machine one side timed after the other can be 2x off.
#include <algorithm>
#include <array>
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
#include "octet/bert.h"
#include "octet/cpu_features.h"
#include "octet/model.h"
#include "octet/profile.h"
#include "octet/recipe.h"
#include "octet/t5.h"
#include "octet/train.h"
#include "octet/vit.h"

namespace octet::cli {
namespace {

struct Options {
  std::string config = "gpt-mini";
  std::string precision = "bf16,fp8";
  int rounds = 3;
  int steps = 3;  // per round and precision
  int warmup = 1;
  int torch_steps = 2;  // per round; a torch bf16 gpt-mini step takes ~3 s on two cores
  int64_t micro_batch_size = 8;
  // Debian's torch runs FP32 GEMMs on a generic BLAS (~2 GFLOP/s): a full gpt-mini micro-batch
  // would take minutes per step, so torch fp32 times fewer sequences (tokens/s is per token).
  int64_t torch_fp32_micro_batch_size = 1;
  int64_t seq_length = 0;  // 0 = the config's (GPT, BERT, T5's encoder: max_seq_len; a ViT:
                           // patches + 1)
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
  // Where the step goes: mean ms per step in each profile::Category over the timed steps
  // (torch: one step under its profiler, its ops mapped to the same categories), and the mean
  // step those come from; the rest of the step is "other".
  bool has_breakdown = false;
  std::array<double, profile::kCategories> breakdown_ms{};
  double breakdown_step_ms = 0;
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

// The mock data's random stream: xorshift64, seeded per batch.
struct Xorshift {
  uint64_t state;
  explicit Xorshift(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
  // Uniform in [0, n) (n small: the modulo's bias does not matter here).
  int32_t below(int64_t n) { return static_cast<int32_t>(next() % static_cast<uint64_t>(n)); }
};

// Mock tokens [B,T] from a xorshift stream: ids and next-token targets of one window.
void mock_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed, Tensor& ids, Tensor& targets) {
  ids = Tensor::empty({B, T}, DType::I32);
  targets = Tensor::empty({B, T}, DType::I32);
  Xorshift random(seed);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t <= T; ++t) {
      const int32_t token = random.below(vocab);
      if (t > 0) targets.data<int32_t>()[b * T + t - 1] = token;
      if (t < T) ids.data<int32_t>()[b * T + t] = token;
    }
  }
}

// A mock BERT pretraining micro-batch (bert_micro_batch's contract) of B full-length sequences
// of T >= 5 tokens: [CLS] A [SEP] B [SEP], the first [SEP] at T/2, token type 1 after it; text
// ids uniform; ~15% of the text positions masked, at least one per sequence (80% [MASK], else a
// random text id), their targets the original ids and -100 elsewhere; NSP labels uniform 0/1.
pipeline::MicroBatch mock_bert_batch(const BertConfig& config, int64_t B, int64_t T,
                                     uint64_t seed) {
  Tensor ids = Tensor::empty({B, T}, DType::I32), token_types = Tensor::empty({B, T}, DType::I32);
  Tensor lengths = Tensor::empty({B}, DType::I32), targets = Tensor::empty({B, T}, DType::I32);
  Tensor nsp_labels = Tensor::empty({B}, DType::I32);
  Xorshift random(seed);
  const int64_t split = T / 2;
  auto is_text = [&](int64_t t) { return t > 0 && t != split && t < T - 1; };
  auto mask = [&](int32_t& id, int32_t& target) {
    target = id;
    id = random.below(10) < 8 ? static_cast<int32_t>(config.mask_id())
                              : random.below(config.text_vocab());
  };
  for (int64_t b = 0; b < B; ++b) {
    int32_t* id = ids.data<int32_t>() + b * T;
    int32_t* type = token_types.data<int32_t>() + b * T;
    int32_t* target = targets.data<int32_t>() + b * T;
    lengths.data<int32_t>()[b] = static_cast<int32_t>(T);
    nsp_labels.data<int32_t>()[b] = random.below(2);
    bool masked = false;
    for (int64_t t = 0; t < T; ++t) {
      type[t] = t > split ? 1 : 0;
      target[t] = -100;
      if (!is_text(t)) {
        id[t] = static_cast<int32_t>(t == 0 ? config.cls_id() : config.sep_id());
        continue;
      }
      id[t] = random.below(config.text_vocab());
      if (random.below(100) < 15) {
        mask(id[t], target[t]);
        masked = true;
      }
    }
    if (!masked) {  // one of the T - 3 text positions: 1..split-1, split+1..T-2
      int64_t t = 1 + random.below(T - 3);
      if (t >= split) ++t;
      mask(id[t], target[t]);
    }
  }
  return bert_micro_batch(ids, token_types, lengths, targets, nsp_labels);
}

// The lengths of a mock batch's B sequences of L tokens: full, but every fourth sequence
// (b % 4 == 3) 1 .. L/4 tokens shorter (none shorter below 4 tokens).
Tensor mock_lengths(int64_t B, int64_t L, Xorshift& random) {
  Tensor lengths = Tensor::empty({B}, DType::I32);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cut = L >= 4 ? 1 + random.below(L / 4) : 0;
    lengths.data<int32_t>()[b] = static_cast<int32_t>(b % 4 == 3 ? L - cut : L);
  }
  return lengths;
}

// A mock T5 span-corruption micro-batch (t5_micro_batch's contract) of B sequences, S encoder
// and T decoder tokens, lengths from mock_lengths: encoder ids uniform text ids with ~1/8 of
// the positions the next sentinel, [EOS] last, [PAD] after; targets the same with ~1/4
// sentinels, [EOS] last, -100 after; the decoder's ids [PAD] then the targets shifted right
// ([PAD] where the targets are -100). bench/peers/torch_t5.py's mock_batch has the same form.
pipeline::MicroBatch mock_t5_batch(const T5Config& config, int64_t B, int64_t S, int64_t T,
                                   uint64_t seed) {
  Xorshift random(seed);
  const auto pad = static_cast<int32_t>(config.pad_id()),
             eos = static_cast<int32_t>(config.eos_id());
  // [B,L] text ids and sentinels, [EOS] at length - 1, `padding` from length on.
  auto sequences = [&](const Tensor& lengths, int64_t L, int64_t sentinel_every, int32_t padding) {
    Tensor ids = Tensor::empty({B, L}, DType::I32);
    for (int64_t b = 0; b < B; ++b) {
      int32_t* id = ids.data<int32_t>() + b * L;
      const int64_t length = lengths.data<int32_t>()[b];
      int64_t sentinels = 0;
      for (int64_t t = 0; t < L; ++t) {
        id[t] = random.below(config.text_vocab());
        if (random.below(sentinel_every) == 0 && sentinels < config.num_sentinels) {
          id[t] = static_cast<int32_t>(config.sentinel_id(sentinels++));
        }
        if (t == length - 1) id[t] = eos;
        if (t >= length) id[t] = padding;
      }
    }
    return ids;
  };
  const Tensor enc_lengths = mock_lengths(B, S, random);
  const Tensor enc_ids = sequences(enc_lengths, S, 8, pad);
  const Tensor dec_lengths = mock_lengths(B, T, random);
  const Tensor targets = sequences(dec_lengths, T, 4, -100);
  Tensor dec_ids = Tensor::empty({B, T}, DType::I32);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* target = targets.data<int32_t>() + b * T;
    int32_t* id = dec_ids.data<int32_t>() + b * T;
    id[0] = pad;
    for (int64_t t = 1; t < T; ++t) id[t] = target[t - 1] == -100 ? pad : target[t - 1];
  }
  return t5_micro_batch(enc_ids, enc_lengths, dec_ids, dec_lengths, targets);
}

// The model under test, from the config's family: a GPT on mock tokens, a ViT on mock images,
// a BERT on mock pretraining sequences or a T5 on mock span-corruption batches.
struct BenchModel {
  std::string family = "gpt", name;
  GPTConfig gpt;
  ViTConfig vit;
  BertConfig bert;
  T5Config t5;
  int64_t seq_length = 0;     // tokens per sample (a T5: its encoder's, what tokens/s counts)
  int64_t target_length = 0;  // a T5: decoder tokens per sample (the config's max_target_len)
  // The BF16 tokens/s ratio to PyTorch's BF16 autocast a family's issue asks for: GPT's on
  // this processor (Debian's torch runs BF16 slowly here), 2x for the other models (issue 15)
  // and for a GPT with a mixture of experts against PyTorch's MoE layer (issue 13).
  double torch_goal() const { return family == "gpt" && !gpt.moe() ? 6.0 : 2.0; }

  BenchModel(const std::string& config_path, int64_t seq_length_option) {
    family = config_model_family(config_path);
    if (family == "vit") {
      vit = ViTConfig::load(config_path);
      name = vit.name;
      OCTET_CHECK(seq_length_option == 0 || seq_length_option == vit.seq_len(),
                  "bench train: --seq-length ", seq_length_option, ": a ViT's sequence is its ",
                  vit.num_patches(), " patches and the class token (", vit.seq_len(), ")");
      seq_length = vit.seq_len();
      return;
    }
    if (family == "bert") {
      bert = BertConfig::load(config_path);
      name = bert.name;
      seq_length = seq_length_option ? seq_length_option : bert.max_seq_len;
      // [CLS] A [SEP] B [SEP] with A and B non-empty: five tokens at least.
      OCTET_CHECK(seq_length >= 5 && seq_length <= bert.max_seq_len,
                  "bench train: ", "--seq-length expected in [5, ", bert.max_seq_len, "] for ",
                  bert.name, " (a BERT's mock sequence is [CLS] A [SEP] B [SEP]), got ",
                  seq_length);
      return;
    }
    if (family == "t5") {
      t5 = T5Config::load(config_path);
      name = t5.name;
      seq_length = seq_length_option ? seq_length_option : t5.max_seq_len;
      target_length = t5.max_target_len;
      OCTET_CHECK(seq_length >= 1 && seq_length <= t5.max_seq_len,
                  "bench train: --seq-length (a T5's encoder tokens) expected in [1, ",
                  t5.max_seq_len, "] for ", t5.name, ", got ", seq_length);
      return;
    }
    OCTET_CHECK(family == "gpt", "bench train: config '", config_path,
                "': expected a gpt, vit, bert or t5 model, got '", family, "'");
    gpt = GPTConfig::load(config_path);
    name = gpt.name;
    seq_length = seq_length_option ? seq_length_option : gpt.max_seq_len;
    OCTET_CHECK(seq_length >= 1 && seq_length <= gpt.max_seq_len,
                "bench train: ", "--seq-length expected in [1, ", gpt.max_seq_len, "] for ",
                gpt.name, ", got ", seq_length);
  }
  bool is_vit() const { return family == "vit"; }
  bool is_bert() const { return family == "bert"; }
  bool is_t5() const { return family == "t5"; }
  double num_parameters() const {
    if (is_bert()) return static_cast<double>(bert.num_parameters());
    if (is_t5()) return static_cast<double>(t5.num_parameters());
    return static_cast<double>(is_vit() ? vit.num_parameters() : gpt.num_parameters());
  }
  double flops_per_token() const {
    if (is_bert()) return bert.train_flops_per_token(seq_length);
    if (is_t5()) return t5.train_flops_per_token(seq_length, target_length);  // per input token
    return is_vit() ? vit.train_flops_per_token() : gpt.train_flops_per_token(seq_length);
  }
  // What train_step's loss is, for the printed explanation.
  const char* loss_text() const {
    if (is_bert()) return "MLM cross-entropy over the masked tokens + NSP";
    if (is_t5()) return "the decoder's cross-entropy over the targets";
    return is_vit() ? "the class token's cross-entropy" : "fused chunked cross-entropy";
  }
  std::unique_ptr<TrainableModel> make(uint64_t seed) const {
    if (is_bert()) return std::make_unique<Bert>(bert, seed);
    if (is_t5()) return std::make_unique<T5>(t5, seed);
    if (is_vit()) return std::make_unique<ViT>(vit, seed);
    return std::make_unique<GPT>(gpt, seed);
  }
  // Mock micro-batch: tokens and their next tokens, uniform pixels and labels, masked
  // sentence pairs, or corrupted text and its spans.
  pipeline::MicroBatch batch(int64_t B, uint64_t seed) const {
    if (is_bert()) return mock_bert_batch(bert, B, seq_length, seed);
    if (is_t5()) return mock_t5_batch(t5, B, seq_length, target_length, seed);
    if (!is_vit()) {
      Tensor ids, targets;
      mock_batch(B, seq_length, gpt.vocab_size, seed, ids, targets);
      return gpt_micro_batch(ids, targets);
    }
    Tensor pixels = Tensor::empty({B, vit.pixels()}, DType::F32);
    Tensor labels = Tensor::empty({B}, DType::I32);
    Xorshift random(seed);
    for (int64_t i = 0; i < pixels.numel(); ++i) {
      pixels.data<float>()[i] = static_cast<float>(random.below(2001)) / 1000.0f - 1.0f;
    }
    for (int64_t b = 0; b < B; ++b) labels.data<int32_t>()[b] = random.below(vit.num_classes);
    return vit_micro_batch(pixels, labels);
  }
};

// Bytes the model's context keeps from forward to backward: one forward of a micro-batch with
// its context held, after a first forward that built the weight caches and workspaces (BF16 /
// FP8 weight copies live until the next optimizer step and are not activations).
int64_t saved_activation_bytes(TrainableModel& model, const pipeline::MicroBatch& batch,
                               DType dtype, bool fp8, const recipe::Recipe& recipe) {
  auto forward = [&] {
    auto ctx = model.make_context();
    fp8_autocast scope(fp8, recipe);
    model.forward(0, Tensor(), batch, dtype, 1.0f, *ctx);
    return ctx;
  };
  forward();
  const int64_t before = memory_stats().current_bytes;
  auto ctx = forward();
  return memory_stats().current_bytes - before;
}

// One precision's model, optimizer and mock batches, timed one training step at a time.
class OctetRun {
 public:
  OctetRun(const BenchModel& bench_model, const std::string& precision, const Options& o)
      : constructed_from_bytes_(memory_stats().current_bytes),
        fp8_(precision == "fp8"),
        dtype_(precision == "fp32" ? DType::F32 : DType::BF16),
        model_(bench_model.make(o.seed)),
        optimizer_(model_->parameters(), AdamWOptions{}) {
    recipe::DelayedScaling delayed;  // trainer.cpp's make_recipe: delayed, HYBRID, history 16
    delayed.fp8_format = recipe::Format::HYBRID;
    delayed.amax_history_len = 16;
    recipe_ = delayed;
    for (uint64_t i = 0; i < 4; ++i)
      batches_.push_back(bench_model.batch(o.micro_batch_size, o.seed + i));
    result_.impl = "octet";
    result_.precision = precision;
    result_.micro_batch_size = o.micro_batch_size;
    result_.warmup = o.warmup;
    held_bytes_ = memory_stats().current_bytes - constructed_from_bytes_;
  }

  // zero_grad + train_step + AdamW + on_parameters_updated; timed unless `warmup`.
  void step(bool warmup) {
    const pipeline::MicroBatch& batch = batches_[static_cast<size_t>(step_++) % batches_.size()];
    const int64_t start_bytes = memory_stats().current_bytes;
    reset_peak_memory();
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = process_cpu_seconds();
    if (!warmup) profile::start();
    model_->zero_grad();
    float loss = 0;
    {
      fp8_autocast scope(fp8_, recipe_);
      loss = model_->train_step(batch, dtype_, 1.0f);
    }
    const int64_t train_step_peak = memory_stats().peak_bytes - start_bytes;
    optimizer_.step(6e-4f);
    model_->on_parameters_updated();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu_elapsed = process_cpu_seconds() - cpu_start;
    if (!warmup) {
      const profile::Totals totals = profile::totals();
      profile::stop();
      for (int c = 0; c < profile::kCategories; ++c) category_seconds_[c] += totals.seconds[c];
    }
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

  void begin_round() { round_start_ = seconds_.size(); }
  // Tokens per second of the steps taken since begin_round (their median step).
  double round_tokens_per_s(int64_t B, int64_t T) const {
    const std::vector<double> round(seconds_.begin() + static_cast<std::ptrdiff_t>(round_start_),
                                    seconds_.end());
    return static_cast<double>(B * T) / bench::median(round);
  }

  Result finish(int64_t B, int64_t T) {
    result_.steps = static_cast<int>(seconds_.size());
    result_.step_ms = bench::median(seconds_) * 1e3;
    result_.cpu_ms = bench::median(cpu_seconds_) * 1e3;
    result_.tokens_per_s = static_cast<double>(B * T) / (result_.step_ms / 1e3);
    result_.saved_activation_bytes =
        saved_activation_bytes(*model_, batches_.front(), dtype_, fp8_, recipe_);
    const double steps = static_cast<double>(seconds_.size());
    result_.has_breakdown = true;
    for (int c = 0; c < profile::kCategories; ++c) {
      result_.breakdown_ms[c] = category_seconds_[c] / steps * 1e3;
    }
    double total = 0;
    for (double s : seconds_) total += s;
    result_.breakdown_step_ms = total / steps * 1e3;
    return result_;
  }

 private:
  int64_t constructed_from_bytes_;
  int64_t held_bytes_ = 0;  // what this run keeps between steps (model, optimizer, caches)
  bool fp8_;
  DType dtype_;
  recipe::Recipe recipe_;
  std::unique_ptr<TrainableModel> model_;
  AdamW optimizer_;
  std::vector<pipeline::MicroBatch> batches_;
  Result result_;
  std::vector<double> seconds_, cpu_seconds_;
  size_t round_start_ = 0;
  std::array<double, profile::kCategories> category_seconds_{};  // over the timed steps
  int step_ = 0;
};

// The peer: one torch_train.py process per precision (so that its resident-memory high-water
// mark is that precision's), kept running and asked for a few steps each round.
class TorchPeer {
 public:
  TorchPeer(const std::filesystem::path& config_path, const std::string& precision,
            const Options& o, const BenchModel& model)
      : seq_length_(model.seq_length) {
    result_.impl = "torch_" + precision;
    result_.precision = precision;
    result_.micro_batch_size = precision == "fp32"
                                   ? std::min(o.torch_fp32_micro_batch_size, o.micro_batch_size)
                                   : o.micro_batch_size;
    result_.warmup = o.warmup;
    const std::filesystem::path script = bench::find_peer_script("torch_train.py");
    if (script.empty()) {
      std::fprintf(stderr, "bench train: bench/peers/torch_train.py not found; no torch figures\n");
      return;
    }
    std::vector<std::string> command = {"/usr/bin/python3",
                                        script.string(),
                                        "--config",
                                        config_path.string(),
                                        "--precision",
                                        precision,
                                        "--micro-batch-size",
                                        std::to_string(result_.micro_batch_size),
                                        "--seq-length",
                                        std::to_string(model.seq_length),
                                        "--warmup",
                                        std::to_string(o.warmup),
                                        "--threads",
                                        std::to_string(num_threads()),
                                        "--seed",
                                        std::to_string(o.seed)};
    if (model.is_t5()) {
      command.insert(command.end(), {"--target-length", std::to_string(model.target_length)});
    }
    running_ = process_.start(command);
    if (!running_) std::fprintf(stderr, "bench train: torch %s did not start\n", precision.c_str());
  }
  bool running() const { return running_; }
  const std::string& impl() const { return result_.impl; }

  // `steps` timed steps; the round's tokens/s (NaN once the peer has stopped).
  double round(int steps) {
    if (!running_) return NAN;
    const auto answer = process_.ask(nlohmann::json{{"steps", steps}}.dump());
    if (!answer || !answer->contains("seconds")) return stopped();
    const auto seconds = answer->at("seconds").get<std::vector<double>>();
    const auto cpu = answer->at("cpu_seconds").get<std::vector<double>>();
    seconds_.insert(seconds_.end(), seconds.begin(), seconds.end());
    cpu_seconds_.insert(cpu_seconds_.end(), cpu.begin(), cpu.end());
    const auto& loss = answer->at("loss");
    result_.loss = loss.is_number() ? loss.get<double>() : NAN;
    return static_cast<double>(result_.micro_batch_size * seq_length_) / bench::median(seconds);
  }

  std::optional<Result> finish() {
    if (seconds_.empty()) return std::nullopt;
    if (running_) {
      const auto answer = process_.ask(R"({"op": "report"})");
      if (answer && answer->contains("peak_bytes")) {
        result_.peak_bytes = answer->at("peak_bytes").get<int64_t>();
        result_.saved_activation_bytes = answer->at("saved_activation_bytes").get<int64_t>();
      }
      // One step under torch.profiler, its ops' self times by octet's categories.
      const auto profiled = process_.ask(R"({"op": "profile"})");
      if (profiled && profiled->contains("categories")) {
        const auto& categories = profiled->at("categories");
        for (int c = 0; c < profile::kCategories; ++c) {
          const char* name = profile::category_name(static_cast<profile::Category>(c));
          result_.breakdown_ms[c] = categories.value(name, 0.0);
        }
        result_.breakdown_step_ms = profiled->at("step_ms").get<double>();
        result_.has_breakdown = true;
      }
    }
    result_.steps = static_cast<int>(seconds_.size());
    result_.step_ms = bench::median(seconds_) * 1e3;
    result_.cpu_ms = bench::median(cpu_seconds_) * 1e3;
    result_.tokens_per_s =
        static_cast<double>(result_.micro_batch_size * seq_length_) / (result_.step_ms / 1e3);
    return result_;
  }

 private:
  double stopped() {
    running_ = false;
    std::fprintf(stderr, "bench train: %s stopped answering; its figures end here\n",
                 result_.impl.c_str());
    return NAN;
  }

  int64_t seq_length_;
  bench::PeerProcess process_;
  bool running_ = false;
  Result result_;
  std::vector<double> seconds_, cpu_seconds_;
};

// The peers, ended last-started first: each peer process inherited the pipes of the peers
// started before it (bench::PeerProcess does not mark them close-on-exec), so an earlier peer
// reads the end of its requests, and exits, only once the later ones have exited. Ended first
// to last (std::vector's order), a run with fp32 and bf16 peers would wait forever.
struct TorchPeers : std::vector<std::unique_ptr<TorchPeer>> {
  TorchPeers() = default;
  TorchPeers(const TorchPeers&) = delete;
  TorchPeers& operator=(const TorchPeers&) = delete;
  ~TorchPeers() {
    while (!empty()) pop_back();
  }
};

// Per-round ratios (the same round's medians on both sides), NaN where a side is missing.
struct RoundRatios {
  std::vector<double> fp32_vs_torch, bf16_vs_torch, fp8_vs_torch_bf16, fp8_vs_bf16;
};

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

// Ratios the goals speak of: tokens/s as medians of the per-round ratios, NaN where a side
// is missing.
struct Ratios {
  double fp32_vs_torch = NAN, bf16_vs_torch = NAN, fp8_vs_torch_bf16 = NAN;
  double fp8_vs_bf16_tokens = NAN, fp8_vs_bf16_saved = NAN;
  // Over all timed steps, per CPU-second (what a loaded machine disturbs least).
  double bf16_vs_torch_cpu = NAN, fp8_vs_bf16_cpu = NAN;
};

Ratios ratios(const std::vector<Result>& results, const RoundRatios& rounds) {
  auto saved = [&](const char* impl, const char* precision) {
    const Result* r = find(results, impl, precision);
    return r ? static_cast<double>(r->saved_activation_bytes) : NAN;
  };
  Ratios q;
  q.fp32_vs_torch = bench::median_or_nan(rounds.fp32_vs_torch);
  q.bf16_vs_torch = bench::median_or_nan(rounds.bf16_vs_torch);
  q.fp8_vs_torch_bf16 = bench::median_or_nan(rounds.fp8_vs_torch_bf16);
  q.fp8_vs_bf16_tokens = bench::median_or_nan(rounds.fp8_vs_bf16);
  q.fp8_vs_bf16_saved = saved("octet", "fp8") / saved("octet", "bf16");
  auto per_cpu = [&](const char* impl, const char* precision) {
    const Result* r = find(results, impl, precision);
    return r ? tokens_per_cpu_second(*r) : NAN;
  };
  q.bf16_vs_torch_cpu = per_cpu("octet", "bf16") / per_cpu("torch_bf16", "bf16");
  q.fp8_vs_bf16_cpu = per_cpu("octet", "fp8") / per_cpu("octet", "bf16");
  return q;
}

// Each category's ms per step, then "other" (the step's remainder: embeddings' gathers, residual
// copies, dtype conversions, the framework's own work) and the step.
nlohmann::json breakdown_json(const Result& r) {
  nlohmann::json out = nlohmann::json::object();
  double named = 0;
  for (int c = 0; c < profile::kCategories; ++c) {
    out[profile::category_name(static_cast<profile::Category>(c))] = r.breakdown_ms[c];
    named += r.breakdown_ms[c];
  }
  out["other"] = std::max(0.0, r.breakdown_step_ms - named);
  out["step"] = r.breakdown_step_ms;
  return out;
}

void print_json(const std::vector<Result>& results, const RoundRatios& rounds,
                const BenchModel& model, const Options& o, double peak_gflops) {
  const Ratios q = ratios(results, rounds);
  for (const Result& r : results) {
    nlohmann::json line = {{"impl", r.impl},
                           {"config", model.name},
                           {"model", model.family},
                           {"precision", r.precision},
                           {"micro_batch_size", r.micro_batch_size},
                           {"seq_length", model.seq_length},
                           {"steps", r.steps},
                           {"rounds", o.rounds},
                           {"warmup", r.warmup},
                           {"step_ms", r.step_ms},
                           {"cpu_ms", r.cpu_ms},
                           {"tokens_per_s", r.tokens_per_s},
                           {"mfu", r.mfu},
                           {"peak_gflops", peak_gflops},
                           {"peak_bytes", r.peak_bytes},
                           {"saved_activation_bytes", r.saved_activation_bytes},
                           {"loss", bench::json_number(r.loss)},
                           {"threads", num_threads()}};
    if (model.is_t5()) line["target_length"] = model.target_length;
    if (r.has_breakdown) line["breakdown_ms"] = breakdown_json(r);
    if (r.impl == "octet") {
      line["train_step_peak_bytes"] = r.step_peak_bytes;
      // Medians of the per-round ratios; the per-round values beside them.
      if (r.precision == "fp32") {
        line["ratio_vs_torch"] = bench::json_number(q.fp32_vs_torch);
        line["ratio_vs_torch_rounds"] = rounds.fp32_vs_torch;
      }
      if (r.precision == "bf16") {
        line["ratio_vs_torch"] = bench::json_number(q.bf16_vs_torch);
        line["ratio_vs_torch_rounds"] = rounds.bf16_vs_torch;
      }
      if (r.precision == "fp8") {
        line["ratio_vs_torch_bf16"] = bench::json_number(q.fp8_vs_torch_bf16);
        line["ratio_vs_torch_bf16_rounds"] = rounds.fp8_vs_torch_bf16;
        line["ratio_vs_bf16_tokens"] = bench::json_number(q.fp8_vs_bf16_tokens);
        line["ratio_vs_bf16_tokens_rounds"] = rounds.fp8_vs_bf16;
        line["ratio_vs_bf16_saved_activations"] = bench::json_number(q.fp8_vs_bf16_saved);
      }
    }
    std::printf("%s\n", line.dump().c_str());
  }
}

void print_breakdown(const std::vector<Result>& results, const BenchModel& model, const Options& o,
                     double peak_gflops) {
  std::vector<const Result*> shown;
  for (const Result& r : results) {
    if (r.has_breakdown && r.breakdown_step_ms > 0) shown.push_back(&r);
  }
  if (shown.empty()) return;
  std::printf("\nwhere the step goes (ms per step, share of the step):\n%-18s", "");
  for (const Result* r : shown) {
    std::printf(" %18s", (r->impl + " " + r->precision).c_str());
  }
  std::printf("\n");
  std::vector<nlohmann::json> rows;
  for (const Result* r : shown) rows.push_back(breakdown_json(*r));
  std::vector<std::string> names;
  for (int c = 0; c < profile::kCategories; ++c) {
    names.emplace_back(profile::category_name(static_cast<profile::Category>(c)));
  }
  names.emplace_back("other");
  names.emplace_back("step");
  for (const std::string& name : names) {
    std::printf("%-18s", name.c_str());
    for (size_t i = 0; i < shown.size(); ++i) {
      const double ms = rows[i].at(name).get<double>();
      std::printf(" %10.1f %6.1f%%", ms, 100.0 * ms / shown[i]->breakdown_step_ms);
    }
    std::printf("\n");
  }
  // The model's FLOPs at the measured GEMM peak: the step every category but GEMMs would have
  // to vanish to reach (and GEMMs run at the peak).
  const double at_peak_ms = model.flops_per_token() *
                            static_cast<double>(o.micro_batch_size * model.seq_length) /
                            (peak_gflops * 1e9) * 1e3;
  std::printf(
      "octet: each operator's entry point timed (exclusive of the operators it calls; FP8\n"
      "  casts include the GEMMs' widening of FP8 operands), mean over the timed steps. torch:\n"
      "  one step under torch.profiler (its overhead included), ops' self CPU time mapped to\n"
      "  the same categories (its attention is explicit: bmm, softmax, masking). The step's\n"
      "  FLOPs at the measured BF16 GEMM peak take %.1f ms (B=%lld).\n",
      at_peak_ms, (long long)o.micro_batch_size);
}

const char* verdict(double value, double goal, bool at_least) {
  if (!std::isfinite(value)) return "n/a";
  return (at_least ? value >= goal : value <= goal) ? "met" : "NOT met";
}

void print_table(const std::vector<Result>& results, const RoundRatios& rounds,
                 const BenchModel& model, const Options& o, double peak_gflops) {
  const double mb = 1024.0 * 1024.0;
  std::printf(
      "octet bench train: %s (%.1fM parameters), micro-batch %lld x seq %lld = %lld "
      "tokens/step, %d threads\n",
      model.name.c_str(), model.num_parameters() / 1e6, (long long)o.micro_batch_size,
      (long long)model.seq_length, (long long)(o.micro_batch_size * model.seq_length),
      num_threads());
  if (model.is_vit()) {
    std::printf("a ViT: images/s = tokens/s / %lld (its patches and the class token)\n",
                (long long)model.seq_length);
  }
  if (model.is_t5()) {
    std::printf(
        "a T5: tokens are encoder (input) tokens; each sequence also has %lld decoder "
        "tokens, whose work the FLOPs per token include\n",
        (long long)model.target_length);
  }
  std::printf("measured BF16 GEMM peak %.1f GFLOP/s; %.3f GFLOP per token (MFU counts these)\n",
              peak_gflops, model.flops_per_token() / 1e9);
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
  const Ratios q = ratios(results, rounds);
  double best_mfu = NAN;
  for (const Result& r : results) {
    if (r.impl == "octet" && r.precision != "fp32") {
      best_mfu = std::isfinite(best_mfu) ? std::max(best_mfu, r.mfu) : r.mfu;
    }
  }
  std::printf(
      "ratios of tokens/s over %d rounds, median (min..max) of per-round ratios:\n"
      "  octet/torch fp32 %s, bf16 %s, fp8/torch_bf16 %s; octet fp8/bf16 %s\n"
      "  octet fp8/bf16 saved activations %.2f; per CPU-second over all steps: octet/torch "
      "bf16 %.2f, octet fp8/bf16 %.2f\n",
      o.rounds, bench::median_range(rounds.fp32_vs_torch).c_str(),
      bench::median_range(rounds.bf16_vs_torch).c_str(),
      bench::median_range(rounds.fp8_vs_torch_bf16).c_str(),
      bench::median_range(rounds.fp8_vs_bf16).c_str(), q.fp8_vs_bf16_saved, q.bf16_vs_torch_cpu,
      q.fp8_vs_bf16_cpu);
  std::printf(
      "goals: bf16 >= %gx torch bf16: %s; fp8 >= 1.0x bf16 tokens/s: %s; fp8 saved "
      "activations <= 0.6x bf16: %s; MFU >= 70%% (best of bf16/fp8 %.1f%%): %s\n",
      model.torch_goal(), verdict(q.bf16_vs_torch, model.torch_goal(), true),
      verdict(q.fp8_vs_bf16_tokens, 1.0, true), verdict(q.fp8_vs_bf16_saved, 0.6, false),
      100 * best_mfu, verdict(best_mfu, 0.7, true));
  std::printf(
      "step: zero_grad + train_step (forward, %s, backward) + AdamW\n"
      "  (clip 1.0) + on_parameters_updated. Each round: octet's precisions take %d steps\n"
      "  each in turn (one of each), and each torch peer (a process kept running) %d steps,\n"
      "  octet first in even rounds, the peer first in odd ones; step_ms: median over all\n"
      "  timed steps after %d warm-up; tok/cpu_s: tokens per second of process CPU time (2\n"
      "  busy threads count twice). torch fp32 runs B=%lld sequences (Debian's torch has a\n"
      "  generic-BLAS FP32 GEMM, ~2 GFLOP/s): tokens/s is per token. fp8: DelayedScaling\n"
      "  HYBRID, amax history 16. MFU: train_flops_per_token x tokens/s over the best of the\n"
      "  BF16 GEMM peaks measured before and after the rounds.\n"
      "peak_MB: octet: Tensor storage (params, grads, AdamW state, activations, workspaces);\n"
      "  torch: the peer process's resident-memory growth from before the model was built.\n"
      "step_MB: octet's peak during train_step above the bytes held before it.\n"
      "saved_MB: octet: what the model's context holds after one forward (the BF16 or\n"
      "  FP8 weight copies, made once per optimizer step, are not counted); torch: the\n"
      "  distinct storages autograd saved in one forward (parameters excluded).\n",
      model.loss_text(), o.steps, o.torch_steps, o.warmup,
      (long long)std::min(o.torch_fp32_micro_batch_size, o.micro_batch_size));
}

void run_bench(const Options& o) {
  OCTET_CHECK(o.rounds >= 1, "bench train: --rounds expected >= 1, got ", o.rounds);
  OCTET_CHECK(o.steps >= 1, "bench train: --steps expected >= 1, got ", o.steps);
  OCTET_CHECK(o.torch_steps >= 1, "bench train: --torch-steps expected >= 1, got ", o.torch_steps);
  OCTET_CHECK(o.warmup >= 0, "bench train: --warmup expected >= 0, got ", o.warmup);
  OCTET_CHECK(o.micro_batch_size >= 1, "bench train: --micro-batch-size expected >= 1, got ",
              o.micro_batch_size);
  const std::filesystem::path config_path = resolve_config(o.config);
  const BenchModel model(config_path.string(), o.seq_length);
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
  std::vector<std::unique_ptr<OctetRun>> runs;
  for (const std::string& precision : precisions) {
    runs.push_back(std::make_unique<OctetRun>(model, precision, o));
  }
  // One peer per torch precision: bf16 stands beside fp8.
  TorchPeers peers;
  for (const std::string& precision : precisions) {
    const std::string peer = precision == "fp8" ? "bf16" : precision;
    const bool started = std::any_of(peers.begin(), peers.end(),
                                     [&](const auto& p) { return p->impl() == "torch_" + peer; });
    if (o.no_torch || started) continue;
    if (!o.json) std::fprintf(stderr, "bench train: starting torch %s ...\n", peer.c_str());
    peers.push_back(std::make_unique<TorchPeer>(config_path, peer, o, model));
  }
  for (int i = 0; i < o.warmup; ++i) {
    for (auto& run : runs) run->step(/*warmup=*/true);
  }
  RoundRatios rounds;
  const int64_t B = o.micro_batch_size, T = model.seq_length;
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<double> peer_tokens(peers.size(), NAN);
    auto run_peers = [&] {
      for (size_t i = 0; i < peers.size(); ++i) peer_tokens[i] = peers[i]->round(o.torch_steps);
    };
    if (round % 2 == 1) run_peers();  // who goes first alternates round by round
    for (auto& run : runs) run->begin_round();
    for (int i = 0; i < o.steps; ++i) {  // octet's precisions in turn, one step each
      for (auto& run : runs) run->step(/*warmup=*/false);
    }
    if (round % 2 == 0) run_peers();
    auto ours = [&](const char* precision) -> double {
      for (size_t i = 0; i < runs.size(); ++i) {
        if (precisions[i] == precision) return runs[i]->round_tokens_per_s(B, T);
      }
      return NAN;
    };
    auto theirs = [&](const char* precision) -> double {
      for (size_t i = 0; i < peers.size(); ++i) {
        if (peers[i]->impl() == std::string("torch_") + precision) return peer_tokens[i];
      }
      return NAN;
    };
    bench::push_finite(rounds.fp32_vs_torch, ours("fp32") / theirs("fp32"));
    bench::push_finite(rounds.bf16_vs_torch, ours("bf16") / theirs("bf16"));
    bench::push_finite(rounds.fp8_vs_torch_bf16, ours("fp8") / theirs("bf16"));
    bench::push_finite(rounds.fp8_vs_bf16, ours("fp8") / ours("bf16"));
    if (!o.json) {
      std::fprintf(stderr, "bench train: round %d/%d tokens/s:", round + 1, o.rounds);
      for (size_t i = 0; i < runs.size(); ++i) {
        std::fprintf(stderr, " octet %s %.0f", precisions[i].c_str(),
                     runs[i]->round_tokens_per_s(B, T));
      }
      for (size_t i = 0; i < peers.size(); ++i) {
        std::fprintf(stderr, " %s %.0f", peers[i]->impl().c_str(), peer_tokens[i]);
      }
      std::fprintf(stderr, "\n");
    }
  }
  measure_peak();
  std::vector<Result> results;
  for (auto& run : runs) results.push_back(run->finish(B, T));
  for (auto& peer : peers) {
    if (auto r = peer->finish()) results.push_back(*r);
  }
  const double flops_per_token = model.flops_per_token();
  for (Result& r : results) r.mfu = flops_per_token * r.tokens_per_s / (peak_gflops * 1e9);

  if (o.json) {
    print_json(results, rounds, model, o, peak_gflops);
  } else {
    print_table(results, rounds, model, o, peak_gflops);
    print_breakdown(results, model, o, peak_gflops);
  }
}

}  // namespace

void register_bench_train(CLI::App& bench) {
  CLI::App* cmd = bench.add_subcommand(
      "train",
      "Training steps of a GPT, ViT, BERT or T5 config: tokens/s, MFU, memory; beside PyTorch "
      "fp32 and bf16");
  auto o = std::make_shared<Options>();
  cmd->add_option("--config", o->config, "Model config JSON, or a name in configs/")
      ->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32 | bf16 | fp8, comma-separated")
      ->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "Rounds, each timing octet and the peer in turn")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--steps", o->steps, "Timed steps per precision and round")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--warmup", o->warmup, "Untimed steps first")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--torch-steps", o->torch_steps, "Timed PyTorch steps per round")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--torch-fp32-micro-batch-size", o->torch_fp32_micro_batch_size,
                  "Sequences per torch fp32 step (its generic-BLAS GEMMs are slow)")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per step")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--seq-length", o->seq_length,
                  "Tokens per sequence (0: the config's; a ViT: its patches + 1; a BERT: >= 5; "
                  "a T5: its encoder's)")
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
