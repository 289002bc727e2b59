// Column blocks of row-major matrices: splitting a fused projection's output [N, sum(widths)]
// into separate tensors and joining their gradients back, plus elementwise sums.
#pragma once

#include <cstring>
#include <vector>

#include "octet/ops/dropout.h"
#include "octet/tensor.h"

namespace octet::modules_detail {

// copy(r) for r in [0, rows): over the threads when `bytes` reach 256 KiB, else on the calling
// thread without entering a parallel region (libgomp wakes its pool with a futex even for a
// region whose `if` is false: a decode step split one 2304-column row into Q, K and V 36 times,
// each a region).
template <typename Copy>
inline void for_rows(int64_t rows, int64_t bytes, const Copy& copy) {
  if (bytes < (int64_t{1} << 18)) {
    for (int64_t r = 0; r < rows; ++r) copy(r);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) copy(r);
}

// parts[i] [N, widths[i]] (any shape with N * widths[i] elements, allocated, dtype of fused)
// <- columns of fused [N, sum(widths)]. Each part's width is its numel / N.
inline void split_columns(const Tensor& fused, const std::vector<Tensor*>& parts) {
  const int64_t rows = fused.rows(), cols = fused.cols();
  const size_t element = dtype_bytes(fused.dtype());
  const auto* src = static_cast<const unsigned char*>(fused.raw());
  int64_t begin = 0;
  for (Tensor* part : parts) {
    const int64_t width = part->numel() / rows;
    OCTET_CHECK(
        part->dtype() == fused.dtype() && width * rows == part->numel() && begin + width <= cols,
        "split_columns: part ", shape_str(part->shape()), " does not fit [", rows, ",", cols,
        "] at column ", begin);
    auto* dst = static_cast<unsigned char*>(part->raw());
    for_rows(rows, rows * width * static_cast<int64_t>(element), [&](int64_t r) {
      std::memcpy(dst + r * width * element, src + (r * cols + begin) * element, width * element);
    });
    begin += width;
  }
  OCTET_CHECK(begin == cols, "split_columns: parts cover ", begin, " of ", cols, " columns");
}

// The inverse: fused [rows, sum(widths)] (new, dtype of the parts) from parts seen as
// [rows, width].
inline Tensor join_columns(const std::vector<const Tensor*>& parts, int64_t rows) {
  int64_t cols = 0;
  for (const Tensor* part : parts) cols += part->numel() / rows;
  const DType dtype = parts.front()->dtype();
  const size_t element = dtype_bytes(dtype);
  Tensor fused = Tensor::empty({rows, cols}, dtype);
  auto* dst = static_cast<unsigned char*>(fused.raw());
  int64_t begin = 0;
  for (const Tensor* part : parts) {
    OCTET_CHECK(part->dtype() == dtype, "join_columns: parts of mixed dtypes");
    const int64_t width = part->numel() / rows;
    const auto* src = static_cast<const unsigned char*>(part->raw());
    for_rows(rows, rows * width * static_cast<int64_t>(element), [&](int64_t r) {
      std::memcpy(dst + (r * cols + begin) * element, src + r * width * element, width * element);
    });
    begin += width;
  }
  return fused;
}

// a + b (same shape and dtype, F32|BF16), a new tensor shaped like a.
inline Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  const Shape flat = {a.rows(), a.cols()};
  Tensor out_flat = out.reshape(flat);
  ops::bias_dropout_add_forward(a.reshape(flat), nullptr, b.reshape(flat), ops::DropoutParams{},
                                out_flat);
  return out;
}

}  // namespace octet::modules_detail
