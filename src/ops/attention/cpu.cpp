// Attention, fast path: FlashAttention-2 on the CPU.
//
// K and V are first packed to F32, per kv head, D padded to 16 (Kt also transposed per key
// tile) so that every tile product is a register-blocked vec::gemm. Forward: one task per
// (batch, head, 64-query tile) runs the online softmax over the visible 64-key tiles and
// writes out and lse. Backward: one task per (batch, kv head, k-tile split) recomputes the
// probabilities from lse, accumulates dK and dV of its key tiles locally over the whole query
// group, and adds dQ into the split's own F32 buffer, summed at the end (no races, no atomics).
// Scratch is Tensors linear in T and S, plus fixed per-thread tiles: never T x S.
// An additive bias [H,T,S] is added to each score tile (forward and the backward's
// recomputation); its gradient dbias sums dS over the batch: batch entries are dealt to a few
// chunks, each with its own [H,T,S] buffer (the first is dbias itself) and run one after
// another inside each (chunk, kv head, split) task, so no two threads write one element; the
// buffers are summed at the end. Only then is scratch T x S: the bias already is.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/convert.h"
#include "octet/cpu_features.h"
#include "ops/attention/bf16_dot.h"
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
  float scale_log2 = 0.0f;      // scores are kept in the log2 domain: exp2 instead of exp
  const float* bias = nullptr;  // [H,T,S] or null
  float inv_scale = 0.0f;       // 1 / the softmax scale: bias enters the unscaled scores
  bool dropout = false;
  bool bf16_tiles = false;  // tile products in BF16 pairs (bf16_dot.h)
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  attention_detail::Fp8Rounder p_fp8, ds_fp8;  // inactive unless options.fp8 sets a scale
};

// BF16 tiles for BF16 inputs where the processor has VDPBF16PS at least 0.75x as fast as its F32
// FMA per flop (bf16_dot_rate(), the rule BF16 GEMMs follow), unless FP8 attention rounds P or
// dS to FP8 (those stay F32 operands). OCTET_ATTENTION_TILES=bf16|f32 forces a path (bf16 only
// where the processor has it; the tests run both), auto (or unset) chooses.
bool use_bf16_tiles(const AttentionOptions& o, DType dtype) {
  const char* text = std::getenv("OCTET_ATTENTION_TILES");
  const std::string choice = text != nullptr ? text : "";
  OCTET_CHECK(choice.empty() || choice == "auto" || choice == "bf16" || choice == "f32",
              "OCTET_ATTENTION_TILES expected bf16, f32 or auto, got '", choice, "'");
  if (dtype != DType::BF16 || active_isa() != Isa::Avx512 || !cpu_features().avx512_bf16) {
    return false;
  }
  if (o.fp8.enabled()) return false;
  if (choice == "bf16" || choice == "f32") return choice == "bf16";
  return bf16_dot_rate() >= 0.75;
}

Plan make_plan(const AttentionShape& s, const AttentionOptions& o, DType dtype) {
  Plan p;
  p.bf16_tiles = use_bf16_tiles(o, dtype);
  p.s = s;
  p.o = &o;
  p.dp = round_up(s.head_dim, kPadD);
  p.q_tiles = (s.queries + kBlockQ - 1) / kBlockQ;
  p.k_tiles = (s.keys + kBlockK - 1) / kBlockK;
  p.padded_keys = p.k_tiles * kBlockK;
  p.bias = o.bias != nullptr ? o.bias->data<float>() : nullptr;
  p.inv_scale = 1.0f / s.scale;
  p.scale_log2 = s.scale * kLog2e;
  p.dropout = o.dropout > 0.0f;
  p.threshold = attention_detail::dropout_threshold(o.dropout);
  p.keep_scale = 1.0f / (1.0f - o.dropout);
  p.p_fp8 = attention_detail::Fp8Rounder(o.fp8.p_format, o.fp8.p_scale);
  p.ds_fp8 = attention_detail::Fp8Rounder(o.fp8.ds_format, o.fp8.ds_scale);
  return p;
}

// ---- packing: loops over bshd rows --------------------------------------------------------------

// One row: out[0, D) := in[0, D) as Out (BF16 to F32 by the bulk conversion), out[D, dp) := 0.
template <typename T, typename Out>
void pack_row(const T* in, int64_t D, int64_t dp, Out* out) {
  if constexpr (std::is_same_v<T, Out>) {
    std::memcpy(out, in, D * sizeof(T));
  } else if constexpr (std::is_same_v<T, bfloat16> && std::is_same_v<Out, float>) {
    convert_bf16_to_f32(in, out, static_cast<size_t>(D));
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = simd::load(in[d]);
  }
  std::memset(static_cast<void*>(out + D), 0, (dp - D) * sizeof(Out));
}

// dst [B,Hx,rows,dp] := src [B,L,Hx,D], as F32 or (BF16 tiles) as the BF16 itself, every
// element written: columns from D on and rows from L on as zeros. The source is read in its
// own order, a token's heads side by side (walking one head's rows, a row apart, read it at a
// fraction of the bandwidth: the packs took a sixth of the fused forward + backward at T = 256
// on a Zen 3 VM).
template <typename T, typename Out>
void pack_rows(const T* src, int64_t B, int64_t L, int64_t Hx, int64_t D, int64_t rows, int64_t dp,
               Out* dst) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < rows; ++l) {
      for (int64_t h = 0; h < Hx; ++h) {
        Out* out = dst + ((b * Hx + h) * rows + l) * dp;
        if (l < L) {
          pack_row(src + ((b * L + l) * Hx + h) * D, D, dp, out);
        } else {
          std::memset(static_cast<void*>(out), 0, dp * sizeof(Out));
        }
      }
    }
  }
}

