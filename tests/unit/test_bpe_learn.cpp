// learn_bpe against a plain reference that recounts every pair at every step, and the learned
// vocabulary through Gpt2Tokenizer: the training text encodes to the count the learner reports
// and decodes back to itself.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

namespace fs = std::filesystem;

// The definition, step by step: count every adjacent pair of every piece (weighted by how
// often the piece occurs), merge the most frequent (ties: lower left id, then lower right),
// left to right; a merged string already in the vocabulary keeps its id.
BpeVocabulary reference_bpe(const std::vector<std::string_view>& texts, int32_t vocab_size,
                            int64_t min_pair_count) {
  std::map<std::string, int64_t> piece_count;
  for (const std::string_view text : texts)
    for (const std::string_view piece : gpt2_pretokenize(text)) ++piece_count[std::string(piece)];
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> counts;
  for (const auto& [piece, count] : piece_count) {
    words.emplace_back();
    for (const char byte : piece) words.back().push_back(static_cast<unsigned char>(byte));
    counts.push_back(count);
  }
  BpeVocabulary vocabulary;
  for (int b = 0; b < 256; ++b) vocabulary.tokens.emplace_back(1, static_cast<char>(b));
  while (static_cast<int32_t>(vocabulary.tokens.size()) < vocab_size - 1) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pairs;
    for (size_t w = 0; w < words.size(); ++w)
      for (size_t i = 0; i + 1 < words[w].size(); ++i)
        pairs[{words[w][i], words[w][i + 1]}] += counts[w];
    std::pair<int32_t, int32_t> best{};
    int64_t best_count = 0;
    for (const auto& [pair, count] : pairs) {  // ascending pairs: the first maximum wins ties
      if (count > best_count) {
        best_count = count;
        best = pair;
      }
    }
    if (best_count < min_pair_count) break;
    const std::string bytes = vocabulary.tokens[best.first] + vocabulary.tokens[best.second];
    int32_t merged = -1;
    for (size_t id = 0; id < vocabulary.tokens.size(); ++id)
      if (vocabulary.tokens[id] == bytes) merged = static_cast<int32_t>(id);
    if (merged < 0) {
      merged = static_cast<int32_t>(vocabulary.tokens.size());
      vocabulary.tokens.push_back(bytes);
    }
    vocabulary.merges.push_back(best);
    for (std::vector<int32_t>& word : words) {
      std::vector<int32_t> next;
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == best.first && word[i + 1] == best.second) {
          next.push_back(merged);
          i += 2;
        } else {
          next.push_back(word[i++]);
        }
      }
      word = next;
    }
  }
  vocabulary.tokens.emplace_back("<|endoftext|>");
  for (size_t w = 0; w < words.size(); ++w)
    vocabulary.training_tokens += counts[w] * static_cast<int64_t>(words[w].size());
  return vocabulary;
}

// Text from a few syllables, so that pairs repeat with varied counts: words, numbers,
// punctuation, contractions, runs of spaces and newlines, and two-byte letters.
std::string synthetic_text(uint32_t seed, size_t words) {
  const std::vector<std::string> syllables = {"th", "e", "an", "d", "in", "g",  "re", "o",  "n",
                                              "st", "a", "er", "ü", "é",  "ch", "q",  "ab", "c"};
  const std::vector<std::string> separators = {" ",  " ",   " ",    ", ",    ". ", "\n",
                                               "  ", "'s ", " 42 ", "!\n\n", " (", ") "};
  std::mt19937 rng(seed);
  std::string text;
  for (size_t w = 0; w < words; ++w) {
    const size_t length = 1 + rng() % 4;
    for (size_t s = 0; s < length; ++s) text += syllables[rng() % syllables.size()];
    text += separators[rng() % separators.size()];
  }
  return text;
}

fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("octet-bpe-" + name + "-" + std::to_string(static_cast<long>(getpid())));
  fs::remove_all(dir);
  return dir;
}

