// GEMM entry points: boundary checks, then the oneDNN matmul (matmul.cpp). FP8 operands are
// widened exactly to BF16 (scales folded or left to the output scale) or, when a block scale
// is not a power of two, dequantized to F32.
#include "octet/gemm.h"

#include "gemm/fp8_operand.h"
#include "gemm/gemm_checks.h"
#include "gemm/matmul.h"
#include "gemm/packed_weight.h"
#include "gemm/workspace.h"
#include "octet/profile.h"

namespace octet {

using gemm_detail::MatmulArgs;

namespace {

MatmulArgs epilogue_args(Tensor& c, float alpha, float beta, const Epilogue& epilogue) {
  MatmulArgs args;
  args.c_dtype = c.dtype();
  args.c = c.raw();
  args.output_scale = alpha;
  args.beta = beta;
  args.bias = epilogue.bias;
  args.activation = epilogue.activation;
  return args;
}

void check_fp8_pair(DType a, DType b) {
  OCTET_CHECK(is_fp8(a) && is_fp8(b), "gemm: FP8 operands expected e4m3/e5m2, got ", dtype_name(a),
              " x ", dtype_name(b));
  OCTET_CHECK(a == DType::E4M3 || b == DType::E4M3,
              "gemm: FP8 e5m2 x e5m2 is not supported (one operand must be e4m3)");
}

void check_float8(const Float8Tensor& x, std::string_view what) {
  OCTET_CHECK(x.has_rowwise() || x.has_columnwise(), what, " holds no data");
}

}  // namespace

void gemm(const Tensor& A, const Tensor& B, Tensor& C, bool trans_a, bool trans_b, float alpha,
          float beta, const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  gemm_detail::check_matrix(A, "gemm: A");
  gemm_detail::check_matrix(B, "gemm: B");
  check_dtype_in(A, {DType::F32, DType::BF16}, "gemm: A");
  check_dtype(B, A.dtype(), "gemm: B (same dtype as A)");
  OCTET_CHECK(B.ndim() == 2, "gemm: B expected a matrix ", trans_b ? "[N,K]" : "[K,N]", ", got ",
              shape_str(B.shape()));
  const int64_t m = trans_a ? A.cols() : A.rows();
  const int64_t k = trans_a ? A.rows() : A.cols();
  const int64_t n = gemm_detail::check_b_dims(B.dim(0), B.dim(1), k, trans_b, "gemm: B");
  if (A.dtype() == DType::F32) {
    gemm_detail::check_c(C, m, n, {DType::F32}, "f32");
  } else {
    gemm_detail::check_c(C, m, n, {DType::F32, DType::BF16}, "bf16");
  }
  gemm_detail::check_epilogue(epilogue, n);
  if (k == 0) return gemm_detail::apply_epilogue_only(C, m, n, beta, epilogue);

  MatmulArgs args = epilogue_args(C, alpha, beta, epilogue);
  args.m = m;
  args.n = n;
  args.k = k;
  args.a_dtype = A.dtype();
  args.b_dtype = B.dtype();
  args.trans_a = trans_a;
  args.trans_b = trans_b;
  args.a = A.raw();
  args.b = B.raw();
  gemm_detail::run_matmul(args);
}

void gemm(const Tensor& A, PackedWeight& B, Tensor& C, bool trans_a, float alpha, float beta,
          const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  gemm_detail::PackedWeightState& weight = PackedWeightAccess::state(B);
  gemm_detail::check_matrix(A, "gemm: A");
  check_dtype_in(A, {DType::F32, DType::BF16}, "gemm: A");
  OCTET_CHECK(!weight.is_fp8,
              "gemm: an FP8 PackedWeight needs an FP8 A (quantize A, then call "
              "gemm(Float8Tensor, PackedWeight))");
  check_dtype(weight.tensor, A.dtype(), "gemm: PackedWeight B (same dtype as A)");
  const int64_t m = trans_a ? A.cols() : A.rows();
  const int64_t k = trans_a ? A.rows() : A.cols();
  OCTET_CHECK(k == weight.k, "gemm: A expected ", trans_a ? "[K,M]=" : "[M,K]=",
              shape_str(trans_a ? Shape{weight.k, m} : Shape{m, weight.k}),
              " (K of the PackedWeight), got ", shape_str(A.shape()));
  const int64_t n = weight.n;
  if (A.dtype() == DType::F32) {
    gemm_detail::check_c(C, m, n, {DType::F32}, "f32");
  } else {
    gemm_detail::check_c(C, m, n, {DType::F32, DType::BF16}, "bf16");
  }
  gemm_detail::check_epilogue(epilogue, n);
  if (k == 0) return gemm_detail::apply_epilogue_only(C, m, n, beta, epilogue);

  MatmulArgs args = epilogue_args(C, alpha, beta, epilogue);
  args.m = m;
  args.n = n;
  args.k = k;
  args.a_dtype = A.dtype();
  args.b_dtype = A.dtype();
  args.trans_a = trans_a;
  args.a = A.raw();
  args.packed = &weight;
  gemm_detail::run_matmul(args);
}

namespace {

// oneDNN has no F32 x F32 -> BF16 matmul: when an FP8 GEMM must widen to F32 (block scales
// that do not fold into BF16) and C is BF16, it computes into an F32 copy and rounds back.
class F32OutputFor {
 public:
  F32OutputFor(Tensor& c, DType work, float beta) : c_(c) {
    if (work != DType::F32 || c.dtype() != DType::BF16) return;
    staged_ = beta != 0.0f ? c.to(DType::F32) : Tensor::empty(c.shape(), DType::F32);
  }
  Tensor& target() { return staged_.defined() ? staged_ : c_; }
  void finish() {
    if (staged_.defined()) c_.copy_from(staged_.to(DType::BF16));
  }

