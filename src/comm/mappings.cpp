// Megatron's region mappings (tensor_parallel/mappings.py): each forward with its adjoint
// backward, over a tensor-parallel Communicator.
#include "octet/mappings.h"

#include "octet/error.h"

namespace octet {

namespace {

Tensor as_rows(const Tensor& x) {
  return x.reshape({x.rows(), x.cols()});
}

int64_t shard_rows(const Tensor& x, Communicator& tp, const char* what) {
  const int64_t rows = x.rows(), size = tp.size();
  OCTET_CHECK(rows % size == 0, what, ": ", rows, " token rows do not split across ", size,
              " tensor-parallel ranks (", tp.name(), ")");
  return rows / size;
}

Tensor summed(const Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  Tensor out = as_rows(x).clone();
  tp.all_reduce(out, ReduceOp::Sum);
  return out;
}

Tensor gathered(const Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return as_rows(x);
  return tp.all_gather(as_rows(x));
}

Tensor reduce_scattered(const Tensor& x, Communicator& tp, const char* what) {
  shard_rows(x, tp, what);
  if (tp.size() == 1) return as_rows(x);
  return tp.reduce_scatter(as_rows(x), ReduceOp::Sum);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Mappings.

Tensor copy_to_tensor_parallel_region(const Tensor& x, Communicator&) {
  return x;
}
Tensor copy_to_tensor_parallel_region_backward(const Tensor& dy, Communicator& tp) {
  return summed(dy, tp);
}

Tensor reduce_from_tensor_parallel_region(const Tensor& x, Communicator& tp) {
  return summed(x, tp);
}
Tensor reduce_from_tensor_parallel_region_backward(const Tensor& dy, Communicator&) {
  return dy;
}

Tensor scatter_to_sequence_parallel_region(const Tensor& x, Communicator& tp) {
  const int64_t rows = shard_rows(x, tp, "scatter_to_sequence_parallel_region");
  if (tp.size() == 1) return as_rows(x);
  return as_rows(x).slice_rows(tp.rank() * rows, (tp.rank() + 1) * rows).clone();
}
Tensor scatter_to_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp) {
  return gathered(dy, tp);
}

Tensor gather_from_sequence_parallel_region(const Tensor& x, Communicator& tp) {
  return gathered(x, tp);
}
Tensor gather_from_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp) {
  return reduce_scattered(dy, tp, "gather_from_sequence_parallel_region backward");
}

Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& x, Communicator& tp) {
  return reduce_scattered(x, tp, "reduce_scatter_to_sequence_parallel_region");
}
Tensor reduce_scatter_to_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp) {
  return gathered(dy, tp);
}

Tensor split_columns_to_tensor_parallel_region(const Tensor& x, Communicator& tp) {
  const int64_t cols = x.cols(), size = tp.size();
  OCTET_CHECK(cols % size == 0, "split_columns_to_tensor_parallel_region: ", cols,
              " columns do not split across ", size, " tensor-parallel ranks");
  if (size == 1) return as_rows(x);
  const int64_t width = cols / size;
  Tensor out = Tensor::empty({x.rows(), width}, x.dtype());
  copy_columns(as_rows(x), tp.rank() * width, width, out, 0);
  return out;
}

Tensor gather_columns_from_tensor_parallel_region(const Tensor& x, Communicator& tp) {
  const int64_t size = tp.size();
  if (size == 1) return as_rows(x);
  const int64_t rows = x.rows(), width = x.cols();
  const Tensor blocks = tp.all_gather(as_rows(x));  // [TP*N, W], rank i's block at rows i*N
  Tensor out = Tensor::empty({rows, size * width}, x.dtype());
  for (int64_t i = 0; i < size; ++i) {
    copy_columns(blocks.slice_rows(i * rows, (i + 1) * rows), 0, width, out, i * width);
  }
  return out;
}

}  // namespace octet
