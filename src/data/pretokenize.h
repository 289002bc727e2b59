// GPT-2 pre-tokenization, written out by hand over code points. The regex it implements,
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// always matches at the current position (every code point is a letter, a number, a space or
// "other"), so the text splits into consecutive pieces with no gaps.
#pragma once

#include <cstddef>
#include <string_view>

#include "data/unicode.h"

namespace octet::detail {

struct CodePoint {
  unicode::CharClass char_class;
  size_t bytes;
};

inline CodePoint code_point_at(std::string_view text, size_t offset) {
  const auto byte = static_cast<unsigned char>(text[offset]);
  if (byte < 0x80) return {unicode::classify(byte), 1};
  char32_t value = 0;
  const size_t bytes = unicode::decode_utf8(text, offset, &value);
  return {unicode::classify(value), bytes};
}

// End of the run of code points of class `wanted` starting at offset.
inline size_t run_end(std::string_view text, size_t offset, unicode::CharClass wanted) {
  while (offset < text.size()) {
    const CodePoint next = code_point_at(text, offset);
    if (next.char_class != wanted) break;
    offset += next.bytes;
  }
  return offset;
}

// Length in bytes of a contraction ('s 't 're 've 'm 'll 'd) at offset, or 0.
inline size_t contraction_bytes(std::string_view text, size_t offset) {
  if (text[offset] != '\'' || offset + 1 >= text.size()) return 0;
  const char a = text[offset + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (offset + 2 >= text.size()) return 0;
  const char b = text[offset + 2];
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// The end of the piece that starts at `begin`.
inline size_t piece_end(std::string_view text, size_t begin) {
  using unicode::CharClass;
  if (const size_t bytes = contraction_bytes(text, begin)) return begin + bytes;
  const CodePoint first = code_point_at(text, begin);
  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": one optional U+0020 before the run.
  if (text[begin] == ' ' && begin + 1 < text.size()) {
    const CodePoint second = code_point_at(text, begin + 1);
    if (second.char_class != CharClass::kSpace) return run_end(text, begin + 1, second.char_class);
  }
  if (first.char_class != CharClass::kSpace) return run_end(text, begin, first.char_class);
  // "\s+(?!\S)": a whitespace run, less its last code point when a non-space follows it
  // (that code point then leads the next piece, e.g. the space of " word"); "\s+" when the
  // run is a single code point.
  size_t last_start = begin;
  size_t end = begin + first.bytes;
  while (end < text.size()) {
    const CodePoint next = code_point_at(text, end);
    if (next.char_class != CharClass::kSpace) break;
    last_start = end;
    end += next.bytes;
  }
  if (end == text.size() || last_start == begin) return end;
  return last_start;
}

// Calls visit(piece) for each piece of text, in order.
template <typename Visit>
void for_each_piece(std::string_view text, Visit&& visit) {
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = piece_end(text, begin);
    visit(text.substr(begin, end - begin));
    begin = end;
  }
}

}  // namespace octet::detail
