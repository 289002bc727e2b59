// Decode attention over a paged KV cache (vLLM's PagedAttention): one query per sequence
// against the keys and values its block table points to, read in place. Each sequence's keys
// are cut into partitions, one task per (sequence, group of heads, partition) with each
// head's own online softmax (max, sum, weighted values), and the partitions merged by their
// log-sum-exp, so a long context spreads over the threads like many short ones.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/lane_sums.h"
#include "octet/ops/attention.h"
#include "octet/profile.h"
#include "ops/attention/vec.h"
#include "ops/device_dispatch.h"

namespace octet::ops {

namespace {

constexpr int64_t kPartition = 256;  // keys per task (fewer where tasks are few)
constexpr int64_t kChunk = 32;       // scores computed before each rescale
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMaxGroupHeads = 16;  // query heads per task, at most

struct PagedShape {
  int64_t sequences, heads, kv_heads, head_dim, block_size, blocks, table_width;
  float scale;
};

PagedShape check_paged(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                       const Tensor& block_tables, const Tensor& context_lens,
                       const AttentionOptions& options, const Tensor& out, const Tensor* k_scale,
                       const Tensor* v_scale) {
  OCTET_CHECK(q.ndim() == 3 && k_pool.ndim() == 4, "paged_attention: q expected [S,H,D] and ",
              "pools [blocks, block_size, Hkv, D], got ", shape_str(q.shape()), " and ",
              shape_str(k_pool.shape()));
  PagedShape s{q.dim(0),
               q.dim(1),
               k_pool.dim(2),
               q.dim(2),
               k_pool.dim(1),
               k_pool.dim(0),
               block_tables.ndim() == 2 ? block_tables.dim(1) : 0,
               0.0f};
  OCTET_CHECK(v_pool.shape() == k_pool.shape() && v_pool.dtype() == k_pool.dtype(),
              "paged_attention: v pool ", shape_str(v_pool.shape()), " ",
              dtype_name(v_pool.dtype()), " expected like the k pool ", shape_str(k_pool.shape()),
              " ", dtype_name(k_pool.dtype()));
  OCTET_CHECK(k_pool.dim(3) == s.head_dim && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
              "paged_attention: q heads ", s.heads, " x D ", s.head_dim,
              " do not match pool heads ", s.kv_heads, " x D ", k_pool.dim(3));
  OCTET_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16,
              "paged_attention: q expected f32 or bf16, got ", dtype_name(q.dtype()));
  const bool fp8 = k_pool.dtype() == DType::E4M3;
  OCTET_CHECK(fp8 ? k_scale != nullptr && v_scale != nullptr : k_pool.dtype() == q.dtype(),
              "paged_attention: pools expected of q's dtype ", dtype_name(q.dtype()),
              ", or e4m3 with their scales, got ", dtype_name(k_pool.dtype()),
              k_scale != nullptr ? " with scales" : " without scales");
  if (fp8) {
    const Shape scale_shape = {k_pool.dim(0), k_pool.dim(1), k_pool.dim(2)};
    OCTET_CHECK(k_scale->shape() == scale_shape && v_scale->shape() == scale_shape &&
                    k_scale->dtype() == DType::F32 && v_scale->dtype() == DType::F32,
                "paged_attention: FP8 pool scales expected ", shape_str(scale_shape), " f32, got ",
                shape_str(k_scale->shape()), " and ", shape_str(v_scale->shape()));
  }
  OCTET_CHECK(block_tables.dtype() == DType::I32 && block_tables.ndim() == 2 &&
                  block_tables.dim(0) == s.sequences,
              "paged_attention: block_tables expected [S, max_blocks] I32 with S = ", s.sequences,
              ", got ", shape_str(block_tables.shape()), " ", dtype_name(block_tables.dtype()));
  OCTET_CHECK(context_lens.dtype() == DType::I32 && context_lens.ndim() == 1 &&
                  context_lens.dim(0) == s.sequences,
              "paged_attention: context_lens expected [S] I32, got ",
              shape_str(context_lens.shape()));
  OCTET_CHECK(out.shape() == q.shape() && out.dtype() == q.dtype(),
              "paged_attention: out expected ", shape_str(q.shape()), " ", dtype_name(q.dtype()),
              ", got ", shape_str(out.shape()));
  const int32_t* lens = context_lens.data<int32_t>();
  const int32_t* tables = block_tables.data<int32_t>();
  for (int64_t i = 0; i < s.sequences; ++i) {
    OCTET_CHECK(lens[i] >= 1 && lens[i] <= s.table_width * s.block_size,
                "paged_attention: sequence ", i, " has ", lens[i], " keys, expected 1..",
                s.table_width * s.block_size, " (its block table's room)");
    for (int64_t b = 0; b < (lens[i] + s.block_size - 1) / s.block_size; ++b) {
      const int32_t block = tables[i * s.table_width + b];
      OCTET_CHECK(block >= 0 && block < s.blocks, "paged_attention: sequence ", i, " block ", b,
                  " = ", block, " outside [0, ", s.blocks, ")");
    }
  }
  s.scale = options.softmax_scale > 0 ? options.softmax_scale
                                      : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  return s;
}

// The first key the query (at position len - 1) sees: a left window cuts the start.
int64_t first_key(int64_t len, const AttentionOptions& options) {
  return options.window_left >= 0 ? std::max<int64_t>(0, len - 1 - options.window_left) : 0;
}

// E4M3 code -> float, for FP8 pools.
const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[static_cast<size_t>(i)] = fp8_to_float(static_cast<uint8_t>(i), DType::E4M3);
    }
    return t;
  }();
  return table.data();
}

