// Cross-entropy, fast path: OpenMP over rows; per row, the vocabulary is walked in chunks of
// kVocabChunk columns (an online max / sum-exp, as in flash attention), then once more to write
// the gradient. BF16 rows are widened one chunk at a time into a per-thread F32 buffer, so the
// only workspace is threads x kVocabChunk floats, never anything of size N x V.
//
// NaN in a row propagates to its loss through the plain sum of the logits (kept anyway for
// label smoothing), and to its gradient through math::exp (src/ops/activation/math.h), which keeps
// NaN.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ops/activation/math.h"
#include "ops/loss/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

constexpr int64_t kVocabChunk = 2048;  // 8 KiB of F32: the chunk stays in L1 between its passes

OCTET_ALWAYS_INLINE float chunk_max(const float* x, int64_t n) {
  float max = -INFINITY;
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < n; ++j) max = x[j] > max ? x[j] : max;
  return max;
}

// Returns sum_j e^(x_j - shift); adds sum_j x_j to *sum.
OCTET_ALWAYS_INLINE float chunk_sum_exp(const float* x, int64_t n, float shift, float* sum) {
  float sum_exp = 0.0f;
  float sum_x = 0.0f;
#pragma omp simd reduction(+ : sum_exp, sum_x)
  for (int64_t j = 0; j < n; ++j) {
    sum_exp += math::exp(x[j] - shift);
    sum_x += x[j];
  }
  *sum += sum_x;
  return sum_exp;
}

// dx_j = scale * p_j - offset, p_j = e^((x_j - max) - log_sum), lse = max + log_sum: the maximum
// is subtracted first (exact near it), so p keeps F32 accuracy at any |x|; x_j - lse with lse
// rounded to F32 would be off by |x| * 2^-24. dx may be x itself (in place).
template <typename T>
OCTET_ALWAYS_INLINE void chunk_grad(const float* x, int64_t n, float max, float log_sum,
                                    float scale, float offset, T* dx) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    simd::store(scale * math::exp((x[j] - max) - log_sum) - offset, dx + j);
  }
}

// The chunk as F32: F32 rows are read where they lie, BF16 ones widened into buffer.
OCTET_ALWAYS_INLINE const float* chunk_f32(const float* x, int64_t, float*) {
  return x;
}
OCTET_ALWAYS_INLINE const float* chunk_f32(const bfloat16* x, int64_t n, float* buffer) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) buffer[j] = simd::load(x[j]);
  return buffer;
}

struct RowArgs {
  int64_t vocab = 0;
  float smoothing = 0.0f;
  float grad_scale = 1.0f;
};

// One row not ignored: returns its loss; writes dx when not null.
template <typename T>
OCTET_ALWAYS_INLINE float row_body(const T* x, int64_t target, const RowArgs& a, T* dx,
                                   float* buffer) {
  const float x_target = simd::load(x[target]);  // read before an in-place dx overwrites it
  float max = -INFINITY;
  float sum_exp = 0.0f;
  float sum = 0.0f;
  for (int64_t begin = 0; begin < a.vocab; begin += kVocabChunk) {
    const int64_t n = std::min(kVocabChunk, a.vocab - begin);
    const float* chunk = chunk_f32(x + begin, n, buffer);
    const float chunk_max_value = chunk_max(chunk, n);
    if (chunk_max_value > max) {
      sum_exp *= std::exp(max - chunk_max_value);
      max = chunk_max_value;
    }
    sum_exp += chunk_sum_exp(chunk, n, max, &sum);
  }
  const double log_sum = std::log(double{sum_exp});
  const double lse = double{max} + log_sum;
  const double vocab = static_cast<double>(a.vocab);
  const double loss =
      lse - (1.0 - a.smoothing) * double{x_target} - double{a.smoothing} * double{sum} / vocab;
  if (dx) {
    const float log_sum_f = static_cast<float>(log_sum);
    const float offset = static_cast<float>(double{a.grad_scale} * a.smoothing / vocab);
    for (int64_t begin = 0; begin < a.vocab; begin += kVocabChunk) {
      const int64_t n = std::min(kVocabChunk, a.vocab - begin);
      chunk_grad(chunk_f32(x + begin, n, buffer), n, max, log_sum_f, a.grad_scale, offset,
                 dx + begin);
    }
    const float p_target = math::exp((x_target - max) - log_sum_f);
    simd::store(a.grad_scale * (p_target - (1.0f - a.smoothing)) - offset, dx + target);
  }
  return static_cast<float>(loss);
}

