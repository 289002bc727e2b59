// Sampling: temperature, top-k, top-p over softmax probabilities; greedy at temperature 0.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "octet/infer.h"
#include "octet/rng.h"

namespace octet {

int32_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& o, uint64_t step) {
  OCTET_CHECK(vocab > 0, "sample_token: empty vocabulary");
  OCTET_CHECK(o.temperature >= 0, "sampling: temperature must be >= 0, got ", o.temperature);
  OCTET_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p expected in (0, 1], got ", o.top_p);
  OCTET_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0, got ", o.top_k);
  for (int64_t i = 0; i < vocab; ++i) {
    OCTET_CHECK(!std::isnan(logits[i]), "sampling: logit ", i, " is NaN (the model diverged?)");
  }
  if (o.temperature == 0.0f || o.top_k == 1) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = o.top_k > 0 ? std::min(o.top_k, vocab) : vocab;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  order.resize(static_cast<size_t>(keep));
  std::vector<double> probability(order.size());
  const double top = logits[order[0]];
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    probability[i] = std::exp((logits[order[i]] - top) / o.temperature);
    total += probability[i];
  }
  // Nucleus: keep the most likely tokens until their mass reaches top_p.
  double mass = 0;
  size_t cut = order.size();
  for (size_t i = 0; i < order.size(); ++i) {
    mass += probability[i] / total;
    if (mass >= o.top_p) {
      cut = i + 1;
      break;
    }
  }
  double kept = std::accumulate(probability.begin(), probability.begin() + cut, 0.0);
  auto words = philox4x32(o.seed, step, 0x73616d706c65ull);  // "sample"
  double u = ((uint64_t{words[0]} << 21) ^ words[1]) * 0x1p-53 * kept;
  for (size_t i = 0; i < cut; ++i) {
    u -= probability[i];
    if (u < 0) return order[i];
  }
  return order[cut - 1];
}

}  // namespace octet
