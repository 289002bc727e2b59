// Mixture-of-experts routing, fast path. The router: OpenMP over tokens, each token's routing
// as the reference computes it (router_math.h). The permutation: the row map by one counting
// pass, rows moved by memcpy in parallel; the weighted sums and their gradients per token,
// summed in F32 by loops vectorized for the active instruction set.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "octet/cpu_features.h"
#include "ops/moe/checks.h"
#include "ops/moe/router_math.h"
#include "ops/simd.h"

namespace octet::ops::cpu {

using namespace moe_detail;

RouterLosses router_forward(const Tensor& logits, const RouterOptions& o, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts) {
  const RouterShape s = check_router("router_forward", logits, o);
  check_router_outputs("router_forward", s, scores, probs, experts, counts);
  const int64_t N = s.tokens, E = s.experts, k = s.topk;
  std::vector<double> lse(static_cast<size_t>(N));
#pragma omp parallel
  {
    std::vector<float> keys;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      lse[static_cast<size_t>(n)] =
          route_token(logits.data<float>() + n * E, E, o, scores.data<float>() + n * E,
                      probs.data<float>() + n * k, experts.data<int32_t>() + n * k, keys);
    }
  }
  int32_t* count = counts.data<int32_t>();
  std::memset(count, 0, static_cast<size_t>(E) * sizeof(int32_t));
  const int32_t* chosen = experts.data<int32_t>();
  for (int64_t i = 0; i < N * k; ++i) ++count[chosen[i]];
  return router_losses(lse, scores.data<float>(), count, N, E, o);
}

void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& o,
                     Tensor& dlogits) {
  const RouterShape s =
      check_router_backward("router_backward", dprobs, logits, scores, experts, counts, o, dlogits);
  const int64_t N = s.tokens, E = s.experts, k = s.topk;
#pragma omp parallel
  {
    std::vector<double> ds;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      route_token_backward(dprobs.data<float>() + n * k, logits.data<float>() + n * E,
                           scores.data<float>() + n * E, experts.data<int32_t>() + n * k,
                           counts.data<int32_t>(), N, E, o, dlogits.data<float>() + n * E, ds);
    }
  }
}

namespace {

// One token's rows: out[c] = sum_j w[j] * rows[j][c] (unpermute: w the probabilities; the
// permutation's backward: w all 1), summed in F32.
template <typename T>
OCTET_ALWAYS_INLINE void weighted_sum(const T* base, const int32_t* rows, const float* w, int64_t k,
                                      int64_t C, T* out) {
  constexpr int64_t kBlock = 256;
  float acc[kBlock];
  for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
    const int64_t width = std::min(kBlock, C - c0);
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) acc[c] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const T* in = base + rows[j] * C + c0;
      const float weight = w ? w[j] : 1.0f;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) acc[c] += weight * simd::load(in[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) simd::store(acc[c], &out[c0 + c]);
  }
}

// One token's unpermute backward: dy rows = p[j] * dout, dprobs[j] = <dout, y row>.
template <typename T>
OCTET_ALWAYS_INLINE void unpermute_grad(const T* dout, const T* y, const int32_t* rows,
                                        const float* p, int64_t k, int64_t C, T* dy,
                                        float* dprobs) {
  for (int64_t j = 0; j < k; ++j) {
    const T* in = y + rows[j] * C;
    T* out = dy + rows[j] * C;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) {
      const float g = simd::load(dout[c]);
      dot += g * simd::load(in[c]);
      simd::store(p[j] * g, &out[c]);
    }
    dprobs[j] = dot;
  }
}

template <typename T>
OCTET_TARGET_AVX512 void weighted_sum_avx512(const T* base, const int32_t* rows, const float* w,
                                             int64_t k, int64_t C, T* out) {
  weighted_sum(base, rows, w, k, C, out);
}
template <typename T>
OCTET_TARGET_AVX2 void weighted_sum_avx2(const T* base, const int32_t* rows, const float* w,
                                         int64_t k, int64_t C, T* out) {
  weighted_sum(base, rows, w, k, C, out);
}
template <typename T>
void weighted_sum_scalar(const T* base, const int32_t* rows, const float* w, int64_t k, int64_t C,
                         T* out) {
  weighted_sum(base, rows, w, k, C, out);
}
template <typename T>
OCTET_TARGET_AVX512 void unpermute_grad_avx512(const T* dout, const T* y, const int32_t* rows,
                                               const float* p, int64_t k, int64_t C, T* dy,
                                               float* dprobs) {
  unpermute_grad(dout, y, rows, p, k, C, dy, dprobs);
}
template <typename T>
OCTET_TARGET_AVX2 void unpermute_grad_avx2(const T* dout, const T* y, const int32_t* rows,
                                           const float* p, int64_t k, int64_t C, T* dy,
                                           float* dprobs) {
  unpermute_grad(dout, y, rows, p, k, C, dy, dprobs);
}
template <typename T>
void unpermute_grad_scalar(const T* dout, const T* y, const int32_t* rows, const float* p,
                           int64_t k, int64_t C, T* dy, float* dprobs) {
  unpermute_grad(dout, y, rows, p, k, C, dy, dprobs);
}

