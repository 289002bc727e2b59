// T5 span-corruption micro-batches: noise spans replaced by sentinels in the input and spelled
// out in the target (see t5_batcher.h).
#include "train/t5_batcher.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "octet/error.h"
#include "octet/rng.h"
#include "train/sample_draws.h"

namespace octet::train_detail {
namespace {

// A sample draws at most 3 N + 2 words (two per mock token, one per gap between tokens
// considered as a cut, two for the shard position): the constructor keeps that under
// SampleDraws::kMaxWords, so samples never share a block.

// Splits `items` into `parts` positive lengths, uniform over all such splits (T5's
// _random_segmentation): parts - 1 of the items - 1 gaps between items become cuts, chosen by
// selection sampling (each gap in turn with probability cuts still needed / gaps left).
void random_segmentation(int64_t items, int64_t parts, SampleDraws& draws, int64_t* lengths) {
  int64_t needed = parts - 1, previous = 0, part = 0;
  for (int64_t gap = 1; gap < items && needed > 0; ++gap) {
    const auto gaps_left = static_cast<double>(items - gap);  // this one and those after it
    if (draws.uniform() * gaps_left < static_cast<double>(needed)) {
      lengths[part++] = gap - previous;
      previous = gap;
      --needed;
    }
  }
  lengths[part] = items - previous;
}

// Python's and NumPy's round: to the nearest integer, a half to the even one.
int64_t round_half_even(double value) {
  const double floor = std::floor(value), fraction = value - floor;
  const auto low = static_cast<int64_t>(floor);
  if (fraction != 0.5) return fraction < 0.5 ? low : low + 1;
  return low % 2 == 0 ? low : low + 1;
}

}  // namespace

int64_t T5Batcher::noise_count(int64_t window) {
  OCTET_CHECK(window >= kMinWindow, "T5 data: a window expected at least ", kMinWindow,
              " tokens, got ", window);
  const int64_t rounded = round_half_even(static_cast<double>(window) * kNoiseDensity);
  return std::clamp<int64_t>(rounded, 1, window - 1);
}

int64_t T5Batcher::span_count(int64_t noise) {
  const auto mean = static_cast<double>(kMeanNoiseSpanLength);
  return std::max<int64_t>(1, round_half_even(static_cast<double>(noise) / mean));
}

int64_t T5Batcher::input_length(int64_t window) {
  const int64_t noise = noise_count(window);
  return window - noise + span_count(noise) + 1;
}

int64_t T5Batcher::target_length(int64_t window) {
  const int64_t noise = noise_count(window);
  return noise + span_count(noise) + 1;
}

int64_t T5Batcher::window_length(int64_t enc_len, int64_t dec_len) {
  OCTET_CHECK(enc_len >= input_length(kMinWindow) && dec_len >= target_length(kMinWindow),
              "T5 data: enc_len and dec_len expected at least ", input_length(kMinWindow), " and ",
              target_length(kMinWindow),
              " (a window of 2 tokens: one kept, one noise span, each with a sentinel and "
              "[EOS]), got ",
              enc_len, " and ", dec_len);
  // Both lengths grow with N (one more token is kept or noise, and spans only follow noise),
  // so the windows that fit are [2, N]: bisect between a fitting one and one too long (more
  // than 0.8 N positions go to the encoder).
  auto fits = [&](int64_t window) {
    return input_length(window) <= enc_len && target_length(window) <= dec_len;
  };
  int64_t low = kMinWindow, high = 2 * enc_len + 2;
  while (high - low > 1) {
    const int64_t middle = low + (high - low) / 2;
    (fits(middle) ? low : high) = middle;
  }
  return low;
}

T5Batcher::T5Batcher(const std::string& path, bool mock, const T5Config& config, int64_t enc_len,
                     int64_t dec_len, uint64_t seed, uint64_t stream)
    : mock_(mock),
      config_(config),
      enc_len_(enc_len),
      dec_len_(dec_len),
      window_(0),
      seed_(seed),
      stream_(stream) {
  OCTET_CHECK(config_.text_vocab() >= 1, "T5 data: the config's vocab_size expected at least ",
              config_.num_sentinels + 3, " (text ids, then [PAD] [EOS] and ", config_.num_sentinels,
              " sentinels), got ", config_.vocab_size);
  const int64_t min_enc = input_length(kMinWindow), min_dec = target_length(kMinWindow);
  OCTET_CHECK(enc_len_ >= min_enc && enc_len_ <= config_.max_seq_len,
              "T5 data: enc_len expected in [", min_enc, ", max_seq_len = ", config_.max_seq_len,
              "] (a window of 2 tokens takes ", min_enc,
              ": a kept token, a sentinel and [EOS]), got ", enc_len_);
  OCTET_CHECK(dec_len_ >= min_dec && dec_len_ <= config_.max_target_len,
              "T5 data: dec_len expected in [", min_dec,
              ", max_target_len = ", config_.max_target_len, "] (a window of 2 tokens takes ",
              min_dec, ": a sentinel, the noise token and [EOS]), got ", dec_len_);
  window_ = window_length(enc_len_, dec_len_);
  const int64_t spans = span_count(noise_count(window_));
  OCTET_CHECK(spans <= config_.num_sentinels, "T5 data: a window of ", window_, " tokens (enc_len ",
              enc_len_, ", dec_len ", dec_len_, ") has ", spans,
              " noise spans, more than the config's num_sentinels = ", config_.num_sentinels,
              ": raise num_sentinels to at least ", spans, " or shorten enc_len and dec_len");
  OCTET_CHECK(3 * window_ + 2 <= SampleDraws::kMaxWords, "T5 data: a window of ", window_,
              " tokens draws more random words than a sample's ", SampleDraws::kMaxWords);
  if (mock_) return;
  shard_ = std::make_unique<TokenShard>(TokenShard::open(path, /*check_ids=*/false));
  OCTET_CHECK(shard_->vocab_size() <= config_.text_vocab(), "T5 data '", path, "' has vocabulary ",
              shard_->vocab_size(), ", larger than the config's text ", "vocabulary ",
              config_.text_vocab(), " (vocab_size ", config_.vocab_size, " - 2 - ",
              config_.num_sentinels, " sentinels): raise the config's vocab_size to at least ",
              shard_->vocab_size() + 2 + config_.num_sentinels,
              " (shard vocabulary + [PAD] [EOS] + num_sentinels)");
  OCTET_CHECK(shard_->size() >= window_ + 1, "T5 data '", path, "' holds ", shard_->size(),
              " tokens: expected at least window + 1 = ", window_ + 1, " (a window of ", window_,
              " tokens for enc_len ", enc_len_, ", dec_len ", dec_len_, ")");
}

pipeline::MicroBatch T5Batcher::batch(int64_t index, int64_t size) const {
  OCTET_CHECK(index >= 0 && size > 0, "T5 data: batch expected index >= 0 and size > 0, got ",
              "index ", index, ", size ", size);
  const int64_t S = enc_len_, T = dec_len_, N = window_;
  Tensor enc_ids = Tensor::empty({size, S}, DType::I32);
  Tensor enc_lengths = Tensor::empty({size}, DType::I32);
  Tensor dec_ids = Tensor::empty({size, T}, DType::I32);
  Tensor dec_lengths = Tensor::empty({size}, DType::I32);
  Tensor targets = Tensor::empty({size, T}, DType::I32);
  const int32_t pad = static_cast<int32_t>(config_.pad_id());
  const int32_t eos = static_cast<int32_t>(config_.eos_id());
  const int64_t noise = noise_count(N), spans = span_count(noise);
  const int64_t enc_length = input_length(N), dec_length = target_length(N);
  std::vector<int32_t> window(static_cast<size_t>(N));
  std::vector<int64_t> noise_lengths(static_cast<size_t>(spans));
  std::vector<int64_t> kept_lengths(static_cast<size_t>(spans));

  for (int64_t b = 0; b < size; ++b) {
    SampleDraws draws(seed_, static_cast<uint64_t>(index * size + b), stream_);
    if (mock_) {
      for (int32_t& token : window) token = static_cast<int32_t>(draws.below(config_.text_vocab()));
    } else {
      shard_->read(draws.between(0, shard_->size() - N), N, window.data());
    }
    random_segmentation(noise, spans, draws, noise_lengths.data());
    random_segmentation(N - noise, spans, draws, kept_lengths.data());

    // The window is kept 0, span 0, kept 1, span 1, ...: kept tokens go to the input, each
    // span to the target after its sentinel, which stands in for it in the input.
    int32_t* enc = enc_ids.data<int32_t>() + b * S;
    int32_t* target = targets.data<int32_t>() + b * T;
    const int32_t* token = window.data();
    int64_t e = 0, t = 0;
    for (int64_t k = 0; k < spans; ++k) {
      const auto sentinel = static_cast<int32_t>(config_.sentinel_id(k));
      const int64_t kept = kept_lengths[static_cast<size_t>(k)];
      const int64_t span = noise_lengths[static_cast<size_t>(k)];
      std::copy(token, token + kept, enc + e);
      token += kept;
      e += kept;
      enc[e++] = sentinel;
      target[t++] = sentinel;
      std::copy(token, token + span, target + t);
      token += span;
      t += span;
    }
    enc[e++] = eos;
    target[t++] = eos;
    OCTET_CHECK(e == enc_length && t == dec_length, "T5 data: internal error: sample lengths ", e,
                " and ", t, ", expected ", enc_length, " and ", dec_length);
    std::fill(enc + e, enc + S, pad);
    std::fill(target + t, target + T, -100);

    int32_t* dec = dec_ids.data<int32_t>() + b * T;
    dec[0] = pad;  // the decoder's start token
    std::copy(target, target + dec_length - 1, dec + 1);
    std::fill(dec + dec_length, dec + T, pad);
    enc_lengths.data<int32_t>()[b] = static_cast<int32_t>(enc_length);
    dec_lengths.data<int32_t>()[b] = static_cast<int32_t>(dec_length);
  }
  return t5_micro_batch(enc_ids, enc_lengths, dec_ids, dec_lengths, targets);
}

}  // namespace octet::train_detail
