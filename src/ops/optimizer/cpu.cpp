// AdamW and gradient norms, fast path. Every tensor of the list is cut into chunks of
// kChunkElements; one OpenMP loop runs over all chunks of all tensors (a multi-tensor apply).
// Within a chunk, blocks of kBlockElements are updated and, for an FP8 model copy, quantized
// while still in L1. The element-wise arithmetic is the reference's, operation for operation;
// the AVX2 / AVX-512 paths may fuse a multiply and an add (the compiler contracts them), so
// they can differ from the reference in the last bit. The model copy is always the exact
// conversion of the master weight this path computed.
// The norm sums each chunk in FP64, then the chunks in order: fixed bits for any thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "octet/fp8.h"
#include "ops/optimizer/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

constexpr int64_t kChunkElements = int64_t{1} << 14;
constexpr int64_t kBlockElements = 2048;

struct Chunk {
  size_t tensor = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

std::vector<Chunk> make_chunks(size_t count, auto numel_of) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = numel_of(t);
    for (int64_t begin = 0; begin < n; begin += kChunkElements) {
      chunks.push_back({t, begin, std::min(n, begin + kChunkElements)});
    }
  }
  return chunks;
}

// ---- AdamW ------------------------------------------------------------------------------

struct UpdateArgs {
  optimizer_detail::AdamWCoefficients k;
  float decay = 1.0f;
};

// One block of n <= kBlockElements elements. kBf16Model: also write model[j] = bf16(param[j]).
// The square roots run in a loop of their own: std::sqrt may set errno in this build (no
// -fno-math-errno), a branch that keeps it out of vector loops; the other two loops vectorize.
template <typename G, bool kBf16Model>
OCTET_ALWAYS_INLINE void adamw_body(float* param, const G* grad, float* m, float* v,
                                    bfloat16* model, int64_t n, const UpdateArgs& a) {
  float root[kBlockElements];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = simd::load(grad[j]);
    m[j] = m[j] * a.k.beta1 + a.k.one_minus_beta1 * g;
    v[j] = v[j] * a.k.beta2 + a.k.one_minus_beta2 * g * g;
  }
  for (int64_t j = 0; j < n; ++j) root[j] = std::sqrt(v[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float denom = root[j] / a.k.bias_correction2_sqrt + a.k.eps;
    const float p = param[j] * a.decay - a.k.step_size * (m[j] / denom);
    param[j] = p;
    if constexpr (kBf16Model) simd::store(p, model + j);
  }
}

template <typename G, bool kBf16Model>
OCTET_TARGET_AVX512 void adamw_avx512(float* param, const G* grad, float* m, float* v,
                                      bfloat16* model, int64_t n, const UpdateArgs& a) {
  adamw_body<G, kBf16Model>(param, grad, m, v, model, n, a);
}
template <typename G, bool kBf16Model>
OCTET_TARGET_AVX2 void adamw_avx2(float* param, const G* grad, float* m, float* v, bfloat16* model,
                                  int64_t n, const UpdateArgs& a) {
  adamw_body<G, kBf16Model>(param, grad, m, v, model, n, a);
}
template <typename G, bool kBf16Model>
void adamw_scalar(float* param, const G* grad, float* m, float* v, bfloat16* model, int64_t n,
                  const UpdateArgs& a) {
  adamw_body<G, kBf16Model>(param, grad, m, v, model, n, a);
}

template <typename G>
using AdamWKernel = void (*)(float*, const G*, float*, float*, bfloat16*, int64_t,
                             const UpdateArgs&);

template <typename G>
AdamWKernel<G> pick_adamw(Isa isa, bool bf16_model) {
  if (isa == Isa::Avx512) return bf16_model ? adamw_avx512<G, true> : adamw_avx512<G, false>;
  if (isa == Isa::Avx2) return bf16_model ? adamw_avx2<G, true> : adamw_avx2<G, false>;
  return bf16_model ? adamw_scalar<G, true> : adamw_scalar<G, false>;
}

// Updates elements [begin,end) of t; returns max |param| there when the model copy is FP8.
float update_chunk(AdamWTensor& t, int64_t begin, int64_t end, const UpdateArgs& a, Isa isa) {
  const bool fp8_model = t.model.defined() && is_fp8(t.model.dtype());
  const bool bf16_model = t.model.defined() && t.model.dtype() == DType::BF16;
  float* param = t.param.data<float>();
  float* m = t.exp_avg.data<float>();
  float* v = t.exp_avg_sq.data<float>();
  bfloat16* model_bf16 = bf16_model ? t.model.data<bfloat16>() : nullptr;
  float amax = 0.0f;
  for (int64_t b = begin; b < end; b += kBlockElements) {
    const int64_t n = std::min(kBlockElements, end - b);
    bfloat16* model_block = model_bf16 ? model_bf16 + b : nullptr;
    if (t.grad.dtype() == DType::F32) {
      pick_adamw<float>(isa, bf16_model)(param + b, t.grad.data<float>() + b, m + b, v + b,
                                         model_block, n, a);
    } else {
      pick_adamw<bfloat16>(isa, bf16_model)(param + b, t.grad.data<bfloat16>() + b, m + b, v + b,
                                            model_block, n, a);
    }
    if (fp8_model) {
      uint8_t* codes = static_cast<uint8_t*>(t.model.raw()) + b;
      const float block_amax =
          quantize_fp8(param + b, static_cast<size_t>(n), t.model_scale, t.model.dtype(), codes);
      amax = optimizer_detail::nan_max(amax, block_amax);
    }
  }
  return amax;
}