// out[i * kBlockK + j] := in[j * stride + i] for i, j < 8: eight rows of eight floats transposed
// (unpacks within 128-bit lanes, then the lanes exchanged).
OCTET_TARGET_AVX2 void transpose_8x8(const float* in, int64_t stride, float* out) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(in + j * stride);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    for (int e = 0; e < 2; ++e) {
      const __m256 a = t[j + e], c = t[j + 2 + e];
      r[j + 2 * e] = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(1, 0, 1, 0));
      r[j + 2 * e + 1] = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 2, 3, 2));
    }
  }
  // r[i], i < 4: column i of rows 0-3 in the low lane, column i + 4 in the high lane; r[4 + i]
  // the same for rows 4-7.
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * kBlockK, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
    _mm256_storeu_ps(out + (i + 4) * kBlockK, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
  }
}

// A tile's rows [kBlockK][dp] (F32, keys past the sequence as zeros) transposed into
// tile [dp][kBlockK].
OCTET_TARGET_AVX2 void transpose_tile_avx2(const float* rows, int64_t dp, float* tile) {
  for (int64_t d = 0; d < dp; d += 8) {
    for (int64_t c = 0; c < kBlockK; c += 8) {
      transpose_8x8(rows + c * dp + d, dp, tile + d * kBlockK + c);
    }
  }
}

// dst [B,Hkv,k_tiles,dp,kBlockK], every element written: each key tile transposed, keys
// contiguous, d from D on and keys from S on as zeros. A task takes a key tile of every head:
// its keys' rows read in order (heads side by side) and widened into F32 rows of dp per head,
// then each head's tile transposed 8 x 8 in registers where the processor has AVX2.
template <typename T>
void pack_transposed(const T* src, int64_t B, int64_t S, int64_t Hkv, int64_t D, int64_t k_tiles,
                     int64_t dp, float* dst) {
  const bool avx2 = active_isa() != Isa::Scalar;
#pragma omp parallel
  {
    std::vector<float> rows(static_cast<size_t>(Hkv * kBlockK * dp));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < k_tiles; ++t) {
        const int64_t keys = std::clamp<int64_t>(S - t * kBlockK, 0, kBlockK);
        for (int64_t c = 0; c < kBlockK; ++c) {
          for (int64_t h = 0; h < Hkv; ++h) {
            float* row = rows.data() + (h * kBlockK + c) * dp;
            if (c < keys) {
              pack_row(src + ((b * S + t * kBlockK + c) * Hkv + h) * D, D, dp, row);
            } else {
              std::fill_n(row, dp, 0.0f);
            }
          }
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          const float* head = rows.data() + h * kBlockK * dp;
          float* tile = dst + ((b * Hkv + h) * k_tiles + t) * dp * kBlockK;
          if (avx2) {
            transpose_tile_avx2(head, dp, tile);
            continue;
          }
          for (int64_t d = 0; d < dp; ++d) {
            for (int64_t c = 0; c < kBlockK; ++c) tile[d * kBlockK + c] = head[c * dp + d];
          }
        }
      }
    }
  }
}

// BF16 tiles (bf16_dot.h). dst [B,Hkv,k_tiles,dp/2,kBlockK,2], every element written (the
// padding with zeros): each key tile's keys in pairs along d, for S = Q K^T. A pair is one
// 32-bit word, so this is a transpose of words, 16 x 16 at a time (an odd D word by word).
void pack_pairs_along_d(const bfloat16* src, int64_t B, int64_t S, int64_t Hkv, int64_t D,
                        int64_t k_tiles, int64_t dp, bfloat16* dst) {
  const int64_t whole = D / 2, words = dp / 2;  // whole pairs in a row; pairs per packed row
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t t = 0; t < k_tiles; ++t) {
        auto* tile =
            reinterpret_cast<uint32_t*>(dst + ((b * Hkv + h) * k_tiles + t) * dp * kBlockK);
        const int64_t first_key = t * kBlockK;
        if (D % 2 == 0) {
          const auto* in =
              reinterpret_cast<const uint32_t*>(src + ((b * S + first_key) * Hkv + h) * D);
          for (int64_t c = 0; c < kBlockK; c += 16) {
            const int64_t keys = std::clamp<int64_t>(S - first_key - c, 0, 16);
            for (int64_t w = 0; w < words; w += 16) {
              bf16dot::transpose_words_16x16(in + c * Hkv * whole + w, Hkv * whole, keys,
                                             std::clamp<int64_t>(whole - w, 0, 16),
                                             tile + w * kBlockK + c, kBlockK,
                                             std::min<int64_t>(words - w, 16));
            }
          }
          continue;
        }
        for (int64_t c = 0; c < kBlockK; ++c) {
          const int64_t key = first_key + c;
          int64_t w = 0;
          if (key < S) {
            const bfloat16* in = src + ((b * S + key) * Hkv + h) * D;
            for (; w < whole; ++w)
              tile[w * kBlockK + c] = in[2 * w].bits | uint32_t{in[2 * w + 1].bits} << 16;
            tile[w++ * kBlockK + c] = in[D - 1].bits;  // (last, 0)
          }
          for (; w < words; ++w) tile[w * kBlockK + c] = 0;
        }
      }
    }
  }
}

// dst [B,Hx,rows/2,dp,2], every element written (rows from L on and d from D on as zeros): rows
// in pairs along the rows, for the products that reduce over them (P V, dS K, dO^T P, Q^T dS).
void pack_pairs_along_keys(const bfloat16* src, int64_t B, int64_t L, int64_t Hx, int64_t D,
                           int64_t rows, int64_t dp, bfloat16* dst) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hx; ++h) {
      bf16dot::interleave_bf16_rows(reinterpret_cast<const uint16_t*>(src + (b * L * Hx + h) * D),
                                    Hx * D, L, rows, D, dp,
                                    reinterpret_cast<uint16_t*>(dst + (b * Hx + h) * rows * dp));
    }
  }
}

