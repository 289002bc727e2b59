// T5Batcher: the window length for (enc_len, dec_len), span-corrupted samples that give back
// their window, T5's noise rates and span lengths, determinism, the errors for bad data; and
// T5's relative position buckets against Hugging Face's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "octet/data.h"
#include "octet/error.h"
#include "octet/t5.h"
#include "train/t5_batcher.h"

namespace octet {
namespace {

using testing::error_of;
using train_detail::T5Batcher;

constexpr int64_t kTextVocab = 1000;
constexpr int64_t kSentinels = 20;

T5Config small_config() {
  T5Config config;
  config.vocab_size = kTextVocab + 2 + kSentinels;
  config.num_sentinels = kSentinels;
  config.max_seq_len = 128;
  config.max_target_len = 64;
  return config;
}

// One sample taken apart: the kept runs and noise spans in window order, and the window.
struct Sample {
  std::vector<int64_t> kept_lengths, span_lengths, span_starts;  // starts: window positions
  std::vector<int32_t> window;
};

// Checks the layout of sample b (enc_ids, targets, dec_ids, lengths, padding, sentinels in
// order, [EOS] placement, the counts of noise tokens and spans) and returns it taken apart.
Sample check_sample(const pipeline::MicroBatch& batch, int64_t b, int64_t S, int64_t T, int64_t N,
                    const T5Config& config) {
  const std::string where = "sample " + std::to_string(b);
  const int32_t* enc = batch.at("enc_ids").data<int32_t>() + b * S;
  const int32_t* dec = batch.at("dec_ids").data<int32_t>() + b * T;
  const int32_t* target = batch.at("targets").data<int32_t>() + b * T;
  const int64_t enc_length = batch.at("enc_lengths").data<int32_t>()[b];
  const int64_t dec_length = batch.at("dec_lengths").data<int32_t>()[b];
  const int64_t noise = T5Batcher::noise_count(N), spans = T5Batcher::span_count(noise);
  EXPECT_EQ(enc_length, N - noise + spans + 1) << where;
  EXPECT_EQ(dec_length, noise + spans + 1) << where;
  EXPECT_LE(enc_length, S) << where;
  EXPECT_LE(dec_length, T) << where;
  auto sentinel_number = [&](int32_t id) {  // k for sentinel k, -1 for any other id
    const int64_t k = config.vocab_size - 1 - id;
    return k >= 0 && k < config.num_sentinels ? k : -1;
  };
  auto is_text = [&](int32_t id) { return id >= 0 && id < config.text_vocab(); };

  // The targets: sentinel k then span k, for k = 0, 1, ..., then [EOS], then -100.
  Sample s;
  std::vector<std::vector<int32_t>> span_tokens;
  int64_t t = 0;
  for (; t < dec_length - 1; ++t) {
    const int64_t k = sentinel_number(target[t]);
    if (k >= 0) {
      EXPECT_EQ(k, static_cast<int64_t>(span_tokens.size())) << where << " target " << t;
      span_tokens.emplace_back();
    } else {
      EXPECT_TRUE(is_text(target[t])) << where << " target " << t << " = " << target[t];
      EXPECT_FALSE(span_tokens.empty()) << where << ": targets expected to open with a sentinel";
      if (!span_tokens.empty()) span_tokens.back().push_back(target[t]);
    }
  }
  EXPECT_EQ(target[dec_length - 1], config.eos_id()) << where;
  for (t = dec_length; t < T; ++t) EXPECT_EQ(target[t], -100) << where << " target " << t;
  EXPECT_EQ(static_cast<int64_t>(span_tokens.size()), spans) << where;

  // dec_ids: the start token [PAD], the targets shifted right by one, [PAD]s.
  EXPECT_EQ(dec[0], config.pad_id()) << where;
  for (t = 1; t < dec_length; ++t) EXPECT_EQ(dec[t], target[t - 1]) << where << " dec " << t;
  for (t = dec_length; t < T; ++t) EXPECT_EQ(dec[t], config.pad_id()) << where << " dec " << t;

  // enc_ids: kept runs with sentinel k for span k, [EOS], [PAD]s; the window put back together.
  int64_t next_sentinel = 0, kept = 0;
  for (int64_t e = 0; e < enc_length - 1; ++e) {
    const int64_t k = sentinel_number(enc[e]);
    if (k < 0) {
      EXPECT_TRUE(is_text(enc[e])) << where << " enc " << e << " = " << enc[e];
      s.window.push_back(enc[e]);
      ++kept;
      continue;
    }
    EXPECT_EQ(k, next_sentinel++) << where << " enc " << e;
    if (k >= spans) continue;
    s.kept_lengths.push_back(kept);
    kept = 0;
    s.span_starts.push_back(static_cast<int64_t>(s.window.size()));
    const std::vector<int32_t>& span = span_tokens[static_cast<size_t>(k)];
    s.span_lengths.push_back(static_cast<int64_t>(span.size()));
    s.window.insert(s.window.end(), span.begin(), span.end());
  }
  EXPECT_EQ(next_sentinel, spans) << where;
  EXPECT_EQ(kept, 0) << where << ": a noise span expected to end the window";
  EXPECT_EQ(enc[enc_length - 1], config.eos_id()) << where;
  for (int64_t e = enc_length; e < S; ++e) EXPECT_EQ(enc[e], config.pad_id()) << where;
  EXPECT_EQ(static_cast<int64_t>(s.window.size()), N) << where;
  int64_t noise_tokens = 0;
  for (const int64_t length : s.span_lengths) {
    EXPECT_GE(length, 1) << where << ": an empty noise span";
    noise_tokens += length;
  }
  for (const int64_t length : s.kept_lengths) EXPECT_GE(length, 1) << where << ": an empty run";
  EXPECT_EQ(noise_tokens, noise) << where;
  return s;
}

bool consecutive(const std::vector<int32_t>& ids) {
  for (size_t t = 1; t < ids.size(); ++t) {
    if (ids[t] != (ids[t - 1] + 1) % kTextVocab) return false;
  }
  return true;
}

TEST(T5Data, WindowLengthIsTheLargestThatFits) {
  // T5's published pair: 568 raw tokens make 512 inputs and 114 targets.
  EXPECT_EQ(T5Batcher::window_length(512, 114), 568);
  EXPECT_EQ(T5Batcher::input_length(568), 512);
  EXPECT_EQ(T5Batcher::target_length(568), 114);
  EXPECT_LT(T5Batcher::window_length(512, 113), 568);  // the targets bind
  EXPECT_EQ(T5Batcher::window_length(3, 3), 2);
  // Python's round (a half to even), as T5's helper and Hugging Face's script use.
  EXPECT_EQ(T5Batcher::noise_count(10), 2);
  EXPECT_EQ(T5Batcher::noise_count(30), 4);
  EXPECT_EQ(T5Batcher::noise_count(50), 8);
  EXPECT_EQ(T5Batcher::noise_count(70), 10);
  EXPECT_EQ(T5Batcher::noise_count(568), 85);
  EXPECT_EQ(T5Batcher::noise_count(2), 1);
  EXPECT_EQ(T5Batcher::noise_count(3), 1);  // round(0.45) = 0, clamped to 1
  EXPECT_EQ(T5Batcher::span_count(1), 1);
  EXPECT_EQ(T5Batcher::span_count(4), 1);
  EXPECT_EQ(T5Batcher::span_count(5), 2);
  EXPECT_EQ(T5Batcher::span_count(85), 28);
  auto fits = [](int64_t N, int64_t enc_len, int64_t dec_len) {
    const int64_t noise = std::clamp<int64_t>(std::llrint(0.15 * static_cast<double>(N)), 1, N - 1);
    const int64_t spans = std::max<int64_t>(1, std::llrint(static_cast<double>(noise) / 3.0));
    return N - noise + spans + 1 <= enc_len && noise + spans + 1 <= dec_len;
  };
  for (int64_t enc_len = 3; enc_len <= 80; ++enc_len) {
    for (int64_t dec_len = 3; dec_len <= 30; ++dec_len) {
      const int64_t N = T5Batcher::window_length(enc_len, dec_len);
      ASSERT_TRUE(fits(N, enc_len, dec_len)) << enc_len << ", " << dec_len << ": " << N;
      for (int64_t longer = N + 1; longer <= N + 40; ++longer) {
        ASSERT_FALSE(fits(longer, enc_len, dec_len)) << enc_len << ", " << dec_len << ": " << N;
      }
    }
  }
  for (const auto& [enc_len, dec_len] : {std::pair<int64_t, int64_t>{2, 10}, {10, 2}}) {
    const std::string message = error_of([&] { T5Batcher::window_length(enc_len, dec_len); });
    EXPECT_NE(message.find("enc_len and dec_len expected at least 3 and 3"), std::string::npos)
        << message;
  }
}

TEST(T5Data, EverySampleGivesBackItsWindow) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 5000);
  const T5Config config = small_config();
  // The encoder binds, the decoder binds, the smallest window, T5's own ratio.
  for (const auto& [S, T] : {std::pair<int64_t, int64_t>{128, 64}, {128, 20}, {3, 3}, {64, 16}}) {
    SCOPED_TRACE("enc_len " + std::to_string(S) + ", dec_len " + std::to_string(T));
    T5Batcher batcher(path, false, config, S, T, 11, 0);
    const int64_t N = batcher.window();
    EXPECT_EQ(N, T5Batcher::window_length(S, T));
    for (int64_t index = 0; index < 4; ++index) {
      const pipeline::MicroBatch batch = batcher.batch(index, 16);
      EXPECT_EQ(batch.at("enc_ids").shape(), (Shape{16, S}));
      for (const char* name : {"dec_ids", "targets"}) {
        EXPECT_EQ(batch.at(name).shape(), (Shape{16, T})) << name;
      }
      for (const char* name : {"enc_lengths", "dec_lengths"}) {
        EXPECT_EQ(batch.at(name).shape(), (Shape{16})) << name;
      }
      for (const auto& [name, tensor] : batch) EXPECT_EQ(tensor.dtype(), DType::I32) << name;
      for (int64_t b = 0; b < 16; ++b) {
        const Sample s = check_sample(batch, b, S, T, N, config);
        ASSERT_TRUE(consecutive(s.window)) << "sample " << b << " of batch " << index;
      }
    }
  }
}

