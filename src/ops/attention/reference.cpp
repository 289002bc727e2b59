// Attention, the oracle: for each (batch, head) the full T x S score matrix in double (bias
// added), an explicit softmax, dropout from the same RNG as the fast path, and the textbook
// backward (dbias the sum over the batch of the score gradients).
#include <cmath>
#include <limits>
#include <vector>

#include "ops/attention/checks.h"

namespace octet::ops {

using attention_detail::AttentionShape;
using attention_detail::KeyRange;

bool attention_dropout_keep(uint64_t seed, uint64_t offset, int64_t b, int64_t h, int64_t num_heads,
                            int64_t i, int64_t j, float p) {
  attention_detail::Philox words =
      attention_detail::dropout_words(seed, offset, b * num_heads + h, i, j & ~int64_t{3});
  return words.word[j & 3] >= attention_detail::dropout_threshold(p);
}

void attention_dropout_mask(uint64_t seed, uint64_t offset, float p, Tensor& keep) {
  OCTET_CHECK(keep.defined() && keep.ndim() == 4, "attention_dropout_mask: keep expected ",
              "[B,H,T,S], got ", keep.defined() ? shape_str(keep.shape()) : "undefined");
  check_dtype(keep, DType::U8, "attention_dropout_mask: keep");
  const int64_t B = keep.dim(0), H = keep.dim(1), T = keep.dim(2), S = keep.dim(3);
  uint8_t* out = keep.data<uint8_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = 0; j < S; ++j)
          out[((b * H + h) * T + i) * S + j] =
              attention_dropout_keep(seed, offset, b, h, H, i, j, p);
}

namespace reference {
namespace {

// Probabilities P [T,S] (before dropout) and lse [T] of head (b, h).
struct HeadProbabilities {
  std::vector<double> p;
  std::vector<double> lse;
  std::vector<double> max;  // each row's largest scaled score
};

HeadProbabilities head_probabilities(const AttentionShape& s, const AttentionOptions& o,
                                     const std::vector<float>& q, const std::vector<float>& k,
                                     int64_t b, int64_t h) {
  const int64_t T = s.queries, S = s.keys, D = s.head_dim, hk = h / s.group;
  HeadProbabilities out{std::vector<double>(T * S, 0.0),
                        std::vector<double>(T, std::numeric_limits<double>::infinity()),
                        std::vector<double>(T, 0.0)};
  std::vector<double> row(S);
  for (int64_t i = 0; i < T; ++i) {
    KeyRange range = attention_detail::visible_keys(s, o, b, i);
    if (range.empty()) continue;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t j = range.lo; j < range.hi; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        dot += double{q[((b * T + i) * s.heads + h) * D + d]} *
               k[((b * S + j) * s.kv_heads + hk) * D + d];
      }
      row[j] = dot * s.scale;
      if (o.bias != nullptr) row[j] += o.bias->data<float>()[(h * T + i) * S + j];
      max = std::max(max, row[j]);
    }
    double sum = 0.0;
    for (int64_t j = range.lo; j < range.hi; ++j) sum += std::exp(row[j] - max);
    for (int64_t j = range.lo; j < range.hi; ++j) out.p[i * S + j] = std::exp(row[j] - max) / sum;
    out.lse[i] = max + std::log(sum);
    out.max[i] = max;
  }
  return out;
}

// Dropout factor of (b, h, i, j): 0 or 1 / (1 - p); 1 without dropout.
double dropout_factor(const AttentionShape& s, const AttentionOptions& o, int64_t b, int64_t h,
                      int64_t i, int64_t j) {
  if (o.dropout == 0.0f) return 1.0;
  return attention_dropout_keep(o.seed, o.offset, b, h, s.heads, i, j, o.dropout)
             ? 1.0 / (1.0 - o.dropout)
             : 0.0;
}