// W elements of a pool row as floats: F32 as they are, BF16 widened in registers (16-bit
// words zero-extended and shifted, one vector conversion), E4M3 codes through the table.
template <int W>
OCTET_ALWAYS_INLINE vec::F<W> load_kv(const float* p, const float*) {
  return vec::load<W>(p);
}
template <int W>
struct WordTypes {
  typedef uint16_t H __attribute__((vector_size(sizeof(uint16_t) * W)));
  typedef uint32_t U __attribute__((vector_size(sizeof(uint32_t) * W)));
};
template <int W>
OCTET_ALWAYS_INLINE vec::F<W> load_kv(const bfloat16* p, const float*) {
  using H = typename WordTypes<W>::H;
  using U = typename WordTypes<W>::U;
  H h;
  std::memcpy(&h, p, sizeof h);
  const U bits = __builtin_convertvector(h, U) << 16;
  vec::F<W> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
template <int W>
OCTET_ALWAYS_INLINE vec::F<W> load_kv(const uint8_t* p, const float* table) {
  vec::F<W> v;
  for (int i = 0; i < W; ++i) v[i] = table[p[i]];
  return v;
}
OCTET_ALWAYS_INLINE float load_kv1(float x, const float*) {
  return x;
}
OCTET_ALWAYS_INLINE float load_kv1(bfloat16 x, const float*) {
  return simd::load(x);
}
OCTET_ALWAYS_INLINE float load_kv1(uint8_t code, const float* table) {
  return table[code];
}

// Sum of the lanes by halving: log2(W) shuffles and adds.
template <int W>
OCTET_ALWAYS_INLINE float sum_lanes(vec::F<W> v) {
  if constexpr (W == 16) {
    const vec::F<8> h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return sum_lanes<8>(h);
  } else if constexpr (W == 8) {
    const vec::F<4> h =
        __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return sum_lanes<4>(h);
  } else {
    return vec::reduce_sum<W>(v);
  }
}

// T: q and out; P: the pools' elements (T, or E4M3 codes with per-(token, head) scales).
template <typename T, typename P>
struct PagedArgs {
  const PagedShape* s;
  const T* q;
  const P* k;
  const P* v;
  const int32_t* tables;
  const float* k_scale = nullptr;  // [blocks * block_size * Hkv], FP8 pools only
  const float* v_scale = nullptr;
  const float* table = nullptr;  // e4m3_table() for FP8 pools
};

// The rows of a task's keys, a chunk of kChunk at a time: located by walking the block table
// (no division per key), and the next chunk's asked for before the chunk in hand is summed
// (the K and V runs of the task's heads: the step's weights have pushed them out of the
// cache, and memory works while the chunk in hand is computed).
template <typename T, typename P>
class ChunkRows {
 public:
  ChunkRows(const PagedArgs<T, P>& a, int64_t seq, int64_t h0, int64_t h1, int64_t begin,
            int64_t end)
      : a_(a),
        s_(*a.s),
        table_(a.tables + seq * a.s->table_width),
        end_(end),
        block_(begin / a.s->block_size),
        offset_(begin % a.s->block_size) {
    const int64_t group = s_.heads / s_.kv_heads;
    hk0_ = h0 / group;
    run_bytes_ = ((h1 - 1) / group + 1 - hk0_) * s_.head_dim * static_cast<int64_t>(sizeof(P));
    locate(begin, slots_[0]);
  }
  // The slots of chunk `index` (keys from c0; chunks taken in order).
  const int64_t* chunk(int64_t c0, int64_t index) {
    if (c0 + kChunk < end_) locate(c0 + kChunk, slots_[(index + 1) % 2]);
    return slots_[index % 2];
  }

 private:
  void locate(int64_t c0, int64_t* slots) {
    const int64_t n = std::min(end_ - c0, kChunk), row = s_.kv_heads * s_.head_dim;
    for (int64_t j = 0; j < n; ++j) {
      slots[j] = static_cast<int64_t>(table_[block_]) * s_.block_size + offset_;
      if (++offset_ == s_.block_size) {
        offset_ = 0;
        ++block_;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const char* kj = reinterpret_cast<const char*>(a_.k + slots[j] * row + hk0_ * s_.head_dim);
      const char* vj = reinterpret_cast<const char*>(a_.v + slots[j] * row + hk0_ * s_.head_dim);
      for (int64_t byte = 0; byte < run_bytes_; byte += 64) {
        __builtin_prefetch(kj + byte);
        __builtin_prefetch(vj + byte);
      }
    }
  }

  const PagedArgs<T, P>& a_;
  const PagedShape& s_;
  const int32_t* table_;
  int64_t end_, block_, offset_, hk0_ = 0, run_bytes_ = 0;
  int64_t slots_[2][kChunk];
};

// A task's start: each of its H heads' query, scaled, into qf [H, D], and the head's record
// (max, sum, D values) cleared.
template <typename T, typename P>
OCTET_ALWAYS_INLINE void start_task(const PagedArgs<T, P>& a, int64_t seq, int64_t h0, int64_t H,
                                    float* qf, float* part) {
  const PagedShape& s = *a.s;
  const int64_t D = s.head_dim;
  for (int64_t h = 0; h < H; ++h) {
    const T* q = a.q + (seq * s.heads + h0 + h) * D;
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = simd::load(q[d]) * s.scale;
    float* ph = part + h * (2 + D);
    ph[0] = -std::numeric_limits<float>::infinity();
    ph[1] = 0.0f;
    for (int64_t d = 0; d < D; ++d) ph[2 + d] = 0.0f;
  }
}

// One head's chunk of n scores turned into probabilities in place against the running
// maximum (updated): returns the factor the head's running sums take (exp of the old maximum
// less the new) and the chunk's probability sum. The maximum is subtracted before scaling
// into base 2 (exact at any magnitude); the vector exp2 runs over the whole chunk, the lanes
// past n at -inf (zero).
struct ChunkWeights {
  float rescale, sum;
};
template <int W>
OCTET_ALWAYS_INLINE ChunkWeights chunk_probabilities(float* scores, int64_t n, float& max) {
  float chunk_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) chunk_max = std::max(chunk_max, scores[j]);
  const float new_max = std::max(max, chunk_max);
  const float rescale = std::exp2((max - new_max) * kLog2e);
  max = new_max;
  for (int64_t j = 0; j < n; ++j) scores[j] = (scores[j] - new_max) * kLog2e;
  for (int64_t j = n; j < kChunk; ++j) scores[j] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < kChunk; j += W) {
    vec::store<W>(scores + j, vec::exp2<W>(vec::load<W>(scores + j)));
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += scores[j];
  return {rescale, sum};
}

// One (sequence, heads [h0, h1), keys [begin, end)) task: for each head of the group its max,
// sum of exp(score - max) and weighted sum of values, into part[(h - h0) * (2 + D)] onward
// (max, sum, then D values). Keys go in chunks of kChunk (ChunkRows): every head's scores,
// one rescale of each head's running sums per chunk, and the chunk's values. The heads of a
// group lie side by side in a token's row, so a task reads each row of the pools as one run
// (vLLM's kernel takes one head per thread block; here a head per task read one cache line
// pair per token, a row apart, and ran at a third of the bandwidth).
template <int W, typename T, typename P>
OCTET_ALWAYS_INLINE void partition_task(const PagedArgs<T, P>& a, int64_t seq, int64_t h0,
                                        int64_t h1, int64_t begin, int64_t end, float* part) {
  const PagedShape& s = *a.s;
  const int64_t D = s.head_dim, group = s.heads / s.kv_heads, H = h1 - h0;
  const int64_t row = s.kv_heads * D;  // elements per token in a pool
  const int64_t stride = 2 + D;
  alignas(64) float qf[kMaxGroupHeads * 256];
  start_task(a, seq, h0, H, qf, part);
  const int64_t Dv = D / W * W;
  alignas(64) float scores[kMaxGroupHeads][kChunk];
  ChunkRows<T, P> rows(a, seq, h0, h1, begin, end);
  for (int64_t c0 = begin, chunk = 0; c0 < end; c0 += kChunk, ++chunk) {
    const int64_t n = std::min(end - c0, kChunk);
    const int64_t* slots = rows.chunk(c0, chunk);
    // Scores, key by key across the group's heads (one run of the K row).
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t hk = (h0 + h) / group;
        const P* kj = a.k + slots[j] * row + hk * D;
        const float* qh = qf + h * D;
        vec::F<W> dot = vec::splat<W>(0.0f);
        int64_t d = 0;
        for (; d < Dv; d += W) dot += vec::load<W>(qh + d) * load_kv<W>(kj + d, a.table);
        float score = sum_lanes<W>(dot);
        for (; d < D; ++d) score += qh[d] * load_kv1(kj[d], a.table);
        if (a.k_scale != nullptr) score *= a.k_scale[slots[j] * s.kv_heads + hk];
        scores[h][j] = score;
      }
    }
    // Each head's running sums rescaled once per chunk.
    for (int64_t h = 0; h < H; ++h) {
      float* ph = part + h * stride;
      const ChunkWeights w = chunk_probabilities<W>(scores[h], n, ph[0]);
      ph[1] = ph[1] * w.rescale + w.sum;
      for (int64_t d = 0; d < D; ++d) ph[2 + d] *= w.rescale;
    }
    // Values, key by key across the heads (one run of the V row).
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t hk = (h0 + h) / group;
        float p = scores[h][j];
        const P* vj = a.v + slots[j] * row + hk * D;
        if (a.v_scale != nullptr) p *= a.v_scale[slots[j] * s.kv_heads + hk];  // after the sum
        float* acc = part + h * stride + 2;
        const vec::F<W> pv = vec::splat<W>(p);
        int64_t d = 0;
        for (; d < Dv; d += W) {
          vec::store<W>(acc + d, vec::load<W>(acc + d) + pv * load_kv<W>(vj + d, a.table));
        }
        for (; d < D; ++d) acc[d] += p * load_kv1(vj[d], a.table);
      }
    }
  }
}

