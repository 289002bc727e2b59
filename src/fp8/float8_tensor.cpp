// Float8Tensor: back to F32 through the block scales, from whichever usage it holds.
#include <algorithm>

#include "fp8/transpose.h"
#include "octet/error.h"
#include "octet/fp8.h"

namespace octet {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// codes [rows, cols] with its scale_inv laid out for that orientation -> F32 [rows, cols].
Tensor dequantize_matrix(const Float8Tensor& tensor, const Tensor& codes, const Tensor& scale_inv,
                         int64_t rows, int64_t cols, const char* what) {
  check_shape(codes, {rows, cols}, what, "rows,cols");
  check_dtype(codes, tensor.format, what);
  Tensor out = Tensor::empty({rows, cols}, DType::F32);
  const uint8_t* code = static_cast<const uint8_t*>(codes.raw());
  float* values = out.data<float>();
  if (tensor.mode == ScalingMode::PerTensor) {
    check_shape(scale_inv, {1}, "Float8Tensor: per-tensor scale_inv");
    dequantize_fp8(code, static_cast<size_t>(rows * cols), tensor.format,
                   scale_inv.data<float>()[0], values);
    return out;
  }
  const bool mx = tensor.mode == ScalingMode::MXFP8;
  const int64_t block_rows = mx ? 1 : tensor.block_rows;
  const int64_t block_cols = mx ? 32 : tensor.block_cols;
  OCTET_CHECK(block_rows >= 1 && block_cols >= 1, "Float8Tensor: block expected >= 1x1, got ",
              block_rows, "x", block_cols);
  const int64_t block_col_count = ceil_div(cols, block_cols);
  check_shape(scale_inv, {ceil_div(rows, block_rows), block_col_count}, "Float8Tensor: scale_inv",
              "block_rows,block_cols");
  check_dtype(scale_inv, mx ? DType::U8 : DType::F32, "Float8Tensor: scale_inv");
  const float* block_scale = mx ? nullptr : scale_inv.data<float>();
  const uint8_t* block_code = mx ? scale_inv.data<uint8_t>() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t scale_row = (r / block_rows) * block_col_count;
    for (int64_t block_col = 0; block_col < block_col_count; ++block_col) {
      const int64_t c0 = block_col * block_cols;
      const size_t width = static_cast<size_t>(std::min(cols, c0 + block_cols) - c0);
      const float factor = mx ? e8m0_to_float(block_code[scale_row + block_col])
                              : block_scale[scale_row + block_col];
      dequantize_fp8(code + r * cols + c0, width, tensor.format, factor, values + r * cols + c0);
    }
  }
  return out;
}

Tensor transposed(const Tensor& matrix) {
  Tensor out = Tensor::empty({matrix.dim(1), matrix.dim(0)}, DType::F32);
  detail::transpose_matrix(matrix.data<float>(), matrix.dim(0), matrix.dim(1), out.data<float>());
  return out;
}

}  // namespace

Tensor Float8Tensor::dequantize() const {
  if (has_rowwise())
    return dequantize_matrix(*this, data, scale_inv, rows, cols, "Float8Tensor: data");
  OCTET_CHECK(has_columnwise(), "Float8Tensor::dequantize: tensor holds neither data nor data_t");
  return transposed(
      dequantize_matrix(*this, data_t, scale_inv_t, cols, rows, "Float8Tensor: data_t"));
}

Tensor Float8Tensor::dequantize_t() const {
  if (has_columnwise()) {
    return dequantize_matrix(*this, data_t, scale_inv_t, cols, rows, "Float8Tensor: data_t");
  }
  OCTET_CHECK(has_rowwise(), "Float8Tensor::dequantize_t: tensor holds neither data nor data_t");
  return transposed(dequantize_matrix(*this, data, scale_inv, rows, cols, "Float8Tensor: data"));
}

}  // namespace octet
