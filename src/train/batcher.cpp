// Deterministic token windows for training and validation (see batcher.h).
#include "train/batcher.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/error.h"
#include "octet/rng.h"

namespace octet::train_detail {

Batcher::Batcher(const std::string& path, bool mock, int64_t vocab, int64_t seq_len, uint64_t seed,
                 uint64_t stream)
    : mock_(mock), vocab_(vocab), seq_len_(seq_len), seed_(seed), stream_(stream) {
  if (mock_) return;
  shard_ = std::make_unique<TokenShard>(TokenShard::open(path, /*check_ids=*/false));
  OCTET_CHECK(shard_->vocab_size() <= vocab, "data '", path, "' has vocabulary ",
              shard_->vocab_size(), ", larger than the model's ", vocab);
  OCTET_CHECK(shard_->size() > seq_len + 1, "data '", path, "' holds ", shard_->size(),
              " tokens: expected more than seq_length + 1 = ", seq_len + 1);
}

void Batcher::fill(int64_t batch_index, int64_t micro_batch, Tensor& ids, Tensor& targets) const {
  ids = Tensor::empty({micro_batch, seq_len_}, DType::I32);
  targets = Tensor::empty({micro_batch, seq_len_}, DType::I32);
  std::vector<int32_t> window(static_cast<size_t>(seq_len_ + 1));
  for (int64_t b = 0; b < micro_batch; ++b) {
    uint64_t index = static_cast<uint64_t>(batch_index * micro_batch + b);
    auto words = philox4x32(seed_, index, stream_);
    uint64_t random = (uint64_t{words[0]} << 32) | words[1];
    if (mock_) {
      for (int64_t t = 0; t <= seq_len_; ++t) {
        auto w = philox4x32(seed_ ^ 0x5bd1e995u, index * 65536 + static_cast<uint64_t>(t), stream_);
        window[t] = static_cast<int32_t>(w[0] % static_cast<uint64_t>(vocab_));
      }
    } else {
      uint64_t span = static_cast<uint64_t>(shard_->size() - seq_len_ - 1);
      shard_->read(static_cast<int64_t>(random % span), seq_len_ + 1, window.data());
    }
    std::copy(window.begin(), window.end() - 1, ids.data<int32_t>() + b * seq_len_);
    std::copy(window.begin() + 1, window.end(), targets.data<int32_t>() + b * seq_len_);
  }
}

double unigram_entropy(const std::string& path) {
  TokenShard shard = TokenShard::open(path, /*check_ids=*/false);
  std::vector<int64_t> counts(static_cast<size_t>(shard.vocab_size()), 0);
  std::vector<int32_t> ids(1 << 16);
  for (int64_t begin = 0; begin < shard.size(); begin += static_cast<int64_t>(ids.size())) {
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(ids.size()), shard.size() - begin);
    shard.read(begin, count, ids.data());
    for (int64_t i = 0; i < count; ++i) ++counts[static_cast<size_t>(ids[i])];
  }
  double entropy = 0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(shard.size());
    entropy -= p * std::log(p);
  }
  return entropy;
}

}  // namespace octet::train_detail
