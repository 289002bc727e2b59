// GPT-2 byte-level BPE: vocabulary loading, merges, encode and decode.
#include <algorithm>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/byte_alphabet.h"
#include "data/pretokenize.h"
#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  OCTET_CHECK(in, "tokenizer: cannot open ", path, " (run scripts/fetch_data.sh to fetch it)");
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

// Maps a token string of encoder.json / vocab.bpe (byte-to-unicode characters) to its bytes.
class ByteDecoder {
 public:
  ByteDecoder() {
    std::fill(std::begin(byte_of_), std::end(byte_of_), -1);
    const std::vector<char32_t> table = detail::byte_to_code_point();
    for (int b = 0; b < 256; ++b) byte_of_[table[b]] = static_cast<unsigned char>(b);
  }
  std::string bytes(std::string_view token, const std::string& where) const {
    std::string out;
    for (size_t offset = 0; offset < token.size();) {
      char32_t code_point = 0;
      offset += unicode::decode_utf8(token, offset, &code_point);
      OCTET_CHECK(code_point < 512 && byte_of_[code_point] >= 0, where,
                  ": expected byte-to-unicode characters (U+0021..U+0143), got U+",
                  static_cast<uint32_t>(code_point), " in \"", token, "\"");
      out.push_back(static_cast<char>(byte_of_[code_point]));
    }
    return out;
  }

 private:
  int byte_of_[512] = {};  // code point -> byte, -1 for none
};

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::vector<std::string_view> split_whitespace(std::string_view line) {
  std::vector<std::string_view> parts;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t' && line[j] != '\r') ++j;
    if (j > i) parts.push_back(line.substr(i, j - i));
    i = j;
  }
  return parts;
}

}  // namespace

Gpt2Tokenizer Gpt2Tokenizer::load(const std::string& vocab_dir, BpeRankLookup lookup) {
  return Gpt2Tokenizer(vocab_dir + "/encoder.json", vocab_dir + "/vocab.bpe", lookup);
}

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& encoder_json_path,
                             const std::string& vocab_bpe_path, BpeRankLookup lookup) {
  const ByteDecoder decoder_table;

  // encoder.json: {"token string": id, ...}; ids must be 0..n-1, each used once.
  const nlohmann::json encoder = [&] {
    try {
      return nlohmann::json::parse(read_file(encoder_json_path));
    } catch (const nlohmann::json::exception& error) {
      fail(detail::concat(encoder_json_path,
                          ": expected a JSON object, got a parse error: ", error.what()));
    }
  }();
  OCTET_CHECK(encoder.is_object() && !encoder.empty(), encoder_json_path,
              ": expected a non-empty JSON object of token -> id");
  const size_t vocab_size = encoder.size();
  token_bytes_.assign(vocab_size, std::string());
  std::vector<bool> seen(vocab_size, false);
  std::unordered_map<std::string, int32_t> id_of;
  id_of.reserve(vocab_size * 2);
  for (const auto& [token, value] : encoder.items()) {
    OCTET_CHECK(value.is_number_integer(), encoder_json_path, ": token \"", token,
                "\" expected an integer id, got ", value.dump());
    const int64_t id = value.get<int64_t>();
    OCTET_CHECK(id >= 0 && id < static_cast<int64_t>(vocab_size) && !seen[id], encoder_json_path,
                ": token \"", token, "\" expected a unique id in [0, ", vocab_size, "), got ", id);
    seen[id] = true;
    token_bytes_[id] = decoder_table.bytes(token, encoder_json_path);
    id_of.emplace(token_bytes_[id], static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = id_of.find(std::string(1, static_cast<char>(b)));
    OCTET_CHECK(it != id_of.end(), encoder_json_path, ": expected a token for every byte, byte ", b,
                " has none");
    byte_ids_[b] = it->second;
  }
  if (const auto it = id_of.find("<|endoftext|>"); it != id_of.end()) eot_id_ = it->second;

  // vocab.bpe: a "#version" line, then one merge "left right" per line; rank = line order.
  const std::string bpe_text = read_file(vocab_bpe_path);
  std::vector<std::pair<std::string, std::string>> merge_list;
  {
    std::istringstream lines(bpe_text);
    std::string line;
    size_t line_number = 0;
    while (std::getline(lines, line)) {
      ++line_number;
      if (line_number == 1 && line.rfind("#version", 0) == 0) continue;
      const std::vector<std::string_view> parts = split_whitespace(line);
      if (parts.empty()) continue;
      const std::string where = detail::concat(vocab_bpe_path, ":", line_number);
      OCTET_CHECK(parts.size() == 2, where, ": expected 2 symbols, got ", parts.size());
      merge_list.emplace_back(decoder_table.bytes(parts[0], where),
                              decoder_table.bytes(parts[1], where));
    }
  }
  auto id_or = [&](const std::string& bytes) {
    const auto it = id_of.find(bytes);
    return it == id_of.end() ? -1 : it->second;
  };
  merges_.reserve(merge_list.size() * 2);
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const auto& [left, right] = merge_list[rank];
    const int32_t left_id = id_or(left), right_id = id_or(right), merged_id = id_or(left + right);
    OCTET_CHECK(left_id >= 0 && right_id >= 0 && merged_id >= 0, vocab_bpe_path, ": merge ", rank,
                " expected its symbols and their concatenation in encoder.json");
    // A repeated merge keeps its last rank, as both reference encoders' dicts do.
    merges_[pair_key(left_id, right_id)] = {static_cast<int32_t>(rank), merged_id};
  }
  if (lookup == BpeRankLookup::kGpt3EncoderJs) {
    // The JavaScript encoder keys ranks by `${left},${right}`: every other split of a merge's
    // key at a comma into two tokens finds the same rank. Listed merges take precedence (their
    // key is unique in GPT-2's file; were it not, the last rank would win in both maps).
    for (size_t rank = 0; rank < merge_list.size(); ++rank) {
      const auto& [left, right] = merge_list[rank];
      const std::string key = left + "," + right;
      for (size_t comma = key.find(','); comma != std::string::npos;
           comma = key.find(',', comma + 1)) {
        if (comma == left.size() || comma == 0 || comma + 1 == key.size()) continue;
        const std::string alias_left = key.substr(0, comma), alias_right = key.substr(comma + 1);
        const int32_t a = id_or(alias_left), b = id_or(alias_right);
        const int32_t merged = id_or(alias_left + alias_right);
        // A merged string outside the vocabulary would give `undefined` in the reference.
        if (a < 0 || b < 0 || merged < 0) continue;
        merges_.try_emplace(pair_key(a, b), Merge{static_cast<int32_t>(rank), merged});
      }
    }
  }
}

