// The octet command: a thin layer over liboctet. Each sub-command lives in its own file.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "octet/error.h"

int main(int argc, char** argv) {
  CLI::App app{"octet: train and serve Transformer models fast, with FP8 numerics"};
  app.require_subcommand(1);
  app.set_version_flag("--version", OCTET_VERSION_STRING);
  octet::cli::register_info(app);
  octet::cli::register_demo(app);
  octet::cli::register_train(app);
  octet::cli::register_generate(app);
  octet::cli::register_tokenize(app);
  octet::cli::register_schedule(app);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks, each beside its peer");
  bench->require_subcommand(1);
  octet::cli::register_bench_gemm(*bench);
  octet::cli::register_bench_ops(*bench);
  octet::cli::register_bench_train(*bench);
  octet::cli::register_bench_parallel(*bench);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const octet::Error& error) {
    std::fprintf(stderr, "octet: error: %s\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "octet: unexpected error: %s\n", error.what());
    return 2;
  }
  return 0;
}