// Storage for a pack: every pack writes all of its elements (the padding as zeros).
Tensor pack_storage(bool bf16, Shape shape) {
  return Tensor::empty(std::move(shape), bf16 ? DType::BF16 : DType::F32);
}

// dst[0, n) := src[0, n) in T (BF16: the bulk conversion, nearest even).
template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    convert_f32_to_bf16(src, dst, static_cast<size_t>(n));
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

// With a bias, row[c] += bias[h, i, j0 + c] / scale for the visible columns [c_lo, c_hi) (the
// rest are masked after): the tile's scores stay unscaled (scale * row is the softmax's score),
// so a zero bias changes nothing, and rounding the sum costs what scaling first would (T5's
// scale of 1 adds the bias exactly).
OCTET_ALWAYS_INLINE void add_bias(const Plan& p, int64_t h, int64_t i, int64_t j0, int64_t c_lo,
                                  int64_t c_hi, float* row) {
  if (p.bias == nullptr) return;
  const float* bias = p.bias + (h * p.s.queries + i) * p.s.keys + j0;
  const float inv_scale = p.inv_scale;
  for (int64_t c = c_lo; c < c_hi; ++c) row[c] += bias[c] * inv_scale;
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
  // F32 tiles: kt [B,Hkv,k_tiles,dp,kBlockK] and v [B,Hkv,padded_keys,dp], F32.
  // BF16 tiles (bf16_dot.h): kt [B,Hkv,k_tiles,dp/2,kBlockK,2] (pairs along d) and
  // v [B,Hkv,padded_keys/2,dp,2] (pairs along the keys), BF16.
  const void* kt;
  const void* v;
  // F32 tiles: q packed [B,H,T,dp], F32 (null: the tiles read q's rows in place).
  const float* q_rows;
  T* out;
  float* lse;
  int64_t lse_parts;  // 1: F32 lse; 2: hi + lo
};

constexpr int64_t forward_workspace_floats(int64_t dp) {
  // + P in BF16 (BF16 tiles) + the amax slot
  return 2 * kBlockQ * dp + kBlockQ * kBlockK + 2 * kBlockQ + kBlockQ * kBlockK / 2 + 1;
}

