// `octet serve`'s HTTP side on cpp-httplib: routes, the completion handler (one engine request
// per choice, answered whole or as server-sent events), draining, and Prometheus metrics.
// The engine's callbacks run on its stepping thread: they append a token's bytes to the
// request's state under its mutex and wake the HTTP worker waiting on it, nothing more.
#include <dirent.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "infer/http.h"
#include "infer/openai_api.h"
#include "infer/server_metrics.h"
#include "octet/serve.h"

namespace octet {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using serving::Metrics;
using serving::Outcome;

struct Completion;

// Whether the client of a request being answered has closed its connection. httplib 0.11 (the
// Debian package) gives a handler no socket, and a client that leaves a non-streaming request
// shows nothing until the answer is written: its connection's socket is found among the
// process's descriptors by its two ends (the request's remote and local address and port,
// unique among open TCP connections), once, and then peeked without waiting. End of stream or
// a reset means the client is gone; nothing to read yet, or bytes of a pipelined request, mean
// it is still there. (A client that half-closes after sending reads as gone; HTTP clients
// such as curl, browsers and the OpenAI libraries do not.)
class ConnectionProbe {
 public:
  explicit ConnectionProbe(const httplib::Request& request) : request_(request) {}

  bool client_gone() {
    if (fd_ < 0 && !searched_) {
      fd_ = find_socket();
      searched_ = true;
    }
    if (fd_ < 0) return false;  // not found: nothing to say it is gone
    char byte = 0;
    const ssize_t n = ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n >= 0) return n == 0;
    return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  }

 private:
  // A socket address as httplib writes it (numeric host, port).
  static bool endpoint(const sockaddr_storage& address, socklen_t length, std::string& host,
                       int& port) {
    char name[NI_MAXHOST], service[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, name, sizeof(name),
                      service, sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
      return false;
    }
    host = name;
    port = std::atoi(service);
    return true;
  }

  int find_socket() const {
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return -1;
    int found = -1;
    while (const dirent* entry = ::readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(entry->d_name, &end, 10);
      if (end == entry->d_name || *end != '\0') continue;
      sockaddr_storage peer{}, local{};
      socklen_t peer_length = sizeof(peer), local_length = sizeof(local);
      if (::getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_length) !=
              0 ||
          ::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_length) !=
              0) {
        continue;
      }
      std::string peer_host, local_host;
      int peer_port = -1, local_port = -1;
      if (endpoint(peer, peer_length, peer_host, peer_port) &&
          endpoint(local, local_length, local_host, local_port) &&
          peer_port == request_.remote_port && peer_host == request_.remote_addr &&
          local_port == request_.local_port && local_host == request_.local_addr) {
        found = static_cast<int>(fd);
        break;
      }
    }
    ::closedir(dir);
    return found;
  }

  const httplib::Request& request_;
  int fd_ = -1;
  bool searched_ = false;
};

// How often a worker waiting for a non-streaming answer looks whether its client is still there.
constexpr std::chrono::milliseconds kClientProbeInterval{100};

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::string dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

struct TokenLogprob {
  std::string token;  // its text (U+FFFD for bytes that are not whole characters)
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;
  size_t text_offset = 0;  // byte offset of the token in the completion's text
};

struct ChoiceState {
  uint64_t engine_id = 0;
  bool submitted = false;
  std::string bytes;      // generated so far, cut before a stop string
  size_t bytes_sent = 0;  // streaming: bytes turned into text and sent
  std::vector<TokenLogprob> logprobs;
  size_t logprobs_sent = 0;
  int64_t tokens = 0;
  bool stop_string_seen = false;
  bool finished = false, final_sent = false;
  FinishReason reason = FinishReason::Length;
  std::string error;
  Clock::time_point last_token;
};

// One completion request: written by the engine's callbacks, read by the HTTP worker.
struct RequestState {
  // Fixed before the first choice is submitted.
  const Gpt2Tokenizer* tokenizer = nullptr;
  std::shared_ptr<Metrics> metrics;
  std::vector<std::string> stop;
  size_t stop_hold_bytes = 0;  // streaming keeps this many back: a stop string may start there
  int32_t end_of_text = -1;    // its bytes are not text
  int64_t logprobs = -1;
  Clock::time_point arrival;