// partition_task for AVX-512 and head sizes of DV x 16 (32, 64, 128): the same sums, taken
// head by head over the chunk (its rows were asked for a chunk ahead): 16 keys' scores at a
// time, their lane sums by one transposing tree, and each head's weighted values summed in
// registers over the chunk. With whole rows per task, GPT-2 124M's decode attention went from
// 0.48 to 0.37 ms per step at batch 1, 3.2 to 2.5 at batch 8 and 12.4 to 10.2 at batch 32 (an
// AMD EPYC VM, 2 threads; the software prefetch still gains a tenth there).
template <int DV, typename T, typename P>
OCTET_ALWAYS_INLINE void partition_task16(const PagedArgs<T, P>& a, int64_t seq, int64_t h0,
                                          int64_t h1, int64_t begin, int64_t end, float* part) {
  constexpr int W = 16;
  constexpr int64_t D = DV * W;
  using V = vec::F<W>;
  const PagedShape& s = *a.s;
  const int64_t group = s.heads / s.kv_heads, H = h1 - h0;
  const int64_t row = s.kv_heads * D;
  const int64_t stride = 2 + D;
  alignas(64) float qf[kMaxGroupHeads * D];
  start_task(a, seq, h0, H, qf, part);
  alignas(64) float scores[kChunk];
  ChunkRows<T, P> rows(a, seq, h0, h1, begin, end);
  for (int64_t c0 = begin, chunk = 0; c0 < end; c0 += kChunk, ++chunk) {
    const int64_t n = std::min(end - c0, kChunk);
    const int64_t* slots = rows.chunk(c0, chunk);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = (h0 + h) / group;
      V qv[DV];
      for (int v = 0; v < DV; ++v) qv[v] = vec::load<W>(qf + h * D + v * W);
      for (int64_t j0 = 0; j0 < n; j0 += W) {
        V dots[W];
        for (int jj = 0; jj < W; ++jj) {
          dots[jj] = vec::splat<W>(0.0f);
          if (j0 + jj >= n) continue;
          const P* kj = a.k + slots[j0 + jj] * row + hk * D;
          for (int v = 0; v < DV; ++v) dots[jj] += qv[v] * load_kv<W>(kj + v * W, a.table);
        }
        V lanes;
        lane_sums16(dots, &lanes);
        vec::store<W>(scores + j0, lanes);
      }
      if (a.k_scale != nullptr) {
        for (int64_t j = 0; j < n; ++j) scores[j] *= a.k_scale[slots[j] * s.kv_heads + hk];
      }
      float* ph = part + h * stride;
      const ChunkWeights w = chunk_probabilities<W>(scores, n, ph[0]);
      ph[1] = ph[1] * w.rescale + w.sum;
      V acc[DV];
      for (int v = 0; v < DV; ++v) acc[v] = vec::load<W>(ph + 2 + v * W) * w.rescale;
      for (int64_t j = 0; j < n; ++j) {
        float p = scores[j];
        if (a.v_scale != nullptr) p *= a.v_scale[slots[j] * s.kv_heads + hk];  // after the sum
        const V pv = vec::splat<W>(p);
        const P* vj = a.v + slots[j] * row + hk * D;
        for (int v = 0; v < DV; ++v) acc[v] += pv * load_kv<W>(vj + v * W, a.table);
      }
      for (int v = 0; v < DV; ++v) vec::store<W>(ph + 2 + v * W, acc[v]);
    }
  }
}

