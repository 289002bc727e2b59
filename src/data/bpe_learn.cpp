// Learning a byte-level BPE vocabulary from text, and writing it in GPT-2's file format.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "data/byte_alphabet.h"
#include "data/pretokenize.h"
#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}
int32_t left_of(uint64_t key) {
  return static_cast<int32_t>(key >> 32);
}
int32_t right_of(uint64_t key) {
  return static_cast<int32_t>(key & 0xffffffffu);
}

// The distinct pieces of the text with their counts, as symbol sequences, and for every
// adjacent pair its count and the pieces it occurs in.
class PairTable {
 public:
  void add_piece(std::string_view piece, int64_t count) {
    std::vector<int32_t> symbols(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) symbols[i] = static_cast<unsigned char>(piece[i]);
    words_.push_back(std::move(symbols));
    counts_.push_back(count);
  }

  void count_all_pairs() {
    for (size_t w = 0; w < words_.size(); ++w) add_pairs(static_cast<int32_t>(w), +1);
    for (const auto& [key, count] : pair_count_) heap_.push({count, key});
    changed_.clear();
  }

  // The most frequent pair (ties: lower left id, then lower right id), or false when none is
  // left with at least min_count occurrences.
  bool best(int64_t min_count, uint64_t* key) {
    while (!heap_.empty()) {
      const Entry top = heap_.top();
      const auto it = pair_count_.find(top.key);
      if (it == pair_count_.end() || it->second != top.count) {  // stale entry
        heap_.pop();
        continue;
      }
      if (top.count < min_count) return false;
      *key = top.key;
      return true;
    }
    return false;
  }

  // Replaces every occurrence of the pair, left to right, by `merged` in every piece holding it.
  void merge(uint64_t key, int32_t merged) {
    const int32_t left = left_of(key), right = right_of(key);
    const std::vector<int32_t> holders = std::move(where_[key]);
    where_.erase(key);
    ++stamp_;
    if (visited_.size() < words_.size()) visited_.resize(words_.size(), 0);
    for (const int32_t w : holders) {
      if (visited_[w] == stamp_) continue;
      visited_[w] = stamp_;
      std::vector<int32_t>& symbols = words_[w];
      bool present = false;
      for (size_t i = 0; i + 1 < symbols.size() && !present; ++i)
        present = symbols[i] == left && symbols[i + 1] == right;
      if (!present) continue;
      add_pairs(w, -1);
      size_t out = 0;
      for (size_t i = 0; i < symbols.size(); ++out) {
        if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) {
          symbols[out] = merged;
          i += 2;
        } else {
          symbols[out] = symbols[i];
          i += 1;
        }
      }
      symbols.resize(out);
      add_pairs(w, +1);
    }
    for (const uint64_t changed : changed_) {
      const auto it = pair_count_.find(changed);
      if (it == pair_count_.end()) continue;
      if (it->second <= 0) {
        pair_count_.erase(it);
      } else {
        heap_.push({it->second, changed});
      }
    }
    changed_.clear();
  }

  int64_t total_symbols() const {
    int64_t total = 0;
    for (size_t w = 0; w < words_.size(); ++w)
      total += counts_[w] * static_cast<int64_t>(words_[w].size());
    return total;
  }

 private:
  struct Entry {
    int64_t count;
    uint64_t key;
    // Max-heap on count; among equal counts the lower key (left id, then right id) first.
    bool operator<(const Entry& other) const {
      return count != other.count ? count < other.count : key > other.key;
    }
  };

  void add_pairs(int32_t w, int sign) {
    const std::vector<int32_t>& symbols = words_[w];
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const uint64_t key = pair_key(symbols[i], symbols[i + 1]);
      pair_count_[key] += sign * counts_[w];
      if (sign > 0) where_[key].push_back(w);  // may repeat; merge() skips repeats
      changed_.push_back(key);
    }
  }

  std::vector<std::vector<int32_t>> words_;
  std::vector<int64_t> counts_;
  std::unordered_map<uint64_t, int64_t> pair_count_;
  std::unordered_map<uint64_t, std::vector<int32_t>> where_;
  std::priority_queue<Entry> heap_;
  std::vector<uint64_t> changed_;
  std::vector<uint32_t> visited_;
  uint32_t stamp_ = 0;
};

