// BertBatcher: the layout of [CLS] A [SEP] B [SEP] samples, next-sentence pairs that continue
// (or do not continue) the text, 80/10/10 masking rates, determinism and the errors for bad data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "octet/bert.h"
#include "octet/data.h"
#include "octet/error.h"
#include "train/bert_batcher.h"

namespace octet {
namespace {

using testing::error_of;
using train_detail::BertBatcher;

constexpr int64_t kTextVocab = 100;

BertConfig small_config() {
  BertConfig config;
  config.vocab_size = kTextVocab + 4;
  config.max_seq_len = 64;
  return config;
}

// One sample of a micro-batch, with the original text recovered from the targets.
struct Sample {
  const int32_t *ids = nullptr, *types = nullptr, *targets = nullptr;
  int64_t length = 0, label = 0, len_a = 0;
  std::vector<int32_t> original;  // ids with every masked position restored
};

Sample sample_of(const pipeline::MicroBatch& batch, int64_t b, int64_t T) {
  Sample s;
  s.ids = batch.at("ids").data<int32_t>() + b * T;
  s.types = batch.at("token_types").data<int32_t>() + b * T;
  s.targets = batch.at("targets").data<int32_t>() + b * T;
  s.length = batch.at("lengths").data<int32_t>()[b];
  s.label = batch.at("nsp_labels").data<int32_t>()[b];
  for (int64_t t = 0; t < T; ++t) {
    s.original.push_back(s.targets[t] == -100 ? s.ids[t] : s.targets[t]);
  }
  return s;
}

// Checks the layout of sample b ([CLS] A [SEP] B [SEP] [PAD]..., token types, one masked
// count) and fills len_a; returns the sample.
Sample check_structure(const pipeline::MicroBatch& batch, int64_t b, int64_t T,
                       const BertConfig& config) {
  Sample s = sample_of(batch, b, T);
  const std::string where = "sample " + std::to_string(b);
  EXPECT_GE(s.length, BertBatcher::kMinLength) << where;
  EXPECT_LE(s.length, T) << where;
  EXPECT_TRUE(s.label == 0 || s.label == 1) << where;
  EXPECT_EQ(s.ids[0], config.cls_id()) << where;
  EXPECT_EQ(s.original[s.length - 1], config.sep_id()) << where;
  int64_t first_sep = 1;
  while (first_sep < s.length - 1 && s.original[first_sep] != config.sep_id()) ++first_sep;
  s.len_a = first_sep - 1;
  const int64_t text = s.length - 3;
  EXPECT_GE(s.len_a, 1) << where;
  EXPECT_LE(s.len_a, text - 1) << where;
  int64_t masked = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool special = t == 0 || t == first_sep || t == s.length - 1 || t >= s.length;
    if (t >= s.length) {
      EXPECT_EQ(s.ids[t], config.pad_id()) << where << " position " << t;
    }
    if (!special) {
      EXPECT_LT(s.original[t], config.text_vocab()) << where << " position " << t;
      EXPECT_GE(s.original[t], 0) << where << " position " << t;
      const bool input_ok = s.ids[t] < config.text_vocab() || s.ids[t] == config.mask_id();
      EXPECT_TRUE(input_ok && s.ids[t] >= 0) << where << " position " << t;
    }
    if (s.targets[t] != -100) {
      ++masked;
      EXPECT_FALSE(special) << where << " masks special position " << t;
    }
    const int32_t type = t > first_sep && t < s.length ? 1 : 0;
    EXPECT_EQ(s.types[t], type) << where << " position " << t;
  }
  const int64_t expected = std::max<int64_t>(1, std::llround(0.15 * static_cast<double>(text)));
  EXPECT_EQ(masked, expected) << where << " with " << text << " text tokens";
  return s;
}

bool consecutive(const std::vector<int32_t>& ids, int64_t begin, int64_t end) {
  for (int64_t t = begin + 1; t < end; ++t) {
    if (ids[t] != (ids[t - 1] + 1) % kTextVocab) return false;
  }
  return true;
}

TEST(BertData, ShapesAndLayoutOfEverySample) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 5000);
  const BertConfig config = small_config();
  for (int64_t T : {5, 32, 64}) {
    BertBatcher batcher(path, false, config, T, 11, 0);
    for (int64_t index = 0; index < 4; ++index) {
      const pipeline::MicroBatch batch = batcher.batch(index, 16);
      for (const char* name : {"ids", "token_types", "targets"}) {
        EXPECT_EQ(batch.at(name).shape(), (Shape{16, T})) << name;
        EXPECT_EQ(batch.at(name).dtype(), DType::I32) << name;
      }
      for (const char* name : {"lengths", "nsp_labels"}) {
        EXPECT_EQ(batch.at(name).shape(), (Shape{16})) << name;
        EXPECT_EQ(batch.at(name).dtype(), DType::I32) << name;
      }
      for (int64_t b = 0; b < 16; ++b) check_structure(batch, b, T, config);
    }
  }
}