// Every token's weighted sum over its k rows of `rows` [N*k, C] (weights null: all 1).
template <typename T>
void weighted_sums(const Tensor& rows, const Tensor& row_map, const float* weights, Tensor& out) {
  auto fn = weighted_sum_scalar<T>;
  if (active_isa() == Isa::Avx512) fn = weighted_sum_avx512<T>;
  if (active_isa() == Isa::Avx2) fn = weighted_sum_avx2<T>;
  const int64_t N = row_map.dim(0), k = row_map.dim(1), C = out.dim(1);
  const T* base = rows.data<T>();
  const int32_t* map = row_map.data<int32_t>();
  T* dst = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    fn(base, map + n * k, weights ? weights + n * k : nullptr, k, C, dst + n * C);
  }
}

void weighted_sums(const Tensor& rows, const Tensor& row_map, const float* weights, Tensor& out) {
  if (out.dtype() == DType::F32) return weighted_sums<float>(rows, row_map, weights, out);
  weighted_sums<bfloat16>(rows, row_map, weights, out);
}

template <typename T>
void unpermute_grads(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                     const Tensor& probs, Tensor& dy, Tensor& dprobs) {
  auto fn = unpermute_grad_scalar<T>;
  if (active_isa() == Isa::Avx512) fn = unpermute_grad_avx512<T>;
  if (active_isa() == Isa::Avx2) fn = unpermute_grad_avx2<T>;
  const int64_t N = row_map.dim(0), k = row_map.dim(1), C = dout.dim(1);
  const int32_t* map = row_map.data<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    fn(dout.data<T>() + n * C, y.data<T>(), map + n * k, probs.data<float>() + n * k, k, C,
       dy.data<T>(), dprobs.data<float>() + n * k);
  }
}

}  // namespace

void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map) {
  const PermuteShape s = check_permute(tokens, experts, num_experts, permuted, row_map);
  const int64_t N = s.tokens, k = s.topk, C = s.hidden;
  // A counting sort: each expert's first row, then the entries in order.
  const int32_t* e = experts.data<int32_t>();
  int32_t* map = row_map.data<int32_t>();
  std::vector<int32_t> next(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t i = 0; i < N * k; ++i) ++next[static_cast<size_t>(e[i]) + 1];
  for (size_t x = 1; x < next.size(); ++x) next[x] += next[x - 1];
  for (int64_t i = 0; i < N * k; ++i) map[i] = next[static_cast<size_t>(e[i])]++;
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(tokens.dtype());
  const auto* in = static_cast<const char*>(tokens.raw());
  auto* out = static_cast<char*>(permuted.raw());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N * k; ++i) {
    std::memcpy(out + static_cast<size_t>(map[i]) * row_bytes,
                in + static_cast<size_t>(i / k) * row_bytes, row_bytes);
  }
}

void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens) {
  check_permute_backward(dpermuted, row_map, dtokens);
  weighted_sums(dpermuted, row_map, nullptr, dtokens);
}

void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out) {
  check_unpermute(y, row_map, probs, out);
  weighted_sums(y, row_map, probs.data<float>(), out);
}

void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs) {
  check_unpermute_backward(dout, y, row_map, probs, dy, dprobs);
  if (y.dtype() == DType::F32) return unpermute_grads<float>(dout, y, row_map, probs, dy, dprobs);
  unpermute_grads<bfloat16>(dout, y, row_map, probs, dy, dprobs);
}

void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept) {
  const PermuteShape s = check_capacity_drop(experts, probs, num_experts, capacity, dispatch, kept);
  const int64_t pairs = s.tokens * s.topk;
  const int32_t* e = experts.data<int32_t>();
  const float* p = probs.data<float>();
  int32_t* d = dispatch.data<int32_t>();
  // Each expert's pairs in order (a counting sort), then the first `capacity` of them by the
  // policy's order: a stable partial sort by probability, or as they are.
  std::vector<int64_t> first(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++first[static_cast<size_t>(e[i]) + 1];
  for (size_t x = 1; x < first.size(); ++x) first[x] += first[x - 1];
  std::vector<int64_t> order(static_cast<size_t>(pairs));
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    order[static_cast<size_t>(next[static_cast<size_t>(e[i])]++)] = i;
  for (int64_t i = 0; i < pairs; ++i) d[i] = static_cast<int32_t>(num_experts);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t expert = 0; expert < num_experts; ++expert) {
    auto begin = order.begin() + first[static_cast<size_t>(expert)];
    auto end = order.begin() + first[static_cast<size_t>(expert) + 1];
    const int64_t keep = std::min<int64_t>(capacity, end - begin);
    if (policy == DropPolicy::Probs && keep < end - begin) {
      // Higher probability first; among equals the earlier pair (the order is by pair index).
      std::stable_sort(begin, end, [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    }
    for (auto it = begin; it != begin + keep; ++it) d[*it] = static_cast<int32_t>(expert);
    kept.data<int32_t>()[expert] = static_cast<int32_t>(keep);
  }
}

}  // namespace octet::ops::cpu
