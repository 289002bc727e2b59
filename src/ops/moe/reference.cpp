// Mixture-of-experts routing, the oracle: token after token, FP64 sums, one thread.
#include <vector>

#include "ops/moe/checks.h"
#include "ops/moe/router_math.h"
#include "ops/simd.h"

namespace octet::ops::reference {

using namespace moe_detail;

RouterLosses router_forward(const Tensor& logits, const RouterOptions& o, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts) {
  const RouterShape s = check_router("router_forward", logits, o);
  check_router_outputs("router_forward", s, scores, probs, experts, counts);
  const int64_t N = s.tokens, E = s.experts, k = s.topk;
  std::vector<double> lse(static_cast<size_t>(N));
  std::vector<float> keys;
  int32_t* count = counts.data<int32_t>();
  for (int64_t e = 0; e < E; ++e) count[e] = 0;
  for (int64_t n = 0; n < N; ++n) {
    int32_t* chosen = experts.data<int32_t>() + n * k;
    lse[static_cast<size_t>(n)] =
        route_token(logits.data<float>() + n * E, E, o, scores.data<float>() + n * E,
                    probs.data<float>() + n * k, chosen, keys);
    for (int64_t j = 0; j < k; ++j) ++count[chosen[j]];
  }
  return router_losses(lse, scores.data<float>(), count, N, E, o);
}

void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& o,
                     Tensor& dlogits) {
  const RouterShape s =
      check_router_backward("router_backward", dprobs, logits, scores, experts, counts, o, dlogits);
  const int64_t N = s.tokens, E = s.experts, k = s.topk;
  std::vector<double> ds;
  for (int64_t n = 0; n < N; ++n) {
    route_token_backward(dprobs.data<float>() + n * k, logits.data<float>() + n * E,
                         scores.data<float>() + n * E, experts.data<int32_t>() + n * k,
                         counts.data<int32_t>(), N, E, o, dlogits.data<float>() + n * E, ds);
  }
}

namespace {

template <typename T>
void copy_row(const T* in, T* out, int64_t C) {
  for (int64_t c = 0; c < C; ++c) out[c] = in[c];
}

}  // namespace

void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map) {
  const PermuteShape s = check_permute(tokens, experts, num_experts, permuted, row_map);
  const int64_t N = s.tokens, k = s.topk, C = s.hidden;
  const int32_t* e = experts.data<int32_t>();
  int32_t* map = row_map.data<int32_t>();
  // Expert by expert, each one's tokens in order.
  int32_t next = 0;
  for (int64_t expert = 0; expert < num_experts; ++expert) {
    for (int64_t i = 0; i < N * k; ++i) {
      if (e[i] == expert) map[i] = next++;
    }
  }
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t n = i / k;
    if (tokens.dtype() == DType::F32) {
      copy_row(tokens.data<float>() + n * C, permuted.data<float>() + map[i] * C, C);
    } else {
      copy_row(tokens.data<bfloat16>() + n * C, permuted.data<bfloat16>() + map[i] * C, C);
    }
  }
}

void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens) {
  const PermuteShape s = check_permute_backward(dpermuted, row_map, dtokens);
  const int64_t N = s.tokens, k = s.topk, C = s.hidden;
  const int32_t* map = row_map.data<int32_t>();
  const bool f32 = dtokens.dtype() == DType::F32;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t at = map[n * k + j] * C + c;
        sum += f32 ? dpermuted.data<float>()[at] : simd::load(dpermuted.data<bfloat16>()[at]);
      }
      if (f32) {
        dtokens.data<float>()[n * C + c] = static_cast<float>(sum);
      } else {
        simd::store(static_cast<float>(sum), &dtokens.data<bfloat16>()[n * C + c]);
      }
    }
  }
}

void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out) {
  const PermuteShape s = check_unpermute(y, row_map, probs, out);
  const int64_t N = s.tokens, k = s.topk, C = s.hidden;
  const int32_t* map = row_map.data<int32_t>();
  const float* p = probs.data<float>();
  const bool f32 = y.dtype() == DType::F32;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t at = map[n * k + j] * C + c;
        sum +=
            double{p[n * k + j]} * (f32 ? y.data<float>()[at] : simd::load(y.data<bfloat16>()[at]));
      }
      if (f32) {
        out.data<float>()[n * C + c] = static_cast<float>(sum);
      } else {
        simd::store(static_cast<float>(sum), &out.data<bfloat16>()[n * C + c]);
      }
    }
  }
}

void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs) {
  const PermuteShape s = check_unpermute_backward(dout, y, row_map, probs, dy, dprobs);
  const int64_t N = s.tokens, k = s.topk, C = s.hidden;
  const int32_t* map = row_map.data<int32_t>();
  const bool f32 = y.dtype() == DType::F32;
  auto value = [&](const Tensor& t, int64_t at) {
    return f32 ? t.data<float>()[at] : simd::load(t.data<bfloat16>()[at]);
  };
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = map[n * k + j];
      const float p = probs.data<float>()[n * k + j];
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        const float g = value(dout, n * C + c);
        dot += double{g} * value(y, row * C + c);
        if (f32) {
          dy.data<float>()[row * C + c] = p * g;
        } else {
          simd::store(p * g, &dy.data<bfloat16>()[row * C + c]);
        }
      }
      dprobs.data<float>()[n * k + j] = static_cast<float>(dot);
    }
  }
}

void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept) {
  const PermuteShape s = check_capacity_drop(experts, probs, num_experts, capacity, dispatch, kept);
  const int64_t pairs = s.tokens * s.topk;
  const int32_t* e = experts.data<int32_t>();
  const float* p = probs.data<float>();
  int32_t* d = dispatch.data<int32_t>();
  // Expert by expert: `capacity` times, the best pair not yet kept (the highest probability, the
  // earliest pair among equals; Position: the earliest).
  for (int64_t i = 0; i < pairs; ++i) d[i] = static_cast<int32_t>(num_experts);
  for (int64_t expert = 0; expert < num_experts; ++expert) {
    int64_t held = 0;
    for (; held < capacity; ++held) {
      int64_t best = -1;
      for (int64_t i = 0; i < pairs; ++i) {
        if (e[i] != expert || d[i] == expert) continue;
        if (best < 0 || (policy == DropPolicy::Probs && p[i] > p[best])) best = i;
        if (policy == DropPolicy::Position) break;
      }
      if (best < 0) break;
      d[best] = static_cast<int32_t>(expert);
    }
    kept.data<int32_t>()[expert] = static_cast<int32_t>(held);
  }
}

}  // namespace octet::ops::reference