  std::mutex mutex;
  std::condition_variable changed;
  std::vector<ChoiceState> choices;
  int64_t unfinished = 0;
  uint64_t version = 0;    // bumped on every change the worker may want to see
  bool abandoned = false;  // the HTTP side is gone: callbacks only end their request

  const std::string& token_piece(int32_t id) const {
    static const std::string kNone;
    return id == end_of_text || id < 0 || id >= tokenizer->vocab_size()
               ? kNone
               : tokenizer->token_bytes(id);
  }

  // A token as logprobs name it ("<|endoftext|>" included).
  std::string token_name(int32_t id) const {
    return id >= 0 && id < tokenizer->vocab_size()
               ? api::utf8_text(tokenizer->token_bytes(id), true)
               : "<|" + std::to_string(id) + "|>";
  }

  // Engine thread.
  bool on_token(size_t index, const TokenOutput& out) {
    const Clock::time_point now = Clock::now();
    std::lock_guard lock(mutex);
    if (abandoned) return false;
    ChoiceState& choice = choices[index];
    ++choice.tokens;
    if (choice.tokens == 1) {
      metrics->time_to_first_token.observe(seconds_between(arrival, now));
    } else {
      metrics->inter_token_latency.observe(seconds_between(choice.last_token, now));
    }
    choice.last_token = now;
    const size_t offset = choice.bytes.size();
    const std::string& piece = token_piece(out.token);
    choice.bytes += piece;
    if (logprobs >= 0) {
      TokenLogprob entry{token_name(out.token), out.logprob, {}, offset};
      for (const auto& [id, logprob] : out.top_logprobs)
        entry.top.emplace_back(token_name(id), logprob);
      choice.logprobs.push_back(std::move(entry));
    }
    bool go_on = true;
    if (!stop.empty()) {
      if (const size_t at = api::find_stop(choice.bytes, stop, offset); at != std::string::npos) {
        choice.bytes.resize(at);
        while (!choice.logprobs.empty() && choice.logprobs.back().text_offset >= at) {
          choice.logprobs.pop_back();
        }
        choice.stop_string_seen = true;
        go_on = false;
      }
    }
    ++version;
    changed.notify_all();
    return go_on;
  }

  // Engine thread (or the submitting one), exactly once per submitted choice.
  void on_finish(size_t index, FinishReason reason, const std::string& error) {
    std::lock_guard lock(mutex);
    ChoiceState& choice = choices[index];
    choice.finished = true;
    choice.reason = choice.stop_string_seen ? FinishReason::Stop : reason;
    choice.error = error;
    metrics->finished(choice.reason);
    --unfinished;
    ++version;
    changed.notify_all();
  }

  bool all_finished() const { return unfinished == 0; }
};

json logprobs_json(const ChoiceState& choice, size_t begin, size_t end) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (size_t i = begin; i < end; ++i) {
    const TokenLogprob& entry = choice.logprobs[i];
    tokens.push_back(entry.token);
    token_logprobs.push_back(entry.logprob);
    json alternatives = json::object();
    for (const auto& [token, logprob] : entry.top) {
      if (!alternatives.contains(token)) alternatives[token] = logprob;
    }
    top.push_back(std::move(alternatives));
    offsets.push_back(entry.text_offset);
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

// httplib's server with a longer accept queue. The library listens with a backlog of 5 (fixed
// when Debian compiled it): past 5 connections waiting for accept() the kernel drops the
// handshake's last packet, the client's request is retransmitted with growing delays, and a
// worker that accepted the connection may give up waiting for it. listen() again on the
// bound socket raises the backlog (Linux: the second call only sets it).
class HttpServer : public httplib::Server {
 public:
  bool raise_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }
};

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr int kListenBacklog = 1024;  // connections waiting for accept() (capped by somaxconn)

}  // namespace

struct Server::Impl {
  Impl(Engine& engine_in, const Gpt2Tokenizer& tokenizer_in, ServerOptions options_in)
      : engine(engine_in),
        tokenizer(tokenizer_in),
        options(std::move(options_in)),
        metrics(std::make_shared<Metrics>()),
        random_base(std::random_device{}() * 0x100000001ull ^ std::random_device{}()) {}

  Engine& engine;
  const Gpt2Tokenizer& tokenizer;
  ServerOptions options;
  std::shared_ptr<Metrics> metrics;
  HttpServer http;
  const uint64_t random_base;
  std::atomic<uint64_t> counter{0};

