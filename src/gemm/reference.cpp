// The GEMM oracle (FP64 accumulation), the naive FP32 baseline and the scalar activations.
#include <cmath>
#include <vector>

#include "gemm/gemm_checks.h"
#include "octet/gemm.h"

namespace octet {

float apply_activation(Activation activation, float x) {
  switch (activation) {
    case Activation::None:
      return x;
    case Activation::GeluTanh: {
      const float sqrt_2_over_pi = 0.7978845608028654f;
      return 0.5f * x * (1.0f + std::tanh(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
    }
    case Activation::GeluErf:
      return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
    case Activation::Relu:
      return x > 0.0f ? x : 0.0f;
  }
  return x;
}

void gemm_reference(const Tensor& A, const Tensor& B, Tensor& C, bool trans_a, bool trans_b,
                    float alpha, float beta, const Epilogue& epilogue) {
  gemm_detail::check_matrix(A, "gemm_reference: A");
  gemm_detail::check_matrix(B, "gemm_reference: B");
  OCTET_CHECK(B.ndim() == 2, "gemm_reference: B expected a matrix, got ", shape_str(B.shape()));
  const int64_t m = trans_a ? A.cols() : A.rows();
  const int64_t k = trans_a ? A.rows() : A.cols();
  const int64_t n = gemm_detail::check_b_dims(B.dim(0), B.dim(1), k, trans_b, "gemm_reference: B");
  gemm_detail::check_c(C, m, n, {DType::F32, DType::BF16}, "reference");
  gemm_detail::check_epilogue(epilogue, n);

  // op(A) as [M,K] and op(B)^T as [N,K], in double, so the inner loop is a contiguous dot.
  const std::vector<float> a_values = A.to_floats();
  const std::vector<float> b_values = B.to_floats();
  std::vector<double> a(static_cast<size_t>(m * k));
  std::vector<double> bt(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      a[i * k + p] = a_values[trans_a ? p * m + i : i * k + p];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t p = 0; p < k; ++p) {
      bt[j * k + p] = b_values[trans_b ? j * k + p : p * n + j];
    }
  }
  std::vector<float> bias(static_cast<size_t>(n), 0.0f);
  if (epilogue.bias != nullptr) bias = epilogue.bias->to_floats();
  const bool is_bf16 = C.dtype() == DType::BF16;
  float* c_f32 = is_bf16 ? nullptr : C.data<float>();
  bfloat16* c_bf16 = is_bf16 ? C.data<bfloat16>() : nullptr;

#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      const double* a_row = &a[static_cast<size_t>(i * k)];
      const double* b_row = &bt[static_cast<size_t>(j * k)];
      for (int64_t p = 0; p < k; ++p) sum += a_row[p] * b_row[p];
      double value = static_cast<double>(alpha) * sum;
      const int64_t index = i * n + j;
      if (beta != 0.0f) {
        const float old = is_bf16 ? bf16_to_float(c_bf16[index].bits) : c_f32[index];
        value += static_cast<double>(beta) * old;
      }
      value += bias[static_cast<size_t>(j)];
      const float result = apply_activation(epilogue.activation, static_cast<float>(value));
      if (is_bf16) {
        c_bf16[index].bits = float_to_bf16(result);
      } else {
        c_f32[index] = result;
      }
    }
  }
}

void gemm_naive_f32(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K) {
  for (int64_t i = 0; i < M; ++i) {
    float* c_row = C + i * N;
    for (int64_t j = 0; j < N; ++j) c_row[j] = 0.0f;
    for (int64_t p = 0; p < K; ++p) {
      const float a = A[i * K + p];
      const float* b_row = B + p * N;
      for (int64_t j = 0; j < N; ++j) c_row[j] += a * b_row[j];
    }
  }
}

}  // namespace octet
