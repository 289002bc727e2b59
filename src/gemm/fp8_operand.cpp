#include "gemm/fp8_operand.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <string>

#include "octet/cpu_features.h"

namespace octet::gemm_detail {

namespace {

Fp8Matrix rowwise_matrix(const Float8Tensor& x) {
  return {static_cast<const uint8_t*>(x.data.raw()),
          x.rows,
          x.cols,
          x.format,
          x.mode,
          x.block_rows,
          x.block_cols,
          &x.scale_inv};
}

Fp8Matrix columnwise_matrix(const Float8Tensor& x) {
  // Per-tensor scaling has one scale for both usages; some producers fill only scale_inv.
  const Tensor* scale =
      x.mode == ScalingMode::PerTensor && !x.scale_inv_t.defined() ? &x.scale_inv : &x.scale_inv_t;
  return {static_cast<const uint8_t*>(x.data_t.raw()),
          x.cols,
          x.rows,
          x.format,
          x.mode,
          x.block_rows,
          x.block_cols,
          scale};
}

// Whether the other usage may stand in: per-tensor scales, or 2D blocks (128x128), which
// span K in either orientation. 1x128 blocks and MXFP8 lie along one dimension only.
bool either_usage_works(const Float8Tensor& x) {
  return x.mode == ScalingMode::PerTensor ||
         (x.mode == ScalingMode::Block && x.block_rows > 1 && x.block_cols > 1);
}

std::string block_name(const Float8Tensor& x) {
  if (x.mode == ScalingMode::MXFP8) return "MXFP8 1x32";
  if (x.mode == ScalingMode::PerTensor) return "per-tensor";
  return detail::concat(x.block_rows, "x", x.block_cols);
}

// preferred_rowwise: the rowwise data has its blocks along K; rowwise_is_transposed: the
// rowwise data is op(X)^T. Picks the K-blocked usage, or the other one where that works.
Fp8Operand select(const Float8Tensor& x, bool preferred_rowwise, bool rowwise_is_transposed,
                  std::string_view what) {
  OCTET_CHECK(x.has_rowwise() || x.has_columnwise(), what, ": Float8Tensor [", x.rows, ",", x.cols,
              "] holds neither rowwise nor columnwise data");
  const bool have_preferred = preferred_rowwise ? x.has_rowwise() : x.has_columnwise();
  bool use_rowwise = preferred_rowwise;
  if (!have_preferred) {
    OCTET_CHECK(either_usage_works(x), what, ": ", block_name(x),
                " scaling needs its blocks along K, which only the ",
                preferred_rowwise ? "rowwise" : "columnwise", " usage has; quantize it with ",
                preferred_rowwise ? "rowwise=true" : "columnwise=true");
    use_rowwise = !preferred_rowwise;
  }
  if (use_rowwise) return {rowwise_matrix(x), rowwise_is_transposed};
  return {columnwise_matrix(x), !rowwise_is_transposed};
}

bool is_power_of_two(float value, int* exponent) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t biased = (bits >> 23) & 0xFF;
  if ((bits >> 31) != 0 || (bits & 0x7FFFFF) != 0 || biased == 0 || biased == 0xFF) {
    return false;
  }
  *exponent = static_cast<int>(biased) - 127;
  return true;
}

// Biased BF16 exponents of the smallest nonzero and the largest finite FP8 value.
void fp8_exponent_range(DType format, int* lowest, int* highest) {
  if (format == DType::E4M3) {
    *lowest = 127 - 9;   // 2^-9
    *highest = 127 + 8;  // 448 = 1.75 * 2^8
  } else {
    *lowest = 127 - 16;   // 2^-16
    *highest = 127 + 15;  // 57344 = 1.75 * 2^15
  }
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int mx_block_cols(const Fp8Matrix& m) {
  return m.block_cols > 0 ? m.block_cols : 32;
}

// The scale of the block holding element (row, col), as a float.
float block_scale(const Fp8Matrix& m, int64_t row, int64_t col) {
  if (m.mode == ScalingMode::MXFP8) {
    const int64_t blocks = ceil_div(m.cols, mx_block_cols(m));
    return e8m0_to_float(m.scale_inv->data<uint8_t>()[row * blocks + col / mx_block_cols(m)]);
  }
  const int64_t blocks = ceil_div(m.cols, m.block_cols);
  return m.scale_inv->data<float>()[(row / m.block_rows) * blocks + col / m.block_cols];
}

int run_cols(const Fp8Matrix& m) {
  if (m.mode == ScalingMode::MXFP8) return mx_block_cols(m);
  return m.block_cols;
}

// Multiplies BF16 values by 2^exponent: adds it to the exponent field of every finite
// nonzero value (zeros, infinities and NaN stay). bf16_foldable() checked that the results
// stay normal, so this is exact.
void shift_exponents_scalar(bfloat16* data, size_t n, int exponent) {
  const auto shift = static_cast<uint16_t>(exponent * 128);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const uint16_t bits = data[i].bits;
    const uint16_t field = bits & 0x7F80;
    data[i].bits = field != 0 && field != 0x7F80 ? static_cast<uint16_t>(bits + shift) : bits;
  }
}

__attribute__((target("avx512f,avx512bw"))) void shift_exponents_avx512(bfloat16* data, size_t n,
                                                                        int exponent) {
  const __m512i shift = _mm512_set1_epi16(static_cast<int16_t>(exponent * 128));
  const __m512i field_mask = _mm512_set1_epi16(0x7F80);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i bits = _mm512_loadu_si512(data + i);
    const __m512i field = _mm512_and_si512(bits, field_mask);
    const __mmask32 finite_nonzero =
        _mm512_test_epi16_mask(bits, field_mask) & _mm512_cmpneq_epi16_mask(field, field_mask);
    _mm512_storeu_si512(data + i, _mm512_mask_add_epi16(bits, finite_nonzero, bits, shift));
  }
  shift_exponents_scalar(data + i, n - i, exponent);
}