  // Draining and the listen/stop hand-over.
  mutable std::mutex mutex;
  std::condition_variable idle;
  int64_t in_flight = 0;
  bool is_draining = false, stopped = false, listening = false, bound = false;
  int port = -1;

  uint64_t next_random() { return mix(random_base + counter.fetch_add(1)); }

  // Holds a completion request in flight (stop() waits for none); empty while draining.
  struct InFlight {
    Impl* server = nullptr;
    InFlight() = default;
    explicit InFlight(Impl* s) : server(s) {}
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    ~InFlight() {
      if (!server) return;
      std::lock_guard lock(server->mutex);
      if (--server->in_flight == 0) server->idle.notify_all();
    }
  };
  std::unique_ptr<InFlight> enter() {
    std::lock_guard lock(mutex);
    if (is_draining) return nullptr;
    ++in_flight;
    return std::make_unique<InFlight>(this);
  }

  bool draining() const;
  void routes();
  void complete(const httplib::Request& request, httplib::Response& response);
  void respond(const std::shared_ptr<Completion>& completion, const httplib::Request& request,
               httplib::Response& response);
  void stream(const std::shared_ptr<Completion>& completion, httplib::Response& response);
};

namespace {

void send_error(httplib::Response& response, int status, const std::string& message,
                const std::string& param = "", const char* type = "invalid_request_error") {
  response.status = status;
  response.set_content(api::error_body(message, type, param), "application/json");
}

// A submitted completion, held by the HTTP worker (and by the stream it writes): when it goes,
// every choice still running is cancelled so that its KV blocks are freed.
struct Completion {
  Completion(Engine& engine_in, std::shared_ptr<Metrics> metrics_in)
      : engine(engine_in), metrics(std::move(metrics_in)) {}
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  ~Completion() {
    abandon();
    if (!counted) metrics->count(Outcome::Cancelled);
  }

  void abandon() {
    std::vector<uint64_t> running;
    {
      std::lock_guard lock(state->mutex);
      state->abandoned = true;
      for (const ChoiceState& choice : state->choices) {
        if (choice.submitted && !choice.finished) running.push_back(choice.engine_id);
      }
    }
    for (uint64_t engine_id : running) engine.cancel(engine_id);
  }
  void count(Outcome outcome) {
    if (!counted) metrics->count(outcome);
    counted = true;
  }

  Engine& engine;
  std::shared_ptr<Metrics> metrics;
  std::shared_ptr<RequestState> state = std::make_shared<RequestState>();
  std::unique_ptr<Server::Impl::InFlight> in_flight;
  std::string id;
  int64_t created = 0;
  std::string model;
  bool counted = false;

  json chunk(json choice) const {
    return {{"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", json::array({std::move(choice)})}};
  }

  // Streaming: the events for what arrived since the last call (the state's mutex held);
  // `finished` says whether every choice has sent its last event.
  std::vector<std::string> new_events(bool& finished) {
    std::vector<std::string> events;
    finished = true;
    for (size_t index = 0; index < state->choices.size(); ++index) {
      ChoiceState& choice = state->choices[index];
      if (choice.final_sent) continue;
      const size_t held = choice.finished ? 0 : state->stop_hold_bytes;
      const size_t end =
          std::max(choice.bytes_sent, choice.bytes.size() - std::min(held, choice.bytes.size()));
      size_t used = 0;
      std::string text = api::utf8_text(
          std::string_view(choice.bytes).substr(choice.bytes_sent, end - choice.bytes_sent),
          choice.finished, &used);
      choice.bytes_sent += used;
      const bool new_logprobs = choice.logprobs_sent < choice.logprobs.size();
      if (text.empty() && !new_logprobs && !choice.finished) continue;
      if (choice.finished &&
          (choice.reason == FinishReason::Cancelled || choice.reason == FinishReason::Error)) {
        const std::string message = choice.reason == FinishReason::Error
                                        ? "generation failed: " + choice.error
                                        : "the request was cancelled (the server is stopping)";
        events.push_back("data: " + api::error_body(message, "server_error", "") + "\n\n");
        choice.final_sent = true;
        continue;
      }
      json logprobs = nullptr;
      if (state->logprobs >= 0) {
        logprobs = logprobs_json(choice, choice.logprobs_sent, choice.logprobs.size());
        choice.logprobs_sent = choice.logprobs.size();
      }
      json finish_reason = nullptr;
      if (choice.finished) finish_reason = finish_reason_name(choice.reason);
      events.push_back("data: " +
                       dump(chunk({{"index", index},
                                   {"text", std::move(text)},
                                   {"logprobs", std::move(logprobs)},
                                   {"finish_reason", std::move(finish_reason)}})) +
                       "\n\n");
      choice.final_sent = choice.finished;
    }
    for (const ChoiceState& choice : state->choices) finished = finished && choice.final_sent;
    return events;
  }
};

}  // namespace

