// Bias + dropout + residual fast path: OpenMP over rows; per row the keep/scale factors come
// from Philox blocks (four elements per call), then one vectorized pass does the arithmetic.
#include <omp.h>

#include <vector>

#include "octet/rng.h"
#include "ops/dropout/checks.h"
#include "ops/simd.h"

namespace octet::ops::cpu {
namespace {

// Forward passes below this many elements run on the calling thread: a decode step's row or
// two is done before a second thread would have woken.
constexpr int64_t kParallelMinElements = int64_t{1} << 14;

// factor[c] = 1/(1-p) if element (first + c) is kept, else 0.
void fill_factors(const DropoutParams& d, int64_t first, int64_t count, float* factor) {
  const float kept = 1.0f / (1.0f - d.probability);
  if (d.probability == 0.0f) {
    for (int64_t c = 0; c < count; ++c) factor[c] = 1.0f;
    return;
  }
  int64_t index = first;
  const int64_t end = first + count;
  while (index < end) {
    auto words = philox4x32(d.seed, d.offset + static_cast<uint64_t>(index / 4));
    for (int64_t lane = index % 4; lane < 4 && index < end; ++lane, ++index) {
      factor[index - first] = uniform_from_bits(words[lane]) >= d.probability ? kept : 0.0f;
    }
  }
}

template <typename In, typename Res, typename Out>
OCTET_ALWAYS_INLINE void forward_row(const In* x, const float* bias, const Res* residual,
                                     const float* factor, Out* out, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    simd::store(simd::load(residual[c]) + (simd::load(x[c]) + bias[c]) * factor[c], &out[c]);
  }
}

template <typename In, typename Out>
OCTET_ALWAYS_INLINE void backward_row(const In* dout, const float* factor, Out* dx, float* dbias,
                                      int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float g = simd::load(dout[c]) * factor[c];
    simd::store(g, &dx[c]);
    dbias[c] += g;
  }
}

template <typename In, typename Res, typename Out>
OCTET_TARGET_AVX512 void forward_avx512(const In* x, const float* b, const Res* r, const float* f,
                                        Out* o, int64_t n) {
  forward_row(x, b, r, f, o, n);
}
template <typename In, typename Res, typename Out>
OCTET_TARGET_AVX2 void forward_avx2(const In* x, const float* b, const Res* r, const float* f,
                                    Out* o, int64_t n) {
  forward_row(x, b, r, f, o, n);
}
template <typename In, typename Res, typename Out>
void forward_scalar(const In* x, const float* b, const Res* r, const float* f, Out* o, int64_t n) {
  forward_row(x, b, r, f, o, n);
}

template <typename In, typename Out>
OCTET_TARGET_AVX512 void backward_avx512(const In* g, const float* f, Out* dx, float* db,
                                         int64_t n) {
  backward_row(g, f, dx, db, n);
}
template <typename In, typename Out>
OCTET_TARGET_AVX2 void backward_avx2(const In* g, const float* f, Out* dx, float* db, int64_t n) {
  backward_row(g, f, dx, db, n);
}
template <typename In, typename Out>
void backward_scalar(const In* g, const float* f, Out* dx, float* db, int64_t n) {
  backward_row(g, f, dx, db, n);
}

template <typename In, typename Res, typename Out>
void run_forward(const Tensor& x, const float* bias, const Tensor& residual, const DropoutParams& d,
                 Tensor& out) {
  using Row = void (*)(const In*, const float*, const Res*, const float*, Out*, int64_t);
  Row row = active_isa() == Isa::Avx512 ? forward_avx512<In, Res, Out>
            : active_isa() == Isa::Avx2 ? forward_avx2<In, Res, Out>
                                        : forward_scalar<In, Res, Out>;
  const int64_t rows = x.rows(), cols = x.cols();
  const In* xs = x.data<In>();
  const Res* rs = residual.data<Res>();
  Out* os = out.data<Out>();
  // The rows on the calling thread (an orphaned `omp for`: inside a region they are shared).
  auto rows_body = [&] {
    std::vector<float> factor(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      fill_factors(d, r * cols, cols, factor.data());
      row(xs + r * cols, bias, rs + r * cols, factor.data(), os + r * cols, cols);
    }
  };
  // Small inputs never enter a parallel region (even an `if (false)` one wakes the pool).
  if (rows * cols < kParallelMinElements) {
    rows_body();
  } else {
#pragma omp parallel
    rows_body();
  }
}

