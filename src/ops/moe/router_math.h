// One token's routing, forward and backward, in FP64: the reference runs it token after token,
// the CPU path over tokens in parallel. The router is N x E work beside the experts' GEMMs, so
// both compute it alike and choose the same experts bit for bit (a score rounded differently
// could swap two experts of nearly equal score).
#pragma once

#include <cmath>
#include <vector>

#include "ops/moe/checks.h"

namespace octet::ops::moe_detail {

// Megatron-Core's guard against a zero sum.
constexpr double kSumGuard = 1e-20;

// logits[0, E) -> scores[0, E) (the score function's), probs[0, k) and experts[0, k); returns
// logsumexp(logits) (the z-loss's term).
inline double route_token(const float* logits, int64_t E, const RouterOptions& o, float* scores,
                          float* probs, int32_t* experts, std::vector<float>& keys) {
  double max = logits[0];
  for (int64_t e = 1; e < E; ++e) max = std::max(max, double{logits[e]});
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(double{logits[e]} - max);
  const double lse = max + std::log(sum);
  for (int64_t e = 0; e < E; ++e) {
    const double x = logits[e];
    scores[e] = static_cast<float>(o.score == RouterScore::Softmax ? std::exp(x - lse)
                                                                   : 1.0 / (1.0 + std::exp(-x)));
  }
  const float* bias = o.expert_bias ? o.expert_bias->data<float>() : nullptr;
  keys.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) keys[static_cast<size_t>(e)] = scores[e] + (bias ? bias[e] : 0);
  choose_topk(keys.data(), E, o.topk, experts);
  double chosen = 0;
  for (int64_t j = 0; j < o.topk; ++j) chosen += scores[experts[j]];
  const double divisor = o.normalize ? chosen + kSumGuard : 1.0;
  for (int64_t j = 0; j < o.topk; ++j) {
    probs[j] = static_cast<float>(double{scores[experts[j]]} / divisor * o.scaling);
  }
  return lse;
}

// The aux loss's constant: coeff * E / (k * N^2).
inline double aux_scale(const RouterOptions& o, int64_t N, int64_t E) {
  return double{o.aux_loss_coeff} * static_cast<double>(E) /
         (static_cast<double>(o.topk) * static_cast<double>(N) * static_cast<double>(N));
}

// One token's dlogits[0, E) from dprobs[0, k), the forward's logits, scores, experts and the
// counts; N is the number of tokens (the losses' means).
inline void route_token_backward(const float* dprobs, const float* logits, const float* scores,
                                 const int32_t* experts, const int32_t* counts, int64_t N,
                                 int64_t E, const RouterOptions& o, float* dlogits,
                                 std::vector<double>& ds) {
  const int64_t k = o.topk;
  ds.assign(static_cast<size_t>(E), 0.0);
  double chosen = 0, dot = 0;
  for (int64_t j = 0; j < k; ++j) chosen += scores[experts[j]];
  const double divisor = o.normalize ? chosen + kSumGuard : 1.0;
  for (int64_t j = 0; j < k; ++j) dot += double{dprobs[j]} * o.scaling * scores[experts[j]];
  for (int64_t j = 0; j < k; ++j) {
    const double g = double{dprobs[j]} * o.scaling;
    ds[static_cast<size_t>(experts[j])] += o.normalize ? (g - dot / divisor) / divisor : g;
  }
  if (o.aux_loss_coeff > 0.0f) {
    const double c = aux_scale(o, N, E);
    if (o.score == RouterScore::Softmax) {
      for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += c * counts[e];
    } else {
      double total = 0, weighted = 0;
      for (int64_t e = 0; e < E; ++e) total += scores[e];
      total += kSumGuard;
      for (int64_t e = 0; e < E; ++e) weighted += c * counts[e] * scores[e] / total;
      for (int64_t e = 0; e < E; ++e) {
        ds[static_cast<size_t>(e)] += (c * counts[e] - weighted) / total;
      }
    }
  }
  if (o.score == RouterScore::Softmax) {
    double inner = 0;
    for (int64_t e = 0; e < E; ++e) inner += ds[static_cast<size_t>(e)] * scores[e];
    for (int64_t e = 0; e < E; ++e) {
      dlogits[e] = static_cast<float>(scores[e] * (ds[static_cast<size_t>(e)] - inner));
    }
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const double s = scores[e];
      dlogits[e] = static_cast<float>(ds[static_cast<size_t>(e)] * s * (1.0 - s));
    }
  }
  if (o.z_loss_coeff > 0.0f) {
    double max = logits[0];
    for (int64_t e = 1; e < E; ++e) max = std::max(max, double{logits[e]});
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double{logits[e]} - max);
    const double lse = max + std::log(sum);
    const double c = 2.0 * o.z_loss_coeff * lse / static_cast<double>(N);
    for (int64_t e = 0; e < E; ++e) {
      dlogits[e] = static_cast<float>(dlogits[e] + c * std::exp(double{logits[e]} - lse));
    }
  }
}

// The losses from each token's logsumexp and the forward's scores and counts.
inline RouterLosses router_losses(const std::vector<double>& lse, const float* scores,
                                  const int32_t* counts, int64_t N, int64_t E,
                                  const RouterOptions& o) {
  RouterLosses losses;
  if (o.aux_loss_coeff > 0.0f) {
    // sum_e P_e f_e, P_e summing each token's scores (sigmoid scores normalized per token).
    double total = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float* s = scores + n * E;
      double norm = 1.0, weighted = 0;
      if (o.score == RouterScore::Sigmoid) {
        norm = kSumGuard;
        for (int64_t e = 0; e < E; ++e) norm += s[e];
      }
      for (int64_t e = 0; e < E; ++e) weighted += double{s[e]} * counts[e];
      total += weighted / norm;
    }
    losses.aux = aux_scale(o, N, E) * total;
  }
  if (o.z_loss_coeff > 0.0f) {
    double total = 0;
    for (double l : lse) total += l * l;
    losses.z = o.z_loss_coeff * total / static_cast<double>(N);
  }
  return losses;
}

}  // namespace octet::ops::moe_detail