TEST(LearnBpe, EqualsTheStepByStepDefinition) {
  for (const uint32_t seed : {1u, 2u, 3u}) {
    const std::string a = synthetic_text(seed, 3000), b = synthetic_text(seed + 100, 500);
    const std::vector<std::string_view> texts = {a, b};
    for (const int32_t vocab_size : {257, 300, 600}) {
      const BpeVocabulary fast = learn_bpe(texts, vocab_size);
      const BpeVocabulary reference = reference_bpe(texts, vocab_size, 2);
      EXPECT_EQ(fast.merges, reference.merges) << "seed " << seed << " vocab " << vocab_size;
      EXPECT_EQ(fast.tokens, reference.tokens) << "seed " << seed << " vocab " << vocab_size;
      EXPECT_EQ(fast.training_tokens, reference.training_tokens);
      EXPECT_EQ(fast.training_bytes, static_cast<int64_t>(a.size() + b.size()));
    }
  }
}

TEST(LearnBpe, StopsWhenNoPairRepeats) {
  const std::string text = "abcabc xyz";  // pieces "abcabc", " xyz": only a-b, b-c, c-a...
  const std::vector<std::string_view> texts = {text};
  const BpeVocabulary vocabulary = learn_bpe(texts, 1000);
  // "ab" (twice) merges, then "ab"+"c" (twice); nothing else occurs twice.
  ASSERT_EQ(vocabulary.merges.size(), 2u);
  EXPECT_EQ(vocabulary.tokens[256], "ab");
  EXPECT_EQ(vocabulary.tokens[257], "abc");
  EXPECT_EQ(vocabulary.tokens.back(), "<|endoftext|>");
  EXPECT_EQ(vocabulary.training_tokens, 2 + 4);  // "abc" "abc", " " "x" "y" "z"
  // With every pair allowed, merging goes on until each piece is one token.
  const BpeVocabulary all = learn_bpe(texts, 1000, 1);
  EXPECT_EQ(all.training_tokens, 2);
}

TEST(LearnBpe, TokenizerEncodesTheTrainingTextToTheLearnedCountAndBack) {
  const std::string text = synthetic_text(7, 20000);
  const std::vector<std::string_view> texts = {text};
  const BpeVocabulary vocabulary = learn_bpe(texts, 512);
  ASSERT_EQ(vocabulary.tokens.size(), 512u);
  const fs::path dir = temp_dir("roundtrip");
  save_bpe_vocabulary(vocabulary, dir.string());
  for (const BpeRankLookup lookup : {BpeRankLookup::kExact, BpeRankLookup::kGpt3EncoderJs}) {
    const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(dir.string(), lookup);
    EXPECT_EQ(tokenizer.vocab_size(), 512);
    EXPECT_EQ(tokenizer.eot_id(), 511);
    for (int32_t id = 0; id < 511; ++id)
      EXPECT_EQ(tokenizer.token_bytes(id), vocabulary.tokens[id]);
    const std::vector<int32_t> ids = tokenizer.encode(text);
    EXPECT_EQ(static_cast<int64_t>(ids.size()), vocabulary.training_tokens);
    EXPECT_EQ(tokenizer.decode(ids), text);
  }
  // Text it never saw still round-trips (every byte is a token).
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(dir.string());
  const std::string unseen = "Zebra 123 \xe6\x97\xa5\xe6\x9c\xac \t\n~";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(unseen)), unseen);
  // Nothing but the two files (temp names renamed away).
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 2u);
  fs::remove_all(dir);
}

TEST(LearnBpe, SameInputSameVocabulary) {
  const std::string text = synthetic_text(11, 5000);
  const std::vector<std::string_view> texts = {text};
  const BpeVocabulary first = learn_bpe(texts, 400), second = learn_bpe(texts, 400);
  EXPECT_EQ(first.tokens, second.tokens);
  EXPECT_EQ(first.merges, second.merges);
}

TEST(LearnBpe, BadInputThrowsNamingIt) {
  const std::string text = "hello hello";
  const std::vector<std::string_view> texts = {text};
  try {
    learn_bpe(texts, 256);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("at least 257"), std::string::npos) << error.what();
  }
  const std::string bad = "fine\xff";
  const std::vector<std::string_view> bad_texts = {text, bad};
  try {
    learn_bpe(bad_texts, 300);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("text 1"), std::string::npos) << message;
    EXPECT_NE(message.find("UTF-8"), std::string::npos) << message;
  }
  BpeVocabulary empty;
  EXPECT_THROW(save_bpe_vocabulary(empty, temp_dir("empty").string()), Error);
}

}  // namespace
}  // namespace octet
