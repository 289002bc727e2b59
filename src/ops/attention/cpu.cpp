// Attention, fast path: FlashAttention-2 on the CPU.
//
// K and V are first packed to F32, per kv head, D padded to 16 (Kt also transposed per key
// tile) so that every tile product is a register-blocked vec::gemm. Forward: one task per
// (batch, head, 64-query tile) runs the online softmax over the visible 64-key tiles and
// writes out and lse. Backward: one task per (batch, kv head, k-tile split) recomputes the
// probabilities from lse, accumulates dK and dV of its key tiles locally over the whole query
// group, and adds dQ into the split's own F32 buffer, summed at the end (no races, no atomics).
// Scratch is Tensors linear in T and S, plus fixed per-thread tiles: never T x S.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/attention/checks.h"
#include "ops/attention/vec.h"

namespace octet::ops::cpu {
namespace {

using attention_detail::AttentionShape;
using attention_detail::KeyRange;

constexpr int64_t kBlockQ = 64;  // queries per tile
constexpr int64_t kBlockK = 64;  // keys per tile
constexpr int64_t kPadD = 16;    // the widest vector: packed rows hold whole vectors
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

struct Plan {
  AttentionShape s;
  const AttentionOptions* o = nullptr;
  int64_t dp = 0;  // D padded to kPadD
  int64_t q_tiles = 0, k_tiles = 0, padded_keys = 0;
  float scale_log2 = 0.0f;  // scores are kept in the log2 domain: exp2 instead of exp
  bool dropout = false;
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  attention_detail::Fp8Rounder p_fp8, ds_fp8;  // inactive unless options.fp8 sets a scale
};

Plan make_plan(const AttentionShape& s, const AttentionOptions& o) {
  Plan p;
  p.s = s;
  p.o = &o;
  p.dp = round_up(s.head_dim, kPadD);
  p.q_tiles = (s.queries + kBlockQ - 1) / kBlockQ;
  p.k_tiles = (s.keys + kBlockK - 1) / kBlockK;
  p.padded_keys = p.k_tiles * kBlockK;
  p.scale_log2 = s.scale * kLog2e;
  p.dropout = o.dropout > 0.0f;
  p.threshold = attention_detail::dropout_threshold(o.dropout);
  p.keep_scale = 1.0f / (1.0f - o.dropout);
  p.p_fp8 = attention_detail::Fp8Rounder(o.fp8.p_format, o.fp8.p_scale);
  p.ds_fp8 = attention_detail::Fp8Rounder(o.fp8.ds_format, o.fp8.ds_scale);
  return p;
}

// ---- packing: plain loops over bshd rows ----------------------------------------------------

// dst [B,Hx,rows,dp] (zeroed) := src [B,L,Hx,D] * multiplier.
template <typename T>
void pack_rows(const T* src, int64_t B, int64_t L, int64_t Hx, int64_t D, float multiplier,
               int64_t rows, int64_t dp, float* dst) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hx; ++h) {
      for (int64_t l = 0; l < L; ++l) {
        const T* in = src + ((b * L + l) * Hx + h) * D;
        float* out = dst + ((b * Hx + h) * rows + l) * dp;
        for (int64_t d = 0; d < D; ++d) out[d] = simd::load(in[d]) * multiplier;
      }
    }
  }
}

// dst [B,Hkv,k_tiles,dp,kBlockK] (zeroed): each key tile transposed, keys contiguous.
template <typename T>
void pack_transposed(const T* src, int64_t B, int64_t S, int64_t Hkv, int64_t D, int64_t k_tiles,
                     int64_t dp, float* dst) {
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t t = 0; t < k_tiles; ++t) {
        float* tile = dst + ((b * Hkv + h) * k_tiles + t) * dp * kBlockK;
        for (int64_t c = 0; c < kBlockK && t * kBlockK + c < S; ++c) {
          const T* in = src + ((b * S + t * kBlockK + c) * Hkv + h) * D;
          for (int64_t d = 0; d < D; ++d) tile[d * kBlockK + c] = simd::load(in[d]);
        }
      }
    }
  }
}