 private:
  Tensor& c_;
  Tensor staged_;
};

}  // namespace

void gemm(const Float8Tensor& A, const Float8Tensor& B, Tensor& C, bool trans_a, bool trans_b,
          float alpha, float beta, const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  check_float8(A, "gemm: FP8 A");
  check_float8(B, "gemm: FP8 B");
  check_fp8_pair(A.format, B.format);
  const int64_t m = trans_a ? A.cols : A.rows;
  const int64_t k = trans_a ? A.rows : A.cols;
  const int64_t n = gemm_detail::check_b_dims(B.rows, B.cols, k, trans_b, "gemm: FP8 B");
  gemm_detail::check_c(C, m, n, {DType::F32, DType::BF16}, "fp8");
  gemm_detail::check_epilogue(epilogue, n);
  const gemm_detail::Fp8Operand a = gemm_detail::select_a_operand(A, trans_a, "gemm: FP8 A");
  const gemm_detail::Fp8Operand b = gemm_detail::select_b_operand(B, trans_b, "gemm: FP8 B");
  if (k == 0) return gemm_detail::apply_epilogue_only(C, m, n, beta, epilogue);

  // Without a oneDNN BF16 matmul, FP8 widens straight to F32 (as exact, one pass fewer).
  const DType work = gemm_bf16_native() && gemm_detail::bf16_foldable(a.matrix) &&
                             gemm_detail::bf16_foldable(b.matrix)
                         ? DType::BF16
                         : DType::F32;
  gemm_detail::Fp8Workspace& workspace = gemm_detail::fp8_workspace();
  void* a_data = workspace.a.reserve(static_cast<size_t>(m * k) * dtype_bytes(work));
  void* b_data = workspace.b.reserve(static_cast<size_t>(k * n) * dtype_bytes(work));
  gemm_detail::widen(a.matrix, work, a_data);
  gemm_detail::widen(b.matrix, work, b_data);

  const double scale = static_cast<double>(alpha) * gemm_detail::tensor_scale_inv(a.matrix) *
                       gemm_detail::tensor_scale_inv(b.matrix);
  F32OutputFor output(C, work, beta);
  MatmulArgs args = epilogue_args(output.target(), static_cast<float>(scale), beta, epilogue);
  args.m = m;
  args.n = n;
  args.k = k;
  args.a_dtype = work;
  args.b_dtype = work;
  args.trans_a = a.transposed;
  args.trans_b = b.transposed;
  args.a = a_data;
  args.b = b_data;
  gemm_detail::run_matmul(args);
  output.finish();
}

void gemm(const Float8Tensor& A, PackedWeight& B, Tensor& C, bool trans_a, float alpha, float beta,
          const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  gemm_detail::PackedWeightState& weight = PackedWeightAccess::state(B);
  check_float8(A, "gemm: FP8 A");
  OCTET_CHECK(weight.is_fp8, "gemm: FP8 A expected an FP8 PackedWeight, got one holding ",
              dtype_name(weight.tensor.dtype()));
  check_fp8_pair(A.format, weight.fp8.format);
  const int64_t m = trans_a ? A.cols : A.rows;
  const int64_t k = trans_a ? A.rows : A.cols;
  OCTET_CHECK(k == weight.k, "gemm: FP8 A expected ", trans_a ? "[K,M]=" : "[M,K]=",
              shape_str(trans_a ? Shape{weight.k, m} : Shape{m, weight.k}),
              " (K of the PackedWeight), got ", shape_str({A.rows, A.cols}));
  const int64_t n = weight.n;
  gemm_detail::check_c(C, m, n, {DType::F32, DType::BF16}, "fp8");
  gemm_detail::check_epilogue(epilogue, n);
  const gemm_detail::Fp8Operand a = gemm_detail::select_a_operand(A, trans_a, "gemm: FP8 A");
  if (k == 0) return gemm_detail::apply_epilogue_only(C, m, n, beta, epilogue);

  bool weight_foldable = false;
  {
    std::lock_guard<std::mutex> lock(weight.mutex);
    weight_foldable = weight.foldable;
  }
  const DType work = gemm_bf16_native() && gemm_detail::bf16_foldable(a.matrix) && weight_foldable
                         ? DType::BF16
                         : DType::F32;
  gemm_detail::Fp8Workspace& workspace = gemm_detail::fp8_workspace();
  void* a_data = workspace.a.reserve(static_cast<size_t>(m * k) * dtype_bytes(work));
  gemm_detail::widen(a.matrix, work, a_data);

  const double scale =
      static_cast<double>(alpha) * gemm_detail::tensor_scale_inv(a.matrix) * weight.fp8_scale_inv();
  F32OutputFor output(C, work, beta);
  MatmulArgs args = epilogue_args(output.target(), static_cast<float>(scale), beta, epilogue);
  args.m = m;
  args.n = n;
  args.k = k;
  args.a_dtype = work;
  args.b_dtype = work;
  args.trans_a = a.transposed;
  args.a = a_data;
  args.packed = &weight;
  gemm_detail::run_matmul(args);
  output.finish();
}

}  // namespace octet
