// GPT-2's bytes_to_unicode: the printable character each byte is written as in encoder.json
// and vocab.bpe.
#pragma once

#include <vector>

namespace octet::detail {

// Printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100.. in byte order.
inline std::vector<char32_t> byte_to_code_point() {
  std::vector<char32_t> table(256);
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    table[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

}  // namespace octet::detail
