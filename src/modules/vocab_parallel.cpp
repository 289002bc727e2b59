// Vocabulary parallelism (Megatron's vocab_parallel_cross_entropy): the tied output layer's
// logits split by vocabulary rows, and the vocabulary ranges (the embedding's lookup of a
// vocabulary part is ops::embedding_part_forward / backward).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "octet/tensor_parallel.h"

namespace octet {

VocabRange vocab_range(int64_t vocab, int rank, int size) {
  OCTET_CHECK(size > 0 && rank >= 0 && rank < size && vocab > 0, "vocab_range: rank ", rank, " of ",
              size, " over a vocabulary of ", vocab);
  const int64_t part = (vocab + size - 1) / size;
  return {std::min(vocab, rank * part), std::min(vocab, (rank + 1) * part)};
}

void vocab_parallel_cross_entropy(Tensor& logits, const Tensor& targets, VocabRange range,
                                  Tensor& losses, bool backward, float grad_scale,
                                  Communicator& tp) {
  constexpr int32_t kIgnore = -100;
  check_dtype(logits, DType::F32, "vocab-parallel cross-entropy: logits");
  check_dtype(targets, DType::I32, "vocab-parallel cross-entropy: targets");
  const int64_t rows = logits.dim(0), V = logits.dim(1);
  OCTET_CHECK(V == range.size(), "vocab-parallel cross-entropy: logits expected [", rows, ", ",
              range.size(), "], got ", shape_str(logits.shape()));
  check_shape(targets, {rows}, "vocab-parallel cross-entropy: targets", "N");
  float* x = logits.data<float>();
  const int32_t* target = targets.data<int32_t>();
  // 1. The row maxima over the whole vocabulary.
  Tensor max = Tensor::empty({rows}, DType::F32);
  float* m = max.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < V; ++j) best = std::max(best, x[r * V + j]);
    m[r] = best;
  }
  tp.all_reduce(max, ReduceOp::Max);
  // 2. Sum of exp(x - max) and the target's logit (from the rank that owns it), summed.
  Tensor sums = Tensor::empty({rows, 2}, DType::F32);
  float* s = sums.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(double{x[r * V + j]} - m[r]);
    s[2 * r] = static_cast<float>(sum);
    const bool owned = target[r] >= range.begin && target[r] < range.end;
    s[2 * r + 1] = owned ? x[r * V + (target[r] - range.begin)] : 0.0f;
  }
  tp.all_reduce(sums, ReduceOp::Sum);
  // 3. loss = log-sum-exp - target logit; gradient softmax - onehot, locally.
  float* loss = losses.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (target[r] == kIgnore) {
      loss[r] = 0.0f;
      if (backward) std::fill(x + r * V, x + (r + 1) * V, 0.0f);
      continue;
    }
    const double lse = double{m[r]} + std::log(double{s[2 * r]});
    loss[r] = static_cast<float>(lse - s[2 * r + 1]);
    if (!backward) continue;
    for (int64_t j = 0; j < V; ++j) {
      const double onehot = range.begin + j == target[r] ? 1.0 : 0.0;
      x[r * V + j] =
          static_cast<float>(grad_scale * (std::exp(double{x[r * V + j]} - lse) - onehot));
    }
  }
}

}  // namespace octet