TEST(T5Data, NoiseRateAndSpanLengthsMatchT5) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 20000);
  const T5Config config = small_config();
  const int64_t S = 128, T = 32;
  T5Batcher batcher(path, false, config, S, T, 3, 1);
  const int64_t N = batcher.window();
  const int64_t noise = T5Batcher::noise_count(N), spans = T5Batcher::span_count(noise);
  ASSERT_EQ(N, 141);  // 21 noise tokens in 7 spans: 128 inputs and 29 targets
  int64_t samples = 0, noise_tokens = 0, span_total = 0, single_spans = 0, single_runs = 0;
  int64_t first_run_total = 0;
  std::vector<int64_t> starts_by_quarter(4, 0);
  std::vector<bool> first_start_seen(static_cast<size_t>(N), false);
  for (int64_t index = 0; index < 40; ++index) {
    const pipeline::MicroBatch batch = batcher.batch(index, 100);
    for (int64_t b = 0; b < 100; ++b) {
      const Sample s = check_sample(batch, b, S, T, N, config);
      ASSERT_TRUE(consecutive(s.window));
      ++samples;
      for (const int64_t length : s.span_lengths) {
        noise_tokens += length;
        ++span_total;
        single_spans += length == 1;
      }
      for (const int64_t length : s.kept_lengths) single_runs += length == 1;
      for (const int64_t start : s.span_starts) ++starts_by_quarter[size_t(start * 4 / N)];
      first_start_seen[static_cast<size_t>(s.span_starts[0])] = true;
      first_run_total += s.kept_lengths[0];
    }
  }
  const double n = static_cast<double>(samples);
  const double noise_fraction = static_cast<double>(noise_tokens) / (n * double(N));
  const double mean_span = static_cast<double>(noise_tokens) / static_cast<double>(span_total);
  // A uniform split of m tokens into k positive parts has a part of 1 with chance
  // (k - 1) / (m - 1).
  const double single_span_rate = double(single_spans) / double(span_total);
  const double single_run_rate = double(single_runs) / double(span_total);  // as many runs
  const double expected_single_span = double(spans - 1) / double(noise - 1);
  const double expected_single_run = double(spans - 1) / double(N - noise - 1);
  const double mean_first_run = double(first_run_total) / n;
  int64_t distinct_first_starts = 0;
  for (const bool seen : first_start_seen) distinct_first_starts += seen;
  std::printf(
      "%lld samples of N = %lld: noise %.4f, mean span %.3f, spans of 1 %.4f (expected %.4f), "
      "runs of 1 %.4f (expected %.4f), first run %.2f (expected %.2f), %lld first starts; "
      "starts by quarter %lld %lld %lld %lld\n",
      static_cast<long long>(samples), static_cast<long long>(N), noise_fraction, mean_span,
      single_span_rate, expected_single_span, single_run_rate, expected_single_run, mean_first_run,
      double(N - noise) / double(spans), static_cast<long long>(distinct_first_starts),
      static_cast<long long>(starts_by_quarter[0]), static_cast<long long>(starts_by_quarter[1]),
      static_cast<long long>(starts_by_quarter[2]), static_cast<long long>(starts_by_quarter[3]));
  EXPECT_NEAR(noise_fraction, 0.15, 0.005);
  EXPECT_DOUBLE_EQ(noise_fraction, double(noise) / double(N));
  EXPECT_NEAR(mean_span, 3.0, 0.3);
  EXPECT_NEAR(single_span_rate, expected_single_span, 0.02);
  EXPECT_NEAR(single_run_rate, expected_single_run, 0.01);
  EXPECT_NEAR(mean_first_run, double(N - noise) / double(spans), 0.6);
  // Spans start all over the window, not at fixed places.
  EXPECT_GT(distinct_first_starts, 40);
  for (const int64_t count : starts_by_quarter) EXPECT_GT(count, span_total / 8);
}