// ---- norms and scaling ------------------------------------------------------------------

template <typename G>
OCTET_ALWAYS_INLINE double sum_squares_body(const G* g, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const double value = simd::load(g[j]);
    sum += value * value;
  }
  return sum;
}

template <typename G>
OCTET_ALWAYS_INLINE void scale_body(G* g, int64_t n, float coefficient) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) simd::store(simd::load(g[j]) * coefficient, g + j);
}

template <typename G>
OCTET_TARGET_AVX512 double sum_squares_avx512(const G* g, int64_t n) {
  return sum_squares_body(g, n);
}
template <typename G>
OCTET_TARGET_AVX2 double sum_squares_avx2(const G* g, int64_t n) {
  return sum_squares_body(g, n);
}
template <typename G>
double sum_squares_scalar(const G* g, int64_t n) {
  return sum_squares_body(g, n);
}
template <typename G>
OCTET_TARGET_AVX512 void scale_avx512(G* g, int64_t n, float coefficient) {
  scale_body(g, n, coefficient);
}
template <typename G>
OCTET_TARGET_AVX2 void scale_avx2(G* g, int64_t n, float coefficient) {
  scale_body(g, n, coefficient);
}
template <typename G>
void scale_scalar(G* g, int64_t n, float coefficient) {
  scale_body(g, n, coefficient);
}

template <typename G>
double sum_squares(Isa isa, const G* g, int64_t n) {
  return isa == Isa::Avx512 ? sum_squares_avx512(g, n)
         : isa == Isa::Avx2 ? sum_squares_avx2(g, n)
                            : sum_squares_scalar(g, n);
}

template <typename G>
void scale(Isa isa, G* g, int64_t n, float coefficient) {
  isa == Isa::Avx512 ? scale_avx512(g, n, coefficient)
  : isa == Isa::Avx2 ? scale_avx2(g, n, coefficient)
                     : scale_scalar(g, n, coefficient);
}

}  // namespace

void adamw_step(std::span<AdamWTensor> tensors, const AdamWHyper& hyper) {
  const auto k = optimizer_detail::adamw_coefficients(hyper);
  for (size_t i = 0; i < tensors.size(); ++i) optimizer_detail::check_adamw_tensor(tensors[i], i);
  const std::vector<Chunk> chunks =
      make_chunks(tensors.size(), [&](size_t t) { return tensors[t].param.numel(); });
  std::vector<float> chunk_amax(chunks.size(), 0.0f);
  const Isa isa = active_isa();
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    AdamWTensor& t = tensors[chunks[c].tensor];
    const UpdateArgs args{k, optimizer_detail::decay_factor(hyper, t.weight_decay)};
    chunk_amax[c] = update_chunk(t, chunks[c].begin, chunks[c].end, args, isa);
  }
  for (AdamWTensor& t : tensors) {
    if (t.model.defined() && is_fp8(t.model.dtype())) t.model_amax = 0.0f;
  }
  for (int64_t c = 0; c < count; ++c) {
    AdamWTensor& t = tensors[chunks[c].tensor];
    if (t.model.defined() && is_fp8(t.model.dtype())) {
      t.model_amax = optimizer_detail::nan_max(t.model_amax, chunk_amax[c]);
    }
  }
}

double global_grad_norm(std::span<const Tensor> grads) {
  optimizer_detail::check_grads(grads, "global_grad_norm");
  const std::vector<Chunk> chunks =
      make_chunks(grads.size(), [&](size_t t) { return grads[t].numel(); });
  std::vector<double> partial(chunks.size(), 0.0);
  const Isa isa = active_isa();
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    const Tensor& g = grads[chunks[c].tensor];
    const int64_t n = chunks[c].end - chunks[c].begin;
    partial[c] = g.dtype() == DType::F32
                     ? sum_squares(isa, g.data<float>() + chunks[c].begin, n)
                     : sum_squares(isa, g.data<bfloat16>() + chunks[c].begin, n);
  }
  double sum = 0.0;
  for (double value : partial) sum += value;
  return std::sqrt(sum);
}

double clip_grad_norm(std::span<Tensor> grads, double max_norm) {
  const double norm = ops::global_grad_norm(grads);
  const float coefficient = optimizer_detail::clip_coefficient(norm, max_norm);
  if (coefficient == 1.0f) return norm;
  const std::vector<Chunk> chunks =
      make_chunks(grads.size(), [&](size_t t) { return grads[t].numel(); });
  const Isa isa = active_isa();
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    Tensor& g = grads[chunks[c].tensor];
    const int64_t n = chunks[c].end - chunks[c].begin;
    if (g.dtype() == DType::F32) {
      scale(isa, g.data<float>() + chunks[c].begin, n, coefficient);
    } else {
      scale(isa, g.data<bfloat16>() + chunks[c].begin, n, coefficient);
    }
  }
  return norm;
}

}  // namespace octet::ops::cpu