// Bf16: the tile products in BF16 pairs (W = 16 under OCTET_TARGET_AVX512_BF16, T = bfloat16).
template <int W, int R, int NV, bool Bf16, typename T>
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
  uint16_t* pb = reinterpret_cast<uint16_t*>(l + kBlockQ);  // [rows, kBlockK] P in BF16
  uint16_t* qb = reinterpret_cast<uint16_t*>(qs);           // [rows, dp] queries in BF16
  KeyRange ranges[kBlockQ];
  const KeyRange all = tile_ranges(p, b, i0, rows, ranges);
  for (int64_t r = 0; r < rows; ++r) l[r] = 0.0f;

  if (!all.empty()) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = a.q + ((b * s.queries + i0 + r) * s.heads + h) * D;
      float* row = qs + r * dp;
      // Unscaled: the scores' maximum is subtracted before they are scaled, so x - max is exact
      // near the maximum and the probabilities keep F32 accuracy at any score magnitude.
      if constexpr (Bf16) {
        std::memcpy(qb + r * dp, in, D * sizeof(uint16_t));
        for (int64_t d = D; d < dp; ++d) qb[r * dp + d] = 0;
      } else if (a.q_rows != nullptr) {
        std::memcpy(row, a.q_rows + ((b * s.heads + h) * s.queries + i0 + r) * dp,
                    dp * sizeof(float));
      } else {
        for (int64_t d = 0; d < D; ++d) row[d] = simd::load(in[d]);
        for (int64_t d = D; d < dp; ++d) row[d] = 0.0f;
      }
      for (int64_t d = 0; d < dp; ++d) acc[r * dp + d] = 0.0f;
      m[r] = -kInf;
    }
    const int64_t kt_head = (b * s.kv_heads + hk) * p.k_tiles * dp * kBlockK;  // elements
    const int64_t v_head = (b * s.kv_heads + hk) * p.padded_keys * dp;
    for (int64_t kt = all.lo / kBlockK; kt * kBlockK < all.hi; ++kt) {
      const int64_t j0 = kt * kBlockK;
      if constexpr (Bf16) {
        bf16dot::gemm(rows, kBlockK, dp / 2, reinterpret_cast<const uint32_t*>(qb), dp / 2, 1,
                      static_cast<const uint16_t*>(a.kt) + kt_head + kt * dp * kBlockK, 2 * kBlockK,
                      sc, kBlockK, false);
      } else {
        vec::gemm<W, R, NV>(rows, kBlockK, dp, qs, dp,
                            static_cast<const float*>(a.kt) + kt_head + kt * dp * kBlockK, kBlockK,
                            sc, kBlockK, false);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sc + r * kBlockK;
        int64_t c_lo, c_hi;
        tile_columns(ranges[r], j0, c_lo, c_hi);
        if (c_lo >= c_hi) {  // this row sees nothing here
          for (int64_t c = 0; c < kBlockK; ++c) row[c] = 0.0f;
          if constexpr (Bf16) std::fill_n(pb + r * kBlockK, kBlockK, uint16_t{0});
          continue;
        }
        add_bias(p, h, i0 + r, j0, c_lo, c_hi, row);
        for (int64_t c = 0; c < c_lo; ++c) row[c] = -kInf;
        for (int64_t c = c_hi; c < kBlockK; ++c) row[c] = -kInf;
        vec::F<W> max_v = vec::splat<W>(-kInf);
        for (int64_t c = 0; c < kBlockK; c += W) {
          const vec::F<W> x = vec::load<W>(row + c);
          max_v = x > max_v ? x : max_v;
        }
        // All in vectors (the maximum and the sum splat by butterflies, alpha by the vector
        // exp2): no scalar reduction or libm call per row.
        const vec::F<W> scale_v = vec::splat<W>(p.scale_log2), m_old = vec::splat<W>(m[r]);
        max_v = vec::all_max<W>(max_v);
        const vec::F<W> m_v = max_v > m_old ? max_v : m_old;
        const vec::F<W> alpha_v = vec::exp2<W>((m_old - m_v) * scale_v);
        vec::F<W> sum_v{};
        for (int64_t c = 0; c < kBlockK; c += W) {
          const vec::F<W> e = vec::exp2<W>((vec::load<W>(row + c) - m_v) * scale_v);
          vec::store<W>(row + c, e);
          sum_v += e;
        }
        l[r] = l[r] * alpha_v[0] + vec::all_sum<W>(sum_v)[0];
        m[r] = m_v[0];
        if (alpha_v[0] != 1.0f) {
          for (int64_t d = 0; d < dp; d += W) {
            vec::store<W>(acc + r * dp + d, vec::load<W>(acc + r * dp + d) * alpha_v);
          }
        }
        if (p.dropout) apply_dropout(p, b, h, i0 + r, j0, c_lo, c_hi, row, nullptr, 0);
        if (p.p_fp8.active()) {
          float& amax = ws[forward_workspace_floats(dp) - 1];
          amax = std::max(amax, round_fp8(p.p_fp8, row, kBlockK));
        }
        if constexpr (Bf16) bf16dot::round_row(row, pb + r * kBlockK, kBlockK);
      }
      if constexpr (Bf16) {
        bf16dot::gemm(rows, dp, kBlockK / 2, reinterpret_cast<const uint32_t*>(pb), kBlockK / 2, 1,
                      static_cast<const uint16_t*>(a.v) + v_head + j0 * dp, 2 * dp, acc, dp, true);
      } else {
        vec::gemm<W, R, NV>(rows, dp, kBlockK, sc, kBlockK,
                            static_cast<const float*>(a.v) + v_head + j0 * dp, dp, acc, dp, true);
      }
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
  forward_tile<16, 4, 4, false>(a, b, h, qt, ws);
}
OCTET_TARGET_AVX512_BF16 void forward_tile_bf16(const ForwardArgs<bfloat16>& a, int64_t b,
                                                int64_t h, int64_t qt, float* ws) {
  forward_tile<16, 4, 4, true>(a, b, h, qt, ws);
}
template <typename T>
OCTET_TARGET_AVX2 void forward_tile_avx2(const ForwardArgs<T>& a, int64_t b, int64_t h, int64_t qt,
                                         float* ws) {
  // Blocks of 2 rows x 4 vectors (32 columns): a tile's 64 keys, and head sizes of 64 or 128,
  // leave no one-vector remainder, whose loop (a broadcast per FMA) took a fifth of the time
  // with 4 x 3 blocks. 4 x 3 -> 2 x 4 ran the forward 5-10% and the backward 8-15% faster at
  // T = 256 and 1024 on a Zen 3 VM.
  forward_tile<8, 2, 4, false>(a, b, h, qt, ws);
}
template <typename T>
void forward_tile_scalar(const ForwardArgs<T>& a, int64_t b, int64_t h, int64_t qt, float* ws) {
  forward_tile<4, 2, 4, false>(a, b, h, qt, ws);
}

template <typename T>
void forward_typed(const Plan& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                   Tensor& lse) {
  const AttentionShape& s = p.s;
  const bool bf16 = p.bf16_tiles;
  auto pack = [bf16](Shape shape) { return pack_storage(bf16, std::move(shape)); };
  Tensor kt = pack({s.batch, s.kv_heads, p.k_tiles, p.dp, kBlockK});
  Tensor vp = pack({s.batch, s.kv_heads, p.padded_keys, p.dp});
  auto tile_fn = forward_tile_scalar<T>;
  if (active_isa() == Isa::Avx512) tile_fn = forward_tile_avx512<T>;
  if (active_isa() == Isa::Avx2) tile_fn = forward_tile_avx2<T>;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (bf16) {
      tile_fn = forward_tile_bf16;
      pack_pairs_along_d(k.data<bfloat16>(), s.batch, s.keys, s.kv_heads, s.head_dim, p.k_tiles,
                         p.dp, kt.data<bfloat16>());
      pack_pairs_along_keys(v.data<bfloat16>(), s.batch, s.keys, s.kv_heads, s.head_dim,
                            p.padded_keys, p.dp, vp.data<bfloat16>());
    }
  }
  if (!bf16) {
    pack_transposed(k.data<T>(), s.batch, s.keys, s.kv_heads, s.head_dim, p.k_tiles, p.dp,
                    kt.data<float>());
    pack_rows(v.data<T>(), s.batch, s.keys, s.kv_heads, s.head_dim, p.padded_keys, p.dp,
              vp.data<float>());
  }
  // F32 tiles: q's rows packed too, so that a tile reads 64 rows side by side and not a row
  // of each token (the heads between them).
  Tensor qp = bf16 ? Tensor() : pack({s.batch, s.heads, s.queries, p.dp});
  if (!bf16) {
    pack_rows(q.data<T>(), s.batch, s.queries, s.heads, s.head_dim, s.queries, p.dp,
              qp.data<float>());
  }
  const ForwardArgs<T> args{&p,
                            q.data<T>(),
                            kt.raw(),
                            vp.raw(),
                            bf16 ? nullptr : qp.data<float>(),
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
  // F32 tiles: q and dout [B,H,T,dp], k [B,Hkv,padded_keys,dp], kt and vt
  // [B,Hkv,k_tiles,dp,kBlockK], all F32.
  // BF16 tiles (bf16_dot.h), all BF16: q and dout [B,H,T,dp]; k [B,Hkv,padded_keys/2,dp,2]
  // (pairs along the keys, for dS K); kt and vt [B,Hkv,k_tiles,dp/2,kBlockK,2] (pairs along d,
  // for Q K^T and dO V^T); q_pairs and dout_pairs [B,H,q_tiles*kBlockQ/2,dp,2] (pairs along the
  // queries, for dV^T += dO^T P and dK^T += Q^T dS).
  // rows_in_place: q and dout are the inputs themselves ([B,T,H,D], BF16 tiles with D == dp).
  const void* q;
  const void* dout;
  bool rows_in_place;
  const void* k;
  const void* kt;
  const void* vt;
  const void* q_pairs;
  const void* dout_pairs;
  // Each row's lse as ref * scale + rho (ref an F32 in the unscaled scores' units, near the
  // row's maximum; rho the rest, here times log2 e): p = exp2((s - ref) * scale log2 e - rho),
  // where s - ref is exact near the maximum.
  const float* lse_ref;  // [B,H,T]
  const float* lse_rho;  // [B,H,T]
  const float* delta;    // [B,H,T] rowsum(dout * out)
  float* dq;             // [splits,B,H,T,dp]
  int64_t splits;
  // dbias: batch entry b adds its dS to dbias_chunks[b % chunks], [H,T,S] (null: no dbias).
  float* const* dbias_chunks;
  int64_t chunks;
  T* dk;
  T* dv;
};

