// Quantizers: F32 / BF16 matrices to Float8Tensors under per-tensor, block or MXFP8 scaling,
// and the quantizer each recipe prescribes for a tensor role.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "fp8/transpose.h"
#include "octet/error.h"
#include "octet/recipe.h"

namespace octet {
namespace {

constexpr int kMxfp8Block = 32;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// max that lets NaN through, as torch.max and the amax kernels do.
float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::nanf("");
  return std::max(a, b);
}

float reduce_amax(const std::vector<float>& amaxes) {
  float amax = 0.0f;
  for (float value : amaxes) amax = nan_max(amax, value);
  return amax;
}

uint8_t* codes_of(Tensor& tensor) {
  return static_cast<uint8_t*>(tensor.raw());
}

void check_fp8_format(DType format, const char* what) {
  OCTET_CHECK(is_fp8(format), what, ": format expected e4m3 or e5m2, got ", dtype_name(format));
}

void check_scale(float scale, const char* what) {
  OCTET_CHECK(std::isfinite(scale) && scale > 0.0f, what, ": scale expected finite and > 0, got ",
              scale);
}

// x [rows, cols] in blocks of block_rows x block_cols: one FP32 scale per block from the
// block's amax. codes [rows, cols], scale_inv [ceil(rows/br), ceil(cols/bc)]. Returns amax.
template <typename T>
float quantize_blocks(const T* x, int64_t rows, int64_t cols, int block_rows, int block_cols,
                      DType format, bool power_2_scale, float amax_epsilon, uint8_t* codes,
                      float* scale_inv) {
  const int64_t block_row_count = ceil_div(rows, block_rows);
  const int64_t block_col_count = ceil_div(cols, block_cols);
  const float max_value = fp8_max(format);
  std::vector<float> block_row_amax(static_cast<size_t>(block_row_count), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t block_row = 0; block_row < block_row_count; ++block_row) {
    const int64_t r0 = block_row * block_rows;
    const int64_t r1 = std::min(rows, r0 + block_rows);
    float row_amax = 0.0f;
    for (int64_t block_col = 0; block_col < block_col_count; ++block_col) {
      const int64_t c0 = block_col * block_cols;
      const size_t width = static_cast<size_t>(std::min(cols, c0 + block_cols) - c0);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) amax = nan_max(amax, amax_of(x + r * cols + c0, width));
      const float scale = compute_scale_from_amax(amax, max_value, power_2_scale, amax_epsilon);
      scale_inv[block_row * block_col_count + block_col] = 1.0f / scale;
      for (int64_t r = r0; r < r1; ++r) {
        quantize_fp8(x + r * cols + c0, width, scale, format, codes + r * cols + c0);
      }
      row_amax = nan_max(row_amax, amax);
    }
    block_row_amax[static_cast<size_t>(block_row)] = row_amax;
  }
  return reduce_amax(block_row_amax);
}

// x [rows, cols] in 1x32 blocks: E8M0 scale_inv = 2^ceil(log2(amax / fp8_max)), so that no
// element saturates. codes [rows, cols], scale_codes [rows, ceil(cols/32)]. Returns amax.
template <typename T>
float quantize_mxfp8(const T* x, int64_t rows, int64_t cols, DType format, uint8_t* codes,
                     uint8_t* scale_codes) {
  const int64_t block_col_count = ceil_div(cols, kMxfp8Block);
  const float max_value = fp8_max(format);
  std::vector<float> row_amax(static_cast<size_t>(rows), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float amax_of_row = 0.0f;
    for (int64_t block_col = 0; block_col < block_col_count; ++block_col) {
      const int64_t c0 = block_col * kMxfp8Block;
      const size_t width = static_cast<size_t>(std::min(cols, c0 + kMxfp8Block) - c0);
      const T* segment = x + r * cols + c0;
      const float amax = amax_of(segment, width);
      const uint8_t scale_code = float_to_e8m0_ceil(amax / max_value);
      scale_codes[r * block_col_count + block_col] = scale_code;
      // 1 / 2^e is exact, so scale * scale_inv == 1 exactly.
      quantize_fp8(segment, width, 1.0f / e8m0_to_float(scale_code), format, codes + r * cols + c0);
      amax_of_row = nan_max(amax_of_row, amax);
    }
    row_amax[static_cast<size_t>(r)] = amax_of_row;
  }
  return reduce_amax(row_amax);
}

}  // namespace