// Visible key ranges of the tile's rows; returns their union [lo, hi) (empty: lo >= hi).
KeyRange tile_ranges(const Plan& p, int64_t b, int64_t i0, int64_t rows, KeyRange* ranges) {
  KeyRange all{std::numeric_limits<int64_t>::max(), 0};
  for (int64_t r = 0; r < rows; ++r) {
    ranges[r] = attention_detail::visible_keys(p.s, *p.o, b, i0 + r);
    if (ranges[r].empty()) continue;
    all.lo = std::min(all.lo, ranges[r].lo);
    all.hi = std::max(all.hi, ranges[r].hi);
  }
  return all;
}

// Columns of key tile j0 that a row with keys [lo, hi) sees, as [c_lo, c_hi).
OCTET_ALWAYS_INLINE void tile_columns(const KeyRange& range, int64_t j0, int64_t& c_lo,
                                      int64_t& c_hi) {
  c_lo = std::clamp<int64_t>(range.lo - j0, 0, kBlockK);
  c_hi = std::clamp<int64_t>(range.hi - j0, 0, kBlockK);
}

// Multiplies row[c] (c in [c_lo, c_hi)) by its dropout factor, 0 or 1/(1-p); `also`, when
// given, gets the same factors at also[c * also_stride] (backward's transposed P).
OCTET_ALWAYS_INLINE void apply_dropout(const Plan& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                                       int64_t c_lo, int64_t c_hi, float* row, float* also,
                                       int64_t also_stride) {
  const int64_t bh = b * p.s.heads + h;
  for (int64_t c4 = c_lo & ~int64_t{3}; c4 < c_hi; c4 += 4) {
    const attention_detail::Philox words =
        attention_detail::dropout_words(p.o->seed, p.o->offset, bh, i, j0 + c4);
    for (int u = 0; u < 4; ++u) {
      const float factor = words.word[u] >= p.threshold ? p.keep_scale : 0.0f;
      row[c4 + u] *= factor;
      if (also != nullptr) also[(c4 + u) * also_stride] *= factor;
    }
  }
}

// Rounds x[0..n) to FP8 through `round` and returns max |x| before rounding. Each thread's
// amax goes to the last float of its workspace (see workspace_floats), reduced afterwards.
inline float round_fp8(const attention_detail::Fp8Rounder& round, float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    amax = std::max(amax, std::fabs(x[c]));
    x[c] = round(x[c]);
  }
  return amax;
}

// The largest of each thread's amax slot (the last float of its workspace).
float reduce_amax_slots(const float* ws_base, int threads, int64_t ws_floats) {
  float amax = 0.0f;
  for (int t = 0; t < threads; ++t) amax = std::max(amax, ws_base[(t + 1) * ws_floats - 1]);
  return amax;
}

// ---- forward --------------------------------------------------------------------------------

template <typename T>
struct ForwardArgs {
  const Plan* plan;
  const T* q;
  const float* kt;  // [B,Hkv,k_tiles,dp,kBlockK]
  const float* v;   // [B,Hkv,padded_keys,dp]
  T* out;
  float* lse;
  int64_t lse_parts;  // 1: F32 lse; 2: hi + lo
};

constexpr int64_t forward_workspace_floats(int64_t dp) {
  return 2 * kBlockQ * dp + kBlockQ * kBlockK + 2 * kBlockQ + 1;  // + the amax slot
}

