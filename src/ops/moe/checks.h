// Argument checks shared by the reference and fast routing kernels, and the top-k choice both
// make (one rule, so that they choose alike).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "octet/ops/moe.h"

namespace octet::ops::moe_detail {

struct RouterShape {
  int64_t tokens = 0, experts = 0, topk = 0;
};

inline std::string what(const char* op, const char* name) {
  return std::string(op) + ": " + name;
}

inline RouterShape check_router(const char* op, const Tensor& logits, const RouterOptions& o) {
  OCTET_CHECK(logits.defined() && logits.ndim() == 2, op, ": logits expected [N, E], got ",
              logits.defined() ? shape_str(logits.shape()) : "an undefined tensor");
  check_dtype(logits, DType::F32, what(op, "logits"));
  const RouterShape s{logits.dim(0), logits.dim(1), o.topk};
  OCTET_CHECK(s.topk >= 1 && s.topk <= s.experts, op, ": topk expected in [1, E = ", s.experts,
              "], got ", s.topk);
  OCTET_CHECK(std::isfinite(o.scaling) && o.scaling > 0.0f, op, ": scaling expected > 0, got ",
              o.scaling);
  OCTET_CHECK(o.aux_loss_coeff >= 0.0f && o.z_loss_coeff >= 0.0f, op,
              ": loss coefficients expected >= 0, got aux ", o.aux_loss_coeff, " and z ",
              o.z_loss_coeff);
  if (o.expert_bias != nullptr) {
    check_dtype(*o.expert_bias, DType::F32, what(op, "expert_bias"));
    check_shape(*o.expert_bias, {s.experts}, what(op, "expert_bias"), "E");
  }
  return s;
}

inline void check_router_outputs(const char* op, const RouterShape& s, const Tensor& scores,
                                 const Tensor& probs, const Tensor& experts, const Tensor& counts) {
  check_dtype(scores, DType::F32, what(op, "scores"));
  check_shape(scores, {s.tokens, s.experts}, what(op, "scores"), "N,E");
  check_dtype(probs, DType::F32, what(op, "probs"));
  check_shape(probs, {s.tokens, s.topk}, what(op, "probs"), "N,k");
  check_dtype(experts, DType::I32, what(op, "experts"));
  check_shape(experts, {s.tokens, s.topk}, what(op, "experts"), "N,k");
  check_dtype(counts, DType::I32, what(op, "counts"));
  check_shape(counts, {s.experts}, what(op, "counts"), "E");
}

inline RouterShape check_router_backward(const char* op, const Tensor& dprobs, const Tensor& logits,
                                         const Tensor& scores, const Tensor& experts,
                                         const Tensor& counts, const RouterOptions& o,
                                         const Tensor& dlogits) {
  const RouterShape s = check_router(op, logits, o);
  check_dtype(dprobs, DType::F32, what(op, "dprobs"));
  check_shape(dprobs, {s.tokens, s.topk}, what(op, "dprobs"), "N,k");
  check_dtype(dlogits, DType::F32, what(op, "dlogits"));
  check_shape(dlogits, {s.tokens, s.experts}, what(op, "dlogits"), "N,E");
  check_router_outputs(op, s, scores, dprobs, experts, counts);  // dprobs is shaped as probs
  return s;
}

// Token n's chosen experts into out[0, k): the k largest keys (score + bias), larger first,
// equal keys by the lower index. Insertion into a sorted list of k: E * k comparisons.
inline void choose_topk(const float* keys, int64_t E, int64_t k, int32_t* out) {
  int64_t held = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float key = keys[e];
    int64_t at = held;
    while (at > 0 && keys[out[at - 1]] < key) --at;
    if (at >= k) continue;
    for (int64_t i = std::min(held, k - 1); i > at; --i) out[i] = out[i - 1];
    out[at] = static_cast<int32_t>(e);
    if (held < k) ++held;
  }
}

struct PermuteShape {
  int64_t tokens = 0, topk = 0, hidden = 0;
};

// experts [N, k] I32, each in [0, E): checked before any row moves.
inline PermuteShape check_experts(const char* op, const Tensor& experts, int64_t num_experts) {
  OCTET_CHECK(experts.defined() && experts.ndim() == 2, op, ": experts expected [N, k], got ",
              experts.defined() ? shape_str(experts.shape()) : "an undefined tensor");
  check_dtype(experts, DType::I32, what(op, "experts"));
  OCTET_CHECK(num_experts >= 1, op, ": num_experts expected >= 1, got ", num_experts);
  const int32_t* e = experts.data<int32_t>();
  for (int64_t i = 0; i < experts.numel(); ++i) {
    OCTET_CHECK(e[i] >= 0 && e[i] < num_experts, op, ": expert ", e[i], " of entry ", i,
                " expected in [0, ", num_experts, ")");
  }
  return {experts.dim(0), experts.dim(1), 0};
}

