// libFuzzer target: arbitrary bytes as a whole token shard file (TokenShard::view, the checks
// TokenShard::open runs on the mapped file). Every input must give a shard or an octet::Error.
#include <cstddef>
#include <cstdint>

#include "octet/data.h"
#include "octet/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    octet::TokenShard shard = octet::TokenShard::view({data, size}, "fuzz input");
    // A shard that passed the id scan holds only ids below its vocab size, and reads them all.
    for (int32_t id : shard.to_vector()) {
      if (id < 0 || id >= shard.vocab_size()) __builtin_trap();
    }
  } catch (const octet::Error&) {
  }
  try {
    // Without the id scan the header checks alone must keep every read inside the input.
    octet::TokenShard shard = octet::TokenShard::view({data, size}, "fuzz input", false);
    if (shard.size() > 0) (void)shard[shard.size() - 1];
    int32_t ids[4];
    shard.read(shard.size() > 4 ? shard.size() - 4 : 0, shard.size() > 4 ? 4 : shard.size(), ids);
  } catch (const octet::Error&) {
  }
  return 0;
}
