// Sub-commands of the octet CLI. Each file registers its own on the parent it is given.
#pragma once

#include <CLI/CLI.hpp>

namespace octet::cli {

void register_info(CLI::App& app);
void register_demo(CLI::App& app);
void register_train(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_schedule(CLI::App& app);
void register_bench_gemm(CLI::App& bench);
void register_bench_ops(CLI::App& bench);
void register_bench_train(CLI::App& bench);
void register_bench_parallel(CLI::App& bench);

}  // namespace octet::cli