void append_utf8(char32_t code_point, std::string& out) {
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else {  // the byte alphabet stays below U+0800
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

void write_atomically(const std::filesystem::path& path, const std::string& content) {
  const std::string temp = path.string() + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temp, std::ios::binary);
    OCTET_CHECK(out, "bpe: cannot write ", temp);
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    OCTET_CHECK(out.good(), "bpe: writing ", temp, " failed");
  }
  std::error_code error;
  std::filesystem::rename(temp, path, error);
  OCTET_CHECK(!error, "bpe: cannot rename ", temp, " to ", path.string(), ": ", error.message());
}

}  // namespace

BpeVocabulary learn_bpe(std::span<const std::string_view> texts, int32_t vocab_size,
                        int64_t min_pair_count) {
  OCTET_CHECK(vocab_size >= 257, "learn_bpe: expected a vocabulary of at least 257 tokens (256 ",
              "bytes and <|endoftext|>), got ", vocab_size);
  OCTET_CHECK(min_pair_count >= 1, "learn_bpe: expected min_pair_count >= 1, got ", min_pair_count);
  BpeVocabulary vocabulary;
  std::unordered_map<std::string_view, int64_t> piece_count;
  for (size_t t = 0; t < texts.size(); ++t) {
    try {
      detail::for_each_piece(texts[t], [&](std::string_view piece) { ++piece_count[piece]; });
    } catch (const Error& error) {
      fail(detail::concat("learn_bpe: text ", t, ": ", error.what()));
    }
    vocabulary.training_bytes += static_cast<int64_t>(texts[t].size());
  }
  // Pieces in a fixed order (the map's order is not), so equal input gives equal ids.
  std::vector<std::pair<std::string_view, int64_t>> pieces(piece_count.begin(), piece_count.end());
  std::sort(pieces.begin(), pieces.end());
  PairTable table;
  for (const auto& [piece, count] : pieces) table.add_piece(piece, count);
  table.count_all_pairs();

  for (int b = 0; b < 256; ++b) vocabulary.tokens.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) id_of.emplace(vocabulary.tokens[b], b);
  const int32_t target = vocab_size - 1;  // the last id is <|endoftext|>
  uint64_t key = 0;
  while (static_cast<int32_t>(vocabulary.tokens.size()) < target &&
         table.best(min_pair_count, &key)) {
    const int32_t left = left_of(key), right = right_of(key);
    std::string bytes = vocabulary.tokens[left] + vocabulary.tokens[right];
    auto [it, inserted] = id_of.emplace(bytes, static_cast<int32_t>(vocabulary.tokens.size()));
    if (inserted) vocabulary.tokens.push_back(std::move(bytes));
    vocabulary.merges.emplace_back(left, right);
    table.merge(key, it->second);
  }
  vocabulary.tokens.emplace_back("<|endoftext|>");
  vocabulary.training_tokens = table.total_symbols();
  return vocabulary;
}

void save_bpe_vocabulary(const BpeVocabulary& vocabulary, const std::string& dir) {
  OCTET_CHECK(vocabulary.tokens.size() >= 257, "save_bpe_vocabulary: expected at least 257 ",
              "tokens, got ", vocabulary.tokens.size());
  const std::vector<char32_t> table = detail::byte_to_code_point();
  auto spelled = [&](const std::string& bytes) {
    std::string out;
    for (const char byte : bytes) append_utf8(table[static_cast<unsigned char>(byte)], out);
    return out;
  };
  nlohmann::ordered_json encoder = nlohmann::ordered_json::object();
  const size_t last = vocabulary.tokens.size() - 1;
  for (size_t id = 0; id < vocabulary.tokens.size(); ++id) {
    const std::string key = id == last ? vocabulary.tokens[id] : spelled(vocabulary.tokens[id]);
    OCTET_CHECK(!encoder.contains(key), "save_bpe_vocabulary: token ", id, " repeats \"", key,
                "\"");
    encoder[key] = id;
  }
  std::string merges = "#version: 0.2\n";
  for (const auto& [left, right] : vocabulary.merges) {
    OCTET_CHECK(left >= 0 && right >= 0 && static_cast<size_t>(left) < last &&
                    static_cast<size_t>(right) < last,
                "save_bpe_vocabulary: merge (", left, ", ", right, ") names a token outside [0, ",
                last, ")");
    merges += spelled(vocabulary.tokens[left]) + " " + spelled(vocabulary.tokens[right]) + "\n";
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  OCTET_CHECK(!error, "bpe: cannot create ", dir, ": ", error.message());
  write_atomically(std::filesystem::path(dir) / "encoder.json", encoder.dump());
  write_atomically(std::filesystem::path(dir) / "vocab.bpe", merges);
}

}  // namespace octet
