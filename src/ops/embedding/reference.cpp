// Embedding reference: plain loops over tokens and channels. The oracle.
#include "ops/embedding/checks.h"

namespace octet::ops::reference {
namespace {

float read(const Tensor& t, int64_t index) {
  return t.dtype() == DType::F32 ? t.data<float>()[index]
                                 : bf16_to_float(t.data<bfloat16>()[index].bits);
}

void forward(const Tensor& ids, const Tensor& table, Tensor& out,
             const embedding_detail::EmbeddingShape& s) {
  check_dtype_in(table, {DType::F32, DType::BF16}, "embedding_forward: table");
  for (int64_t n = 0; n < s.tokens; ++n) {
    const int64_t id = embedding_detail::id_at(ids, n) - s.first;
    const bool held = id >= 0 && id < s.vocab;
    for (int64_t c = 0; c < s.channels; ++c) {
      const float value = held ? read(table, id * s.channels + c) : 0.0f;
      if (out.dtype() == DType::F32) {
        out.data<float>()[n * s.channels + c] = value;
      } else {
        out.data<bfloat16>()[n * s.channels + c].bits = float_to_bf16(value);
      }
    }
  }
}

void backward(const Tensor& ids, const Tensor& dout, Tensor& dtable,
              const embedding_detail::EmbeddingShape& s) {
  check_dtype(dtable, DType::F32, "embedding_backward: dtable");
  float* grad = dtable.data<float>();
  for (int64_t n = 0; n < s.tokens; ++n) {
    const int64_t id = embedding_detail::id_at(ids, n) - s.first;
    if (id < 0 || id >= s.vocab) continue;
    for (int64_t c = 0; c < s.channels; ++c) {
      grad[id * s.channels + c] += read(dout, n * s.channels + c);
    }
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
  for (int64_t r = 0; r < x.dim(0); ++r) {
    const int64_t position = position_offset + (first_row + r) % seq_len;
    for (int64_t c = 0; c < C; ++c) {
      x.data<float>()[r * C + c] += table.data<float>()[position * C + c];
    }
  }
}

void position_embedding_backward(const Tensor& dx, int64_t seq_len, Tensor& dtable,
                                 int64_t first_row, int64_t position_offset) {
  const int64_t C = embedding_detail::check_positions("position_embedding_backward", dx, false,
                                                      dtable, seq_len, first_row, position_offset);
  for (int64_t r = 0; r < dx.dim(0); ++r) {
    const int64_t position = position_offset + (first_row + r) % seq_len;
    for (int64_t c = 0; c < C; ++c) {
      dtable.data<float>()[position * C + c] += read(dx, r * C + c);
    }
  }
}

}  // namespace octet::ops::reference
