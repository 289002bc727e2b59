// Errors: one exception type carrying what was expected and what came.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace octet {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Text pieces (string literals, char pointers, strings and views) are appended as they are:
// the operators' checks name their tensors this way on every call, where a stream's set-up
// cost more than a decode step's layer norm (a microsecond and a half). Anything else goes
// through a stream.
template <typename Part>
constexpr bool is_text = std::is_convertible_v<const Part&, std::string_view>;

template <typename... Parts>
std::string concat(const Parts&... parts) {
  if constexpr ((is_text<Parts> && ...)) {
    std::string out;
    out.reserve((std::string_view(parts).size() + ... + 0));
    (out.append(std::string_view(parts)), ...);
    return out;
  } else {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
  }
}
}  // namespace detail

[[noreturn]] inline void fail(const std::string& message) {
  throw Error(message);
}

}  // namespace octet

// OCTET_CHECK(cond, "gemm: A expected ", a, ", got ", b) throws octet::Error when cond is false.
#define OCTET_CHECK(cond, ...)                                        \
  do {                                                                \
    if (!(cond)) ::octet::fail(::octet::detail::concat(__VA_ARGS__)); \
  } while (0)
