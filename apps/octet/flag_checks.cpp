// Validators shared by the sub-commands: numbers finite and in range, output paths writable,
// all checked while the command line is parsed, before any work.
#include <cmath>
#include <cstdlib>
#include <limits>

#include "commands.h"
#include "octet/error.h"
#include "octet/files.h"

namespace octet::cli {

namespace {

std::string bound(double value) {
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return detail::concat(value);
}

}  // namespace

CLI::Validator number_in(double min, double max, bool min_open, bool max_open) {
  std::string range;
  if (std::isinf(max)) {
    range = detail::concat(min_open ? "> " : ">= ", bound(min));
  } else {
    range = detail::concat("in ", min_open ? "(" : "[", bound(min), ", ", bound(max),
                           max_open ? ")" : "]");
  }
  const std::string expected = "a finite number " + range;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        if (end == text.c_str()) return "expected " + expected + ", got '" + text + "'";
        // Anything after the number is left to CLI11's conversion to report.
        const bool ok = std::isfinite(value) && (min_open ? value > min : value >= min) &&
                        (max_open ? value < max : value <= max);
        return ok ? std::string() : "expected " + expected + ", got " + text;
      },
      "NUMBER " + range);
}

CLI::Validator at_least(double min) {
  return number_in(min, std::numeric_limits<double>::infinity(), false, false);
}

namespace {

// A validator running one of octet/files.h's checks; its octet::Error becomes the message.
CLI::Validator path_check(void (*check)(const std::string&, const std::string&), const char* what,
                          const char* description) {
  return CLI::Validator(
      [=](std::string& path) -> std::string {
        try {
          check(path, what);
        } catch (const Error& error) {
          return error.what();
        }
        return {};
      },
      description);
}

}  // namespace

void add_fp8_weight_flags(CLI::App& cmd, bool& fp8_weights, std::string& scaling,
                          const std::string& help) {
  CLI::Option* flag = cmd.add_flag("--fp8-weights", fp8_weights, help);
  cmd.add_option("--fp8-weight-scaling", scaling,
                 "Scales of --fp8-weights: one per output channel, or one per 128 x 128 block "
                 "(DeepSeek-V3's FP8 weights)")
      ->capture_default_str()
      ->check(CLI::IsMember({"channel", "block128"}))
      ->needs(flag);
}

CLI::Validator output_file() {
  return path_check(check_writable_file, "output file", "FILE (writable)");
}

CLI::Validator output_directory() {
  return path_check(check_writable_directory, "output directory", "DIR (writable)");
}

}  // namespace octet::cli