const std::string& Gpt2Tokenizer::token_bytes(int32_t id) const {
  OCTET_CHECK(id >= 0 && id < vocab_size(), "gpt2 tokenizer: expected a token id in [0, ",
              vocab_size(), "), got ", id);
  return token_bytes_[id];
}

// Merges the piece's bytes, lowest rank first; every occurrence of the chosen pair merges,
// left to right. Among equal ranks the last pair in the word wins, as in the reference.
void Gpt2Tokenizer::bpe(std::string_view piece, std::vector<int32_t>& ids) const {
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i)
    word[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  while (word.size() > 1) {
    int32_t best_rank = INT_MAX;
    uint64_t best_pair = 0;
    Merge best{};
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const uint64_t key = pair_key(word[i], word[i + 1]);
      const auto it = merges_.find(key);
      if (it != merges_.end() && it->second.rank <= best_rank) {
        best_rank = it->second.rank;
        best_pair = key;
        best = it->second;
      }
    }
    if (best_rank == INT_MAX) break;
    size_t out = 0;
    for (size_t i = 0; i < word.size(); ++out) {
      if (i + 1 < word.size() && pair_key(word[i], word[i + 1]) == best_pair) {
        word[out] = best.merged_id;
        i += 2;
      } else {
        word[out] = word[i];
        i += 1;
      }
    }
    word.resize(out);
  }
  ids.insert(ids.end(), word.begin(), word.end());
}

void Gpt2Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& ids) const {
  // Pieces repeat (words): cache each one's ids for this call. Keys view into text.
  std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;  // -> [begin, count)
  std::vector<int32_t> cached_ids;
  detail::for_each_piece(text, [&](std::string_view piece) {
    if (piece.size() == 1) {
      ids.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    const auto it = cache.find(piece);
    if (it != cache.end()) {
      const int32_t* begin = cached_ids.data() + it->second.first;
      ids.insert(ids.end(), begin, begin + it->second.second);
      return;
    }
    const size_t first = ids.size();
    bpe(piece, ids);
    const auto begin = static_cast<uint32_t>(cached_ids.size());
    cached_ids.insert(cached_ids.end(), ids.begin() + static_cast<ptrdiff_t>(first), ids.end());
    cache.emplace(piece, std::make_pair(begin, static_cast<uint32_t>(ids.size() - first)));
  });
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 4 + 16);
  encode_append(text, ids);
  return ids;
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (const int32_t id : ids) text += token_bytes(id);
  return text;
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  detail::for_each_piece(text, [&](std::string_view piece) { pieces.push_back(piece); });
  return pieces;
}

}  // namespace octet
