// BERT pretraining micro-batches: segment pairs with next-sentence labels and 80/10/10 masking
// (see bert_batcher.h).
#include "train/bert_batcher.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "octet/error.h"
#include "octet/rng.h"
#include "train/sample_draws.h"

namespace octet::train_detail {

int64_t BertBatcher::masked_count(int64_t text_tokens) {
  return std::max<int64_t>(1, std::llround(kMaskFraction * static_cast<double>(text_tokens)));
}

BertBatcher::BertBatcher(const std::string& path, bool mock, const BertConfig& config,
                         int64_t seq_len, uint64_t seed, uint64_t stream)
    : mock_(mock), config_(config), seq_len_(seq_len), seed_(seed), stream_(stream) {
  OCTET_CHECK(config_.text_vocab() >= 1, "BERT data: the config's vocab_size expected at least 5 ",
              "(text ids, then [PAD] [CLS] [SEP] [MASK]), got ", config_.vocab_size);
  OCTET_CHECK(seq_len_ >= kMinLength && seq_len_ <= config_.max_seq_len,
              "BERT data: seq_len expected in [", kMinLength,
              ", max_seq_len = ", config_.max_seq_len, "] ([CLS] A [SEP] B [SEP] takes at least ",
              kMinLength, " positions), got ", seq_len_);
  if (mock_) return;
  shard_ = std::make_unique<TokenShard>(TokenShard::open(path, /*check_ids=*/false));
  OCTET_CHECK(shard_->vocab_size() <= config_.text_vocab(), "BERT data '", path,
              "' has vocabulary ", shard_->vocab_size(), ", larger than the config's text ",
              "vocabulary ", config_.text_vocab(), " (vocab_size ", config_.vocab_size,
              " - 4): set the config's vocab_size to at least ", shard_->vocab_size() + 4,
              " (the last four ids are [PAD] [CLS] [SEP] [MASK])");
  OCTET_CHECK(shard_->size() >= 2 * seq_len_, "BERT data '", path, "' holds ", shard_->size(),
              " tokens: expected at least 2 x seq_len = ", 2 * seq_len_);
}

pipeline::MicroBatch BertBatcher::batch(int64_t index, int64_t size) const {
  OCTET_CHECK(index >= 0 && size > 0, "BERT data: batch expected index >= 0 and size > 0, got ",
              "index ", index, ", size ", size);
  const int64_t T = seq_len_;
  Tensor ids = Tensor::empty({size, T}, DType::I32);
  Tensor token_types = Tensor::empty({size, T}, DType::I32);
  Tensor targets = Tensor::empty({size, T}, DType::I32);
  Tensor lengths = Tensor::empty({size}, DType::I32);
  Tensor nsp_labels = Tensor::empty({size}, DType::I32);
  const int32_t pad = static_cast<int32_t>(config_.pad_id());
  const int32_t cls = static_cast<int32_t>(config_.cls_id());
  const int32_t sep = static_cast<int32_t>(config_.sep_id());
  const int32_t mask = static_cast<int32_t>(config_.mask_id());
  const int64_t text_vocab = config_.text_vocab();
  std::vector<int64_t> order(static_cast<size_t>(T));  // partial Fisher-Yates over text tokens

  for (int64_t b = 0; b < size; ++b) {
    SampleDraws draws(seed_, static_cast<uint64_t>(index * size + b), stream_);
    int32_t* row = ids.data<int32_t>() + b * T;
    int32_t* types = token_types.data<int32_t>() + b * T;
    int32_t* target = targets.data<int32_t>() + b * T;

    const int64_t length = draws.uniform() < kShortSeqProb ? draws.between(kMinLength, T) : T;
    const int64_t text = length - 3;
    const int64_t len_a = draws.between(1, text - 1), len_b = text - len_a;
    const bool random_next = draws.uniform() < kRandomNextProb;
    int32_t* a = row + 1;
    int32_t* next = row + 2 + len_a;
    if (mock_) {
      for (int64_t i = 0; i < len_a; ++i) a[i] = static_cast<int32_t>(draws.below(text_vocab));
      for (int64_t i = 0; i < len_b; ++i) next[i] = static_cast<int32_t>(draws.below(text_vocab));
    } else {
      // A starts where A and its continuation both fit, whichever B is taken.
      const int64_t a_begin = draws.between(0, shard_->size() - text);
      int64_t b_begin = a_begin + len_a;
      if (random_next) {  // any window but the continuation itself
        b_begin = draws.between(0, shard_->size() - len_b - 1);
        if (b_begin >= a_begin + len_a) ++b_begin;
      }
      shard_->read(a_begin, len_a, a);
      shard_->read(b_begin, len_b, next);
    }
    row[0] = cls;
    row[1 + len_a] = sep;
    row[length - 1] = sep;
    std::fill(row + length, row + T, pad);
    std::fill(types, types + 2 + len_a, 0);
    std::fill(types + 2 + len_a, types + length, 1);
    std::fill(types + length, types + T, 0);
    std::fill(target, target + T, -100);
    lengths.data<int32_t>()[b] = static_cast<int32_t>(length);
    nsp_labels.data<int32_t>()[b] = random_next ? 1 : 0;

    // Text token i sits at position 1 + i in A and 2 + i in B (after A's [SEP]).
    const int64_t masked = masked_count(text);
    for (int64_t i = 0; i < text; ++i) order[static_cast<size_t>(i)] = i;
    for (int64_t j = 0; j < masked; ++j) {
      std::swap(order[static_cast<size_t>(j)],
                order[static_cast<size_t>(j + draws.below(text - j))]);
      const int64_t i = order[static_cast<size_t>(j)];
      const int64_t position = i < len_a ? 1 + i : 2 + i;
      target[position] = row[position];
      const double choice = draws.uniform();
      if (choice < kMaskTokenProb) {
        row[position] = mask;
      } else if (choice < kMaskTokenProb + kRandomTokenProb) {
        row[position] = static_cast<int32_t>(draws.below(text_vocab));
      }
    }
  }
  return bert_micro_batch(ids, token_types, lengths, targets, nsp_labels);
}

}  // namespace octet::train_detail