void store(const std::vector<double>& values, Tensor& t) {
  std::vector<float> f(values.begin(), values.end());
  Tensor result = Tensor::from_floats(t.shape(), f);
  t.copy_from(t.dtype() == DType::F32 ? result : result.to(t.dtype()));
}

}  // namespace

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& o, Tensor& out, Tensor& lse) {
  const char* op = "flash_attention_forward";
  AttentionShape s = attention_detail::check_inputs(op, q, k, v, o);
  attention_detail::check_output(op, out, q, "out", "B,T,H,D");
  const int64_t lse_parts = attention_detail::check_lse(op, lse, s);
  const int64_t T = s.queries, S = s.keys, D = s.head_dim;
  std::vector<float> qf = q.to_floats(), kf = k.to_floats(), vf = v.to_floats();
  std::vector<double> o_values(q.numel(), 0.0);
  // FP8 (options.fp8): the P V operand is q(exp(s - row max) * dropout), rounded as F32, over
  // the row sum. The fast kernel quantizes each 64-key tile relative to its running maximum,
  // which is this when a row's visible keys lie in one tile.
  const attention_detail::Fp8Rounder round_p(o.fp8.p_format, o.fp8.p_scale);
  float p_amax = 0.0f;
  std::vector<double> lse_values(s.batch * s.heads * T);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      HeadProbabilities hp = head_probabilities(s, o, qf, kf, b, h);
      const int64_t hk = h / s.group;
      for (int64_t i = 0; i < T; ++i) {
        lse_values[(b * s.heads + h) * T + i] = hp.lse[i];
        for (int64_t j = 0; j < S; ++j) {
          double p = hp.p[i * S + j] * dropout_factor(s, o, b, h, i, j);
          if (round_p.active() && p != 0.0) {
            const double row_sum = std::exp(hp.lse[i] - hp.max[i]);
            const auto unnormalized = static_cast<float>(p * row_sum);
            p_amax = std::max(p_amax, unnormalized);
            p = round_p(unnormalized) / row_sum;
          }
          if (p == 0.0) continue;
          for (int64_t d = 0; d < D; ++d) {
            o_values[((b * T + i) * s.heads + h) * D + d] +=
                p * vf[((b * S + j) * s.kv_heads + hk) * D + d];
          }
        }
      }
    }
  }
  store(o_values, out);
  for (size_t row = 0; row < lse_values.size(); ++row) {
    attention_detail::write_lse(lse.data<float>(), lse_parts, static_cast<int64_t>(row),
                                lse_values[row]);
  }
  if (o.fp8.p_amax) *o.fp8.p_amax = p_amax;
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, const AttentionOptions& o,
                              Tensor& dq, Tensor& dk, Tensor& dv) {
  const char* op = "flash_attention_backward";
  AttentionShape s = attention_detail::check_inputs(op, q, k, v, o);
  attention_detail::check_output(op, out, q, "out", "B,T,H,D");
  attention_detail::check_output(op, dout, q, "dout", "B,T,H,D");
  attention_detail::check_lse(op, lse, s);
  attention_detail::check_output(op, dq, q, "dq", "B,T,H,D");
  attention_detail::check_output(op, dk, k, "dk", "B,S,Hkv,D");
  attention_detail::check_output(op, dv, v, "dv", "B,S,Hkv,D");
  attention_detail::check_dbias(op, o, s);
  const int64_t T = s.queries, S = s.keys, D = s.head_dim;
  std::vector<float> qf = q.to_floats(), kf = k.to_floats(), vf = v.to_floats();
  std::vector<float> dof = dout.to_floats();
  // FP8 (options.fp8): dV's operand is q(P * dropout), dQ's and dK's is q(dS); D_i is
  // rowsum(dO * O) over the forward's output, as the fast kernel takes it.
  const attention_detail::Fp8Rounder round_p(o.fp8.p_format, o.fp8.p_scale);
  const attention_detail::Fp8Rounder round_ds(o.fp8.ds_format, o.fp8.ds_scale);
  const bool fp8 = o.fp8.enabled();
  std::vector<float> of = fp8 ? out.to_floats() : std::vector<float>{};
  float ds_amax = 0.0f;
  std::vector<double> dq_values(q.numel(), 0.0), dk_values(k.numel(), 0.0),
      dv_values(v.numel(), 0.0);
  std::vector<double> dbias_values(o.dbias != nullptr ? o.dbias->numel() : 0, 0.0);
  auto q_at = [&](int64_t b, int64_t i, int64_t h) { return ((b * T + i) * s.heads + h) * D; };
  auto k_at = [&](int64_t b, int64_t j, int64_t hk) { return ((b * S + j) * s.kv_heads + hk) * D; };
  std::vector<double> dp(S);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      HeadProbabilities hp = head_probabilities(s, o, qf, kf, b, h);
      const int64_t hk = h / s.group;
      for (int64_t i = 0; i < T; ++i) {
        // dP = (dO V^T) * dropout factor; D_i = sum_j P dP; dS = P (dP - D_i).
        double delta = 0.0;
        for (int64_t j = 0; j < S; ++j) {
          const double factor = dropout_factor(s, o, b, h, i, j);
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d)
            dot += double{dof[q_at(b, i, h) + d]} * vf[k_at(b, j, hk) + d];
          dp[j] = dot * factor;
          delta += hp.p[i * S + j] * dp[j];
          double kept = hp.p[i * S + j] * factor;
          if (round_p.active()) kept = round_p(static_cast<float>(kept));
          for (int64_t d = 0; d < D; ++d)
            dv_values[k_at(b, j, hk) + d] += kept * dof[q_at(b, i, h) + d];
        }
        if (fp8) {
          delta = 0.0;
          for (int64_t d = 0; d < D; ++d)
            delta += double{of[q_at(b, i, h) + d]} * dof[q_at(b, i, h) + d];
        }
        for (int64_t j = 0; j < S; ++j) {
          double ds = hp.p[i * S + j] * (dp[j] - delta);
          if (round_ds.active()) {
            const auto ds32 = static_cast<float>(ds);
            ds_amax = std::max(ds_amax, std::fabs(ds32));
            ds = round_ds(ds32);
          }
          if (o.dbias != nullptr) dbias_values[(h * T + i) * S + j] += ds;
          ds *= s.scale;
          if (ds == 0.0) continue;
          for (int64_t d = 0; d < D; ++d) {
            dq_values[q_at(b, i, h) + d] += ds * kf[k_at(b, j, hk) + d];
            dk_values[k_at(b, j, hk) + d] += ds * qf[q_at(b, i, h) + d];
          }
        }
      }
    }
  }
  if (o.fp8.ds_amax) *o.fp8.ds_amax = ds_amax;
  store(dq_values, dq);
  store(dk_values, dk);
  store(dv_values, dv);
  if (o.dbias != nullptr) store(dbias_values, *o.dbias);
}

}  // namespace reference
}  // namespace octet::ops