constexpr int64_t backward_workspace_floats(int64_t dp) {
  // + P and dS in BF16 pairs, dS in BF16 rows and dK, dV transposed back (BF16 tiles) + the
  // amax slot
  return 3 * kBlockQ * kBlockK + 2 * kBlockK * dp + 3 * kBlockQ * kBlockK / 2 + 2 * kBlockK * dp +
         1;
}

// dst [ceil(rows/2), kBlockK, 2] := rows r and r + 1 of src [rows, kBlockK] as BF16 pairs (the
// missing row of an odd count as zeros).
OCTET_ALWAYS_INLINE void interleave_tile(const float* src, int64_t rows, const float* zeros,
                                         uint16_t* dst) {
  for (int64_t r = 0; r < rows; r += 2) {
    const float* second = r + 1 < rows ? src + (r + 1) * kBlockK : zeros;
    bf16dot::interleave_rows(src + r * kBlockK, second, dst + r * kBlockK, kBlockK);
  }
}

// Bf16: the tile products in BF16 pairs (W = 16 under OCTET_TARGET_AVX512_BF16, T = bfloat16);
// dK and dV are then accumulated transposed ([dp, kBlockK]).
template <int W, int R, int NV, bool Bf16, typename T>
OCTET_ALWAYS_INLINE void backward_task(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                       int64_t split, float* ws) {
  const Plan& p = *a.plan;
  const AttentionShape& s = p.s;
  const int64_t D = s.head_dim, dp = p.dp, queries = s.queries;
  const int64_t pair_rows = p.q_tiles * kBlockQ / 2;  // rows of q_pairs / dout_pairs per head
  float* sc = ws;                                     // [rows, kBlockK] scores -> P
  float* dpr = sc + kBlockQ * kBlockK;                // [rows, kBlockK] dP -> dS
  float* pd = dpr + kBlockQ * kBlockK;     // [rows, kBlockK] P dropped / rounded (dV's operand)
  float* dk_acc = pd + kBlockQ * kBlockK;  // [kBlockK, dp] (BF16 tiles: [dp, kBlockK])
  float* dv_acc = dk_acc + kBlockK * dp;   // [kBlockK, dp] (BF16 tiles: [dp, kBlockK])
  uint16_t* p_pairs = reinterpret_cast<uint16_t*>(dv_acc + kBlockK * dp);  // [rows/2,kBlockK,2]
  uint16_t* ds_pairs = p_pairs + kBlockQ * kBlockK;                        // [rows/2,kBlockK,2]
  uint16_t* ds_rows = ds_pairs + kBlockQ * kBlockK;                        // [rows, kBlockK]
  float* dk_back = reinterpret_cast<float*>(ds_rows + kBlockQ * kBlockK);  // [kBlockK, dp]
  float* dv_back = dk_back + kBlockK * dp;                                 // [kBlockK, dp]
  // dV's operand is P itself unless dropout or FP8 changes it (dS keeps the undropped P).
  const bool own_pd = p.dropout || p.p_fp8.active();
  const float* pv = own_pd ? pd : sc;
  alignas(64) static constexpr float kZeros[kBlockK] = {};
  KeyRange ranges[kBlockQ];
  const int64_t kv_head = b * s.kv_heads + hk;
  for (int64_t kt = split; kt < p.k_tiles; kt += a.splits) {
    const int64_t j0 = kt * kBlockK;
    const int64_t tile_at = (kv_head * p.k_tiles + kt) * dp * kBlockK;  // elements
    for (int64_t x = 0; x < kBlockK * dp; ++x) dk_acc[x] = dv_acc[x] = 0.0f;
    for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
      const int64_t bh = b * s.heads + h;
      for (int64_t qt = 0; qt < p.q_tiles; ++qt) {
        const int64_t i0 = qt * kBlockQ, rows = std::min(kBlockQ, queries - i0);
        const KeyRange all = tile_ranges(p, b, i0, rows, ranges);
        if (all.empty() || all.hi <= j0 || all.lo >= j0 + kBlockK) continue;
        const int64_t q_at = (bh * queries + i0) * dp;  // elements
        if constexpr (Bf16) {
          // The query rows (and dO's) in place or packed; their words as A's pairs.
          const int64_t row_at = a.rows_in_place ? ((b * queries + i0) * s.heads + h) * D : q_at;
          const int64_t row_words = (a.rows_in_place ? s.heads * D : dp) / 2;
          const auto* q_words =
              reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(a.q) + row_at);
          const auto* do_words =
              reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(a.dout) + row_at);
          bf16dot::gemm(rows, kBlockK, dp / 2, q_words, row_words, 1,
                        static_cast<const uint16_t*>(a.kt) + tile_at, 2 * kBlockK, sc, kBlockK,
                        false);
          bf16dot::gemm(rows, kBlockK, dp / 2, do_words, row_words, 1,
                        static_cast<const uint16_t*>(a.vt) + tile_at, 2 * kBlockK, dpr, kBlockK,
                        false);
        } else {
          const float* q_tile = static_cast<const float*>(a.q) + q_at;
          const float* do_tile = static_cast<const float*>(a.dout) + q_at;
          vec::gemm<W, R, NV>(rows, kBlockK, dp, q_tile, dp,
                              static_cast<const float*>(a.kt) + tile_at, kBlockK, sc, kBlockK,
                              false);
          vec::gemm<W, R, NV>(rows, kBlockK, dp, do_tile, dp,
                              static_cast<const float*>(a.vt) + tile_at, kBlockK, dpr, kBlockK,
                              false);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* p_row = sc + r * kBlockK;
          float* d_row = dpr + r * kBlockK;
          float* pd_row = pd + r * kBlockK;
          int64_t c_lo, c_hi;
          tile_columns(ranges[r], j0, c_lo, c_hi);
          if (c_lo >= c_hi) {
            for (int64_t c = 0; c < kBlockK; ++c) p_row[c] = d_row[c] = pd_row[c] = 0.0f;
            continue;
          }
          add_bias(p, h, i0 + r, j0, c_lo, c_hi, p_row);
          const vec::F<W> ref = vec::splat<W>(a.lse_ref[bh * queries + i0 + r]);
          const vec::F<W> rho = vec::splat<W>(a.lse_rho[bh * queries + i0 + r]);
          const vec::F<W> scale = vec::splat<W>(p.scale_log2);
          for (int64_t c = 0; c < kBlockK; c += W) {
            vec::store<W>(p_row + c, vec::exp2<W>((vec::load<W>(p_row + c) - ref) * scale - rho));
          }
          for (int64_t c = 0; c < c_lo; ++c) p_row[c] = 0.0f;
          for (int64_t c = c_hi; c < kBlockK; ++c) p_row[c] = 0.0f;
          if (own_pd) {  // P (for dV) and dP take the dropout factors; dS keeps the undropped P
            for (int64_t c = 0; c < kBlockK; ++c) pd_row[c] = p_row[c];
            if (p.dropout) apply_dropout(p, b, h, i0 + r, j0, c_lo, c_hi, d_row, pd_row, 1);
            if (p.p_fp8.active()) {  // dV's FP8 operand
              for (int64_t c = 0; c < kBlockK; ++c) pd_row[c] = p.p_fp8(pd_row[c]);
            }
          }
          const vec::F<W> delta = vec::splat<W>(a.delta[bh * queries + i0 + r]);
          for (int64_t c = 0; c < kBlockK; c += W) {
            vec::store<W>(d_row + c, vec::load<W>(p_row + c) * (vec::load<W>(d_row + c) - delta));
          }
          if (a.dbias_chunks != nullptr) {  // this task alone writes these (h, i, j) of the chunk
            float* dbias = a.dbias_chunks[b % a.chunks] + (h * queries + i0 + r) * s.keys + j0;
            for (int64_t c = c_lo; c < c_hi; ++c) dbias[c] += d_row[c];
          }
          if (p.ds_fp8.active()) {  // dS as dQ's and dK's FP8 operand
            float& amax = ws[backward_workspace_floats(dp) - 1];
            amax = std::max(amax, round_fp8(p.ds_fp8, d_row, kBlockK));
          }
        }
        float* dq_tile = a.dq + ((split * s.batch + b) * s.heads + h) * queries * dp + i0 * dp;
        if constexpr (Bf16) {
          interleave_tile(pv, rows, kZeros, p_pairs);
          interleave_tile(dpr, rows, kZeros, ds_pairs);
          for (int64_t r = 0; r < rows; ++r) {
            bf16dot::round_row(dpr + r * kBlockK, ds_rows + r * kBlockK, kBlockK);
          }
          const int64_t pairs_at = (bh * pair_rows + i0 / 2) * dp * 2;  // elements
          const int64_t row_pairs = (rows + 1) / 2;
          // dV^T [dp, keys] += dO^T P and dK^T += Q^T dS: A's pair (d, row pair) at word
          // d + pair * dp of the pairs-along-queries packs.
          bf16dot::gemm(dp, kBlockK, row_pairs,
                        reinterpret_cast<const uint32_t*>(
                            static_cast<const uint16_t*>(a.dout_pairs) + pairs_at),
                        1, dp, p_pairs, 2 * kBlockK, dv_acc, kBlockK, true);
          bf16dot::gemm(
              dp, kBlockK, row_pairs,
              reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(a.q_pairs) + pairs_at),
              1, dp, ds_pairs, 2 * kBlockK, dk_acc, kBlockK, true);
          bf16dot::gemm(rows, dp, kBlockK / 2, reinterpret_cast<const uint32_t*>(ds_rows),
                        kBlockK / 2, 1,
                        static_cast<const uint16_t*>(a.k) + kv_head * p.padded_keys * dp + j0 * dp,
                        2 * dp, dq_tile, dp, true);
        } else {
          const float* q_tile = static_cast<const float*>(a.q) + q_at;
          const float* do_tile = static_cast<const float*>(a.dout) + q_at;
          vec::gemm<W, R, NV, true>(kBlockK, dp, rows, pv, kBlockK, do_tile, dp, dv_acc, dp, true);
          vec::gemm<W, R, NV, true>(kBlockK, dp, rows, dpr, kBlockK, q_tile, dp, dk_acc, dp, true);
          vec::gemm<W, R, NV>(rows, dp, kBlockK, dpr, kBlockK,
                              static_cast<const float*>(a.k) + (kv_head * p.padded_keys + j0) * dp,
                              dp, dq_tile, dp, true);
        }
      }
    }
    // dK and dV rows of this key tile, through rows of F32 (the scores' scale applied to dK)
    // into the output dtype; under BF16 tiles the accumulators are [dp, kBlockK], transposed
    // back 16 x 16 first.
    const float* dk_rows = dk_acc;
    const float* dv_rows = dv_acc;
    if constexpr (Bf16) {
      for (int64_t d0 = 0; d0 < dp; d0 += 16) {
        for (int64_t c0 = 0; c0 < kBlockK; c0 += 16) {
          for (auto [from, to] : {std::pair{dk_acc, dk_back}, std::pair{dv_acc, dv_back}}) {
            bf16dot::transpose_words_16x16(
                reinterpret_cast<const uint32_t*>(from + d0 * kBlockK + c0), kBlockK, 16, 16,
                reinterpret_cast<uint32_t*>(to + c0 * dp + d0), dp, 16);
          }
        }
      }
      dk_rows = dk_back;
      dv_rows = dv_back;
    }
    float* row = pd;  // free again
    for (int64_t c = 0; c < kBlockK && j0 + c < s.keys; ++c) {
      for (int64_t d = 0; d < D; ++d) row[d] = dk_rows[c * dp + d] * s.scale;
      const int64_t at = ((b * s.keys + j0 + c) * s.kv_heads + hk) * D;
      store_row(row, a.dk + at, D);
      store_row(dv_rows + c * dp, a.dv + at, D);
    }
  }
}