TEST(T5Data, BatchesAreDeterministicAndDiffer) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 5000);
  const T5Config config = small_config();
  const int64_t S = 96, T = 24;
  for (const bool mock : {false, true}) {
    SCOPED_TRACE(mock ? "mock" : "shard");
    T5Batcher batcher(mock ? "/nonexistent/ignored.bin" : path, mock, config, S, T, 5, 2);
    T5Batcher again(mock ? "" : path, mock, config, S, T, 5, 2);
    T5Batcher other_seed(path, mock, config, S, T, 6, 2);
    T5Batcher other_stream(path, mock, config, S, T, 5, 3);
    testing::expect_batches_deterministic(
        batcher, again, other_seed, other_stream,
        {"enc_ids", "enc_lengths", "dec_ids", "dec_lengths", "targets"});
    int64_t consecutive_windows = 0;
    for (int64_t index : {0, 7, 8}) {
      const pipeline::MicroBatch batch = batcher.batch(index, 8);
      for (int64_t b = 0; b < 8; ++b) {
        consecutive_windows +=
            consecutive(check_sample(batch, b, S, T, batcher.window(), config).window);
      }
    }
    // Mock windows are uniform tokens, shard windows runs of the shard's counting ids.
    EXPECT_EQ(consecutive_windows, mock ? 0 : 24);
  }
}