template <int W, int R, int NV, typename T>
OCTET_ALWAYS_INLINE void forward_tile(const ForwardArgs<T>& a, int64_t b, int64_t h, int64_t qt,
                                      float* ws) {
  const Plan& p = *a.plan;
  const AttentionShape& s = p.s;
  const int64_t D = s.head_dim, dp = p.dp, hk = h / s.group;
  const int64_t i0 = qt * kBlockQ, rows = std::min(kBlockQ, s.queries - i0);
  float* qs = ws;                     // [rows, dp] queries
  float* acc = qs + kBlockQ * dp;     // [rows, dp] unnormalized output
  float* sc = acc + kBlockQ * dp;     // [rows, kBlockK] scores, then probabilities
  float* m = sc + kBlockQ * kBlockK;  // running row max of the unscaled scores
  float* l = m + kBlockQ;             // running row sum
  KeyRange ranges[kBlockQ];
  const KeyRange all = tile_ranges(p, b, i0, rows, ranges);
  for (int64_t r = 0; r < rows; ++r) l[r] = 0.0f;

  if (!all.empty()) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = a.q + ((b * s.queries + i0 + r) * s.heads + h) * D;
      float* row = qs + r * dp;
      // Unscaled: the scores' maximum is subtracted before they are scaled, so x - max is exact
      // near the maximum and the probabilities keep F32 accuracy at any score magnitude.
      for (int64_t d = 0; d < D; ++d) row[d] = simd::load(in[d]);
      for (int64_t d = D; d < dp; ++d) row[d] = 0.0f;
      for (int64_t d = 0; d < dp; ++d) acc[r * dp + d] = 0.0f;
      m[r] = -kInf;
    }
    const float* kt_head = a.kt + (b * s.kv_heads + hk) * p.k_tiles * dp * kBlockK;
    const float* v_head = a.v + (b * s.kv_heads + hk) * p.padded_keys * dp;
    for (int64_t kt = all.lo / kBlockK; kt * kBlockK < all.hi; ++kt) {
      const int64_t j0 = kt * kBlockK;
      vec::gemm<W, R, NV>(rows, kBlockK, dp, qs, dp, kt_head + kt * dp * kBlockK, kBlockK, sc,
                          kBlockK, false);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sc + r * kBlockK;
        int64_t c_lo, c_hi;
        tile_columns(ranges[r], j0, c_lo, c_hi);
        if (c_lo >= c_hi) {  // this row sees nothing here
          for (int64_t c = 0; c < kBlockK; ++c) row[c] = 0.0f;
          continue;
        }
        for (int64_t c = 0; c < c_lo; ++c) row[c] = -kInf;
        for (int64_t c = c_hi; c < kBlockK; ++c) row[c] = -kInf;
        vec::F<W> max_v = vec::splat<W>(-kInf);
        for (int64_t c = 0; c < kBlockK; c += W) {
          const vec::F<W> x = vec::load<W>(row + c);
          max_v = x > max_v ? x : max_v;
        }
        const float m_new = std::max(m[r], vec::reduce_max<W>(max_v));
        const float alpha = std::exp2((m[r] - m_new) * p.scale_log2);
        vec::F<W> sum_v{};
        const vec::F<W> m_v = vec::splat<W>(m_new), scale_v = vec::splat<W>(p.scale_log2);
        for (int64_t c = 0; c < kBlockK; c += W) {
          const vec::F<W> e = vec::exp2<W>((vec::load<W>(row + c) - m_v) * scale_v);
          vec::store<W>(row + c, e);
          sum_v += e;
        }
        l[r] = l[r] * alpha + vec::reduce_sum<W>(sum_v);
        m[r] = m_new;
        if (alpha != 1.0f) {
          const vec::F<W> alpha_v = vec::splat<W>(alpha);
          for (int64_t d = 0; d < dp; d += W) {
            vec::store<W>(acc + r * dp + d, vec::load<W>(acc + r * dp + d) * alpha_v);
          }
        }
        if (p.dropout) apply_dropout(p, b, h, i0 + r, j0, c_lo, c_hi, row, nullptr, 0);
        if (p.p_fp8.active()) {
          float& amax = ws[forward_workspace_floats(dp) - 1];
          amax = std::max(amax, round_fp8(p.p_fp8, row, kBlockK));
        }
      }
      vec::gemm<W, R, NV>(rows, dp, kBlockK, sc, kBlockK, v_head + j0 * dp, dp, acc, dp, true);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    T* out = a.out + ((b * s.queries + i) * s.heads + h) * D;
    const int64_t lse_row = (b * s.heads + h) * s.queries + i;
    if (l[r] > 0.0f) {
      const float inv = 1.0f / l[r];
      for (int64_t d = 0; d < D; ++d) simd::store(acc[r * dp + d] * inv, &out[d]);
      attention_detail::write_lse(a.lse, a.lse_parts, lse_row,
                                  double{m[r]} * s.scale + std::log(double{l[r]}));
    } else {  // padded or fully masked row
      for (int64_t d = 0; d < D; ++d) simd::store(0.0f, &out[d]);
      attention_detail::write_lse(a.lse, a.lse_parts, lse_row, kInf);
    }
  }
}

