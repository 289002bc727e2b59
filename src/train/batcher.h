// Training data for the trainer: deterministic micro-batches, of token windows from a shard
// (or mock tokens) for language models and of labelled images (or mock images) for
// classifiers; and a token shard's unigram entropy.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "octet/data.h"
#include "octet/pipeline_stage.h"
#include "octet/tensor.h"

namespace octet::train_detail {

// Micro-batches by number: the same (seed, index) always gives the same batch, so a resumed
// run sees exactly the data an uninterrupted one would.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // Micro-batch number `index` of `size` samples, in the model's micro-batch form.
  virtual pipeline::MicroBatch batch(int64_t index, int64_t size) const = 0;
};

// Batches of [micro_batch, T+1] windows at positions drawn from Philox(seed, stream, index).
class Batcher : public DataSource {
 public:
  Batcher(const std::string& path, bool mock, int64_t vocab, int64_t seq_len, uint64_t seed,
          uint64_t stream);
  // Batch number batch_index: ids and targets [micro_batch, T] I32 (targets = ids shifted by
  // one token).
  void fill(int64_t batch_index, int64_t micro_batch, Tensor& ids, Tensor& targets) const;
  pipeline::MicroBatch batch(int64_t index, int64_t size) const override;  // gpt_micro_batch

 private:
  bool mock_;
  int64_t vocab_, seq_len_;
  uint64_t seed_, stream_;
  std::unique_ptr<TokenShard> shard_;
};

// Images with their labels as vit_micro_batch()es: pixels [B, C*H*W] F32 normalized by a
// mean and standard deviation (the training split's: validation images are normalized as the
// training images were), labels [B] I32. Training (shuffle) visits every
// image once per epoch in an order drawn from (seed, epoch); evaluation walks the images in
// order. Mock data: Gaussian pixels and uniform labels from Philox.
class ImageBatcher : public DataSource {
 public:
  struct PixelStats {
    double mean = 0, std = 1;  // of pixel / 255 over every pixel of every image
  };
  static PixelStats pixel_stats(const ImageDataset& data);

  // augment: each image flipped left-right with probability 1/2 and shifted by up to
  // kMaxShift pixels each way (the gap filled with zero pixels), drawn from (seed, position).
  // stats: the (mean, std) of pixels / 255 to normalize with; the data's own when absent.
  ImageBatcher(ImageDataset data, bool shuffle, uint64_t seed, uint64_t stream,
               bool augment = false, std::optional<PixelStats> stats = std::nullopt);
  static constexpr int64_t kMaxShift = 2;
  ImageBatcher(int64_t pixels, int64_t num_classes, uint64_t seed, uint64_t stream);  // mock
  pipeline::MicroBatch batch(int64_t index, int64_t size) const override;
  int64_t size() const { return data_.count; }

 private:
  int64_t sample(int64_t position) const;  // the image at a position of the whole stream

  ImageDataset data_;
  bool mock_ = false, shuffle_ = false, augment_ = false;
  int64_t mock_pixels_ = 0, mock_classes_ = 0;
  uint64_t seed_, stream_;
  float mean_ = 0, inv_std_ = 1;
  mutable std::mutex mutex_;
  mutable int64_t epoch_ = -1;
  mutable std::vector<int64_t> order_;  // epoch_'s permutation
};

// Entropy (nats) of the token frequencies of a shard: the loss of the best model that ignores
// context. A language model worth training ends well below it.
double unigram_entropy(const std::string& path);

}  // namespace octet::train_detail