// row_map [N, k] I32: a permutation of [0, N*k) (each row of the permuted tensor once).
inline PermuteShape check_row_map(const char* op, const Tensor& row_map) {
  OCTET_CHECK(row_map.defined() && row_map.ndim() == 2, op, ": row_map expected [N, k], got ",
              row_map.defined() ? shape_str(row_map.shape()) : "an undefined tensor");
  check_dtype(row_map, DType::I32, what(op, "row_map"));
  const int64_t rows = row_map.numel();
  std::vector<char> seen(static_cast<size_t>(rows), 0);
  const int32_t* r = row_map.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i) {
    OCTET_CHECK(r[i] >= 0 && r[i] < rows && !seen[static_cast<size_t>(r[i])], op,
                ": row_map expected a permutation of [0, N*k = ", rows, "), entry ", i, " is ",
                r[i]);
    seen[static_cast<size_t>(r[i])] = 1;
  }
  return {row_map.dim(0), row_map.dim(1), 0};
}

inline void check_rows(const char* op, const char* name, const Tensor& t, int64_t rows,
                       int64_t hidden) {
  check_dtype_in(t, {DType::F32, DType::BF16}, what(op, name));
  check_shape(t, {rows, hidden}, what(op, name));
}

// Each permutation op's arguments, checked before any row moves; returns N, k and C.
inline PermuteShape check_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts,
                                  const Tensor& permuted, const Tensor& row_map) {
  const char* op = "moe_permute";
  PermuteShape s = check_experts(op, experts, num_experts);
  OCTET_CHECK(tokens.ndim() == 2, op, ": tokens expected [N, C], got ", shape_str(tokens.shape()));
  s.hidden = tokens.dim(1);
  check_rows(op, "tokens", tokens, s.tokens, s.hidden);
  check_rows(op, "permuted", permuted, s.tokens * s.topk, s.hidden);
  check_dtype(permuted, tokens.dtype(), what(op, "permuted"));
  check_dtype(row_map, DType::I32, what(op, "row_map"));
  check_shape(row_map, {s.tokens, s.topk}, what(op, "row_map"), "N,k");
  return s;
}

// The row map and the token-order tensor [N, C] beside it (`name`); returns N, k and C.
inline PermuteShape check_token_rows(const char* op, const Tensor& row_map, const char* name,
                                     const Tensor& rows) {
  PermuteShape s = check_row_map(op, row_map);
  OCTET_CHECK(rows.ndim() == 2, op, ": ", name, " expected [N, C], got ", shape_str(rows.shape()));
  s.hidden = rows.dim(1);
  check_rows(op, name, rows, s.tokens, s.hidden);
  return s;
}

inline PermuteShape check_permute_backward(const Tensor& dpermuted, const Tensor& row_map,
                                           const Tensor& dtokens) {
  const char* op = "moe_permute_backward";
  const PermuteShape s = check_token_rows(op, row_map, "dtokens", dtokens);
  check_rows(op, "dpermuted", dpermuted, s.tokens * s.topk, s.hidden);
  check_dtype(dpermuted, dtokens.dtype(), what(op, "dpermuted"));
  return s;
}

inline void check_probs(const char* op, const char* name, const Tensor& probs,
                        const PermuteShape& s) {
  check_dtype(probs, DType::F32, what(op, name));
  check_shape(probs, {s.tokens, s.topk}, what(op, name), "N,k");
}

inline PermuteShape check_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs,
                                    const Tensor& out) {
  const char* op = "moe_unpermute";
  const PermuteShape s = check_token_rows(op, row_map, "out", out);
  check_rows(op, "y", y, s.tokens * s.topk, s.hidden);
  check_dtype(out, y.dtype(), what(op, "out"));
  check_probs(op, "probs", probs, s);
  return s;
}

inline PermuteShape check_unpermute_backward(const Tensor& dout, const Tensor& y,
                                             const Tensor& row_map, const Tensor& probs,
                                             const Tensor& dy, const Tensor& dprobs) {
  const char* op = "moe_unpermute_backward";
  const PermuteShape s = check_token_rows(op, row_map, "dout", dout);
  check_rows(op, "y", y, s.tokens * s.topk, s.hidden);
  check_rows(op, "dy", dy, s.tokens * s.topk, s.hidden);
  check_dtype(dout, y.dtype(), what(op, "dout"));
  check_dtype(dy, y.dtype(), what(op, "dy"));
  check_probs(op, "probs", probs, s);
  check_probs(op, "dprobs", dprobs, s);
  return s;
}

// moe_capacity_drop's arguments, checked before anything is written; returns N and k.
inline PermuteShape check_capacity_drop(const Tensor& experts, const Tensor& probs,
                                        int64_t num_experts, int64_t capacity,
                                        const Tensor& dispatch, const Tensor& kept) {
  const char* op = "moe_capacity_drop";
  PermuteShape s = check_experts(op, experts, num_experts);
  OCTET_CHECK(capacity >= 0, op, ": capacity expected >= 0, got ", capacity);
  check_dtype(probs, DType::F32, what(op, "probs"));
  check_shape(probs, {s.tokens, s.topk}, what(op, "probs"), "N,k");
  check_dtype(dispatch, DType::I32, what(op, "dispatch"));
  check_shape(dispatch, {s.tokens, s.topk}, what(op, "dispatch"), "N,k");
  check_dtype(kept, DType::I32, what(op, "kept"));
  check_shape(kept, {num_experts}, what(op, "kept"), "E");
  return s;
}

}  // namespace octet::ops::moe_detail