using ShiftFunction = void (*)(bfloat16*, size_t, int);
ShiftFunction select_shift_exponents() {
  const bool avx512 = cpu_features().avx512bw && active_isa() == Isa::Avx512;
  return avx512 ? shift_exponents_avx512 : shift_exponents_scalar;
}

bool large(const Fp8Matrix& m) {
  return m.rows * m.cols >= (int64_t{1} << 16);
}

}  // namespace

Fp8Operand select_a_operand(const Float8Tensor& a, bool trans_a, std::string_view what) {
  // A stored [M,K]: rowwise has K-blocks and is A_eff itself. Stored [K,M]: data_t is A_eff.
  return select(a, !trans_a, /*rowwise_is_transposed=*/trans_a, what);
}

Fp8Operand select_b_operand(const Float8Tensor& b, bool trans_b, std::string_view what) {
  // B stored [N,K] (trans_b): rowwise is B_eff = op(B)^T. Stored [K,N]: data_t is B_eff.
  return select(b, trans_b, /*rowwise_is_transposed=*/trans_b, what);
}

float tensor_scale_inv(const Fp8Matrix& m) {
  if (m.mode != ScalingMode::PerTensor) return 1.0f;
  return m.scale_inv->data<float>()[0];
}

bool bf16_foldable(const Fp8Matrix& m) {
  if (m.mode == ScalingMode::PerTensor) return true;
  int lowest = 0;
  int highest = 0;
  fp8_exponent_range(m.format, &lowest, &highest);
  auto in_range = [&](int exponent) { return lowest + exponent >= 1 && highest + exponent <= 254; };
  if (m.mode == ScalingMode::MXFP8) {
    const uint8_t* codes = m.scale_inv->data<uint8_t>();
    for (int64_t i = 0; i < m.scale_inv->numel(); ++i) {
      if (codes[i] == 0xFF || !in_range(static_cast<int>(codes[i]) - 127)) return false;
    }
    return true;
  }
  const float* scales = m.scale_inv->data<float>();
  for (int64_t i = 0; i < m.scale_inv->numel(); ++i) {
    int exponent = 0;
    if (!is_power_of_two(scales[i], &exponent) || !in_range(exponent)) return false;
  }
  return true;
}

void widen(const Fp8Matrix& m, DType dtype, void* out) {
  const int64_t rows = m.rows;
  const int64_t cols = m.cols;
  if (dtype == DType::BF16) {
    auto* dst = static_cast<bfloat16*>(out);
    const bool fold = m.mode != ScalingMode::PerTensor;
    const ShiftFunction shift_exponents = select_shift_exponents();
#pragma omp parallel for schedule(static) if (large(m))
    for (int64_t r = 0; r < rows; ++r) {
      bfloat16* row = dst + r * cols;
      fp8_to_bf16(m.codes + r * cols, static_cast<size_t>(cols), m.format, row);
      if (!fold) continue;
      const int width = run_cols(m);
      for (int64_t c0 = 0; c0 < cols; c0 += width) {
        int exponent = 0;
        if (m.mode == ScalingMode::MXFP8) {
          exponent = static_cast<int>(
                         m.scale_inv->data<uint8_t>()[r * ceil_div(cols, width) + c0 / width]) -
                     127;
        } else {
          is_power_of_two(block_scale(m, r, c0), &exponent);
        }
        const int64_t c1 = std::min(cols, c0 + width);
        if (exponent != 0) shift_exponents(row + c0, static_cast<size_t>(c1 - c0), exponent);
      }
    }
    return;
  }
  OCTET_CHECK(dtype == DType::F32, "gemm: FP8 widening to ", dtype_name(dtype),
              " is not supported");
  auto* dst = static_cast<float*>(out);
#pragma omp parallel for schedule(static) if (large(m))
  for (int64_t r = 0; r < rows; ++r) {
    if (m.mode == ScalingMode::PerTensor) {
      dequantize_fp8(m.codes + r * cols, static_cast<size_t>(cols), m.format, 1.0f, dst + r * cols);
      continue;
    }
    const int width = run_cols(m);
    for (int64_t c0 = 0; c0 < cols; c0 += width) {
      const int64_t c1 = std::min(cols, c0 + width);
      dequantize_fp8(m.codes + r * cols + c0, static_cast<size_t>(c1 - c0), m.format,
                     block_scale(m, r, c0), dst + r * cols + c0);
    }
  }
}

}  // namespace octet::gemm_detail
