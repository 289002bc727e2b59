// GPTConfig::from_json on hostile input: each field takes only its own JSON type and sizes stay
// within bounds that keep the parameter and FLOP counts from overflowing (found by fuzzing,
// tests/fuzz/fuzz_model_config.cpp).
#include <gtest/gtest.h>

#include <string>

#include "octet/model.h"

namespace octet {
namespace {

std::string message_of(const std::string& text) {
  try {
    GPTConfig::from_json(nlohmann::json::parse(text));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const std::string kTiny = R"("vocab_size": 50257, "max_seq_len": 64, "num_layers": 2, )";

TEST(GPTConfigJson, ValidConfigParses) {
  EXPECT_EQ(message_of("{" + kTiny + R"("hidden": 64, "num_heads": 4})"), "");
}

TEST(GPTConfigJson, NumbersOutOfTheFieldsRangeAreErrorsNotUndefinedBehaviour) {
  // 1e300 into an int64 or a float is undefined behaviour in a plain conversion.
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 1e300, "num_heads": 4})")
                .find("'hidden' expected an integer, got 1e+300"),
            std::string::npos);
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 64, "num_heads": 4, "rope_theta": 1e300})")
                .find("'rope_theta' expected a finite number"),
            std::string::npos);
  // 2^64 - 1 would wrap to -1: a negative ffn_hidden.
  EXPECT_NE(message_of("{" + kTiny +
                       R"("hidden": 64, "num_heads": 4, "ffn_hidden": 18446744073709551615})")
                .find("'ffn_hidden' expected an integer"),
            std::string::npos);
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 64, "num_heads": 4, "ffn_hidden": -5})")
                .find("expected >= 0"),
            std::string::npos);
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 64, "num_heads": 4, "bias": 1})")
                .find("'bias' expected true or false, got 1"),
            std::string::npos);
}

TEST(GPTConfigJson, SizesThatWouldOverflowTheCountsAreErrors) {
  // hidden 2^40: hidden * hidden overflows int64 in num_parameters().
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 1099511627776, "num_heads": 1})")
                .find("hidden expected at most 1048576"),
            std::string::npos);
  EXPECT_NE(message_of("{" + kTiny + R"("hidden": 64, "num_heads": 4, "vocab_size": 4294967296})")
                .find("vocab_size expected at most 2147483647"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
