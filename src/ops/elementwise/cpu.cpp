// Elementwise, fast path: OpenMP over blocks of elements, rows or column blocks, inner loops
// vectorized per instruction set. Each element is computed as the reference computes it
// (add_column_sums adds every column's rows in row order), so the results are the
// reference's bit for bit (add_scaled may fuse alpha * x + out into one FMA where alpha is
// not a power of two).
#include <algorithm>

#include "ops/elementwise/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

constexpr int64_t kBlock = 4096;                            // elements per task
constexpr int64_t kParallelMinElements = int64_t{1} << 15;  // below: one thread

template <typename In>
OCTET_ALWAYS_INLINE void add_scaled_body(const In* x, float alpha, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += alpha * simd::load(x[i]);
}

OCTET_ALWAYS_INLINE void scale_body(float* v, float factor, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] *= factor;
}

template <typename T>
OCTET_ALWAYS_INLINE void add_bias_body(T* y, const float* bias, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) simd::store(simd::load(y[c]) + bias[c], y + c);
}

template <typename In>
OCTET_ALWAYS_INLINE void add_row_body(const In* x, float* out, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] += simd::load(x[c]);
}

// One function per instruction set for each body (see src/ops/README.md).
#define OCTET_ELEMENTWISE_VARIANTS(name, body, params, args) \
  template <typename T>                                      \
  OCTET_TARGET_AVX512 void name##_avx512 params {            \
    body args;                                               \
  }                                                          \
  template <typename T>                                      \
  OCTET_TARGET_AVX2 void name##_avx2 params {                \
    body args;                                               \
  }                                                          \
  template <typename T>                                      \
  void name##_scalar params {                                \
    body args;                                               \
  }                                                          \
  template <typename T>                                      \
  auto pick_##name() {                                       \
    switch (active_isa()) {                                  \
      case Isa::Avx512:                                      \
        return &name##_avx512<T>;                            \
      case Isa::Avx2:                                        \
        return &name##_avx2<T>;                              \
      default:                                               \
        return &name##_scalar<T>;                            \
    }                                                        \
  }

OCTET_ELEMENTWISE_VARIANTS(add_scaled_row, add_scaled_body,
                           (const T* x, float alpha, float* out, int64_t n), (x, alpha, out, n))
OCTET_ELEMENTWISE_VARIANTS(scale_row, scale_body, (T * v, float factor, int64_t n), (v, factor, n))
OCTET_ELEMENTWISE_VARIANTS(add_bias_row, add_bias_body, (T * y, const float* bias, int64_t n),
                           (y, bias, n))
OCTET_ELEMENTWISE_VARIANTS(add_row, add_row_body, (const T* x, float* out, int64_t n), (x, out, n))

#undef OCTET_ELEMENTWISE_VARIANTS

template <typename In>
void add_scaled_typed(const Tensor& x, float alpha, Tensor& out) {
  const auto kernel = pick_add_scaled_row<In>();
  const In* xs = x.data<In>();
  float* o = out.data<float>();
  const int64_t n = out.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t b = 0; b < n; b += kBlock) kernel(xs + b, alpha, o + b, std::min(kBlock, n - b));
}

template <typename T>
void add_bias_typed(Tensor& y, const Tensor& bias, int64_t cols) {
  const auto kernel = pick_add_bias_row<T>();
  T* ys = y.data<T>();
  const float* b = bias.data<float>();
  const int64_t rows = y.numel() / cols;
#pragma omp parallel for schedule(static) if (y.numel() >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) kernel(ys + r * cols, b, cols);
}

template <typename In>
void add_column_sums_typed(const Tensor& x, Tensor& out, int64_t cols) {
  const auto kernel = pick_add_row<In>();
  const In* xs = x.data<In>();
  float* o = out.data<float>();
  const int64_t rows = x.numel() / cols, width = 64;
  // Threads own column blocks; each adds its columns' rows in row order.
#pragma omp parallel for schedule(static) if (x.numel() >= kParallelMinElements)
  for (int64_t c0 = 0; c0 < cols; c0 += width) {
    const int64_t n = std::min(width, cols - c0);
    for (int64_t r = 0; r < rows; ++r) kernel(xs + r * cols + c0, o + c0, n);
  }
}

}  // namespace

void add_scaled(const Tensor& x, float alpha, Tensor& out) {
  elementwise_detail::check_add_scaled(x, out);
  x.dtype() == DType::F32 ? add_scaled_typed<float>(x, alpha, out)
                          : add_scaled_typed<bfloat16>(x, alpha, out);
}

void scale(std::span<Tensor> tensors, float factor) {
  elementwise_detail::check_scale(tensors);
  const auto kernel = pick_scale_row<float>();
  for (Tensor& t : tensors) {
    float* v = t.data<float>();
    const int64_t n = t.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
    for (int64_t b = 0; b < n; b += kBlock) kernel(v + b, factor, std::min(kBlock, n - b));
  }
}

void add_bias(Tensor& y, const Tensor& bias) {
  const int64_t cols = elementwise_detail::check_bias("add_bias", y, "y", bias, "bias");
  y.dtype() == DType::F32 ? add_bias_typed<float>(y, bias, cols)
                          : add_bias_typed<bfloat16>(y, bias, cols);
}

void add_column_sums(const Tensor& x, Tensor& out) {
  const int64_t cols = elementwise_detail::check_bias("add_column_sums", x, "x", out, "out");
  x.dtype() == DType::F32 ? add_column_sums_typed<float>(x, out, cols)
                          : add_column_sums_typed<bfloat16>(x, out, cols);
}

}  // namespace octet::ops::cpu