template <typename T, typename P>
OCTET_TARGET_AVX512 void task_avx512(const PagedArgs<T, P>& a, int64_t seq, int64_t h0, int64_t h1,
                                     int64_t begin, int64_t end, float* part) {
  switch (a.s->head_dim) {
    case 32:
      return partition_task16<2>(a, seq, h0, h1, begin, end, part);
    case 64:
      return partition_task16<4>(a, seq, h0, h1, begin, end, part);
    case 128:
      return partition_task16<8>(a, seq, h0, h1, begin, end, part);
    default:
      return partition_task<16>(a, seq, h0, h1, begin, end, part);
  }
}
template <typename T, typename P>
OCTET_TARGET_AVX2 void task_avx2(const PagedArgs<T, P>& a, int64_t seq, int64_t h0, int64_t h1,
                                 int64_t begin, int64_t end, float* part) {
  // partition_task16's form at 8 lanes (8 keys' scores by one transposing tree, a head's
  // values summed in 8 registers) was slower on a Zen 3 VM: GPT-2 124M's decode attention
  // took 0.77-0.79 ms per step at batch 1 against 0.62-0.70 here, 4.6-5.0 against 3.9-4.2 at
  // batch 8 (processes alternated): its accumulators and query vectors spill from AVX2's 16
  // registers.
  partition_task<8>(a, seq, h0, h1, begin, end, part);
}
template <typename T, typename P>
void task_scalar(const PagedArgs<T, P>& a, int64_t seq, int64_t h0, int64_t h1, int64_t begin,
                 int64_t end, float* part) {
  partition_task<4>(a, seq, h0, h1, begin, end, part);
}

