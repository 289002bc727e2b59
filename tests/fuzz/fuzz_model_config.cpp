// libFuzzer target: arbitrary bytes as a model config file (JSON text, then GPTConfig::from_json,
// as GPTConfig::load reads it). Text that is not JSON is rejected as load rejects it; any JSON
// must give a config or an octet::Error. An accepted config must survive what the engine does
// with it: parameter and FLOP counts (no overflow) and a to_json / from_json round trip.
#include <cstddef>
#include <cstdint>

#include "octet/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json json = nlohmann::json::parse(data, data + size, nullptr, false);
  if (json.is_discarded()) return 0;  // GPTConfig::load: "is not valid JSON"
  try {
    octet::GPTConfig config = octet::GPTConfig::from_json(json);
    if (config.num_parameters() <= 0) __builtin_trap();
    if (!(config.train_flops_per_token(config.max_seq_len) > 0)) __builtin_trap();
    nlohmann::json written = config.to_json();
    if (octet::GPTConfig::from_json(written).to_json() != written) __builtin_trap();
  } catch (const octet::Error&) {
  }
  return 0;
}