void Server::Impl::complete(const httplib::Request& request, httplib::Response& response) {
  auto completion = std::make_shared<Completion>(engine, metrics);
  try {
    respond(completion, request, response);
  } catch (const std::exception& error) {
    completion->abandon();
    completion->count(Outcome::Error);
    send_error(response, 500, std::string("internal error: ") + error.what(), "", "server_error");
  }
}

void Server::Impl::respond(const std::shared_ptr<Completion>& completion,
                           const httplib::Request& request, httplib::Response& response) {
  completion->in_flight = enter();
  if (!completion->in_flight) {
    completion->count(Outcome::Rejected);
    return send_error(response, 503, "the server is draining: no new requests", "", "server_error");
  }
  const GPTConfig& config = engine.model_config();
  api::CompletionRequest parsed;
  try {
    parsed = api::parse_completion_request(
        request.body, tokenizer, {options.model_name, config.max_seq_len, config.vocab_size});
  } catch (const api::RequestError& error) {
    completion->count(Outcome::BadRequest);
    return send_error(response, error.status(), error.what(), error.param());
  }

  RequestState& state = *completion->state;
  state.tokenizer = &tokenizer;
  state.metrics = metrics;
  state.stop = parsed.stop;
  for (const std::string& stop : parsed.stop) {
    state.stop_hold_bytes = std::max(state.stop_hold_bytes, stop.size() - 1);
  }
  state.end_of_text = tokenizer.eot_id() < config.vocab_size ? tokenizer.eot_id() : -1;
  state.logprobs = parsed.logprobs;
  state.arrival = Clock::now();
  const size_t choices = parsed.prompts.size() * static_cast<size_t>(parsed.n);
  state.choices.resize(choices);
  char completion_id[24];
  std::snprintf(completion_id, sizeof(completion_id), "cmpl-%016llx",
                static_cast<unsigned long long>(next_random()));
  completion->id = completion_id;
  completion->created = static_cast<int64_t>(std::time(nullptr));
  completion->model = options.model_name;

  // Submit every choice; a refusal withdraws those already in.
  for (size_t index = 0; index < choices; ++index) {
    const size_t prompt = index / static_cast<size_t>(parsed.n);
    const size_t i = index % static_cast<size_t>(parsed.n);
    GenerationRequest generation;
    generation.prompt = parsed.prompts[prompt];
    generation.max_tokens = *parsed.max_tokens;
    generation.sampling = parsed.sampling;
    generation.sampling.seed = parsed.seeded ? parsed.sampling.seed + i : next_random();
    if (state.end_of_text >= 0) generation.stop_token_ids = {state.end_of_text};
    generation.logprobs = parsed.logprobs;
    std::shared_ptr<RequestState> shared = completion->state;
    generation.on_token = [shared, index](const TokenOutput& out) {
      return shared->on_token(index, out);
    };
    generation.on_finish = [shared, index](FinishReason reason, const std::string& error) {
      shared->on_finish(index, reason, error);
    };
    {
      std::lock_guard lock(state.mutex);
      ++state.unfinished;
    }
    try {
      const uint64_t id = engine.add_request(std::move(generation));
      std::lock_guard lock(state.mutex);
      state.choices[index].engine_id = id;
      state.choices[index].submitted = true;
    } catch (const Error& error) {
      {
        std::lock_guard lock(state.mutex);
        --state.unfinished;
      }
      completion->abandon();
      const bool full = dynamic_cast<const QueueFullError*>(&error) != nullptr;
      if (full || !engine.accepting()) {
        completion->count(Outcome::Rejected);
        return send_error(
            response, 503,
            std::string(full ? "the server is busy: " : "the engine is not accepting requests: ") +
                error.what(),
            "", "server_error");
      }
      completion->count(Outcome::BadRequest);
      return send_error(response, 400, error.what());
    }
  }
  if (parsed.stream) return stream(completion, response);

  // Waiting for the whole answer, the worker looks now and then whether its client is still
  // there: one that left has its request cancelled and its KV blocks freed at once.
  ConnectionProbe probe(request);
  std::unique_lock lock(state.mutex);
  while (
      !state.changed.wait_for(lock, kClientProbeInterval, [&] { return state.all_finished(); })) {
    lock.unlock();
    const bool gone = probe.client_gone();
    lock.lock();
    if (!gone) continue;
    lock.unlock();
    completion->abandon();
    completion->count(Outcome::Cancelled);
    // Nobody reads it: nginx's "client closed request", for the server's own log.
    return send_error(response, 499, "the client closed the connection", "", "server_error");
  }
  metrics->request_latency.observe(seconds_between(state.arrival, Clock::now()));
  json out_choices = json::array();
  int64_t completion_tokens = 0, prompt_tokens = 0;
  for (const auto& ids : parsed.prompts) prompt_tokens += static_cast<int64_t>(ids.size());
  for (size_t index = 0; index < choices; ++index) {
    const ChoiceState& choice = state.choices[index];
    if (choice.reason == FinishReason::Error || choice.reason == FinishReason::Cancelled) {
      const bool error = choice.reason == FinishReason::Error;
      completion->count(error ? Outcome::Error : Outcome::Rejected);
      return send_error(response, error ? 500 : 503,
                        error ? "generation failed: " + choice.error
                              : "the request was cancelled (the server is stopping)",
                        "", "server_error");
    }
    completion_tokens += choice.tokens;
    out_choices.push_back(
        {{"index", index},
         {"text", api::utf8_text(choice.bytes, true)},
         {"logprobs",
          state.logprobs >= 0 ? logprobs_json(choice, 0, choice.logprobs.size()) : json(nullptr)},
         {"finish_reason", finish_reason_name(choice.reason)}});
  }
  lock.unlock();
  json body = {{"id", completion->id},
               {"object", "text_completion"},
               {"created", completion->created},
               {"model", options.model_name},
               {"choices", std::move(out_choices)},
               {"usage",
                {{"prompt_tokens", prompt_tokens},
                 {"completion_tokens", completion_tokens},
                 {"total_tokens", prompt_tokens + completion_tokens}}}};
  response.set_content(dump(body), "application/json");
  completion->count(Outcome::Ok);
}