template <typename T>
using RowKernel = float (*)(const T* x, int64_t target, const RowArgs& a, T* dx, float* buffer);

OCTET_TARGET_AVX512 float row_f32_avx512(const float* x, int64_t target, const RowArgs& a,
                                         float* dx, float* buffer) {
  return row_body(x, target, a, dx, buffer);
}
OCTET_TARGET_AVX512 float row_bf16_avx512(const bfloat16* x, int64_t target, const RowArgs& a,
                                          bfloat16* dx, float* buffer) {
  return row_body(x, target, a, dx, buffer);
}
OCTET_TARGET_AVX2 float row_f32_avx2(const float* x, int64_t target, const RowArgs& a, float* dx,
                                     float* buffer) {
  return row_body(x, target, a, dx, buffer);
}
OCTET_TARGET_AVX2 float row_bf16_avx2(const bfloat16* x, int64_t target, const RowArgs& a,
                                      bfloat16* dx, float* buffer) {
  return row_body(x, target, a, dx, buffer);
}
float row_f32_scalar(const float* x, int64_t target, const RowArgs& a, float* dx, float* buffer) {
  return row_body(x, target, a, dx, buffer);
}
float row_bf16_scalar(const bfloat16* x, int64_t target, const RowArgs& a, bfloat16* dx,
                      float* buffer) {
  return row_body(x, target, a, dx, buffer);
}

RowKernel<float> pick_row_kernel(Isa isa, const float*) {
  return isa == Isa::Avx512 ? row_f32_avx512 : isa == Isa::Avx2 ? row_f32_avx2 : row_f32_scalar;
}
RowKernel<bfloat16> pick_row_kernel(Isa isa, const bfloat16*) {
  return isa == Isa::Avx512 ? row_bf16_avx512 : isa == Isa::Avx2 ? row_bf16_avx2 : row_bf16_scalar;
}

template <typename T>
float run_rows(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
               const CrossEntropyOptions& options, const loss_detail::LossShape& s) {
  const T* x = logits.data<T>();
  T* dx = dlogits ? dlogits->data<T>() : nullptr;
  float* row_loss = losses.data<float>();
  const RowKernel<T> kernel = pick_row_kernel(active_isa(), x);
  const RowArgs args{s.vocab, options.label_smoothing, options.grad_scale};
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), s.rows)));
  // Counted by memory_stats(); F32 rows need none.
  Tensor workspace;
  if constexpr (!std::is_same_v<T, float>) {
    workspace = Tensor::empty({threads, kVocabChunk}, DType::F32);
  }
  float* buffers = workspace.defined() ? workspace.data<float>() : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t target = loss_detail::target_at(targets, row);
    const int64_t base = row * s.vocab;
    if (target == options.ignore_index) {
      row_loss[row] = 0.0f;
      if (dx) std::memset(static_cast<void*>(dx + base), 0, sizeof(T) * s.vocab);  // +0 in both
      continue;
    }
    float* buffer = buffers ? buffers + omp_get_thread_num() * kVocabChunk : nullptr;
    row_loss[row] = kernel(x + base, target, args, dx ? dx + base : nullptr, buffer);
  }
  // The mean in row order, in FP64: the same number whatever the thread count.
  double loss_sum = 0.0;
  int64_t valid = 0;
  for (int64_t row = 0; row < s.rows; ++row) {
    if (loss_detail::target_at(targets, row) == options.ignore_index) continue;
    loss_sum += row_loss[row];
    ++valid;
  }
  return static_cast<float>(loss_sum / static_cast<double>(valid));
}

}  // namespace

float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options) {
  const auto s =
      loss_detail::check_cross_entropy("cross_entropy", logits, targets, losses, dlogits, options);
  if (logits.dtype() == DType::F32) {
    return run_rows<float>(logits, targets, losses, dlogits, options, s);
  }
  return run_rows<bfloat16>(logits, targets, losses, dlogits, options, s);
}

}  // namespace octet::ops::cpu
