// CLIP's Fashion-MNIST captions: the vocabulary's layout, captions that encode, decode back
// and name their class, varied but deterministic draws, the zero-shot prompts, ClipBatcher's
// micro-batches on mock images, and the errors for unknown words, bad labels and a short
// max_text_len.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "octet/error.h"
#include "train/batcher.h"
#include "train/clip_captions.h"
#include "train/sample_draws.h"

namespace octet {
namespace {

using testing::error_of;
using train_detail::clip_caption;
using train_detail::clip_class_names;
using train_detail::clip_class_prompts;
using train_detail::clip_decode;
using train_detail::clip_encode;
using train_detail::clip_max_caption_tokens;
using train_detail::clip_prompts_per_class;
using train_detail::clip_vocabulary;
using train_detail::ClipBatcher;
using train_detail::ImageBatcher;
using train_detail::kClipEos;
using train_detail::kClipPad;
using train_detail::kClipSos;
using train_detail::SampleDraws;

constexpr int64_t kClasses = 10;
constexpr int64_t kPixels = 28 * 28;

// Whether `text` holds `phrase` as whole words.
bool has_words(const std::string& text, const std::string& phrase) {
  return (" " + text + " ").find(" " + phrase + " ") != std::string::npos;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

// Whether `text` names class `label` by one of its names.
bool names_class(const std::string& text, int64_t label) {
  for (const std::string& name : clip_class_names(label)) {
    if (has_words(text, name)) return true;
  }
  return false;
}

std::unique_ptr<ClipBatcher> mock_batcher(int64_t max_text_len, uint64_t seed, uint64_t stream,
                                          int64_t classes = kClasses) {
  return std::make_unique<ClipBatcher>(
      std::make_unique<ImageBatcher>(kPixels, classes, seed, stream), max_text_len, seed, stream);
}

TEST(ClipCaptions, VocabularyIsSpecialsThenSortedUniqueWords) {
  const std::vector<std::string>& vocabulary = clip_vocabulary();
  std::printf("vocabulary: %zu ids; longest caption: %lld tokens; %lld prompts per class\n",
              vocabulary.size(), static_cast<long long>(clip_max_caption_tokens()),
              static_cast<long long>(clip_prompts_per_class()));
  ASSERT_GT(vocabulary.size(), 3u);
  EXPECT_EQ(vocabulary[kClipPad], "[PAD]");
  EXPECT_EQ(vocabulary[kClipSos], "[SOS]");
  EXPECT_EQ(vocabulary[kClipEos], "[EOS]");
  for (size_t i = 3; i < vocabulary.size(); ++i) {
    const std::string& word = vocabulary[i];
    EXPECT_FALSE(word.empty()) << "id " << i;
    for (const char c : word) {
      EXPECT_FALSE(std::isupper(static_cast<unsigned char>(c)) || c == ' ') << "'" << word << "'";
    }
    if (i > 3) {
      EXPECT_LT(vocabulary[i - 1], word) << "ids " << i - 1 << " and " << i;
    }
  }
  // Every class's names are spelled in the vocabulary.
  for (int64_t label = 0; label < kClasses; ++label) {
    for (const std::string& name : clip_class_names(label)) {
      EXPECT_EQ(clip_decode(clip_encode(name)), name);
    }
  }
  EXPECT_LE(clip_max_caption_tokens(), 12);
  EXPECT_EQ(train_detail::fashion_mnist_classes().size(), 10u);
  EXPECT_EQ(train_detail::fashion_mnist_classes().front(), "T-shirt/top");
  EXPECT_EQ(train_detail::fashion_mnist_classes().back(), "Ankle boot");
}

TEST(ClipCaptions, EveryCaptionEncodesDecodesAndNamesItsClass) {
  const std::vector<std::string>& vocabulary = clip_vocabulary();
  std::set<std::string> all_captions;
  for (int64_t label = 0; label < kClasses; ++label) {
    std::set<std::string> captions, names_used;
    for (uint64_t position = 0; position < 400; ++position) {
      SampleDraws draws(11, position, 2);
      const std::string caption = clip_caption(label, draws);
      const std::vector<int32_t> ids = clip_encode(caption);
      ASSERT_GE(ids.size(), 4u) << caption;  // [SOS], two words at least, [EOS]
      EXPECT_LE(static_cast<int64_t>(ids.size()), clip_max_caption_tokens()) << caption;
      EXPECT_EQ(ids.front(), kClipSos) << caption;
      EXPECT_EQ(ids.back(), kClipEos) << caption;
      for (size_t t = 1; t + 1 < ids.size(); ++t) {
        EXPECT_GE(ids[t], 3) << caption;
        EXPECT_LT(ids[t], static_cast<int32_t>(vocabulary.size())) << caption;
      }
      EXPECT_EQ(clip_decode(ids), caption);
      EXPECT_TRUE(names_class(caption, label)) << "class " << label << ": " << caption;
      captions.insert(caption);
      for (const std::string& name : clip_class_names(label)) {
        if (has_words(caption, name)) names_used.insert(name);
      }
    }
    std::printf("class %lld (%s): %zu distinct captions of 400, e.g. '%s'\n",
                static_cast<long long>(label),
                train_detail::fashion_mnist_classes()[static_cast<size_t>(label)].c_str(),
                captions.size(), captions.begin()->c_str());
    EXPECT_GE(captions.size(), 50u) << "class " << label;
    EXPECT_EQ(names_used.size(), clip_class_names(label).size()) << "class " << label;
    all_captions.insert(captions.begin(), captions.end());
  }
  // "a" before a vowel is "an".
  for (const std::string& caption : all_captions) {
    const std::vector<std::string> words = split(caption);
    for (size_t i = 0; i + 1 < words.size(); ++i) {
      const bool vowel = std::string("aeiou").find(words[i + 1][0]) != std::string::npos;
      if (words[i] == "a" || words[i] == "an") {
        EXPECT_EQ(words[i] == "an", vowel) << caption;
      }
    }
  }
}

TEST(ClipCaptions, SameDrawsGiveTheSameCaption) {
  for (int64_t label = 0; label < kClasses; ++label) {
    for (uint64_t position : {0u, 1u, 12345u}) {
      SampleDraws first(5, position, 3), second(5, position, 3);
      EXPECT_EQ(clip_caption(label, first), clip_caption(label, second));
      EXPECT_EQ(first.word(), second.word());  // the same number of draws used
    }
  }
  // Another seed or stream gives other captions (over many positions).
  int64_t same_seed = 0, same_stream = 0;
  for (uint64_t position = 0; position < 100; ++position) {
    SampleDraws base(5, position, 3), seed(6, position, 3), stream(5, position, 4);
    const std::string caption = clip_caption(3, base);
    same_seed += caption == clip_caption(3, seed);
    same_stream += caption == clip_caption(3, stream);
  }
  EXPECT_LT(same_seed, 20);
  EXPECT_LT(same_stream, 20);
}

TEST(ClipCaptions, PromptsNameTheirClass) {
  const int64_t prompts = clip_prompts_per_class();
  ASSERT_GE(prompts, 2);
  std::set<std::string> all;
  for (int64_t label = 0; label < kClasses; ++label) {
    const std::vector<std::string> class_prompts = clip_class_prompts(label);
    ASSERT_EQ(static_cast<int64_t>(class_prompts.size()), prompts);
    const std::string& main_name = clip_class_names(label).front();
    for (const std::string& prompt : class_prompts) {
      EXPECT_TRUE(has_words(prompt, main_name)) << prompt;
      const std::vector<int32_t> ids = clip_encode(prompt);
      EXPECT_LE(static_cast<int64_t>(ids.size()), clip_max_caption_tokens()) << prompt;
      EXPECT_EQ(clip_decode(ids), prompt);
      all.insert(prompt);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(all.size()), kClasses * prompts);  // no two alike
  EXPECT_TRUE(has_words(clip_class_prompts(9).front(), "ankle boot"));
}

TEST(ClipCaptions, ErrorsNameTheProblem) {
  const std::string unknown = error_of([] { clip_encode("a photo of a zebra"); });
  EXPECT_NE(unknown.find("unknown word 'zebra'"), std::string::npos) << unknown;
  const std::string double_space = error_of([] { clip_encode("a  dress"); });
  EXPECT_NE(double_space.find("unknown word ''"), std::string::npos) << double_space;
  const std::string special = error_of([] { clip_encode("a [EOS]"); });
  EXPECT_NE(special.find("unknown word '[EOS]'"), std::string::npos) << special;
  const std::string bad_id = error_of([] { clip_decode({1, 100000, 2}); });
  EXPECT_NE(bad_id.find("got 100000"), std::string::npos) << bad_id;
  SampleDraws draws(1, 0, 0);
  const std::string label = error_of([&] { clip_caption(10, draws); });
  EXPECT_NE(label.find("expected in [0, 10)"), std::string::npos) << label;
  EXPECT_NE(label.find("got 10"), std::string::npos) << label;
  const std::string prompt = error_of([] { clip_class_prompts(-1); });
  EXPECT_NE(prompt.find("got -1"), std::string::npos) << prompt;
}

TEST(ClipBatcherTest, ShapesPaddingAndCaptionsOfEverySample) {
  const int64_t T = 16, size = 12, index = 3;
  const uint64_t seed = 9, stream = 1;
  const auto batcher = mock_batcher(T, seed, stream);
  const pipeline::MicroBatch batch = batcher->batch(index, size);
  const int64_t rows = kClasses * clip_prompts_per_class();
  EXPECT_EQ(batch.at("pixels").shape(), (Shape{size, kPixels}));
  EXPECT_EQ(batch.at("labels").shape(), (Shape{size}));
  EXPECT_EQ(batch.at("text_ids").shape(), (Shape{size, T}));
  EXPECT_EQ(batch.at("text_lengths").shape(), (Shape{size}));
  EXPECT_EQ(batch.at("class_ids").shape(), (Shape{rows, T}));
  EXPECT_EQ(batch.at("class_lengths").shape(), (Shape{rows}));
  for (const char* name : {"labels", "text_ids", "text_lengths", "class_ids", "class_lengths"}) {
    EXPECT_EQ(batch.at(name).dtype(), DType::I32) << name;
  }
  // Each text row: [SOS] words [EOS] then [PAD] up to T.
  const auto check_row = [&](const int32_t* row, int64_t length, const std::string& expected) {
    ASSERT_GE(length, 4);
    ASSERT_LE(length, clip_max_caption_tokens());
    EXPECT_EQ(row[0], kClipSos) << expected;
    EXPECT_EQ(row[length - 1], kClipEos) << expected;
    for (int64_t t = 1; t < length - 1; ++t) EXPECT_GE(row[t], 3) << expected;
    for (int64_t t = length; t < T; ++t) EXPECT_EQ(row[t], kClipPad) << expected;
    EXPECT_EQ(clip_decode(std::vector<int32_t>(row, row + T)), expected);
  };
  const int32_t* labels = batch.at("labels").data<int32_t>();
  for (int64_t b = 0; b < size; ++b) {
    SampleDraws draws(seed, static_cast<uint64_t>(index * size + b), stream);
    const std::string caption = clip_caption(labels[b], draws);
    EXPECT_TRUE(names_class(caption, labels[b])) << caption;
    check_row(batch.at("text_ids").data<int32_t>() + b * T,
              batch.at("text_lengths").data<int32_t>()[b], caption);
  }
  const int64_t prompts = clip_prompts_per_class();
  for (int64_t k = 0; k < kClasses; ++k) {
    const std::vector<std::string> class_prompts = clip_class_prompts(k);
    for (int64_t j = 0; j < prompts; ++j) {
      const int64_t row = k * prompts + j;
      check_row(batch.at("class_ids").data<int32_t>() + row * T,
                batch.at("class_lengths").data<int32_t>()[row],
                class_prompts[static_cast<size_t>(j)]);
    }
  }
  // The tightest max_text_len works, and the prompts are the same in every batch.
  const auto tight = mock_batcher(clip_max_caption_tokens(), seed, stream);
  const pipeline::MicroBatch other = tight->batch(0, 64);
  EXPECT_EQ(other.at("text_ids").shape(), (Shape{64, clip_max_caption_tokens()}));
  EXPECT_TRUE(testing::same_i32(batcher->batch(0, 2), batch, {"class_ids", "class_lengths"}));
}

TEST(ClipBatcherTest, BatchesAreDeterministicAndDiffer) {
  const int64_t T = 12;
  const auto batcher = mock_batcher(T, 5, 2), again = mock_batcher(T, 5, 2);
  const auto other_seed = mock_batcher(T, 6, 2), other_stream = mock_batcher(T, 5, 3);
  testing::expect_batches_deterministic(*batcher, *again, *other_seed, *other_stream,
                                        {"labels", "text_ids", "text_lengths"});
  // The same images with another caption seed: the same labels, other captions.
  ClipBatcher other_captions(std::make_unique<ImageBatcher>(kPixels, kClasses, 5, 2), T, 77, 2);
  const pipeline::MicroBatch first = batcher->batch(4, 32), second = other_captions.batch(4, 32);
  EXPECT_TRUE(testing::same_i32(first, second, {"labels"}));
  EXPECT_FALSE(testing::same_i32(first, second, {"text_ids"}));
  // Sample p of the stream has the same caption whatever the batch size.
  const pipeline::MicroBatch halves = batcher->batch(3, 8), whole = batcher->batch(1, 16);
  const int32_t* a = halves.at("text_ids").data<int32_t>();
  const int32_t* b = whole.at("text_ids").data<int32_t>() + 8 * T;
  EXPECT_EQ(std::vector<int32_t>(a, a + 8 * T), std::vector<int32_t>(b, b + 8 * T));
}

TEST(ClipBatcherTest, ErrorsNameTheProblem) {
  const int64_t needed = clip_max_caption_tokens();
  const std::string short_text = error_of([&] { mock_batcher(needed - 1, 1, 0); });
  EXPECT_NE(short_text.find("max_text_len expected at least " + std::to_string(needed)),
            std::string::npos)
      << short_text;
  EXPECT_NE(short_text.find("got " + std::to_string(needed - 1)), std::string::npos) << short_text;
  // Images of classes beyond Fashion-MNIST's ten.
  const auto wide = mock_batcher(needed, 1, 0, 12);
  const std::string label = error_of([&] { wide->batch(0, 64); });
  EXPECT_NE(label.find("image label expected in [0, 10)"), std::string::npos) << label;
  const std::string empty = error_of([&] { mock_batcher(needed, 1, 0)->batch(0, 0); });
  EXPECT_NE(empty.find("size > 0"), std::string::npos) << empty;
}

}  // namespace
}  // namespace octet
