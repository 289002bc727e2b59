// The OpenAI completions API's rules, apart from HTTP: a request body checked field by field
// into a CompletionRequest (each error naming its field, as the API's `param`), and the text
// rules of a response (token bytes to valid UTF-8, stop strings).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "octet/data.h"
#include "octet/infer.h"

namespace octet::api {

// A request the client got wrong: answered with `status` and
// {"error":{"message":..,"type":"invalid_request_error","param":..}}.
class RequestError : public std::runtime_error {
 public:
  RequestError(std::string message, std::string param, int status = 400)
      : std::runtime_error(std::move(message)), param_(std::move(param)), status_(status) {}
  const std::string& param() const { return param_; }
  int status() const { return status_; }

 private:
  std::string param_;  // the request's field at fault; empty for the body as a whole
  int status_;
};

inline constexpr int64_t kMaxChoicesPerPrompt = 16;  // "n"
inline constexpr int64_t kMaxPrompts = 64;           // entries of a "prompt" list
inline constexpr int64_t kMaxStopStrings = 4;
inline constexpr int64_t kMaxLogprobs = 5;

struct CompletionRequest {
  std::vector<std::vector<int32_t>> prompts;  // token ids, one list per prompt (non-empty)
  std::optional<int64_t> max_tokens;          // unset: what the context leaves (JSON null)
  SamplingOptions sampling;
  bool seeded = false;            // "seed" given: choice i of each prompt uses seed + i
  int64_t n = 1;                  // choices per prompt
  std::vector<std::string> stop;  // non-empty strings
  int64_t logprobs = -1;          // -1: none; k: the chosen token's and the top k
  bool stream = false;
};

struct ModelLimits {
  std::string name;     // "model", when given, must be this (else 404)
  int64_t max_seq_len;  // prompt + max_tokens fits in it
  int64_t vocab_size;   // token-id prompts stay below it
};

// Parses and checks a /v1/completions body. Throws RequestError: malformed JSON, an unknown
// field, a wrong type, a value out of range, a prompt that leaves no room for max_tokens.
CompletionRequest parse_completion_request(std::string_view body, const Gpt2Tokenizer& tokenizer,
                                           const ModelLimits& limits);

// {"error":{"message","type","param"}} as text.
std::string error_body(const std::string& message, const std::string& type,
                       const std::string& param);

// UTF-8 text from token bytes. Each complete character is copied, each maximal run of bytes
// that cannot be (or finish) a character becomes U+FFFD, and a character still incomplete at
// the end is held back unless `final` (then it too becomes U+FFFD). *consumed: the bytes used.
// Prefix-stable: converting a growing text piece by piece, each time from where the last
// stopped, gives what converting it whole gives.
std::string utf8_text(std::string_view bytes, bool final, size_t* consumed = nullptr);

// The first position in `text` where one of `stops` occurs, searching only matches that end
// at or after `from` (the bytes before were searched already); npos when none.
size_t find_stop(std::string_view text, const std::vector<std::string>& stops, size_t from);

}  // namespace octet::api
