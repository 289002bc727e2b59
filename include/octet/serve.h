// `octet serve`: an OpenAI-compatible HTTP server over an Engine (cpp-httplib).
//   POST /v1/completions  text completions; "stream": true answers with server-sent events
//   GET  /v1/models       the one model served
//   GET  /health          200 while serving, 503 while draining
//   GET  /metrics         Prometheus text: request outcomes, tokens, KV blocks, latencies
// Each completion choice (prompt x n) is its own GenerationRequest. The engine's callbacks
// only append to the request's state and wake the HTTP worker thread holding the connection,
// which writes the answer; a client gone mid-stream has its requests cancelled.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "octet/data.h"
#include "octet/engine.h"

namespace octet {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                          // 0: any free port (bind() says which)
  std::string model_name = "octet";         // the "model" requests name, /v1/models lists
  int threads = 64;                         // HTTP workers: each open request holds one
  size_t max_body_bytes = size_t{1} << 20;  // larger request bodies are answered 413
};

class Server {
 public:
  // The engine (started by the caller before listen()) and the tokenizer must outlive the
  // server and every request it submitted; the tokenizer's ids must fit the model's vocab.
  Server(Engine& engine, const Gpt2Tokenizer& tokenizer, ServerOptions options);
  ~Server();  // stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port (the chosen one for port 0). Throws Error
  // when the address cannot be bound.
  int bind();
  // Serves on the calling thread until stop() (binds first if bind() was not called). With
  // SIGPIPE blocked in this thread and the workers it starts: a client gone is a write error.
  void listen();
  // Drains: new completions are refused (503) and /health says 503, the requests in flight
  // finish (the engine must still be stepping them), then listen() returns. Any thread;
  // idempotent.
  void stop();
  bool draining() const;

  const ServerOptions& options() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace octet
