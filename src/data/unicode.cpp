// UTF-8 decoding (strict) and code point classes for GPT-2 pre-tokenization.
#include "data/unicode.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>

#include "octet/error.h"

namespace octet::unicode {
namespace {

bool in_ranges(const CodePointRange* ranges, size_t count, char32_t code_point) {
  const CodePointRange* end = ranges + count;
  // First range whose last >= code_point.
  const CodePointRange* it = std::lower_bound(
      ranges, end, code_point, [](const CodePointRange& r, char32_t cp) { return r.last < cp; });
  return it != end && it->first <= code_point;
}

CharClass classify_slow(char32_t code_point) {
  if (in_ranges(kLetterRanges, kLetterRangeCount, code_point)) return CharClass::kLetter;
  if (in_ranges(kNumberRanges, kNumberRangeCount, code_point)) return CharClass::kNumber;
  if (in_ranges(kSpaceRanges, kSpaceRangeCount, code_point)) return CharClass::kSpace;
  return CharClass::kOther;
}

std::array<CharClass, 128> make_ascii_table() {
  std::array<CharClass, 128> table{};
  for (char32_t c = 0; c < 128; ++c) table[c] = classify_slow(c);
  return table;
}

std::string hex_byte(unsigned char byte) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02X", byte);
  return text;
}

}  // namespace

CharClass classify(char32_t code_point) {
  static const std::array<CharClass, 128> ascii = make_ascii_table();
  if (code_point < 128) return ascii[code_point];
  return classify_slow(code_point);
}

size_t decode_utf8(std::string_view text, size_t offset, char32_t* code_point) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(offset);
  if (lead < 0x80) {
    *code_point = lead;
    return 1;
  }
  size_t length = 0;
  char32_t value = 0;
  // The second byte's range excludes overlong forms, surrogates and code points past U+10FFFF.
  unsigned char second_min = 0x80, second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    value = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    value = lead & 0x0F;
    if (lead == 0xE0) second_min = 0xA0;
    if (lead == 0xED) second_max = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    value = lead & 0x07;
    if (lead == 0xF0) second_min = 0x90;
    if (lead == 0xF4) second_max = 0x8F;
  } else {
    fail(detail::concat("invalid UTF-8 at byte offset ", offset,
                        ": expected a lead byte (0x00..0x7F or 0xC2..0xF4), got ", hex_byte(lead)));
  }
  for (size_t k = 1; k < length; ++k) {
    const size_t at = offset + k;
    if (at >= text.size()) {
      fail(detail::concat("invalid UTF-8 at byte offset ", offset, ": lead byte ", hex_byte(lead),
                          " expected ", length, " bytes, got ", text.size() - offset,
                          " before the end of the text"));
    }
    const unsigned char min = k == 1 ? second_min : 0x80;
    const unsigned char max = k == 1 ? second_max : 0xBF;
    if (byte(at) < min || byte(at) > max) {
      fail(detail::concat("invalid UTF-8 at byte offset ", offset, ": lead byte ", hex_byte(lead),
                          " expected a byte in ", hex_byte(min), "..", hex_byte(max), " at offset ",
                          at, ", got ", hex_byte(byte(at))));
    }
    value = (value << 6) | (byte(at) & 0x3F);
  }
  *code_point = value;
  return length;
}

void validate_utf8(std::string_view text) {
  char32_t code_point = 0;
  for (size_t offset = 0; offset < text.size();) {
    offset += decode_utf8(text, offset, &code_point);
  }
}

}  // namespace octet::unicode