TEST(BertData, SegmentsFollowTheTextAndRatesMatch) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 20000);
  const BertConfig config = small_config();
  const int64_t T = 32;
  BertBatcher batcher(path, false, config, T, 3, 1);
  int64_t samples = 0, random_next = 0, short_sequences = 0, random_continuing = 0;
  int64_t masks = 0, as_mask = 0, unchanged = 0, replaced = 0;
  for (int64_t index = 0; index < 40; ++index) {
    const pipeline::MicroBatch batch = batcher.batch(index, 100);
    for (int64_t b = 0; b < 100; ++b) {
      const Sample s = check_structure(batch, b, T, config);
      const int64_t a_end = 1 + s.len_a, b_begin = 2 + s.len_a, b_end = s.length - 1;
      ASSERT_TRUE(consecutive(s.original, 1, a_end)) << "A of sample " << b;
      ASSERT_TRUE(consecutive(s.original, b_begin, b_end)) << "B of sample " << b;
      const bool continues = s.original[b_begin] == (s.original[a_end - 1] + 1) % kTextVocab;
      if (s.label == 0) {
        ASSERT_TRUE(continues) << "label 0 sample " << b << " of batch " << index;
      } else {
        random_continuing += continues;
      }
      ++samples;
      random_next += s.label;
      short_sequences += s.length < T;
      for (int64_t t = 0; t < T; ++t) {
        if (s.targets[t] == -100) continue;
        ++masks;
        if (s.ids[t] == config.mask_id()) {
          ++as_mask;
        } else if (s.ids[t] == s.targets[t]) {
          ++unchanged;
        } else {
          ++replaced;
        }
      }
    }
  }
  const double n = static_cast<double>(samples), m = static_cast<double>(masks);
  std::printf(
      "%lld samples: random next %.4f, short %.4f; %lld masks: [MASK] %.4f, unchanged "
      "%.4f, replaced %.4f\n",
      static_cast<long long>(samples), random_next / n, short_sequences / n,
      static_cast<long long>(masks), as_mask / m, unchanged / m, replaced / m);
  EXPECT_NEAR(random_next / n, BertBatcher::kRandomNextProb, 0.03);
  // L uniform in [5, T] is short (L < T) with probability (T - 5) / (T - 4).
  EXPECT_NEAR(short_sequences / n, BertBatcher::kShortSeqProb * (T - 5) / (T - 4), 0.03);
  // A random B continues A (mod the vocabulary) by chance only: about 1 in kTextVocab.
  EXPECT_LT(random_continuing, random_next * 3 / 100);
  EXPECT_NEAR(as_mask / m, 0.8, 0.02);
  // A random token equals the original 1 time in kTextVocab.
  EXPECT_NEAR(unchanged / m, 0.1 + 0.1 / kTextVocab, 0.015);
  EXPECT_NEAR(replaced / m, 0.1 - 0.1 / kTextVocab, 0.015);
}

TEST(BertData, BatchesAreDeterministicAndDiffer) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 5000);
  const BertConfig config = small_config();
  for (const bool mock : {false, true}) {
    SCOPED_TRACE(mock ? "mock" : "shard");
    BertBatcher batcher(mock ? "/nonexistent/ignored.bin" : path, mock, config, 48, 5, 2);
    BertBatcher again(mock ? "" : path, mock, config, 48, 5, 2);
    BertBatcher other_seed(path, mock, config, 48, 6, 2);
    BertBatcher other_stream(path, mock, config, 48, 5, 3);
    testing::expect_batches_deterministic(
        batcher, again, other_seed, other_stream,
        {"ids", "token_types", "targets", "lengths", "nsp_labels"});
    for (int64_t index : {0, 7, 8}) {
      const pipeline::MicroBatch batch = batcher.batch(index, 8);
      for (int64_t b = 0; b < 8; ++b) check_structure(batch, b, 48, config);
    }
  }
}

TEST(BertData, ErrorsNameTheProblem) {
  testing::TokenShardDir dir(kTextVocab);
  const BertConfig config = small_config();
  const std::string big_vocab = dir.write("big_vocab.bin", 1000, 200);
  EXPECT_NE(error_of([&] {
              BertBatcher(big_vocab, false, config, 32, 1, 0);
            }).find("set the config's vocab_size to at least 204"),
            std::string::npos);
  // The shard's vocabulary may fill the text ids exactly.
  EXPECT_NO_THROW(
      BertBatcher(dir.write("full_vocab.bin", 1000, kTextVocab), false, config, 32, 1, 0));
  const std::string short_shard = dir.write("short.bin", 63);
  EXPECT_NE(error_of([&] {
              BertBatcher(short_shard, false, config, 32, 1, 0);
            }).find("holds 63 tokens: expected at least 2 x seq_len = 64"),
            std::string::npos);
  EXPECT_NO_THROW(BertBatcher(dir.write("just_enough.bin", 64), false, config, 32, 1, 0));
  const std::string good = dir.write("good.bin", 1000);
  for (const int64_t seq_len : {4, 65}) {
    for (const bool mock : {false, true}) {
      const std::string message = error_of([&] { BertBatcher(good, mock, config, seq_len, 1, 0); });
      EXPECT_NE(message.find("seq_len expected in [5, max_seq_len = 64]"), std::string::npos)
          << message;
      EXPECT_NE(message.find("got " + std::to_string(seq_len)), std::string::npos) << message;
    }
  }
  testing::expect_missing_shard_error(
      dir, [&](const std::string& missing) { BertBatcher(missing, false, config, 32, 1, 0); });
}

// 64 x 128 is a typical micro-batch: building one must cost far less than a training step.
TEST(BertData, BatchOf64x128IsFast) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 100000);
  BertConfig config = small_config();
  config.max_seq_len = 128;
  BertBatcher batcher(path, false, config, 128, 1, 0);
  const int repeats = 50;
  int64_t checksum = 0;
  const double ms = testing::ms_per_call(
      repeats, [&](int i) { checksum += batcher.batch(i, 64).at("ids").data<int32_t>()[5]; });
  std::printf("BertBatcher: %.3f ms per 64 x 128 batch (checksum %lld)\n", ms,
              static_cast<long long>(checksum));
  // Loose: a shared, loaded machine must not fail it; a per-token allocation would.
  EXPECT_LT(ms, 5.0);
}

}  // namespace
}  // namespace octet