Quantizer Quantizer::delayed(DType format, FP8Meta* meta, int index) {
  check_fp8_format(format, "Quantizer::delayed");
  OCTET_CHECK(meta != nullptr, "Quantizer::delayed: expected an FP8Meta, got null");
  OCTET_CHECK(index >= 0 && index < meta->num_tensors(),
              "Quantizer::delayed: meta index expected in [0,", meta->num_tensors(), "), got ",
              index);
  Quantizer quantizer;
  quantizer.format_ = format;
  quantizer.mode_ = ScalingMode::PerTensor;
  quantizer.source_ = ScaleSource::Delayed;
  quantizer.meta_ = meta;
  quantizer.meta_index_ = index;
  return quantizer;
}

Quantizer Quantizer::fixed(DType format, float scale) {
  check_fp8_format(format, "Quantizer::fixed");
  check_scale(scale, "Quantizer::fixed");
  Quantizer quantizer;
  quantizer.format_ = format;
  quantizer.mode_ = ScalingMode::PerTensor;
  quantizer.source_ = ScaleSource::Fixed;
  quantizer.fixed_scale_ = scale;
  return quantizer;
}

Quantizer Quantizer::current(DType format, bool power_2_scale, float amax_epsilon) {
  check_fp8_format(format, "Quantizer::current");
  OCTET_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0f,
              "Quantizer::current: amax_epsilon expected finite and >= 0, got ", amax_epsilon);
  Quantizer quantizer;
  quantizer.format_ = format;
  quantizer.mode_ = ScalingMode::PerTensor;
  quantizer.source_ = ScaleSource::Current;
  quantizer.power_2_scale_ = power_2_scale;
  quantizer.amax_epsilon_ = amax_epsilon;
  return quantizer;
}

Quantizer Quantizer::block(DType format, int block_rows, int block_cols, bool power_2_scale,
                           float amax_epsilon) {
  check_fp8_format(format, "Quantizer::block");
  OCTET_CHECK(block_rows >= 1 && block_cols >= 1, "Quantizer::block: block expected >= 1x1, got ",
              block_rows, "x", block_cols);
  OCTET_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0f,
              "Quantizer::block: amax_epsilon expected finite and >= 0, got ", amax_epsilon);
  Quantizer quantizer;
  quantizer.format_ = format;
  quantizer.mode_ = ScalingMode::Block;
  quantizer.source_ = ScaleSource::PerBlock;
  quantizer.block_rows_ = block_rows;
  quantizer.block_cols_ = block_cols;
  quantizer.power_2_scale_ = power_2_scale;
  quantizer.amax_epsilon_ = amax_epsilon;
  return quantizer;
}

Quantizer Quantizer::mxfp8(DType format) {
  check_fp8_format(format, "Quantizer::mxfp8");
  Quantizer quantizer;
  quantizer.format_ = format;
  quantizer.mode_ = ScalingMode::MXFP8;
  quantizer.source_ = ScaleSource::PerBlock;
  quantizer.block_rows_ = 1;
  quantizer.block_cols_ = kMxfp8Block;
  return quantizer;
}

namespace {

struct QuantizeJob {
  DType format;
  int block_rows;
  int block_cols;
  bool power_2_scale;
  float amax_epsilon;
};

// Fills out's rowwise and/or columnwise block- or MXFP8-scaled data from x [rows, cols].
template <typename T>
void quantize_scaled_blocks(const T* x, const QuantizeJob& job, bool rowwise, bool columnwise,
                            Float8Tensor& out) {
  const int64_t rows = out.rows;
  const int64_t cols = out.cols;
  const bool mx = out.mode == ScalingMode::MXFP8;
  // Scale tensor for data [r, c] in its own orientation.
  auto make_scales = [&](int64_t r, int64_t c) {
    return mx ? Tensor::empty({r, ceil_div(c, kMxfp8Block)}, DType::U8)
              : Tensor::empty({ceil_div(r, job.block_rows), ceil_div(c, job.block_cols)},
                              DType::F32);
  };
  auto run = [&](const T* source, int64_t r, int64_t c, Tensor& codes, Tensor& scales) {
    if (mx) return quantize_mxfp8(source, r, c, job.format, codes_of(codes), codes_of(scales));
    return quantize_blocks(source, r, c, job.block_rows, job.block_cols, job.format,
                           job.power_2_scale, job.amax_epsilon, codes_of(codes),
                           scales.data<float>());
  };

  if (rowwise) {
    out.data = Tensor::empty({rows, cols}, job.format);
    out.scale_inv = make_scales(rows, cols);
    out.amax = run(x, rows, cols, out.data, out.scale_inv);
  }
  if (!columnwise) return;
  out.data_t = Tensor::empty({cols, rows}, job.format);
  out.scale_inv_t = make_scales(cols, rows);
  if (rowwise && !mx && job.block_rows == job.block_cols) {
    // Square blocks cover the same elements in both orientations: transpose the result.
    detail::transpose_matrix(codes_of(out.data), rows, cols, codes_of(out.data_t));
    detail::transpose_matrix(out.scale_inv.data<float>(), out.scale_inv.dim(0),
                             out.scale_inv.dim(1), out.scale_inv_t.data<float>());
    return;
  }
  Tensor x_t = Tensor::empty({cols, rows}, dtype_of<T>::value);
  detail::transpose_matrix(x, rows, cols, x_t.data<T>());
  const float amax = run(x_t.data<T>(), cols, rows, out.data_t, out.scale_inv_t);
  if (!rowwise) out.amax = amax;
}

}  // namespace

