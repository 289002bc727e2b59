// `octet serve`: a trained checkpoint behind an OpenAI-compatible HTTP server (octet/serve.h).
// SIGTERM / SIGINT drain it: new requests get 503, those in flight finish, then it exits 0.
// The signals are blocked in every thread and taken by sigwait() on one of them, so no work
// runs in a signal handler.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "commands.h"
#include "octet/data.h"
#include "octet/engine.h"
#include "octet/serve.h"
#include "octet/train.h"

namespace octet::cli {
namespace {

struct ServeOptions {
  std::string checkpoint;
  std::string vocab_dir;
  std::string precision = "fp32";
  double kv_cache_mb = static_cast<double>(EngineOptions{}.kv_cache_bytes >> 20);
  EngineOptions engine;
  ServerOptions server;
  bool fp8_weights = false;
  std::string fp8_weight_scaling = "channel";
};

// Blocks SIGTERM and SIGINT in this thread and every thread it starts from now on; restores
// the mask when it goes.
class BlockedStopSignals {
 public:
  BlockedStopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set_, &previous_);
  }
  ~BlockedStopSignals() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  const sigset_t& set() const { return set_; }

 private:
  sigset_t set_, previous_;
};

void run_serve(ServeOptions& o) {
  std::signal(SIGPIPE, SIG_IGN);  // a client gone is a failed write, not the end of the server
  BlockedStopSignals signals;     // before any thread starts, so that all inherit the mask

  Checkpoint checkpoint = load_checkpoint(o.checkpoint);
  OCTET_CHECK(checkpoint.trainer.contains("config"), "checkpoint '", o.checkpoint,
              "': trainer.json has no model config");
  GPTConfig config = GPTConfig::from_json(checkpoint.trainer.at("config"));
  GPT model(config, 0);
  model.load_state_dict(from_hf_gpt2_names(checkpoint.model));
  if (o.fp8_weights) {
    model.set_inference_fp8_weights(true, parse_fp8_weight_scaling(o.fp8_weight_scaling));
  }
  const Gpt2Tokenizer tokenizer =
      Gpt2Tokenizer::load(checkpoint_vocab_dir(o.vocab_dir, o.checkpoint));
  OCTET_CHECK(tokenizer.vocab_size() <= config.vocab_size, "serve: the tokenizer has ",
              tokenizer.vocab_size(), " tokens, more than the model's ", config.vocab_size,
              " (pass the --vocab-dir the model was trained with)");

  o.engine.dtype = o.precision == "bf16" ? DType::BF16 : DType::F32;
  o.engine.kv_cache_bytes = static_cast<size_t>(o.kv_cache_mb * 1024.0 * 1024.0);
  Engine engine(model, o.engine);
  std::printf("%s", engine.memory_report().c_str());
  Server server(engine, tokenizer, o.server);
  const int port = server.bind();
  engine.start();

  // The signal taker: the first SIGTERM / SIGINT drains the server, which ends listen().
  // When listen() ends for another reason, the same signal sent to this thread wakes it.
  std::atomic<bool> serving{true};
  std::thread taker([&] {
    int received = 0;
    sigwait(&signals.set(), &received);
    if (!serving) return;
    std::printf("octet serve: %s: draining (new requests get 503)\n",
                received == SIGINT ? "SIGINT" : "SIGTERM");
    std::fflush(stdout);
    server.stop();
  });
  std::printf("octet serve: model '%s' listening on http://%s:%d\n", o.server.model_name.c_str(),
              o.server.host.c_str(), port);
  std::fflush(stdout);
  try {
    server.listen();
  } catch (...) {
    serving = false;
    pthread_kill(taker.native_handle(), SIGTERM);
    taker.join();
    throw;
  }
  serving = false;
  pthread_kill(taker.native_handle(), SIGTERM);  // no-op for sigwait once it has returned
  taker.join();
  engine.shutdown(true);
  const EngineStats stats = engine.stats();
  std::printf("octet serve: stopped after %llu requests, %llu tokens generated\n",
              static_cast<unsigned long long>(stats.requests_finished),
              static_cast<unsigned long long>(stats.generation_tokens));
}

}  // namespace

void register_serve(CLI::App& app) {
  CLI::App* cmd =
      app.add_subcommand("serve", "Serve a checkpoint over an OpenAI-compatible HTTP API");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("--ckpt", o->checkpoint, "Checkpoint directory (octet train --save)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--host", o->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o->server.port, "TCP port (0: any free one, printed at start)")
      ->check(number_in(0, 65535))
      ->capture_default_str();
  cmd->add_option("--model-name", o->server.model_name, "The model's name in the API")
      ->capture_default_str();
  cmd->add_option("--vocab-dir", o->vocab_dir, "Directory with encoder.json and vocab.bpe");
  cmd->add_option("--precision", o->precision, "Compute and KV-cache precision: fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--block-size", o->engine.block_size, "Tokens per KV-cache block")
      ->check(number_in(1, 4096))
      ->capture_default_str();
  cmd->add_option("--kv-cache-mb", o->kv_cache_mb, "KV-cache size in MiB")
      ->check(number_in(0, 1e6, true))
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", o->engine.max_num_seqs, "Sequences in a batch at most")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", o->engine.max_num_batched_tokens,
                  "Tokens per step (decodes + prefill chunks) at most")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--max-queue", o->engine.max_waiting,
                  "Requests waiting at most; past it new ones get 503")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--threads", o->server.threads,
                  "HTTP worker threads (each open request holds one)")
      ->check(number_in(1, 4096))
      ->capture_default_str();
  cmd->add_flag_function(
      "--no-prefix-caching", [o](int64_t) { o->engine.enable_prefix_caching = false; },
      "Do not share KV blocks between prompts with the same prefix");
  cmd->add_flag_function(
      "--no-chunked-prefill", [o](int64_t) { o->engine.enable_chunked_prefill = false; },
      "Prefill each prompt in one step");
  add_fp8_weight_flags(*cmd, o->fp8_weights, o->fp8_weight_scaling,
                       "Weight-only FP8 (E4M3) for the GEMMs: fewer bytes per token");
  cmd->add_flag("--fp8-kv", o->engine.fp8_kv,
                "KV cache in E4M3 with one scale per (token, head): about half of BF16's bytes");
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace octet::cli
