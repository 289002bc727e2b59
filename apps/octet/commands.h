// Sub-commands of the octet CLI. Each file registers its own on the parent it is given.
#pragma once

#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

namespace octet::cli {

// `octet train`'s exit status after a graceful stop on SIGTERM/SIGINT (EX_TEMPFAIL).
inline constexpr int kExitStoppedBySignal = 75;

void register_info(CLI::App& app);
void register_demo(CLI::App& app);
void register_train(CLI::App& app);
void register_generate(CLI::App& app);
void register_serve(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_learn_bpe(CLI::App& app);
void register_schedule(CLI::App& app);
void register_bench_gemm(CLI::App& bench);
void register_bench_ops(CLI::App& bench);
void register_bench_train(CLI::App& bench);
void register_bench_converge(CLI::App& bench);
void register_bench_parallel(CLI::App& bench);
void register_bench_infer(CLI::App& bench);
void register_bench_moe(CLI::App& bench);

// The tokenizer directory of generate / serve: --vocab-dir when given, else the tokenizer saved
// in the checkpoint (octet train --vocab-dir), else GPT-2's.
std::string checkpoint_vocab_dir(const std::string& given, const std::string& checkpoint);

// A model config file, or the name of one installed with octet (share/octet/configs) or in
// the source tree (configs/): gpt-tiny, gpt-mini, gpt2-124m. Clear error listing the names.
std::filesystem::path resolve_config(const std::string& config);
// For --config options: replaces a name by its path, or fails with resolve_config's message.
CLI::Validator model_config_validator();

// Numeric flags: a finite number in [min, max] (an open end excludes the bound), so "nan",
// "inf" and out-of-range values fail while parsing, naming the flag and the range.
CLI::Validator number_in(double min, double max, bool min_open = false, bool max_open = false);
CLI::Validator at_least(double min);
// Output paths: writable before any work (octet/files.h: the directory is created if
// missing, a probe file written and removed).
CLI::Validator output_file();
CLI::Validator output_directory();

// --fp8-weights (`help` says what it does in this command) and --fp8-weight-scaling
// channel|block128, which needs it (generate, serve, bench infer).
void add_fp8_weight_flags(CLI::App& cmd, bool& fp8_weights, std::string& scaling,
                          const std::string& help);

}  // namespace octet::cli