template <typename T>
OCTET_TARGET_AVX512 void forward_tile_avx512(const ForwardArgs<T>& a, int64_t b, int64_t h,
                                             int64_t qt, float* ws) {
  forward_tile<16, 4, 4>(a, b, h, qt, ws);
}
template <typename T>
OCTET_TARGET_AVX2 void forward_tile_avx2(const ForwardArgs<T>& a, int64_t b, int64_t h, int64_t qt,
                                         float* ws) {
  forward_tile<8, 4, 3>(a, b, h, qt, ws);
}
template <typename T>
void forward_tile_scalar(const ForwardArgs<T>& a, int64_t b, int64_t h, int64_t qt, float* ws) {
  forward_tile<4, 2, 4>(a, b, h, qt, ws);
}

template <typename T>
void forward_typed(const Plan& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                   Tensor& lse) {
  const AttentionShape& s = p.s;
  Tensor kt = Tensor::zeros({s.batch, s.kv_heads, p.k_tiles, p.dp, kBlockK}, DType::F32);
  Tensor vp = Tensor::zeros({s.batch, s.kv_heads, p.padded_keys, p.dp}, DType::F32);
  pack_transposed(k.data<T>(), s.batch, s.keys, s.kv_heads, s.head_dim, p.k_tiles, p.dp,
                  kt.data<float>());
  pack_rows(v.data<T>(), s.batch, s.keys, s.kv_heads, s.head_dim, 1.0f, p.padded_keys, p.dp,
            vp.data<float>());
  auto tile_fn = forward_tile_scalar<T>;
  if (active_isa() == Isa::Avx512) tile_fn = forward_tile_avx512<T>;
  if (active_isa() == Isa::Avx2) tile_fn = forward_tile_avx2<T>;
  const ForwardArgs<T> args{&p,
                            q.data<T>(),
                            kt.data<float>(),
                            vp.data<float>(),
                            out.data<T>(),
                            lse.data<float>(),
                            lse.ndim() == 4 ? 2 : 1};
  const int threads = num_threads();
  const int64_t ws_floats = forward_workspace_floats(p.dp);
  Tensor workspace = Tensor::zeros({threads, ws_floats}, DType::F32);
  float* ws_base = workspace.data<float>();
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t qt = 0; qt < p.q_tiles; ++qt) {
        tile_fn(args, b, h, qt, ws_base + omp_get_thread_num() * ws_floats);
      }
    }
  }
  if (p.o->fp8.p_amax) *p.o->fp8.p_amax = reduce_amax_slots(ws_base, threads, ws_floats);
}

// ---- backward -------------------------------------------------------------------------------

template <typename T>
struct BackwardArgs {
  const Plan* plan;
  const float* q;     // [B,H,T,dp]
  const float* dout;  // [B,H,T,dp]
  const float* k;     // [B,Hkv,padded_keys,dp]
  const float* kt;    // [B,Hkv,k_tiles,dp,kBlockK]
  const float* vt;    // [B,Hkv,k_tiles,dp,kBlockK]
  // Each row's lse as ref * scale + rho (ref an F32 in the unscaled scores' units, near the
  // row's maximum; rho the rest, here times log2 e): p = exp2((s - ref) * scale log2 e - rho),
  // where s - ref is exact near the maximum.
  const float* lse_ref;  // [B,H,T]
  const float* lse_rho;  // [B,H,T]
  const float* delta;    // [B,H,T] rowsum(dout * out)
  float* dq;             // [splits,B,H,T,dp]
  int64_t splits;
  T* dk;
  T* dv;
};

constexpr int64_t backward_workspace_floats(int64_t dp) {
  return 4 * kBlockQ * kBlockK + 2 * kBlockK * dp + 1;  // + the amax slot
}

