// T5 span-corruption micro-batches from a token shard (or mock tokens), made as T5's
// span_corruption task makes them: a window of raw text, 15% of it in noise spans of mean
// length 3, each span replaced by a sentinel in the encoder's input and spelled out after its
// sentinel in the decoder's target. Every draw comes from Philox(seed, stream, sample
// position), so the same batch number always gives the same batch and a resumed run sees
// exactly the data an uninterrupted one would.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "octet/data.h"
#include "octet/t5.h"
#include "train/batcher.h"

namespace octet::train_detail {

// Each sample, for a raw window of N text tokens (window_length: the same N for every sample):
//   num_noise = noise_count(N), num_spans = span_count(num_noise);
//   the window: N shard tokens at a uniform random position;
//   the noise mask as T5's random_spans_noise_mask: num_noise split into num_spans positive
//   span lengths and the N - num_noise others into num_spans positive gaps, each split uniform
//   over all such splits, laid out gap 0, span 0, gap 1, span 1, ... (a span ends the window);
//   enc_ids = the gaps' tokens with span k replaced by sentinel_id(k), then [EOS], then [PAD];
//   targets = sentinel_id(k) and span k's tokens for each k, then [EOS], then -100;
//   dec_ids = [PAD] (the start token), then targets shifted right by one, then [PAD].
// Mock data: the window's tokens are uniform in [0, text_vocab) instead of shard tokens.
class T5Batcher : public DataSource {
 public:
  static constexpr double kNoiseDensity = 0.15;
  static constexpr int64_t kMeanNoiseSpanLength = 3;
  static constexpr int64_t kMinWindow = 2;  // one kept token and one noise token

  // Noise tokens in a window of N: round(0.15 N) clamped to [1, N - 1], rounded as T5's
  // random_spans_helper and Hugging Face's run_t5_mlm_flax round it (float64, a half to even:
  // 4 of 30, 10 of 70).
  static int64_t noise_count(int64_t window);
  // Noise spans for num_noise tokens: max(1, round(num_noise / 3)).
  static int64_t span_count(int64_t noise);
  // The encoder positions and target positions a window of N fills:
  // N - num_noise + num_spans + 1 and num_noise + num_spans + 1 ([EOS] ends both).
  static int64_t input_length(int64_t window);
  static int64_t target_length(int64_t window);
  // The largest N whose input_length fits enc_len and target_length fits dec_len (both grow
  // with N), as T5's random_spans_helper: 568 for (512, 114). Throws octet::Error when
  // enc_len or dec_len is below 3 (the lengths of N = 2).
  static int64_t window_length(int64_t enc_len, int64_t dec_len);

  // Throws octet::Error for enc_len or dec_len too small for a window of 2 or above
  // config.max_seq_len / config.max_target_len, more spans than config.num_sentinels, a
  // shard whose vocabulary exceeds config.text_vocab() or one of at most N tokens.
  T5Batcher(const std::string& path, bool mock, const T5Config& config, int64_t enc_len,
            int64_t dec_len, uint64_t seed, uint64_t stream);

  // t5_micro_batch: enc_ids [size, enc_len], dec_ids and targets [size, dec_len], enc_lengths
  // and dec_lengths [size], all I32.
  pipeline::MicroBatch batch(int64_t index, int64_t size) const override;

  int64_t window() const { return window_; }  // N

 private:
  bool mock_;
  T5Config config_;
  int64_t enc_len_, dec_len_, window_;
  uint64_t seed_, stream_;
  std::unique_ptr<TokenShard> shard_;
};

}  // namespace octet::train_detail
