// Errors: one exception type carrying what was expected and what came.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace octet {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
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
