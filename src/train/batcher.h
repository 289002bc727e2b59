// Training data for the trainer: deterministic micro-batches of token windows from a shard
// (or mock tokens), and the shard's unigram entropy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "octet/data.h"
#include "octet/tensor.h"

namespace octet::train_detail {

// Batches of [micro_batch, T+1] windows at positions drawn from Philox(seed, stream, index):
// the same (seed, iteration, micro-batch) always gives the same batch, so a resumed run sees
// exactly the data an uninterrupted one would.
class Batcher {
 public:
  Batcher(const std::string& path, bool mock, int64_t vocab, int64_t seq_len, uint64_t seed,
          uint64_t stream);
  // Batch number batch_index: ids and targets [micro_batch, T] I32 (targets = ids shifted by
  // one token).
  void fill(int64_t batch_index, int64_t micro_batch, Tensor& ids, Tensor& targets) const;

 private:
  bool mock_;
  int64_t vocab_, seq_len_;
  uint64_t seed_, stream_;
  std::unique_ptr<TokenShard> shard_;
};

// Entropy (nats) of the token frequencies of a shard: the loss of the best model that ignores
// context. A language model worth training ends well below it.
double unigram_entropy(const std::string& path);

}  // namespace octet::train_detail
