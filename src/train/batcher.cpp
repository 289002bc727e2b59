// Deterministic token windows for training and validation (see batcher.h).
#include "train/batcher.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/error.h"
#include "octet/model.h"
#include "octet/rng.h"
#include "octet/vit.h"

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

pipeline::MicroBatch Batcher::batch(int64_t index, int64_t size) const {
  Tensor ids, targets;
  fill(index, size, ids, targets);
  return gpt_micro_batch(ids, targets);
}

ImageBatcher::PixelStats ImageBatcher::pixel_stats(const ImageDataset& data) {
  OCTET_CHECK(data.count > 0 && !data.pixels.empty(), "image data: no images");
  double sum = 0, squares = 0;
  for (uint8_t p : data.pixels) {
    sum += p;
    squares += double(p) * p;
  }
  const double n = static_cast<double>(data.pixels.size());
  const double mean = sum / n / 255.0, variance = squares / n / (255.0 * 255.0) - mean * mean;
  return {mean, std::sqrt(std::max(variance, 0.0))};
}

ImageBatcher::ImageBatcher(ImageDataset data, bool shuffle, uint64_t seed, uint64_t stream,
                           bool augment, std::optional<PixelStats> stats)
    : data_(std::move(data)), shuffle_(shuffle), augment_(augment), seed_(seed), stream_(stream) {
  OCTET_CHECK(data_.count > 0, "image data: no images");
  // Fashion-MNIST's training set: mean 0.286, std 0.353.
  const PixelStats s = stats ? *stats : pixel_stats(data_);
  OCTET_CHECK(std::isfinite(s.mean) && std::isfinite(s.std) && s.std >= 0,
              "image data: pixel "
              "statistics expected finite with std >= 0, got mean ",
              s.mean, " std ", s.std);
  mean_ = static_cast<float>(s.mean);
  inv_std_ = static_cast<float>(1.0 / std::max(s.std, 1e-6));
}

ImageBatcher::ImageBatcher(int64_t pixels, int64_t num_classes, uint64_t seed, uint64_t stream)
    : mock_(true), mock_pixels_(pixels), mock_classes_(num_classes), seed_(seed), stream_(stream) {}

int64_t ImageBatcher::sample(int64_t position) const {
  const int64_t count = data_.count;
  if (!shuffle_) return position % count;
  const int64_t epoch = position / count;
  std::lock_guard<std::mutex> lock(mutex_);
  if (epoch != epoch_) {
    order_.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) order_[static_cast<size_t>(i)] = i;
    // Fisher-Yates with Philox(seed, epoch, stream): the same order on every rank and resume.
    for (int64_t i = count - 1; i > 0; --i) {
      const auto w = philox4x32(
          seed_, static_cast<uint64_t>(epoch) * (uint64_t{1} << 32) + static_cast<uint64_t>(i),
          stream_);
      const uint64_t r = (uint64_t{w[0]} << 32) | w[1];
      std::swap(order_[static_cast<size_t>(i)], order_[r % static_cast<uint64_t>(i + 1)]);
    }
    epoch_ = epoch;
  }
  return order_[static_cast<size_t>(position % count)];
}

pipeline::MicroBatch ImageBatcher::batch(int64_t index, int64_t size) const {
  const int64_t pixels = mock_ ? mock_pixels_ : data_.rows * data_.cols;
  Tensor x = Tensor::empty({size, pixels}, DType::F32);
  Tensor labels = Tensor::empty({size}, DType::I32);
  float* out = x.data<float>();
  int32_t* y = labels.data<int32_t>();
  for (int64_t b = 0; b < size; ++b) {
    const uint64_t position = static_cast<uint64_t>(index * size + b);
    if (mock_) {
      for (int64_t p = 0; p < pixels; p += 2) {
        // Box-Muller on two Philox words: two Gaussian pixels.
        const auto w =
            philox4x32(seed_ ^ 0x5bd1e995u, position * 65536 + static_cast<uint64_t>(p), stream_);
        const double u1 = (w[0] + 1.0) / 4294967297.0, u2 = w[1] / 4294967296.0;
        const double r = std::sqrt(-2.0 * std::log(u1)), angle = 6.283185307179586 * u2;
        out[b * pixels + p] = static_cast<float>(r * std::cos(angle));
        if (p + 1 < pixels) out[b * pixels + p + 1] = static_cast<float>(r * std::sin(angle));
      }
      y[b] = static_cast<int32_t>(philox4x32(seed_, position, stream_)[2] %
                                  static_cast<uint64_t>(mock_classes_));
      continue;
    }
    const int64_t i = sample(static_cast<int64_t>(position));
    const uint8_t* image = data_.image(i);
    y[b] = data_.labels[static_cast<size_t>(i)];
    float* row = out + b * pixels;
    if (!augment_) {
      for (int64_t p = 0; p < pixels; ++p) {
        row[p] = (static_cast<float>(image[p]) * (1.0f / 255.0f) - mean_) * inv_std_;
      }
      continue;
    }
    const auto w = philox4x32(seed_ ^ 0xa5a5a5a5u, position, stream_);
    const bool flip = w[0] & 1;
    const int64_t span = 2 * kMaxShift + 1;
    const int64_t dy = static_cast<int64_t>(w[1] % span) - kMaxShift;
    const int64_t dx = static_cast<int64_t>(w[2] % span) - kMaxShift;
    const int64_t H = data_.rows, W = data_.cols;
    for (int64_t r = 0; r < H; ++r) {
      for (int64_t c = 0; c < W; ++c) {
        const int64_t sr = r + dy, sc0 = c + dx, sc = flip ? W - 1 - sc0 : sc0;
        const bool inside = sr >= 0 && sr < H && sc0 >= 0 && sc0 < W;
        const float value =
            inside ? static_cast<float>(image[sr * W + sc]) * (1.0f / 255.0f) : 0.0f;
        row[r * W + c] = (value - mean_) * inv_std_;
      }
    }
  }
  return vit_micro_batch(x, labels);
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
