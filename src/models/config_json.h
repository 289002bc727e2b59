// Reading model configs: each field takes only its own JSON type, unknown keys are errors.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "octet/error.h"

namespace octet::models_detail {

// An error naming the first key of `json` not in `known`.
inline void check_known_keys(const nlohmann::json& json, const std::set<std::string>& known) {
  OCTET_CHECK(json.is_object(), "model config: expected a JSON object");
  for (const auto& [key, value] : json.items()) {
    OCTET_CHECK(known.count(key), "model config: unknown key '", key, "'");
  }
}

// field = json[key] when present. nlohmann's own conversions would truncate 1e300 into an
// int64 or a float (undefined behaviour) and wrap 2^64-1 to -1: the value must be of the
// field's type and fit.
template <class Field>
void read_field(const nlohmann::json& json, const char* key, Field& field) {
  if (!json.contains(key)) return;
  const nlohmann::json& value = json.at(key);
  bool fits = false;
  const char* expected = "";
  if constexpr (std::is_same_v<Field, bool>) {
    fits = value.is_boolean();
    expected = "true or false";
  } else if constexpr (std::is_same_v<Field, std::string>) {
    fits = value.is_string();
    expected = "a string";
  } else if constexpr (std::is_same_v<Field, int64_t>) {
    fits = value.is_number_integer() &&
           !(value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{INT64_MAX});
    expected = "an integer";
  } else {
    static_assert(std::is_same_v<Field, float>);
    fits = value.is_number() && std::isfinite(value.get<double>()) &&
           std::fabs(value.get<double>()) <= std::numeric_limits<float>::max();
    expected = "a finite number";
  }
  OCTET_CHECK(fits, "model config: '", key, "' expected ", expected, ", got ",
              value.is_primitive() ? value.dump().substr(0, 64) : value.type_name());
  field = value.get<Field>();
}

// A config file's JSON: a missing file or invalid JSON is an error naming the path.
nlohmann::json read_config_file(const std::string& path);

// Config::from_json of a file's JSON; its errors name the path.
template <class Config>
Config load_config(const std::string& path) {
  const nlohmann::json json = read_config_file(path);
  try {
    return Config::from_json(json);
  } catch (const Error& e) {
    fail(detail::concat(path, ": ", e.what()));
  }
}

// Sizes that must be in [1, limit]: limits far above any real model, so that the counts built
// on them cannot overflow.
struct SizeLimit {
  const char* key;
  int64_t value, limit;
};
inline void check_sizes(std::initializer_list<SizeLimit> sizes) {
  for (const SizeLimit& size : sizes) {
    OCTET_CHECK(size.value > 0 && size.value <= size.limit, "model config: ", size.key,
                " expected in [1, ", size.limit, "], got ", size.value);
  }
}

}  // namespace octet::models_detail