template <typename In, typename Out>
void run_backward(const Tensor& dout, const DropoutParams& d, Tensor& dx, Tensor* dbias) {
  using Row = void (*)(const In*, const float*, Out*, float*, int64_t);
  Row row = active_isa() == Isa::Avx512 ? backward_avx512<In, Out>
            : active_isa() == Isa::Avx2 ? backward_avx2<In, Out>
                                        : backward_scalar<In, Out>;
  const int64_t rows = dout.rows(), cols = dout.cols();
  const int threads = omp_get_max_threads();
  Tensor partial = Tensor::zeros({threads, cols}, DType::F32);  // deterministic dbias
  float* partial_data = partial.data<float>();
  const In* gs = dout.data<In>();
  Out* dxs = dx.data<Out>();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> factor(static_cast<size_t>(cols));
    float* db = partial_data + static_cast<int64_t>(omp_get_thread_num()) * cols;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      fill_factors(d, r * cols, cols, factor.data());
      row(gs + r * cols, factor.data(), dxs + r * cols, db, cols);
    }
  }
  if (dbias) {
    float* out = dbias->data<float>();
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int t = 0; t < threads; ++t) sum += partial_data[static_cast<int64_t>(t) * cols + c];
      out[c] = sum;
    }
  }
}

template <typename In, typename Res>
void forward_for(const Tensor& x, const float* bias, const Tensor& residual, const DropoutParams& d,
                 Tensor& out) {
  if (out.dtype() == DType::F32) {
    run_forward<In, Res, float>(x, bias, residual, d, out);
  } else {
    run_forward<In, Res, bfloat16>(x, bias, residual, d, out);
  }
}

template <typename In>
void forward_for_input(const Tensor& x, const float* bias, const Tensor& residual,
                       const DropoutParams& d, Tensor& out) {
  if (residual.dtype() == DType::F32) {
    forward_for<In, float>(x, bias, residual, d, out);
  } else {
    forward_for<In, bfloat16>(x, bias, residual, d, out);
  }
}

}  // namespace

void bias_dropout_add_forward(const Tensor& x, const Tensor* bias, const Tensor& residual,
                              const DropoutParams& d, Tensor& out) {
  dropout_detail::check_forward(x, bias, residual, d, out);
  if (x.numel() == 0) return;
  std::vector<float> zeros(bias ? 0 : static_cast<size_t>(x.cols()), 0.0f);
  const float* b = bias ? bias->data<float>() : zeros.data();
  if (x.dtype() == DType::F32) {
    forward_for_input<float>(x, b, residual, d, out);
  } else {
    forward_for_input<bfloat16>(x, b, residual, d, out);
  }
}

void bias_dropout_add_backward(const Tensor& dout, const DropoutParams& d, Tensor& dx,
                               Tensor* dbias) {
  dropout_detail::check_backward(dout, d, dx, dbias);
  if (dout.numel() == 0) {
    if (dbias) dbias->zero_();
    return;
  }
  bool in_f32 = dout.dtype() == DType::F32, out_f32 = dx.dtype() == DType::F32;
  if (in_f32 && out_f32) {
    run_backward<float, float>(dout, d, dx, dbias);
  } else if (in_f32) {
    run_backward<float, bfloat16>(dout, d, dx, dbias);
  } else if (out_f32) {
    run_backward<bfloat16, float>(dout, d, dx, dbias);
  } else {
    run_backward<bfloat16, bfloat16>(dout, d, dx, dbias);
  }
}

}  // namespace octet::ops::cpu