template <int W, int R, int NV, typename T>
OCTET_ALWAYS_INLINE void backward_task(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                       int64_t split, float* ws) {
  const Plan& p = *a.plan;
  const AttentionShape& s = p.s;
  const int64_t D = s.head_dim, dp = p.dp, queries = s.queries;
  float* sc = ws;                           // [rows, kBlockK] scores -> P
  float* dpr = sc + kBlockQ * kBlockK;      // [rows, kBlockK] dP -> dS
  float* pt = dpr + kBlockQ * kBlockK;      // [kBlockK, kBlockQ] P (dropped) transposed
  float* dst = pt + kBlockK * kBlockQ;      // [kBlockK, kBlockQ] dS transposed
  float* dk_acc = dst + kBlockK * kBlockQ;  // [kBlockK, dp]
  float* dv_acc = dk_acc + kBlockK * dp;    // [kBlockK, dp]
  KeyRange ranges[kBlockQ];
  const float* k_head = a.k + (b * s.kv_heads + hk) * p.padded_keys * dp;
  for (int64_t kt = split; kt < p.k_tiles; kt += a.splits) {
    const int64_t j0 = kt * kBlockK;
    const float* kt_tile = a.kt + ((b * s.kv_heads + hk) * p.k_tiles + kt) * dp * kBlockK;
    const float* vt_tile = a.vt + ((b * s.kv_heads + hk) * p.k_tiles + kt) * dp * kBlockK;
    for (int64_t x = 0; x < kBlockK * dp; ++x) dk_acc[x] = dv_acc[x] = 0.0f;
    for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
      const int64_t bh = b * s.heads + h;
      for (int64_t qt = 0; qt < p.q_tiles; ++qt) {
        const int64_t i0 = qt * kBlockQ, rows = std::min(kBlockQ, queries - i0);
        const KeyRange all = tile_ranges(p, b, i0, rows, ranges);
        if (all.empty() || all.hi <= j0 || all.lo >= j0 + kBlockK) continue;
        const float* q_tile = a.q + (bh * queries + i0) * dp;
        const float* do_tile = a.dout + (bh * queries + i0) * dp;
        vec::gemm<W, R, NV>(rows, kBlockK, dp, q_tile, dp, kt_tile, kBlockK, sc, kBlockK, false);
        vec::gemm<W, R, NV>(rows, kBlockK, dp, do_tile, dp, vt_tile, kBlockK, dpr, kBlockK, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* p_row = sc + r * kBlockK;
          float* d_row = dpr + r * kBlockK;
          int64_t c_lo, c_hi;
          tile_columns(ranges[r], j0, c_lo, c_hi);
          if (c_lo >= c_hi) {
            for (int64_t c = 0; c < kBlockK; ++c) {
              d_row[c] = 0.0f;
              pt[c * kBlockQ + r] = dst[c * kBlockQ + r] = 0.0f;
            }
            continue;
          }
          const vec::F<W> ref = vec::splat<W>(a.lse_ref[bh * queries + i0 + r]);
          const vec::F<W> rho = vec::splat<W>(a.lse_rho[bh * queries + i0 + r]);
          const vec::F<W> scale = vec::splat<W>(p.scale_log2);
          for (int64_t c = 0; c < kBlockK; c += W) {
            vec::store<W>(p_row + c, vec::exp2<W>((vec::load<W>(p_row + c) - ref) * scale - rho));
          }
          for (int64_t c = 0; c < c_lo; ++c) p_row[c] = 0.0f;
          for (int64_t c = c_hi; c < kBlockK; ++c) p_row[c] = 0.0f;
          // P^T (for dV) and dP take the dropout factors; dS keeps the undropped P.
          for (int64_t c = 0; c < kBlockK; ++c) pt[c * kBlockQ + r] = p_row[c];
          if (p.dropout) apply_dropout(p, b, h, i0 + r, j0, c_lo, c_hi, d_row, pt + r, kBlockQ);
          if (p.p_fp8.active()) {  // P^T as dV's FP8 operand
            for (int64_t c = 0; c < kBlockK; ++c)
              pt[c * kBlockQ + r] = p.p_fp8(pt[c * kBlockQ + r]);
          }
          const vec::F<W> delta = vec::splat<W>(a.delta[bh * queries + i0 + r]);
          for (int64_t c = 0; c < kBlockK; c += W) {
            vec::store<W>(d_row + c, vec::load<W>(p_row + c) * (vec::load<W>(d_row + c) - delta));
          }
          if (p.ds_fp8.active()) {  // dS as dQ's and dK's FP8 operand
            float& amax = ws[backward_workspace_floats(dp) - 1];
            amax = std::max(amax, round_fp8(p.ds_fp8, d_row, kBlockK));
          }
          for (int64_t c = 0; c < kBlockK; ++c) dst[c * kBlockQ + r] = d_row[c];
        }
        vec::gemm<W, R, NV>(kBlockK, dp, rows, pt, kBlockQ, do_tile, dp, dv_acc, dp, true);
        vec::gemm<W, R, NV>(kBlockK, dp, rows, dst, kBlockQ, q_tile, dp, dk_acc, dp, true);
        float* dq_tile = a.dq + ((split * s.batch + b) * s.heads + h) * queries * dp + i0 * dp;
        vec::gemm<W, R, NV>(rows, dp, kBlockK, dpr, kBlockK, k_head + j0 * dp, dp, dq_tile, dp,
                            true);
      }
    }
    for (int64_t c = 0; c < kBlockK && j0 + c < s.keys; ++c) {
      T* dk = a.dk + ((b * s.keys + j0 + c) * s.kv_heads + hk) * D;
      T* dv = a.dv + ((b * s.keys + j0 + c) * s.kv_heads + hk) * D;
      for (int64_t d = 0; d < D; ++d) {
        simd::store(dk_acc[c * dp + d] * s.scale, &dk[d]);
        simd::store(dv_acc[c * dp + d], &dv[d]);
      }
    }
  }
}

