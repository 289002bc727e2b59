// The OpenAI completions request checked field by field (the error names the field, as the
// API's `param`), and the text rules of a response: valid UTF-8 from token bytes, stop strings.
#include "infer/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "octet/error.h"

namespace octet::api {
namespace {

using detail::concat;
using nlohmann::json;

// The value of `name`, or nullptr when it is absent or JSON null (OpenAI's "not given").
const json* find(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void wrong_type(const json& value, const char* name, const char* expected) {
  throw RequestError(concat("'", name, "' must be ", expected, ", got ", value.type_name()), name);
}

int64_t integer_in(const json& value, const char* name, int64_t min, int64_t max) {
  if (!value.is_number_integer()) wrong_type(value, name, "an integer");
  const bool too_big =
      value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(max);
  const int64_t number = too_big ? max : value.get<int64_t>();
  if (too_big || number < min || number > max) {
    throw RequestError(concat("'", name, "' must be in [", min, ", ", max, "], got ", value.dump()),
                       name);
  }
  return number;
}

// A finite number in [min, max]; an open end excludes its bound.
double number_in(const json& value, const char* name, double min, double max,
                 bool min_open = false) {
  if (!value.is_number()) wrong_type(value, name, "a number");
  const double number = value.get<double>();
  const bool below = min_open ? !(number > min) : !(number >= min);
  if (!std::isfinite(number) || below || !(number <= max)) {
    throw RequestError(concat("'", name, "' must be in ", min_open ? "(" : "[", min, ", ", max,
                              "], got ", value.dump()),
                       name);
  }
  return number;
}

bool boolean(const json& value, const char* name) {
  if (!value.is_boolean()) wrong_type(value, name, "a boolean");
  return value.get<bool>();
}

std::vector<int32_t> token_ids(const json& list, int64_t vocab_size) {
  std::vector<int32_t> ids;
  for (const json& id : list) {
    if (!id.is_number_integer()) wrong_type(id, "prompt", "token ids (integers)");
    const int64_t value = id.is_number_unsigned() && id.get<uint64_t>() > uint64_t(vocab_size)
                              ? vocab_size
                              : id.get<int64_t>();
    if (value < 0 || value >= vocab_size) {
      throw RequestError(concat("'prompt': token id ", id.dump(), " is outside the vocabulary [0, ",
                                vocab_size, ")"),
                         "prompt");
    }
    ids.push_back(static_cast<int32_t>(value));
  }
  return ids;
}

// "prompt": a string, a list of strings, a list of token ids, or a list of such lists.
std::vector<std::vector<int32_t>> prompts_of(const json& prompt, const Gpt2Tokenizer& tokenizer,
                                             int64_t vocab_size) {
  std::vector<std::vector<int32_t>> prompts;
  if (prompt.is_string()) {
    prompts.push_back(tokenizer.encode(prompt.get_ref<const std::string&>()));
  } else if (prompt.is_array() && !prompt.empty()) {
    if (prompt.front().is_number_integer()) {
      prompts.push_back(token_ids(prompt, vocab_size));
    } else {
      if (static_cast<int64_t>(prompt.size()) > kMaxPrompts) {
        throw RequestError(
            concat("'prompt' lists ", prompt.size(), " prompts, at most ", kMaxPrompts), "prompt");
      }
      for (const json& entry : prompt) {
        if (entry.is_string()) {
          prompts.push_back(tokenizer.encode(entry.get_ref<const std::string&>()));
        } else if (entry.is_array()) {
          prompts.push_back(token_ids(entry, vocab_size));
        } else {
          wrong_type(entry, "prompt", "strings or lists of token ids");
        }
      }
    }
  } else {
    wrong_type(prompt, "prompt", "a non-empty string or list");
  }
  for (const auto& ids : prompts) {
    if (ids.empty()) throw RequestError("'prompt' must not be empty", "prompt");
  }
  return prompts;
}

std::vector<std::string> stop_strings(const json& stop) {
  std::vector<std::string> strings;
  if (stop.is_string()) {
    strings.push_back(stop.get<std::string>());
  } else if (stop.is_array()) {
    if (static_cast<int64_t>(stop.size()) > kMaxStopStrings) {
      throw RequestError(
          concat("'stop' lists ", stop.size(), " strings, at most ", kMaxStopStrings), "stop");
    }
    for (const json& entry : stop) {
      if (!entry.is_string()) wrong_type(entry, "stop", "strings");
      strings.push_back(entry.get<std::string>());
    }
  } else {
    wrong_type(stop, "stop", "a string or a list of strings");
  }
  for (const std::string& text : strings) {
    if (text.empty()) throw RequestError("'stop' strings must not be empty", "stop");
  }
  return strings;
}

const char* const kFields[] = {"model",
                               "prompt",
                               "max_tokens",
                               "temperature",
                               "top_p",
                               "top_k",
                               "repetition_penalty",
                               "frequency_penalty",
                               "presence_penalty",
                               "stop",
                               "seed",
                               "n",
                               "logprobs",
                               "stream",
                               "echo",
                               "user"};

}  // namespace

CompletionRequest parse_completion_request(std::string_view body, const Gpt2Tokenizer& tokenizer,
                                           const ModelLimits& limits) {
  json request;
  try {
    request = json::parse(body);
  } catch (const json::exception& error) {
    throw RequestError(concat("the body is not valid JSON: ", error.what()), "");
  }
  if (!request.is_object()) {
    throw RequestError(concat("the body must be a JSON object, got ", request.type_name()), "");
  }
  for (const auto& [key, value] : request.items()) {
    bool known = false;
    for (const char* field : kFields) known = known || key == field;
    if (!known) throw RequestError(concat("unknown field '", key, "'"), key);
  }

  CompletionRequest out;
  if (const json* model = find(request, "model")) {
    if (!model->is_string()) wrong_type(*model, "model", "a string");
    if (model->get_ref<const std::string&>() != limits.name) {
      throw RequestError(concat("the model '", model->get<std::string>(),
                                "' does not exist: this server serves '", limits.name, "'"),
                         "model", 404);
    }
  }
  const json* prompt = find(request, "prompt");
  if (!prompt) throw RequestError("'prompt' is required", "prompt");
  out.prompts = prompts_of(*prompt, tokenizer, limits.vocab_size);

  if (auto it = request.find("max_tokens"); it == request.end()) {
    out.max_tokens = 16;  // OpenAI's default; null asks for what the context leaves
  } else if (!it->is_null()) {
    out.max_tokens = integer_in(*it, "max_tokens", 1, std::numeric_limits<int32_t>::max());
  }
  SamplingOptions& sampling = out.sampling;
  if (const json* value = find(request, "temperature")) {
    sampling.temperature = static_cast<float>(number_in(*value, "temperature", 0, 2));
  }
  if (const json* value = find(request, "top_p")) {
    sampling.top_p = static_cast<float>(number_in(*value, "top_p", 0, 1, true));
  }
  if (const json* value = find(request, "top_k")) {
    const int64_t top_k = integer_in(*value, "top_k", -1, std::numeric_limits<int32_t>::max());
    sampling.top_k = top_k < 0 ? 0 : top_k;  // -1: no cut (vLLM's spelling)
  }
  if (const json* value = find(request, "repetition_penalty")) {
    sampling.repetition_penalty =
        static_cast<float>(number_in(*value, "repetition_penalty", 0, 1e6, true));
  }
  if (const json* value = find(request, "frequency_penalty")) {
    sampling.frequency_penalty = static_cast<float>(number_in(*value, "frequency_penalty", -2, 2));
  }
  if (const json* value = find(request, "presence_penalty")) {
    sampling.presence_penalty = static_cast<float>(number_in(*value, "presence_penalty", -2, 2));
  }
  if (const json* value = find(request, "seed")) {
    if (!value->is_number_integer()) wrong_type(*value, "seed", "an integer");
    if (!value->is_number_unsigned() && value->get<int64_t>() < 0) {
      throw RequestError(concat("'seed' must be >= 0, got ", value->dump()), "seed");
    }
    sampling.seed = value->get<uint64_t>();
    out.seeded = true;
  }
  if (const json* value = find(request, "n")) {
    out.n = integer_in(*value, "n", 1, kMaxChoicesPerPrompt);
  }
  if (const json* value = find(request, "stop")) out.stop = stop_strings(*value);
  if (const json* value = find(request, "logprobs")) {
    out.logprobs = integer_in(*value, "logprobs", 0, kMaxLogprobs);
  }
  if (const json* value = find(request, "stream")) out.stream = boolean(*value, "stream");
  if (const json* value = find(request, "echo"); value && boolean(*value, "echo")) {
    throw RequestError("'echo' is not supported", "echo");
  }
  if (const json* value = find(request, "user"); value && !value->is_string()) {
    wrong_type(*value, "user", "a string");
  }

  // Every prompt and its completion fit in the context.
  size_t longest = 0;
  for (const auto& ids : out.prompts) longest = std::max(longest, ids.size());
  const auto prompt_tokens = static_cast<int64_t>(longest);
  if (prompt_tokens >= limits.max_seq_len) {
    throw RequestError(concat("the prompt has ", prompt_tokens,
                              " tokens, leaving no room to generate in the model's context of ",
                              limits.max_seq_len, " tokens"),
                       "prompt");
  }
  if (!out.max_tokens) {
    out.max_tokens = limits.max_seq_len - prompt_tokens;
  } else if (prompt_tokens + *out.max_tokens > limits.max_seq_len) {
    throw RequestError(concat("'max_tokens' is ", *out.max_tokens, " but the prompt has ",
                              prompt_tokens, " tokens: ", prompt_tokens + *out.max_tokens,
                              " is over the model's context of ", limits.max_seq_len, " tokens"),
                       "max_tokens");
  }
  return out;
}

std::string error_body(const std::string& message, const std::string& type,
                       const std::string& param) {
  json error = {{"message", message},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", nullptr}};
  return json{{"error", error}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string utf8_text(std::string_view bytes, bool final, size_t* consumed) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string text;
  text.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const auto lead = static_cast<uint8_t>(bytes[i]);
    if (lead < 0x80) {
      text += static_cast<char>(lead);
      ++i;
      continue;
    }
    // The character's length and the range its second byte must fall in (RFC 3629: no
    // overlong forms, no surrogates, nothing past U+10FFFF).
    size_t length = 0;
    uint8_t second_min = 0x80, second_max = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) second_min = 0xA0;
      if (lead == 0xED) second_max = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) second_min = 0x90;
      if (lead == 0xF4) second_max = 0x8F;
    } else {
      text += kReplacement;  // a continuation byte or a byte no character starts with
      ++i;
      continue;
    }
    size_t fitting = 1;  // bytes of the character that are right so far
    while (fitting < length && i + fitting < bytes.size()) {
      const auto byte = static_cast<uint8_t>(bytes[i + fitting]);
      const uint8_t min = fitting == 1 ? second_min : 0x80, max = fitting == 1 ? second_max : 0xBF;
      if (byte < min || byte > max) break;
      ++fitting;
    }
    if (fitting == length) {
      text.append(bytes.substr(i, length));
    } else if (i + fitting == bytes.size() && !final) {
      break;  // the rest of the character may come with the next token
    } else {
      text += kReplacement;
    }
    i += fitting;
  }
  if (consumed) *consumed = i;
  return text;
}

size_t find_stop(std::string_view text, const std::vector<std::string>& stops, size_t from) {
  size_t first = std::string_view::npos;
  for (const std::string& stop : stops) {
    const size_t start = from >= stop.size() ? from - stop.size() + 1 : 0;
    first = std::min(first, text.find(stop, start));
  }
  return first;
}

}  // namespace octet::api
