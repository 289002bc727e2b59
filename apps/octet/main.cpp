// The octet command: a thin layer over liboctet. Each sub-command lives in its own file.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "commands.h"
#include "octet/comm.h"
#include "octet/error.h"

namespace {

// " on rank 3" under a launcher, else nothing.
std::string where() {
  if (octet::launcher_world_size() <= 1) return {};
  for (const char* variable : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* rank = std::getenv(variable)) return std::string(" on rank ") + rank;
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"octet: train and serve Transformer models fast, with FP8 numerics"};
  app.require_subcommand(1);
  app.set_version_flag("--version", OCTET_VERSION_STRING);
  octet::cli::register_info(app);
  octet::cli::register_demo(app);
  octet::cli::register_train(app);
  octet::cli::register_generate(app);
  octet::cli::register_serve(app);
  octet::cli::register_tokenize(app);
  octet::cli::register_learn_bpe(app);
  octet::cli::register_schedule(app);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks, each beside its peer");
  bench->require_subcommand(1);
  octet::cli::register_bench_gemm(*bench);
  octet::cli::register_bench_ops(*bench);
  octet::cli::register_bench_train(*bench);
  octet::cli::register_bench_converge(*bench);
  octet::cli::register_bench_parallel(*bench);
  octet::cli::register_bench_infer(*bench);
  octet::cli::register_bench_moe(*bench);
  int status = 0;
  std::string message;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const octet::Error& error) {
    status = 1;
    message = std::string("error") + where() + ": " + error.what();
  } catch (const std::exception& error) {
    status = 2;
    message = std::string("unexpected error") + where() + ": " + error.what();
  }
  if (status == 0) return 0;
  std::fprintf(stderr, "octet: %s\n", message.c_str());
  // Under a launcher the other ranks may be waiting for this one in a collective: end them
  // all now rather than leave them to their timeouts.
  octet::abort_job(status);
  return status;
}