template <typename T>
OCTET_TARGET_AVX512 void backward_task_avx512(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                              int64_t split, float* ws) {
  backward_task<16, 4, 4>(a, b, hk, split, ws);
}
template <typename T>
OCTET_TARGET_AVX2 void backward_task_avx2(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                          int64_t split, float* ws) {
  backward_task<8, 4, 3>(a, b, hk, split, ws);
}
template <typename T>
void backward_task_scalar(const BackwardArgs<T>& a, int64_t b, int64_t hk, int64_t split,
                          float* ws) {
  backward_task<4, 2, 4>(a, b, hk, split, ws);
}

template <typename T>
void backward_typed(const Plan& p, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                    Tensor& dk, Tensor& dv) {
  const AttentionShape& s = p.s;
  const int64_t B = s.batch, queries = s.queries, S = s.keys, H = s.heads, Hkv = s.kv_heads;
  const int64_t D = s.head_dim, dp = p.dp;
  const int threads = num_threads();
  const int64_t kv_heads_total = B * Hkv;
  // Key-tile splits per kv head when there are too few heads to feed every thread; each split
  // owns an F32 dQ buffer, so at most kMaxSplits copies of q.
  constexpr int64_t kMaxSplits = 8;
  const int64_t splits = std::clamp<int64_t>((2 * threads + kv_heads_total - 1) / kv_heads_total, 1,
                                             std::min(kMaxSplits, p.k_tiles));

  Tensor qp = Tensor::zeros({B, H, queries, dp}, DType::F32);
  Tensor dop = Tensor::zeros({B, H, queries, dp}, DType::F32);
  Tensor kp = Tensor::zeros({B, Hkv, p.padded_keys, dp}, DType::F32);
  Tensor kt = Tensor::zeros({B, Hkv, p.k_tiles, dp, kBlockK}, DType::F32);
  Tensor vt = Tensor::zeros({B, Hkv, p.k_tiles, dp, kBlockK}, DType::F32);
  Tensor delta = Tensor::empty({B, H, queries}, DType::F32);
  Tensor dq_acc = Tensor::zeros({splits, B, H, queries, dp}, DType::F32);
  pack_rows(q.data<T>(), B, queries, H, D, 1.0f, queries, dp, qp.data<float>());
  Tensor lse_ref = Tensor::empty({B, H, queries}, DType::F32);
  Tensor lse_rho = Tensor::empty({B, H, queries}, DType::F32);
  {
    const int64_t parts = lse.ndim() == 4 ? 2 : 1;
    const float* in = lse.data<float>();
    float* ref = lse_ref.data<float>();
    float* rho = lse_rho.data<float>();
    const double scale = s.scale;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < B * H * queries; ++row) {
      const double value = attention_detail::read_lse(in, parts, row);
      if (!std::isfinite(value)) {  // a row that sees no key: every p is 0
        ref[row] = 0.0f;
        rho[row] = kInf;
        continue;
      }
      ref[row] = static_cast<float>(value / scale);
      rho[row] = static_cast<float>((value - double{ref[row]} * scale) * double{kLog2e});
    }
  }
  pack_rows(dout.data<T>(), B, queries, H, D, 1.0f, queries, dp, dop.data<float>());
  pack_rows(k.data<T>(), B, S, Hkv, D, 1.0f, p.padded_keys, dp, kp.data<float>());
  pack_transposed(k.data<T>(), B, S, Hkv, D, p.k_tiles, dp, kt.data<float>());
  pack_transposed(v.data<T>(), B, S, Hkv, D, p.k_tiles, dp, vt.data<float>());
  {
    const T* o = out.data<T>();
    const T* g = dout.data<T>();
    float* dl = delta.data<float>();
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < queries; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = ((b * queries + i) * H + h) * D;
          float sum = 0.0f;
          for (int64_t d = 0; d < D; ++d) sum += simd::load(o[at + d]) * simd::load(g[at + d]);
          dl[(b * H + h) * queries + i] = sum;
        }
      }
    }
  }

  auto task_fn = backward_task_scalar<T>;
  if (active_isa() == Isa::Avx512) task_fn = backward_task_avx512<T>;
  if (active_isa() == Isa::Avx2) task_fn = backward_task_avx2<T>;
  const BackwardArgs<T> args{&p,
                             qp.data<float>(),
                             dop.data<float>(),
                             kp.data<float>(),
                             kt.data<float>(),
                             vt.data<float>(),
                             lse_ref.data<float>(),
                             lse_rho.data<float>(),
                             delta.data<float>(),
                             dq_acc.data<float>(),
                             splits,
                             dk.data<T>(),
                             dv.data<T>()};
  const int64_t ws_floats = backward_workspace_floats(dp);
  Tensor workspace = Tensor::zeros({threads, ws_floats}, DType::F32);
  float* ws_base = workspace.data<float>();
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      for (int64_t split = 0; split < splits; ++split) {
        task_fn(args, b, hk, split, ws_base + omp_get_thread_num() * ws_floats);
      }
    }
  }
  if (p.o->fp8.ds_amax) *p.o->fp8.ds_amax = reduce_amax_slots(ws_base, threads, ws_floats);

  const float* acc = dq_acc.data<float>();
  T* out_dq = dq.data<T>();
  const int64_t split_stride = B * H * queries * dp;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < queries; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const float* row = acc + ((b * H + h) * queries + i) * dp;
        T* dst = out_dq + ((b * queries + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          float sum = 0.0f;
          for (int64_t sp = 0; sp < splits; ++sp) sum += row[sp * split_stride + d];
          simd::store(sum * s.scale, &dst[d]);
        }
      }
    }
  }
}

}  // namespace

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse) {
  const char* op = "flash_attention_forward";
  AttentionShape s = attention_detail::check_inputs(op, q, k, v, options);
  attention_detail::check_output(op, out, q, "out", "B,T,H,D");
  attention_detail::check_lse(op, lse, s);
  const Plan plan = make_plan(s, options);
  if (q.dtype() == DType::F32) {
    forward_typed<float>(plan, q, k, v, out, lse);
  } else {
    forward_typed<bfloat16>(plan, q, k, v, out, lse);
  }
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout,
                              const AttentionOptions& options, Tensor& dq, Tensor& dk, Tensor& dv) {
  const char* op = "flash_attention_backward";
  AttentionShape s = attention_detail::check_inputs(op, q, k, v, options);
  attention_detail::check_output(op, out, q, "out", "B,T,H,D");
  attention_detail::check_output(op, dout, q, "dout", "B,T,H,D");
  attention_detail::check_lse(op, lse, s);
  attention_detail::check_output(op, dq, q, "dq", "B,T,H,D");
  attention_detail::check_output(op, dk, k, "dk", "B,S,Hkv,D");
  attention_detail::check_output(op, dv, v, "dv", "B,S,Hkv,D");
  const Plan plan = make_plan(s, options);
  if (q.dtype() == DType::F32) {
    backward_typed<float>(plan, q, k, v, out, lse, dout, dq, dk, dv);
  } else {
    backward_typed<bfloat16>(plan, q, k, v, out, lse, dout, dq, dk, dv);
  }
}

}  // namespace octet::ops::cpu