template <typename T, typename P>
void paged_typed(const PagedShape& s, const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                 const Tensor& block_tables, const Tensor& context_lens,
                 const AttentionOptions& options, Tensor& out, const Tensor* k_scale,
                 const Tensor* v_scale) {
  const int32_t* lens = context_lens.data<int32_t>();
  // Tasks take every head of a sequence (up to kMaxGroupHeads: more are split into groups)
  // and partitions of its keys, whose length depends on the sequence's own length only (a
  // sequence's sums, and so its greedy tokens, are the same alone or in any batch): 64 keys
  // up to 1024 (a short sequence alone still spreads over the threads), kPartition beyond.
  const int64_t groups = (s.heads + kMaxGroupHeads - 1) / kMaxGroupHeads;
  auto partition_of = [](int64_t keys) { return keys <= 1024 ? int64_t{64} : kPartition; };
  // Tasks: (sequence, head group, partition); a group's partitions are consecutive, and each
  // task's parts are one (2 + D) record per head of its group.
  struct Task {
    int64_t seq, h0, h1, begin, end, part;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(static_cast<size_t>(s.sequences * groups) + 1, 0);
  const int64_t stride = 2 + s.head_dim;
  int64_t records = 0;
  for (int64_t i = 0; i < s.sequences; ++i) {
    const int64_t begin = first_key(lens[i], options), len = lens[i];
    const int64_t partition = partition_of(len - begin);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t h0 = s.heads * g / groups, h1 = s.heads * (g + 1) / groups;
      first_task[static_cast<size_t>(i * groups + g)] = static_cast<int64_t>(tasks.size());
      for (int64_t p = begin; p < len; p += partition) {
        tasks.push_back({i, h0, h1, p, std::min(len, p + partition), records * stride});
        records += h1 - h0;
      }
    }
  }
  first_task.back() = static_cast<int64_t>(tasks.size());
  std::vector<float> parts(static_cast<size_t>(records * stride));
  PagedArgs<T, P> args{&s, q.data<T>(), static_cast<const P*>(k_pool.raw()),
                       static_cast<const P*>(v_pool.raw()), block_tables.data<int32_t>()};
  if (k_scale != nullptr) {
    args.k_scale = k_scale->data<float>();
    args.v_scale = v_scale->data<float>();
    args.table = e4m3_table();
  }
  auto task_fn = task_scalar<T, P>;
  if (active_isa() == Isa::Avx512) task_fn = task_avx512<T, P>;
  if (active_isa() == Isa::Avx2) task_fn = task_avx2<T, P>;
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
  for (int64_t t = 0; t < count; ++t) {
    const Task& task = tasks[static_cast<size_t>(t)];
    task_fn(args, task.seq, task.h0, task.h1, task.begin, task.end, parts.data() + task.part);
  }
  // Merge each (sequence, head)'s partitions by their maxima.
  T* o = out.data<T>();
  std::vector<float> acc(static_cast<size_t>(s.head_dim));
  for (int64_t i = 0; i < s.sequences; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const size_t r = static_cast<size_t>(i * groups + g);
      const int64_t t0 = first_task[r], t1 = first_task[r + 1];
      const int64_t h0 = s.heads * g / groups, h1 = s.heads * (g + 1) / groups;
      for (int64_t h = h0; h < h1; ++h) {
        auto record = [&](int64_t t) {
          return parts.data() + tasks[static_cast<size_t>(t)].part + (h - h0) * stride;
        };
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t t = t0; t < t1; ++t) max = std::max(max, record(t)[0]);
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = t0; t < t1; ++t) {
          const float* part = record(t);
          const float w = std::exp2((part[0] - max) * kLog2e);
          sum += w * part[1];
          for (int64_t d = 0; d < s.head_dim; ++d) acc[static_cast<size_t>(d)] += w * part[2 + d];
        }
        for (int64_t d = 0; d < s.head_dim; ++d) {
          simd::store(acc[static_cast<size_t>(d)] / sum, &o[(i * s.heads + h) * s.head_dim + d]);
        }
      }
    }
  }
}

}  // namespace