TEST(T5Data, ErrorsNameTheProblem) {
  testing::TokenShardDir dir(kTextVocab);
  const T5Config config = small_config();
  const std::string big_vocab = dir.write("big_vocab.bin", 1000, 2000);
  std::string message = error_of([&] { T5Batcher(big_vocab, false, config, 64, 16, 1, 0); });
  EXPECT_NE(message.find("raise the config's vocab_size to at least 2022"), std::string::npos)
      << message;
  // The shard's vocabulary may fill the text ids exactly.
  EXPECT_NO_THROW(
      T5Batcher(dir.write("full_vocab.bin", 1000, kTextVocab), false, config, 64, 16, 1, 0));

  const int64_t N = T5Batcher::window_length(64, 16);
  const std::string short_shard = dir.write("short.bin", N);
  message = error_of([&] { T5Batcher(short_shard, false, config, 64, 16, 1, 0); });
  EXPECT_NE(message.find("holds " + std::to_string(N) +
                         " tokens: expected at least window + 1 = " + std::to_string(N + 1)),
            std::string::npos)
      << message;
  EXPECT_NO_THROW(T5Batcher(dir.write("just_enough.bin", N + 1), false, config, 64, 16, 1, 0));

  const std::string good = dir.write("good.bin", 1000);
  T5Config few_sentinels = config;
  few_sentinels.num_sentinels = 2;
  few_sentinels.vocab_size = kTextVocab + 2 + 2;
  for (const bool mock : {false, true}) {
    message = error_of([&] { T5Batcher(good, mock, few_sentinels, 64, 16, 1, 0); });
    EXPECT_NE(message.find("3 noise spans, more than the config's num_sentinels = 2"),
              std::string::npos)
        << message;
    EXPECT_NO_THROW(T5Batcher(good, mock, few_sentinels, 40, 10, 1, 0));  // 2 spans
    for (const int64_t enc_len : {2, 129}) {
      message = error_of([&] { T5Batcher(good, mock, config, enc_len, 16, 1, 0); });
      EXPECT_NE(message.find("enc_len expected in [3, max_seq_len = 128]"), std::string::npos)
          << message;
      EXPECT_NE(message.find("got " + std::to_string(enc_len)), std::string::npos) << message;
    }
    for (const int64_t dec_len : {2, 65}) {
      message = error_of([&] { T5Batcher(good, mock, config, 64, dec_len, 1, 0); });
      EXPECT_NE(message.find("dec_len expected in [3, max_target_len = 64]"), std::string::npos)
          << message;
      EXPECT_NE(message.find("got " + std::to_string(dec_len)), std::string::npos) << message;
    }
  }
  testing::expect_missing_shard_error(
      dir, [&](const std::string& missing) { T5Batcher(missing, false, config, 64, 16, 1, 0); });
}

