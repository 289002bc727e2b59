// libFuzzer target: arbitrary bytes as a whole safetensors file (parse_safetensors, the parser
// load_safetensors uses). Every input must give tensors or an octet::Error; anything else (another
// exception, a sanitizer report, a tensor reaching past the input) is a finding.
#include <cstddef>
#include <cstdint>

#include "octet/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    octet::Metadata metadata;
    octet::TensorMap tensors = octet::parse_safetensors({data, size}, "fuzz input", &metadata);
    // The data section tiles exactly: the tensors' bytes can never exceed the input's.
    size_t total_bytes = 0;
    for (const auto& [name, tensor] : tensors) total_bytes += tensor.nbytes();
    if (total_bytes > size) __builtin_trap();
  } catch (const octet::Error&) {
  }
  return 0;
}
