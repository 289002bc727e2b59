// OCP FP8 formats (E4M3, E5M2), their conversions, and Float8Tensor: FP8 codes plus the
// scaling that recovers the real values.
//
// E4M3: bias 7, max 448, no infinities, NaN = S.1111.111, smallest subnormal 2^-9.
// E5M2: bias 15, max 57344, infinities, NaN = S.11111.{01,10,11}, smallest subnormal 2^-16.
// Encoding rounds to nearest even. Without saturation an overflow becomes NaN (E4M3) or
// Inf (E5M2); with saturation any value past the maximum, infinities included, becomes
// +-max (the behaviour of cvt.rn.satfinite); NaN always stays NaN.
#pragma once

#include <cstddef>
#include <cstdint>

#include "octet/dtype.h"
#include "octet/tensor.h"

namespace octet {

// The scalar element conversions (fp8_max, fp8_to_float, float_to_fp8, E8M0) are in dtype.h.

// Bulk kernels, dispatched on active_isa(). All are exact ports of the scalar functions.
// codes[i] = fp8(x[i] * scale) saturating; returns amax = max |x[i]| (NaN if any x is NaN).
float quantize_fp8(const float* x, size_t n, float scale, DType format, uint8_t* codes);
float quantize_fp8(const bfloat16* x, size_t n, float scale, DType format, uint8_t* codes);
// out[i] = fp8_to_float(codes[i]) * scale_inv.
void dequantize_fp8(const uint8_t* codes, size_t n, DType format, float scale_inv, float* out);
// Exact widening: every FP8 value is representable in BF16.
void fp8_to_bf16(const uint8_t* codes, size_t n, DType format, bfloat16* out);
// max |x[i]| (NaN if any x is NaN).
float amax_of(const float* x, size_t n);
float amax_of(const bfloat16* x, size_t n);
// Fused cast + transpose in one pass: x [rows, cols] -> codes [rows, cols] and
// codes_t [cols, rows] (either may be null), scale applied, saturating; returns amax of x.
float cast_transpose_fp8(const float* x, int64_t rows, int64_t cols, float scale, DType format,
                         uint8_t* codes, uint8_t* codes_t);
float cast_transpose_fp8(const bfloat16* x, int64_t rows, int64_t cols, float scale, DType format,
                         uint8_t* codes, uint8_t* codes_t);

enum class ScalingMode {
  PerTensor,  // one FP32 scale for the whole tensor (delayed or current scaling)
  Block,      // FP32 scale per block_rows x block_cols block (1x128, 128x128)
  MXFP8,      // E8M0 power-of-two scale per 1x32 block
};
const char* scaling_mode_name(ScalingMode mode);

// A quantized matrix [rows, cols] (leading dimensions flattened into rows).
// Rowwise usage: `data` [rows, cols] with scaling blocks laid along its last dimension.
// Columnwise usage: `data_t` = the transpose [cols, rows], its scaling blocks laid along
// ITS last dimension (the original rows), with the same block_rows x block_cols in its own
// orientation. A GEMM needs its scaling blocks along K, so it picks the usage that has them.
// Scale tensors: PerTensor [1] F32; Block [ceil(r/block_rows), ceil(c/block_cols)] F32;
// MXFP8 [r, ceil(c/32)] U8 (E8M0), where r x c is the orientation of the data they scale.
// real value = fp8_to_float(code) * scale_inv of its block.
struct Float8Tensor {
  DType format = DType::E4M3;
  ScalingMode mode = ScalingMode::PerTensor;
  int64_t rows = 0;
  int64_t cols = 0;
  int block_rows = 0;  // 0 for per-tensor scaling
  int block_cols = 0;
  Tensor data;  // [rows, cols], dtype = format; undefined without rowwise usage
  Tensor scale_inv;
  Tensor data_t;  // [cols, rows], dtype = format; undefined without columnwise usage
  Tensor scale_inv_t;
  float scale = 1.0f;  // per-tensor: the scale applied (scale_inv = 1 / scale)
  float amax = 0.0f;   // max |x| of the unquantized input

  bool has_rowwise() const { return data.defined(); }
  bool has_columnwise() const { return data_t.defined(); }
  Tensor dequantize() const;    // F32 [rows, cols], from whichever usage exists
  Tensor dequantize_t() const;  // F32 [cols, rows]
};

}  // namespace octet