// T5's own shape, 64 samples of 512 inputs: building one must cost far less than a step.
TEST(T5Data, BatchOf64x512IsFast) {
  testing::TokenShardDir dir(kTextVocab);
  const std::string path = dir.write("train.bin", 100000);
  T5Config config = small_config();
  config.max_seq_len = 512;
  config.max_target_len = 114;
  config.num_sentinels = 100;
  config.vocab_size = kTextVocab + 2 + 100;
  T5Batcher batcher(path, false, config, 512, 114, 1, 0);
  const int repeats = 10;
  int64_t checksum = 0;
  const double ms = testing::ms_per_call(
      repeats, [&](int i) { checksum += batcher.batch(i, 64).at("enc_ids").data<int32_t>()[5]; });
  std::printf("T5Batcher: %.3f ms per 64 x 512 batch (checksum %lld)\n", ms,
              static_cast<long long>(checksum));
  EXPECT_LT(ms, 20.0);  // loose: a shared, loaded machine must not fail it
}

// Against Hugging Face's _relative_position_bucket (num_buckets 32, max_distance 128).
TEST(T5Data, RelativePositionBucketsMatchHuggingFace) {
  const std::vector<int64_t> positions = {-200, -128, -100, -50, -20, -9, -8,  -7,  -1,  0,  1,
                                          5,    7,    8,    9,   20,  50, 100, 127, 128, 200};
  const std::vector<int64_t> bidirectional = {15, 15, 15, 13, 10, 8,  8,  7,  1,  0, 17,
                                              21, 23, 24, 24, 26, 29, 31, 31, 31, 31};
  const std::vector<int64_t> causal = {31, 31, 30, 24, 17, 9, 8, 7, 1, 0, 0,
                                       0,  0,  0,  0,  0,  0, 0, 0, 0, 0};
  for (size_t i = 0; i < positions.size(); ++i) {
    EXPECT_EQ(t5_relative_position_bucket(positions[i], true, 32, 128), bidirectional[i])
        << "bidirectional, relative position " << positions[i];
    EXPECT_EQ(t5_relative_position_bucket(positions[i], false, 32, 128), causal[i])
        << "causal, relative position " << positions[i];
  }
}

}  // namespace
}  // namespace octet
