// Embedding, fast path. Forward: OpenMP over tokens, each row copied (and converted) with
// vector loads. Backward: tokens sorted by id (stable, so repeated ids keep the order of n);
// each thread then owns whole table rows and adds their tokens' gradients in that order: the
// reference's result bit for bit, without atomics, whatever the thread count.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/embedding/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

constexpr int64_t kParallelMinElements = int64_t{1} << 15;

template <typename In, typename Out>
OCTET_ALWAYS_INLINE void copy_row(const In* in, Out* out, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) simd::store(simd::load(in[c]), out + c);
}

template <typename In>
OCTET_ALWAYS_INLINE void add_row(const In* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] += simd::load(in[c]);
}

template <typename In, typename Out>
OCTET_TARGET_AVX512 void copy_row_avx512(const In* in, Out* out, int64_t n) {
  copy_row(in, out, n);
}
template <typename In, typename Out>
OCTET_TARGET_AVX2 void copy_row_avx2(const In* in, Out* out, int64_t n) {
  copy_row(in, out, n);
}
template <typename In, typename Out>
void copy_row_scalar(const In* in, Out* out, int64_t n) {
  copy_row(in, out, n);
}

template <typename In>
OCTET_TARGET_AVX512 void add_row_avx512(const In* in, float* out, int64_t n) {
  add_row(in, out, n);
}
template <typename In>
OCTET_TARGET_AVX2 void add_row_avx2(const In* in, float* out, int64_t n) {
  add_row(in, out, n);
}
template <typename In>
void add_row_scalar(const In* in, float* out, int64_t n) {
  add_row(in, out, n);
}

template <typename In, typename Out>
void forward_rows(const Tensor& ids, const Tensor& table, Tensor& out,
                  const embedding_detail::EmbeddingShape& s) {
  const In* rows = table.data<In>();
  Out* dst = out.data<Out>();
  const Isa isa = active_isa();
  auto copy = isa == Isa::Avx512 ? copy_row_avx512<In, Out>
              : isa == Isa::Avx2 ? copy_row_avx2<In, Out>
                                 : copy_row_scalar<In, Out>;
  const int64_t c = s.channels;
  auto row = [&](int64_t n) {
    const int64_t id = embedding_detail::id_at(ids, n) - s.first;
    if (id < 0 || id >= s.vocab) {  // another part's id (vocabulary parallelism): zeros
      std::memset(static_cast<void*>(dst + n * c), 0, sizeof(Out) * c);
    } else if constexpr (std::is_same_v<In, Out>) {
      std::memcpy(static_cast<void*>(dst + n * c), rows + id * c, sizeof(In) * c);
    } else {
      copy(rows + id * c, dst + n * c, c);
    }
  };
  // A decode step's few rows stay on the calling thread: a region, even one whose `if` is
  // false, wakes the pool.
  if (s.tokens * c < kParallelMinElements) {
    for (int64_t n = 0; n < s.tokens; ++n) row(n);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < s.tokens; ++n) row(n);
}

template <typename In>
void backward_rows(const Tensor& ids, const Tensor& dout, Tensor& dtable,
                   const embedding_detail::EmbeddingShape& s) {
  const In* grad_rows = dout.data<In>();
  float* table_grad = dtable.data<float>();
  const Isa isa = active_isa();
  auto add = isa == Isa::Avx512 ? add_row_avx512<In>
             : isa == Isa::Avx2 ? add_row_avx2<In>
                                : add_row_scalar<In>;
  // The held tokens sorted by id, n ascending within an id; [N] I64, counted like any tensor.
  Tensor order_tensor = Tensor::empty({s.tokens}, DType::I64);
  int64_t* order = order_tensor.data<int64_t>();
  int64_t held = 0;
  for (int64_t n = 0; n < s.tokens; ++n) {
    const int64_t id = embedding_detail::id_at(ids, n) - s.first;
    if (id >= 0 && id < s.vocab) order[held++] = n;
  }
  std::stable_sort(order, order + held, [&](int64_t a, int64_t b) {
    return embedding_detail::id_at(ids, a) < embedding_detail::id_at(ids, b);
  });
  std::vector<int64_t> group_begin;  // where each distinct id starts in `order`, then held
  for (int64_t i = 0; i < held; ++i) {
    if (i == 0 ||
        embedding_detail::id_at(ids, order[i]) != embedding_detail::id_at(ids, order[i - 1])) {
      group_begin.push_back(i);
    }
  }
  group_begin.push_back(held);
  const int64_t groups = static_cast<int64_t>(group_begin.size()) - 1;
  const int64_t c = s.channels;
#pragma omp parallel for schedule(dynamic, 8) if (s.tokens * c >= kParallelMinElements)
  for (int64_t g = 0; g < groups; ++g) {
    float* row = table_grad + (embedding_detail::id_at(ids, order[group_begin[g]]) - s.first) * c;
    for (int64_t i = group_begin[g]; i < group_begin[g + 1]; ++i) {
      add(grad_rows + order[i] * c, row, c);
    }
  }
}

}  // namespace