template <typename T>
OCTET_TARGET_AVX512 void backward_task_avx512(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                              int64_t split, float* ws) {
  backward_task<16, 4, 4, false>(a, b, hk, split, ws);
}
OCTET_TARGET_AVX512_BF16 void backward_task_bf16(const BackwardArgs<bfloat16>& a, int64_t b,
                                                 int64_t hk, int64_t split, float* ws) {
  backward_task<16, 4, 4, true>(a, b, hk, split, ws);
}
template <typename T>
OCTET_TARGET_AVX2 void backward_task_avx2(const BackwardArgs<T>& a, int64_t b, int64_t hk,
                                          int64_t split, float* ws) {
  backward_task<8, 2, 4, false>(a, b, hk, split, ws);  // as forward_tile_avx2
}
template <typename T>
void backward_task_scalar(const BackwardArgs<T>& a, int64_t b, int64_t hk, int64_t split,
                          float* ws) {
  backward_task<4, 2, 4, false>(a, b, hk, split, ws);
}

// dbias's per-chunk buffers: the first is dbias itself, zeroed; the others [chunks - 1, H, T, S]
// scratch, added into it at the end. Empty without dbias.
struct DbiasChunks {
  Tensor scratch;
  std::vector<float*> chunks;
  int64_t elements = 0;
  DbiasChunks(Tensor* dbias, int64_t count) {
    if (dbias == nullptr) return;
    elements = dbias->numel();
    std::memset(dbias->data<float>(), 0, elements * sizeof(float));
    chunks.push_back(dbias->data<float>());
    if (count == 1) return;
    scratch = Tensor::zeros({count - 1, elements}, DType::F32);
    for (int64_t c = 1; c < count; ++c)
      chunks.push_back(scratch.data<float>() + (c - 1) * elements);
  }
  void sum_into_first() {
    if (chunks.size() < 2) return;
    float* sum = chunks[0];
    const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static)
    for (int64_t x = 0; x < elements; ++x) {
      for (int64_t c = 1; c < count; ++c) sum[x] += chunks[c][x];
    }
  }
};

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

  const bool bf16 = p.bf16_tiles;
  auto pack = [bf16](Shape shape) { return pack_storage(bf16, std::move(shape)); };
  const bool rows_in_place = bf16 && D == dp;
  Tensor qp = rows_in_place ? Tensor() : pack({B, H, queries, dp});
  Tensor dop = rows_in_place ? Tensor() : pack({B, H, queries, dp});
  Tensor kp = pack({B, Hkv, p.padded_keys, dp});
  Tensor kt = pack({B, Hkv, p.k_tiles, dp, kBlockK});
  Tensor vt = pack({B, Hkv, p.k_tiles, dp, kBlockK});
  Tensor q_pairs, dout_pairs;  // BF16 tiles only
  Tensor delta = Tensor::empty({B, H, queries}, DType::F32);
  Tensor dq_acc = Tensor::zeros({splits, B, H, queries, dp}, DType::F32);
  // dbias: batch entries dealt to as few chunks as keep 2 tasks per thread (see DbiasChunks).
  const int64_t chunks =
      p.o->dbias == nullptr
          ? B
          : std::clamp<int64_t>((2 * threads + Hkv * splits - 1) / (Hkv * splits), 1, B);
  DbiasChunks dbias(p.o->dbias, chunks);
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
  auto task_fn = backward_task_scalar<T>;
  if (active_isa() == Isa::Avx512) task_fn = backward_task_avx512<T>;
  if (active_isa() == Isa::Avx2) task_fn = backward_task_avx2<T>;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (bf16) {
      task_fn = backward_task_bf16;
      const int64_t padded_queries = p.q_tiles * kBlockQ;
      q_pairs = Tensor::empty({B, H, padded_queries, dp}, DType::BF16);
      dout_pairs = Tensor::empty({B, H, padded_queries, dp}, DType::BF16);
      if (D != dp) {  // else the tiles read q's and dout's rows in place
        pack_rows(q.data<T>(), B, queries, H, D, queries, dp, qp.data<bfloat16>());
        pack_rows(dout.data<T>(), B, queries, H, D, queries, dp, dop.data<bfloat16>());
      }
      pack_pairs_along_keys(q.data<T>(), B, queries, H, D, padded_queries, dp,
                            q_pairs.data<bfloat16>());
      pack_pairs_along_keys(dout.data<T>(), B, queries, H, D, padded_queries, dp,
                            dout_pairs.data<bfloat16>());
      pack_pairs_along_keys(k.data<T>(), B, S, Hkv, D, p.padded_keys, dp, kp.data<bfloat16>());
      pack_pairs_along_d(k.data<T>(), B, S, Hkv, D, p.k_tiles, dp, kt.data<bfloat16>());
      pack_pairs_along_d(v.data<T>(), B, S, Hkv, D, p.k_tiles, dp, vt.data<bfloat16>());
    }
  }
  if (!bf16) {
    pack_rows(q.data<T>(), B, queries, H, D, queries, dp, qp.data<float>());
    pack_rows(dout.data<T>(), B, queries, H, D, queries, dp, dop.data<float>());
    pack_rows(k.data<T>(), B, S, Hkv, D, p.padded_keys, dp, kp.data<float>());
    pack_transposed(k.data<T>(), B, S, Hkv, D, p.k_tiles, dp, kt.data<float>());
    pack_transposed(v.data<T>(), B, S, Hkv, D, p.k_tiles, dp, vt.data<float>());
  }
  {
    const T* o = out.data<T>();
    const T* g = dout.data<T>();
    float* dl = delta.data<float>();
    // BF16 rows are widened in bulk, then summed in F32.
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < queries; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = ((b * queries + i) * H + h) * D;
          float o_row[attention_detail::kMaxHeadDim], g_row[attention_detail::kMaxHeadDim];
          const float* ov = o_row;
          const float* gv = g_row;
          if constexpr (std::is_same_v<T, float>) {
            ov = o + at;
            gv = g + at;
          } else {
            convert_bf16_to_f32(o + at, o_row, static_cast<size_t>(D));
            convert_bf16_to_f32(g + at, g_row, static_cast<size_t>(D));
          }
          float sum = 0.0f;
          for (int64_t d = 0; d < D; ++d) sum += ov[d] * gv[d];
          dl[(b * H + h) * queries + i] = sum;
        }
      }
    }
  }

  const BackwardArgs<T> args{&p,
                             rows_in_place ? q.raw() : qp.raw(),
                             rows_in_place ? dout.raw() : dop.raw(),
                             rows_in_place,
                             kp.raw(),
                             kt.raw(),
                             vt.raw(),
                             bf16 ? q_pairs.raw() : nullptr,
                             bf16 ? dout_pairs.raw() : nullptr,
                             lse_ref.data<float>(),
                             lse_rho.data<float>(),
                             delta.data<float>(),
                             dq_acc.data<float>(),
                             splits,
                             dbias.chunks.empty() ? nullptr : dbias.chunks.data(),
                             chunks,
                             dk.data<T>(),
                             dv.data<T>()};
  const int64_t ws_floats = backward_workspace_floats(dp);
  Tensor workspace = Tensor::zeros({threads, ws_floats}, DType::F32);
  float* ws_base = workspace.data<float>();
  // One task per (chunk, kv head, split), running the chunk's batch entries in turn (one each
  // without dbias: then chunks = B).
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(threads)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      for (int64_t split = 0; split < splits; ++split) {
        for (int64_t b = chunk; b < B; b += chunks) {
          task_fn(args, b, hk, split, ws_base + omp_get_thread_num() * ws_floats);
        }
      }
    }
  }
  if (p.o->fp8.ds_amax) *p.o->fp8.ds_amax = reduce_amax_slots(ws_base, threads, ws_floats);
  dbias.sum_into_first();

  const float* acc = dq_acc.data<float>();
  T* out_dq = dq.data<T>();
  const int64_t split_stride = B * H * queries * dp;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < queries; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const float* row = acc + ((b * H + h) * queries + i) * dp;
        float sums[attention_detail::kMaxHeadDim];
        for (int64_t d = 0; d < D; ++d) {
          float sum = 0.0f;
          for (int64_t sp = 0; sp < splits; ++sp) sum += row[sp * split_stride + d];
          sums[d] = sum * s.scale;
        }
        store_row(sums, out_dq + ((b * queries + i) * H + h) * D, D);
      }
    }
  }
}

}  // namespace

bool flash_attention_bf16_tiles(const AttentionOptions& options, DType dtype) {
  return use_bf16_tiles(options, dtype);
}

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, Tensor& out, Tensor& lse) {
  const char* op = "flash_attention_forward";
  AttentionShape s = attention_detail::check_inputs(op, q, k, v, options);
  attention_detail::check_output(op, out, q, "out", "B,T,H,D");
  attention_detail::check_lse(op, lse, s);
  const Plan plan = make_plan(s, options, q.dtype());
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
  attention_detail::check_dbias(op, options, s);
  const Plan plan = make_plan(s, options, q.dtype());
  if (q.dtype() == DType::F32) {
    backward_typed<float>(plan, q, k, v, out, lse, dout, dq, dk, dv);
  } else {
    backward_typed<bfloat16>(plan, q, k, v, out, lse, dout, dq, dk, dv);
  }
}

}  // namespace octet::ops::cpu