Float8Tensor Quantizer::quantize(const Tensor& x, bool rowwise, bool columnwise) const {
  check_dtype_in(x, {DType::F32, DType::BF16}, "quantize: x");
  OCTET_CHECK(x.device() == Device::CPU, "quantize: x expected on cpu, got ",
              device_name(x.device()));
  OCTET_CHECK(x.numel() > 0, "quantize: x expected non-empty, got shape ", shape_str(x.shape()));
  OCTET_CHECK(rowwise || columnwise,
              "quantize: expected rowwise and/or columnwise usage, got neither");

  Float8Tensor out;
  out.format = format_;
  out.mode = mode_;
  out.rows = x.rows();
  out.cols = x.cols();
  out.block_rows = block_rows_;
  out.block_cols = block_cols_;
  const bool is_bf16 = x.dtype() == DType::BF16;

  if (mode_ != ScalingMode::PerTensor) {
    const QuantizeJob job{format_, block_rows_, block_cols_, power_2_scale_, amax_epsilon_};
    if (is_bf16) {
      quantize_scaled_blocks(x.data<bfloat16>(), job, rowwise, columnwise, out);
    } else {
      quantize_scaled_blocks(x.data<float>(), job, rowwise, columnwise, out);
    }
    return out;
  }

  const size_t numel = static_cast<size_t>(x.numel());
  float scale = fixed_scale_;
  if (source_ == ScaleSource::Delayed) {
    scale = meta_->scale(meta_index_);
  } else if (source_ == ScaleSource::Current) {
    const float amax =
        is_bf16 ? amax_of(x.data<bfloat16>(), numel) : amax_of(x.data<float>(), numel);
    scale = compute_scale_from_amax(amax, fp8_max(format_), power_2_scale_, amax_epsilon_);
  }
  check_scale(scale, "quantize");

  if (rowwise) out.data = Tensor::empty({out.rows, out.cols}, format_);
  if (columnwise) out.data_t = Tensor::empty({out.cols, out.rows}, format_);
  uint8_t* codes = rowwise ? codes_of(out.data) : nullptr;
  uint8_t* codes_t = columnwise ? codes_of(out.data_t) : nullptr;
  out.amax = is_bf16 ? cast_transpose_fp8(x.data<bfloat16>(), out.rows, out.cols, scale, format_,
                                          codes, codes_t)
                     : cast_transpose_fp8(x.data<float>(), out.rows, out.cols, scale, format_,
                                          codes, codes_t);
  out.scale = scale;
  if (rowwise) out.scale_inv = Tensor::from_floats({1}, {1.0f / scale});
  if (columnwise) out.scale_inv_t = Tensor::from_floats({1}, {1.0f / scale});
  if (source_ == ScaleSource::Delayed) meta_->record_amax(meta_index_, out.amax);
  return out;
}

Quantizer make_quantizer(const recipe::Recipe& recipe, TensorRole role, FP8Meta* meta, int index) {
  return std::visit(
      [&](const auto& r) -> Quantizer {
        using R = std::decay_t<decltype(r)>;
        const DType format = fp8_dtype(r.fp8_format, role);
        if constexpr (std::is_same_v<R, recipe::DelayedScaling>) {
          OCTET_CHECK(meta != nullptr,
                      "make_quantizer: DelayedScaling expected an FP8Meta holding the scale, "
                      "got null");
          return Quantizer::delayed(format, meta, index);
        } else if constexpr (std::is_same_v<R, recipe::Float8CurrentScaling>) {
          return Quantizer::current(format, r.power_2_scale, r.amax_epsilon);
        } else if constexpr (std::is_same_v<R, recipe::MXFP8BlockScaling>) {
          return Quantizer::mxfp8(format);
        } else {
          if (role == TensorRole::Weight) {
            return Quantizer::block(format, r.weight_block, r.weight_block, r.power_2_scale,
                                    r.amax_epsilon);
          }
          return Quantizer::block(format, 1, r.activation_block, r.power_2_scale, r.amax_epsilon);
        }
      },
      recipe);
}

}  // namespace octet