namespace {

void forward(const Tensor& ids, const Tensor& table, Tensor& out,
             const embedding_detail::EmbeddingShape& s) {
  check_dtype_in(table, {DType::F32, DType::BF16}, "embedding_forward: table");
  const bool table_f32 = table.dtype() == DType::F32;
  if (out.dtype() == DType::F32) {
    table_f32 ? forward_rows<float, float>(ids, table, out, s)
              : forward_rows<bfloat16, float>(ids, table, out, s);
  } else {
    table_f32 ? forward_rows<float, bfloat16>(ids, table, out, s)
              : forward_rows<bfloat16, bfloat16>(ids, table, out, s);
  }
}

void backward(const Tensor& ids, const Tensor& dout, Tensor& dtable,
              const embedding_detail::EmbeddingShape& s) {
  check_dtype(dtable, DType::F32, "embedding_backward: dtable");
  if (dout.dtype() == DType::F32) {
    backward_rows<float>(ids, dout, dtable, s);
  } else {
    backward_rows<bfloat16>(ids, dout, dtable, s);
  }
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  forward(ids, table, out,
          embedding_detail::check_embedding("embedding_forward", ids, table, "table", out, "out"));
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  backward(
      ids, dout, dtable,
      embedding_detail::check_embedding("embedding_backward", ids, dtable, "dtable", dout, "dout"));
}

void embedding_part_forward(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                            Tensor& out) {
  forward(ids, table, out,
          embedding_detail::check_embedding("embedding_part_forward", ids, table, "table", out,
                                            "out", first, vocab));
}

void embedding_part_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                             Tensor& dtable) {
  backward(ids, dout, dtable,
           embedding_detail::check_embedding("embedding_part_backward", ids, dtable, "dtable", dout,
                                             "dout", first, vocab));
}

void position_embedding_forward(Tensor& x, const Tensor& table, int64_t seq_len, int64_t first_row,
                                int64_t position_offset) {
  const int64_t C = embedding_detail::check_positions("position_embedding_forward", x, true, table,
                                                      seq_len, first_row, position_offset);
  float* xs = x.data<float>();
  const float* positions = table.data<float>() + position_offset * C;
  const int64_t rows = x.dim(0);
  auto add_row = [&](int64_t r) {
    const float* p = positions + ((first_row + r) % seq_len) * C;
    for (int64_t c = 0; c < C; ++c) xs[r * C + c] += p[c];
  };
  if (rows * C < kParallelMinElements) {  // decode: on the calling thread
    for (int64_t r = 0; r < rows; ++r) add_row(r);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) add_row(r);
}

void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row, int64_t position_offset) {
  const int64_t C = embedding_detail::check_positions("position_embedding_backward", dx, false,
                                                      dtable, seq_len, first_row, position_offset);
  const Tensor wide = dx.dtype() == DType::F32 ? dx : dx.to(DType::F32);
  const float* g = wide.data<float>();
  float* w = dtable.data<float>() + position_offset * C;
  const int64_t rows = wide.dim(0);
  // Threads split the positions; each adds its rows in row order.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < seq_len; ++t) {
    float* p = w + t * C;
    for (int64_t r = embedding_detail::first_row_at(t, seq_len, first_row); r < rows;
         r += seq_len) {
      for (int64_t c = 0; c < C; ++c) p[c] += g[r * C + c];
    }
  }
}

}  // namespace octet::ops::cpu