// Server-sent events: the worker writes each new piece as the engine's callbacks wake it.
void Server::Impl::stream(const std::shared_ptr<Completion>& completion,
                          httplib::Response& response) {
  response.set_chunked_content_provider(
      "text/event-stream", [completion](size_t, httplib::DataSink& sink) {
        try {
          RequestState& state = *completion->state;
          uint64_t seen = 0;
          for (bool finished = false; !finished;) {
            std::vector<std::string> events;
            {
              std::unique_lock lock(state.mutex);
              state.changed.wait(lock, [&] { return state.version != seen; });
              seen = state.version;
              events = completion->new_events(finished);
            }
            for (const std::string& event : events) {
              if (!sink.write(event.data(), event.size())) {
                completion->abandon();  // the client is gone: free its blocks now
                completion->count(Outcome::Cancelled);
                return false;
              }
            }
          }
          bool failed = false;
          {
            std::lock_guard lock(state.mutex);
            for (const ChoiceState& choice : state.choices) {
              failed = failed || choice.reason == FinishReason::Cancelled ||
                       choice.reason == FinishReason::Error;
            }
          }
          completion->count(failed ? Outcome::Error : Outcome::Ok);
          static constexpr std::string_view kDone = "data: [DONE]\n\n";
          if (!sink.write(kDone.data(), kDone.size())) return false;
          sink.done();
          return true;
        } catch (...) {
          completion->abandon();
          completion->count(Outcome::Error);
          return false;
        }
      });
}

