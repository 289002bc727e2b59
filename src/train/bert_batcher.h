// BERT pretraining micro-batches from a token shard (or mock tokens), made as the original
// BERT's create_pretraining_data makes them: two segments A and B, B the text that follows A
// or a random segment (the next-sentence label), and 15% of the text tokens masked 80/10/10.
// Every draw comes from Philox(seed, stream, sample position), so the same batch number
// always gives the same batch and a resumed run sees exactly the data an uninterrupted one
// would.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "octet/bert.h"
#include "octet/data.h"
#include "train/batcher.h"

namespace octet::train_detail {

// Each sample of T = seq_len positions:
//   L = T, or with probability kShortSeqProb L uniform in [kMinLength, T];
//   n = L - 3 text tokens split at len_a uniform in [1, n-1], len_b = n - len_a;
//   A = len_a shard tokens at a random position p; B = the len_b tokens right after A
//   (nsp label 0) or, with probability kRandomNextProb, len_b tokens at an independent random
//   position other than p + len_a (label 1);
//   ids = [CLS] A [SEP] B [SEP] [PAD]..., token types 0 up to the first [SEP], 1 for B and the
//   last [SEP], 0 for padding;
//   masked_count(n) distinct text positions chosen uniformly: the input becomes [MASK] (80%),
//   a uniform text token (10%) or stays (10%); targets hold the original token there and
//   -100 elsewhere.
// Mock data: the text tokens are uniform in [0, text_vocab) instead of shard windows.
class BertBatcher : public DataSource {
 public:
  static constexpr double kMaskFraction = 0.15;
  static constexpr double kShortSeqProb = 0.1;
  static constexpr double kRandomNextProb = 0.5;
  static constexpr int64_t kMinLength = 5;  // [CLS] a [SEP] b [SEP]
  // Of a mask, the chances of [MASK] and of a random token (the rest stay unchanged).
  static constexpr double kMaskTokenProb = 0.8;
  static constexpr double kRandomTokenProb = 0.1;

  // Masked positions among n text tokens: max(1, round(kMaskFraction * n)).
  static int64_t masked_count(int64_t text_tokens);

  // Throws octet::Error for seq_len outside [kMinLength, config.max_seq_len], a shard whose
  // vocabulary exceeds config.text_vocab(), or a shard of fewer than 2 * seq_len tokens.
  BertBatcher(const std::string& path, bool mock, const BertConfig& config, int64_t seq_len,
              uint64_t seed, uint64_t stream);

  // bert_micro_batch: ids, token_types, targets [size, T] I32; lengths, nsp_labels [size] I32.
  pipeline::MicroBatch batch(int64_t index, int64_t size) const override;

 private:
  bool mock_;
  BertConfig config_;
  int64_t seq_len_;
  uint64_t seed_, stream_;
  std::unique_ptr<TokenShard> shard_;
};

}  // namespace octet::train_detail
