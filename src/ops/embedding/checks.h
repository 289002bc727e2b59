// Argument checks shared by the reference and fast embedding kernels.
#pragma once

#include <string>

#include "octet/ops/embedding.h"

namespace octet::ops::embedding_detail {

struct EmbeddingShape {
  int64_t tokens = 0;    // N
  int64_t vocab = 0;     // V: the table's rows
  int64_t channels = 0;  // C
  int64_t first = 0;     // the id of the table's row 0 (vocabulary parts)
};

inline int64_t id_at(const Tensor& ids, int64_t index) {
  return ids.dtype() == DType::I32 ? int64_t{ids.data<int32_t>()[index]}
                                   : ids.data<int64_t>()[index];
}

// table_or_dtable [V,C]; rows [*ids.shape, C] (out or dout). Every id is checked up front: in
// [0, V), or for a vocabulary part (vocab > 0) in [0, vocab), the table holding rows
// [first, first + V).
inline EmbeddingShape check_embedding(const char* op, const Tensor& ids,
                                      const Tensor& table_or_dtable, const char* table_name,
                                      const Tensor& rows, const char* rows_name, int64_t first = 0,
                                      int64_t vocab = 0) {
  const std::string name(op);
  check_dtype_in(ids, {DType::I32, DType::I64}, name + ": ids");
  OCTET_CHECK(table_or_dtable.ndim() == 2, op, ": ", table_name, " expected [V,C], got ",
              shape_str(table_or_dtable.shape()));
  EmbeddingShape s{ids.numel(), table_or_dtable.dim(0), table_or_dtable.dim(1), first};
  const int64_t ids_end = vocab > 0 ? vocab : s.vocab;
  OCTET_CHECK(vocab == 0 || (first >= 0 && first + s.vocab <= vocab), op, ": a part of rows [",
              first, ", ", first + s.vocab, ") expected inside the vocabulary of ", vocab);
  Shape rows_shape = ids.shape();
  rows_shape.push_back(s.channels);
  check_shape(rows, rows_shape, name + ": " + rows_name);
  check_dtype_in(rows, {DType::F32, DType::BF16}, name + ": " + rows_name);
  for (int64_t n = 0; n < s.tokens; ++n) {
    const int64_t id = id_at(ids, n);
    OCTET_CHECK(id >= 0 && id < ids_end, op, ": id ", id, " at position ", n,
                " is out of range [0,V) with V=", ids_end);
  }
  return s;
}

// x_or_dx [R, C] (F32 only for the in-place forward); table_or_dtable [P, C] F32. Returns C.
inline int64_t check_positions(const char* op, const Tensor& x_or_dx, bool forward,
                               const Tensor& table_or_dtable, int64_t seq_len, int64_t first_row,
                               int64_t position_offset) {
  const std::string name(op);
  if (forward) {
    check_dtype(x_or_dx, DType::F32, name + ": x");
  } else {
    check_dtype_in(x_or_dx, {DType::F32, DType::BF16}, name + ": dx");
  }
  check_dtype(table_or_dtable, DType::F32, name + ": table");
  OCTET_CHECK(x_or_dx.ndim() == 2 && table_or_dtable.ndim() == 2 &&
                  x_or_dx.dim(1) == table_or_dtable.dim(1),
              op, ": expected rows [R,C] and a table [P,C], got ", shape_str(x_or_dx.shape()),
              " and ", shape_str(table_or_dtable.shape()));
  OCTET_CHECK(seq_len > 0 && first_row >= 0 && position_offset >= 0 &&
                  position_offset + seq_len <= table_or_dtable.dim(0),
              op, ": positions [", position_offset, ", ", position_offset + seq_len, ") (seq_len ",
              seq_len, ", first_row ", first_row, ") expected inside the table's ",
              table_or_dtable.dim(0), " rows");
  return x_or_dx.dim(1);
}

// The first row >= 0 of a shard starting at first_row that sits at position t.
inline int64_t first_row_at(int64_t t, int64_t seq_len, int64_t first_row) {
  return ((t - first_row) % seq_len + seq_len) % seq_len;
}

}  // namespace octet::ops::embedding_detail