namespace cpu {

void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out, const Tensor* k_scale,
                            const Tensor* v_scale) {
  const PagedShape s =
      check_paged(q, k_pool, v_pool, block_tables, context_lens, options, out, k_scale, v_scale);
  OCTET_CHECK(s.head_dim <= 256, "paged_attention: head size ", s.head_dim, " over 256");
  const bool fp8 = k_pool.dtype() == DType::E4M3;
  if (q.dtype() == DType::F32 && fp8) {
    paged_typed<float, uint8_t>(s, q, k_pool, v_pool, block_tables, context_lens, options, out,
                                k_scale, v_scale);
  } else if (q.dtype() == DType::F32) {
    paged_typed<float, float>(s, q, k_pool, v_pool, block_tables, context_lens, options, out,
                              nullptr, nullptr);
  } else if (fp8) {
    paged_typed<bfloat16, uint8_t>(s, q, k_pool, v_pool, block_tables, context_lens, options, out,
                                   k_scale, v_scale);
  } else {
    paged_typed<bfloat16, bfloat16>(s, q, k_pool, v_pool, block_tables, context_lens, options, out,
                                    nullptr, nullptr);
  }
}

}  // namespace cpu

namespace reference {

namespace {

// A pool's real values: F32/BF16 widened, E4M3 codes times their (token, head) scales.
std::vector<float> pool_values(const Tensor& pool, const Tensor* scale) {
  if (pool.dtype() != DType::E4M3) return pool.to_floats();
  const int64_t D = pool.dim(3);
  const auto* codes = static_cast<const uint8_t*>(pool.raw());
  std::vector<float> values(static_cast<size_t>(pool.numel()));
  for (int64_t i = 0; i < pool.numel(); ++i) {
    values[static_cast<size_t>(i)] =
        fp8_to_float(codes[i], DType::E4M3) * scale->data<float>()[i / D];
  }
  return values;
}

}  // namespace

void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out, const Tensor* k_scale,
                            const Tensor* v_scale) {
  const PagedShape s =
      check_paged(q, k_pool, v_pool, block_tables, context_lens, options, out, k_scale, v_scale);
  const std::vector<float> qf = q.to_floats(), kf = pool_values(k_pool, k_scale),
                           vf = pool_values(v_pool, v_scale);
  const int32_t* lens = context_lens.data<int32_t>();
  const int32_t* tables = block_tables.data<int32_t>();
  std::vector<float> result(qf.size());
  const int64_t D = s.head_dim, row = s.kv_heads * D;
  for (int64_t i = 0; i < s.sequences; ++i) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t hk = h / (s.heads / s.kv_heads);
      const float* qh = qf.data() + (i * s.heads + h) * D;
      auto slot = [&](int64_t j) {
        return (static_cast<int64_t>(tables[i * s.table_width + j / s.block_size]) * s.block_size +
                j % s.block_size) *
                   row +
               hk * D;
      };
      std::vector<double> scores;
      for (int64_t j = first_key(lens[i], options); j < lens[i]; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double{qh[d]} * kf[static_cast<size_t>(slot(j) + d)];
        scores.push_back(dot * s.scale);
      }
      const double max = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (int64_t d = 0; d < D; ++d) {
        double value = 0;
        const int64_t j0 = first_key(lens[i], options);
        for (int64_t j = j0; j < lens[i]; ++j) {
          value += scores[static_cast<size_t>(j - j0)] * vf[static_cast<size_t>(slot(j) + d)];
        }
        result[static_cast<size_t>((i * s.heads + h) * D + d)] = static_cast<float>(value / sum);
      }
    }
  }
  out.copy_from(Tensor::from_floats(out.shape(), result).to(out.dtype()));
}

}  // namespace reference

void paged_attention_decode(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& block_tables, const Tensor& context_lens,
                            const AttentionOptions& options, Tensor& out, const Tensor* k_scale,
                            const Tensor* v_scale) {
  const Device device = device_of("paged_attention_decode",
                                  {&q, &k_pool, &v_pool, &block_tables, &context_lens, &out});
  const profile::Scope scope(profile::Category::Attention);
  if (device == Device::CPU) {
    return cpu::paged_attention_decode(q, k_pool, v_pool, block_tables, context_lens, options, out,
                                       k_scale, v_scale);
  }
  no_kernel("paged_attention_decode", device);
}

}  // namespace octet::ops
