#include "gemm/gemm_checks.h"

#include <vector>

namespace octet::gemm_detail {

void check_matrix(const Tensor& x, std::string_view what) {
  OCTET_CHECK(x.defined(), what, " is undefined");
  OCTET_CHECK(x.ndim() >= 2, what, " expected a matrix, got ", shape_str(x.shape()));
  OCTET_CHECK(x.device() == Device::CPU, what, " expected on cpu, got ", device_name(x.device()));
}

int64_t check_b_dims(int64_t b_rows, int64_t b_cols, int64_t k, bool trans_b,
                     std::string_view what) {
  const int64_t n = trans_b ? b_rows : b_cols;
  const int64_t b_k = trans_b ? b_cols : b_rows;
  if (b_k != k) {
    const Shape expected = trans_b ? Shape{n, k} : Shape{k, n};
    fail(detail::concat(what, " expected ", trans_b ? "[N,K]=" : "[K,N]=", shape_str(expected),
                        ", got ", shape_str({b_rows, b_cols})));
  }
  return n;
}

void check_c(const Tensor& c, int64_t m, int64_t n, std::initializer_list<DType> allowed,
             std::string_view operands) {
  OCTET_CHECK(c.defined(), "gemm: C is undefined");
  OCTET_CHECK(c.device() == Device::CPU, "gemm: C expected on cpu, got ", device_name(c.device()));
  OCTET_CHECK(c.ndim() >= 2 && c.rows() == m && c.cols() == n,
              "gemm: C expected [M,N]=", shape_str({m, n}), ", got ", shape_str(c.shape()));
  bool ok = false;
  std::string names;
  for (DType dtype : allowed) {
    ok = ok || c.dtype() == dtype;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(dtype));
  }
  OCTET_CHECK(ok, "gemm: C expected dtype ", names, " for ", operands, " operands, got ",
              dtype_name(c.dtype()));
}

void check_epilogue(const Epilogue& epilogue, int64_t n) {
  if (epilogue.bias == nullptr) return;
  const Tensor& bias = *epilogue.bias;
  OCTET_CHECK(bias.defined(), "gemm: bias is undefined");
  OCTET_CHECK(bias.numel() == n && bias.dim(-1) == n, "gemm: bias expected [N]=[", n, "], got ",
              shape_str(bias.shape()));
  check_dtype_in(bias, {DType::F32, DType::BF16}, "gemm: bias");
}

void apply_epilogue_only(Tensor& c, int64_t m, int64_t n, float beta, const Epilogue& epilogue) {
  std::vector<float> bias(static_cast<size_t>(n), 0.0f);
  if (epilogue.bias != nullptr) bias = epilogue.bias->to_floats();
  const bool is_bf16 = c.dtype() == DType::BF16;
  for (int64_t i = 0; i < m * n; ++i) {
    float value = 0.0f;
    if (beta != 0.0f) {
      const float old = is_bf16 ? bf16_to_float(c.data<bfloat16>()[i].bits) : c.data<float>()[i];
      value = beta * old;
    }
    value = apply_activation(epilogue.activation, value + bias[static_cast<size_t>(i % n)]);
    if (is_bf16) {
      c.data<bfloat16>()[i].bits = float_to_bf16(value);
    } else {
      c.data<float>()[i] = value;
    }
  }
}

}  // namespace octet::gemm_detail
