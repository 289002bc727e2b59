// UTF-8 decoding and the three code point classes of GPT-2's pre-tokenization regex.
// Internal to liboctet (tests include it through src/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace octet::unicode {

struct CodePointRange {
  char32_t first;
  char32_t last;  // inclusive
};

// Generated from node's regex engine (gen_unicode_tables.js): \p{L}, \p{N} and JavaScript's \s.
extern const CodePointRange kLetterRanges[];
extern const size_t kLetterRangeCount;
extern const CodePointRange kNumberRanges[];
extern const size_t kNumberRangeCount;
extern const CodePointRange kSpaceRanges[];
extern const size_t kSpaceRangeCount;

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

// The class of one code point; ASCII is a table look-up, the rest a binary search.
CharClass classify(char32_t code_point);

// Decodes the code point starting at text[offset] into *code_point and returns its length in
// bytes. Strict UTF-8 (as the WHATWG decoder with fatal: true): overlong forms, surrogates,
// code points past U+10FFFF and truncated sequences throw octet::Error naming the byte offset.
size_t decode_utf8(std::string_view text, size_t offset, char32_t* code_point);

// Throws octet::Error naming the first invalid byte's offset, as decode_utf8 does.
void validate_utf8(std::string_view text);

}  // namespace octet::unicode