void Server::Impl::routes() {
  http.Post("/v1/completions", [this](const httplib::Request& request,
                                      httplib::Response& response) {
    try {
      complete(request, response);
    } catch (const std::exception& error) {
      send_error(response, 500, std::string("internal error: ") + error.what(), "", "server_error");
    }
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& response) {
    json model = {{"id", options.model_name},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "octet"},
                  {"max_model_len", engine.model_config().max_seq_len}};
    response.set_content(dump({{"object", "list"}, {"data", json::array({model})}}),
                         "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& response) {
    const bool serving = !draining() && engine.accepting();
    response.status = serving ? 200 : 503;
    response.set_content(serving ? R"({"status":"ok"})" : R"({"status":"draining"})",
                         "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
    try {
      response.set_content(prometheus_text(*metrics, engine.stats()), "text/plain; version=0.0.4");
    } catch (const std::exception& error) {
      send_error(response, 500, error.what(), "", "server_error");
    }
  });
  // Every answer of 400 and above passes here: fill in those httplib made without a body.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& request, httplib::Response& response) {
        if (!response.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        std::string message = "HTTP " + std::to_string(response.status);
        if (response.status == 404) {
          message = "no such endpoint: " + request.method + " " + request.path;
        } else if (response.status == 413) {
          message = "the request body is over " + std::to_string(options.max_body_bytes) + " bytes";
          if (request.path == "/v1/completions") metrics->count(Outcome::BadRequest);
        }
        send_error(response, response.status, message);
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& response, std::exception_ptr) {
        send_error(response, 500, "internal error", "", "server_error");
      });
}

bool Server::Impl::draining() const {
  std::lock_guard lock(mutex);
  return is_draining;
}

Server::Server(Engine& engine, const Gpt2Tokenizer& tokenizer, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, tokenizer, std::move(options))) {
  const ServerOptions& o = impl_->options;
  OCTET_CHECK(o.port >= 0 && o.port <= 65535, "serve: port expected in [0, 65535], got ", o.port);
  OCTET_CHECK(o.threads >= 1, "serve: threads expected >= 1, got ", o.threads);
  OCTET_CHECK(!o.model_name.empty(), "serve: the model name must not be empty");
  OCTET_CHECK(tokenizer.vocab_size() <= engine.model_config().vocab_size,
              "serve: the tokenizer has ", tokenizer.vocab_size(),
              " tokens, more than the model's ", engine.model_config().vocab_size);
  const int threads = o.threads;
  impl_->http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  impl_->http.set_payload_max_length(o.max_body_bytes);
  impl_->http.set_tcp_nodelay(true);
  // httplib's default is SO_REUSEPORT, which lets a second server bind the same port and take
  // half its connections; SO_REUSEADDR alone still allows a restart while old ones linger.
  impl_->http.set_socket_options([](int socket) {
    const int yes = 1;
    setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  impl_->routes();
}

Server::~Server() {
  stop();
  std::unique_lock lock(impl_->mutex);
  impl_->idle.wait(lock, [&] { return !impl_->listening; });
}

int Server::bind() {
  Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  if (s.bound) return s.port;
  const ServerOptions& o = s.options;
  if (o.port == 0) {
    s.port = s.http.bind_to_any_port(o.host);
  } else {
    s.port = s.http.bind_to_port(o.host, o.port) ? o.port : -1;
  }
  OCTET_CHECK(s.port > 0, "serve: cannot listen on ", o.host, ":", o.port,
              " (the address is in use or not this machine's)");
  OCTET_CHECK(s.http.raise_backlog(kListenBacklog), "serve: listen(", kListenBacklog,
              ") on the bound socket failed");
  s.bound = true;
  return s.port;
}

void Server::listen() {
  bind();
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (s.stopped) return;
    s.listening = true;
  }
  // Writing to a client that left raises SIGPIPE, which would end the process: block it here
  // and in the workers (they inherit this thread's mask) so the write fails instead.
  sigset_t blocked, previous;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &blocked, &previous);
  s.http.listen_after_bind();
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  std::lock_guard lock(s.mutex);
  s.listening = false;
  s.idle.notify_all();
}

void Server::stop() {
  Impl& s = *impl_;
  {
    std::unique_lock lock(s.mutex);
    s.is_draining = true;
    s.idle.wait(lock, [&] { return s.in_flight == 0; });
    s.stopped = true;
  }
  // listen() may be between taking `listening` and httplib's loop starting: wait for either.
  for (;;) {
    {
      std::lock_guard lock(s.mutex);
      if (!s.listening) return;
    }
    if (s.http.is_running()) {
      s.http.stop();
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool Server::draining() const {
  return impl_->draining();
}

const ServerOptions& Server::options() const {
  return impl_->options;
}

}  // namespace octet
