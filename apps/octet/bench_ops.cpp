// `octet bench ops`: each fused operator, forward and backward, beside (1) the unfused
// composition of the same work written as separate passes over memory with octet's own
// pieces, and (2) PyTorch 1.13 eager (bench/peers/torch_ops.py), all measured in one run,
// case by case, with the ratios vs_unfused = unfused_ms / ms and vs_torch = torch_ms / ms.
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "octet/gemm.h"
#include "octet/ops/activation.h"
#include "octet/ops/attention.h"
#include "octet/ops/dropout.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"
#include "octet/ops/normalization.h"
#include "octet/ops/optimizer.h"
#include "octet/ops/rope.h"
#include "octet/ops/softmax.h"
#include "octet/rng.h"

namespace octet::cli {
namespace {

using bench::FwdBwdTiming;
using bench::load;
using bench::parallel_for;
using bench::store;

constexpr int64_t kTokens = 2048;  // B*T of every case
constexpr int64_t kHeadDim = 64;
constexpr int64_t kVocab = 50257;
constexpr int64_t kRopeSeq = 1024;     // rope runs at B=2, T=1024
constexpr int64_t kAdamwHidden = 384;  // the gpt-mini parameter set
constexpr float kEps = 1e-5f;
constexpr float kDropout = 0.1f;
constexpr const char* kAllOps =
    "layernorm,rmsnorm,bias_gelu,swiglu,softmax,attention,rope,bias_dropout_add,cross_entropy,"
    "embedding,adamw";

struct Options {
  std::string ops = kAllOps;
  std::string hidden = "384,768";
  std::string seq = "256,1024,2048";
  std::string dtypes = "bf16";
  int rounds = 3;
  int repeats = 5;
  int warmup = 1;
  double min_ms = 100.0;
  int64_t ce_rows = 512;
  bool json = false;
  bool no_torch = false;
};

struct Case {
  std::string op;
  int64_t T = 0;       // sequence length (B = kTokens / T); 0 where no sequence applies
  int64_t hidden = 0;  // 0 where no hidden size applies (cross_entropy)
  DType dtype = DType::BF16;
  int repeats = 1;      // at least
  double min_ms = 0.0;  // and more until the timed runs add up to this
  int64_t batch() const { return kTokens / T; }
  int64_t heads() const { return hidden / kHeadDim; }
  std::string peer_line() const {
    return op + ":" + std::to_string(T) + ":" + std::to_string(hidden) + ":" +
           std::string(dtype_name(dtype)) + ":" + std::to_string(repeats) + ":" +
           std::to_string(static_cast<int64_t>(min_ms));
  }
};

struct Measured {
  FwdBwdTiming ours, unfused;
  std::optional<FwdBwdTiming> torch;
  bool has_backward = true;
  int64_t peak_bytes = -1, unfused_peak_bytes = -1;  // attention only
  // max |fused - unfused| over a forward output and a gradient, on the same inputs: the
  // baseline does the same work (NaN where the inputs differ by layout).
  double unfused_max_diff = NAN;
  // Per round: the same round's ratios (unfused / ours, torch / ours); the timings above are
  // medians over the rounds.
  std::vector<double> vs_unfused, vs_torch;
};

// ---- inputs --------------------------------------------------------------------------------

// Uniform [-scale, scale) plus `center`, from a xorshift generator, converted to dtype.
Tensor random_tensor(Shape shape, DType dtype, uint64_t seed, float scale = 1.0f,
                     float center = 0.0f) {
  Tensor t = Tensor::empty(std::move(shape), DType::F32);
  float* data = t.data<float>();
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    data[i] = center + scale * (static_cast<float>(state >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
  return dtype == DType::F32 ? t : t.to(dtype);
}

Tensor random_ids(int64_t count, int64_t limit, uint64_t seed) {
  Tensor ids = Tensor::empty({count}, DType::I32);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 7;
  for (int64_t i = 0; i < count; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    ids.data<int32_t>()[i] = static_cast<int32_t>(state % static_cast<uint64_t>(limit));
  }
  return ids;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_floats(), y = b.to_floats();
  double diff = 0.0;
  for (size_t i = 0; i < x.size(); ++i) diff = std::max(diff, double{std::fabs(x[i] - y[i])});
  return diff;
}

// After the unfused timing left its results in `outputs`, runs the fused op once and compares.
template <typename Forward, typename Backward>
double compare_with_fused(std::initializer_list<const Tensor*> outputs, Forward&& forward,
                          Backward&& backward) {
  std::vector<Tensor> unfused;
  for (const Tensor* t : outputs) unfused.push_back(t->clone());
  forward();
  backward();
  double diff = 0.0;
  size_t i = 0;
  for (const Tensor* t : outputs) diff = std::max(diff, max_abs_diff(*t, unfused[i++]));
  return diff;
}

// ---- passes the unfused compositions share -------------------------------------------------

// out[c] = sum over rows of term(r, c): per-thread partial rows, then a fixed-order sum.
template <typename Term>
void column_sum(int64_t rows, int64_t cols, const Term& term, float* out) {
  std::vector<float> partial(static_cast<size_t>(omp_get_max_threads() * cols), 0.0f);
  float* partials = partial.data();
  parallel_for(rows, [=](int64_t begin, int64_t end, int thread) OCTET_BENCH_INLINE {
    float* acc = partials + thread * cols;
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) acc[c] += term(r, c);
    }
  });
  for (int64_t c = 0; c < cols; ++c) {
    float sum = 0.0f;
    for (int t = 0; t < omp_get_max_threads(); ++t) sum += partials[t * cols + c];
    out[c] = sum;
  }
}

// out[r] = sum over columns of term(r, c).
template <typename Term>
void row_sum(int64_t rows, int64_t cols, const Term& term, float* out) {
  parallel_for(rows, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
    for (int64_t r = begin; r < end; ++r) {
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += term(r, c);
      out[r] = sum;
    }
  });
}

// out[i] = value(i) over a flat range of n elements.
template <typename E, typename Value>
void map_pass(int64_t n, E* out, const Value& value) {
  parallel_for(n, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) store(value(i), &out[i]);
  });
}

// out[r * cols + c] = value(r, c): row-wise, so that no pass pays a division per element.
template <typename E, typename Value>
void map_rows(int64_t rows, int64_t cols, E* out, const Value& value) {
  parallel_for(rows, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) store(value(r, c), &out[r * cols + c]);
    }
  });
}

template <typename F>
FwdBwdTiming time_case(const Case& c, int warmup, F&& forward, std::function<void()> backward) {
  return bench::time_forward_backward(forward, backward, warmup, c.repeats, c.min_ms);
}

// ---- normalization -------------------------------------------------------------------------

// Unfused LayerNorm: mean pass, variance pass, normalize pass (x_hat kept), affine pass.
// Backward: dbeta pass, dgamma pass, dx_hat = dy * gamma pass, two row-sum passes, dx pass.
template <typename E>
Measured measure_layernorm(const Case& c, int warmup) {
  const int64_t rows = kTokens, cols = c.hidden;
  const Tensor x = random_tensor({rows, cols}, c.dtype, 1);
  const Tensor dy = random_tensor({rows, cols}, c.dtype, 2);
  const Tensor gamma = random_tensor({cols}, DType::F32, 3, 0.1f, 1.0f);
  const Tensor beta = random_tensor({cols}, DType::F32, 4, 0.1f);
  Tensor y = Tensor::empty({rows, cols}, c.dtype), dx = Tensor::empty({rows, cols}, c.dtype);
  Tensor mean = Tensor::empty({rows}, DType::F32), rstd = Tensor::empty({rows}, DType::F32);
  Tensor dgamma = Tensor::empty({cols}, DType::F32), dbeta = Tensor::empty({cols}, DType::F32);
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::layernorm_forward(x, gamma, &beta, kEps, false, y, mean, rstd); },
      [&] { ops::layernorm_backward(dy, x, mean, rstd, gamma, false, dx, dgamma, &dbeta); });

  Tensor x_hat = Tensor::empty({rows, cols}, c.dtype),
         dx_hat = Tensor::empty({rows, cols}, c.dtype);
  Tensor sum_dx_hat = Tensor::empty({rows}, DType::F32);
  Tensor sum_dx_hat_x_hat = Tensor::empty({rows}, DType::F32);
  const E* xs = x.data<E>();
  const E* dys = dy.data<E>();
  const float* g = gamma.data<float>();
  const float* b = beta.data<float>();
  E* ys = y.data<E>();
  E* dxs = dx.data<E>();
  E* xh = x_hat.data<E>();
  E* dxh = dx_hat.data<E>();
  float* mu = mean.data<float>();
  float* rs = rstd.data<float>();
  float* s1 = sum_dx_hat.data<float>();
  float* s2 = sum_dx_hat_x_hat.data<float>();
  const float inv_cols = 1.0f / static_cast<float>(cols);
  m.unfused = time_case(
      c, warmup,
      [&] {
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE { return load(xs[r * cols + k]); }, mu);
        map_pass(rows, mu, [=](int64_t r) OCTET_BENCH_INLINE { return mu[r] * inv_cols; });
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
              const float d = load(xs[r * cols + k]) - mu[r];
              return d * d;
            },
            rs);
        map_pass(rows, rs, [=](int64_t r) OCTET_BENCH_INLINE {
          return 1.0f / std::sqrt(rs[r] * inv_cols + kEps);
        });
        map_rows(rows, cols, xh, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return (load(xs[r * cols + k]) - mu[r]) * rs[r];
        });
        map_rows(rows, cols, ys, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(xh[r * cols + k]) * g[k] + b[k];
        });
      },
      [&] {
        column_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE { return load(dys[r * cols + k]); },
            dbeta.data<float>());
        column_sum(
            rows, cols,
            [=](int64_t r, int64_t k)
                OCTET_BENCH_INLINE { return load(dys[r * cols + k]) * load(xh[r * cols + k]); },
            dgamma.data<float>());
        map_rows(rows, cols, dxh, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(dys[r * cols + k]) * g[k];
        });
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE { return load(dxh[r * cols + k]); }, s1);
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k)
                OCTET_BENCH_INLINE { return load(dxh[r * cols + k]) * load(xh[r * cols + k]); },
            s2);
        map_rows(rows, cols, dxs, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          const int64_t i = r * cols + k;
          return rs[r] * (load(dxh[i]) - s1[r] * inv_cols - load(xh[i]) * s2[r] * inv_cols);
        });
      });
  m.unfused_max_diff = compare_with_fused(
      {&y, &dx}, [&] { ops::layernorm_forward(x, gamma, &beta, kEps, false, y, mean, rstd); },
      [&] { ops::layernorm_backward(dy, x, mean, rstd, gamma, false, dx, dgamma, &dbeta); });
  return m;
}

// Unfused RMSNorm: mean-square pass, normalize pass (x_hat kept), scale pass. Backward:
// dgamma pass, dx_hat pass, row-sum pass, dx pass.
template <typename E>
Measured measure_rmsnorm(const Case& c, int warmup) {
  const int64_t rows = kTokens, cols = c.hidden;
  const Tensor x = random_tensor({rows, cols}, c.dtype, 1);
  const Tensor dy = random_tensor({rows, cols}, c.dtype, 2);
  const Tensor gamma = random_tensor({cols}, DType::F32, 3, 0.1f, 1.0f);
  Tensor y = Tensor::empty({rows, cols}, c.dtype), dx = Tensor::empty({rows, cols}, c.dtype);
  Tensor rstd = Tensor::empty({rows}, DType::F32), dgamma = Tensor::empty({cols}, DType::F32);
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::rmsnorm_forward(x, gamma, kEps, false, y, rstd); },
      [&] { ops::rmsnorm_backward(dy, x, rstd, gamma, false, dx, dgamma); });

  Tensor x_hat = Tensor::empty({rows, cols}, c.dtype),
         dx_hat = Tensor::empty({rows, cols}, c.dtype);
  Tensor sums = Tensor::empty({rows}, DType::F32);
  const E* xs = x.data<E>();
  const E* dys = dy.data<E>();
  const float* g = gamma.data<float>();
  E* ys = y.data<E>();
  E* dxs = dx.data<E>();
  E* xh = x_hat.data<E>();
  E* dxh = dx_hat.data<E>();
  float* rs = rstd.data<float>();
  float* s = sums.data<float>();
  const float inv_cols = 1.0f / static_cast<float>(cols);
  m.unfused = time_case(
      c, warmup,
      [&] {
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
              const float v = load(xs[r * cols + k]);
              return v * v;
            },
            rs);
        map_pass(rows, rs, [=](int64_t r) OCTET_BENCH_INLINE {
          return 1.0f / std::sqrt(rs[r] * inv_cols + kEps);
        });
        map_rows(rows, cols, xh, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(xs[r * cols + k]) * rs[r];
        });
        map_rows(rows, cols, ys, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(xh[r * cols + k]) * g[k];
        });
      },
      [&] {
        column_sum(
            rows, cols,
            [=](int64_t r, int64_t k)
                OCTET_BENCH_INLINE { return load(dys[r * cols + k]) * load(xh[r * cols + k]); },
            dgamma.data<float>());
        map_rows(rows, cols, dxh, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(dys[r * cols + k]) * g[k];
        });
        row_sum(
            rows, cols,
            [=](int64_t r, int64_t k)
                OCTET_BENCH_INLINE { return load(dxh[r * cols + k]) * load(xh[r * cols + k]); },
            s);
        map_rows(rows, cols, dxs, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          const int64_t i = r * cols + k;
          return rs[r] * (load(dxh[i]) - load(xh[i]) * s[r] * inv_cols);
        });
      });
  m.unfused_max_diff = compare_with_fused(
      {&y, &dx}, [&] { ops::rmsnorm_forward(x, gamma, kEps, false, y, rstd); },
      [&] { ops::rmsnorm_backward(dy, x, rstd, gamma, false, dx, dgamma); });
  return m;
}

// ---- activations ---------------------------------------------------------------------------

// bias + GeLU(tanh) on the FFN up projection [N, 4h]. Unfused: bias pass (h kept), octet's GeLU
// pass; backward: octet's GeLU backward pass, then a separate dbias column-sum pass.
template <typename E>
Measured measure_bias_gelu(const Case& c, int warmup) {
  const int64_t rows = kTokens, cols = 4 * c.hidden;
  const Tensor x = random_tensor({rows, cols}, c.dtype, 1, 3.0f);
  const Tensor dy = random_tensor({rows, cols}, c.dtype, 2);
  const Tensor bias = random_tensor({cols}, DType::F32, 3, 0.5f);
  Tensor y = Tensor::empty({rows, cols}, c.dtype), dx = Tensor::empty({rows, cols}, c.dtype);
  Tensor dbias = Tensor::empty({cols}, DType::F32);
  const auto gelu = ops::ActivationKind::GeluTanh;
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::activation_forward(gelu, x, &bias, y); },
      [&] { ops::activation_backward(gelu, dy, x, &bias, dx, &dbias); });

  Tensor h = Tensor::empty({rows, cols}, c.dtype);
  const E* xs = x.data<E>();
  const float* b = bias.data<float>();
  E* hs = h.data<E>();
  const E* dxs = dx.data<E>();
  m.unfused = time_case(
      c, warmup,
      [&] {
        map_rows(rows, cols, hs, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(xs[r * cols + k]) + b[k];
        });
        ops::activation_forward(gelu, h, nullptr, y);
      },
      [&] {
        ops::activation_backward(gelu, dy, h, nullptr, dx, nullptr);
        column_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE { return load(dxs[r * cols + k]); },
            dbias.data<float>());
      });
  m.unfused_max_diff = compare_with_fused(
      {&y, &dx, &dbias}, [&] { ops::activation_forward(gelu, x, &bias, y); },
      [&] { ops::activation_backward(gelu, dy, x, &bias, dx, &dbias); });
  return m;
}

// SwiGLU y = silu(a) * g, F = 4h. Fused: one [N, 2F] input. Unfused: a and g as separate
// tensors, octet's SiLU pass (s kept), multiply pass; backward: dg = dy * s pass, ds = dy * g
// pass, octet's SiLU backward pass.
template <typename E>
Measured measure_swiglu(const Case& c, int warmup) {
  const int64_t rows = kTokens, cols = 4 * c.hidden;
  const Tensor x = random_tensor({rows, 2 * cols}, c.dtype, 1, 3.0f);
  const Tensor dy = random_tensor({rows, cols}, c.dtype, 2);
  Tensor y = Tensor::empty({rows, cols}, c.dtype), dx = Tensor::empty({rows, 2 * cols}, c.dtype);
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::activation_forward(ops::ActivationKind::SwiGlu, x, nullptr, y); },
      [&] { ops::activation_backward(ops::ActivationKind::SwiGlu, dy, x, nullptr, dx, nullptr); });

  const Tensor a = random_tensor({rows, cols}, c.dtype, 3, 3.0f);
  const Tensor gate = random_tensor({rows, cols}, c.dtype, 4, 3.0f);
  Tensor s = Tensor::empty({rows, cols}, c.dtype), ds = Tensor::empty({rows, cols}, c.dtype);
  Tensor da = Tensor::empty({rows, cols}, c.dtype), dgate = Tensor::empty({rows, cols}, c.dtype);
  const E* ss = s.data<E>();
  const E* gs = gate.data<E>();
  const E* dys = dy.data<E>();
  E* ys = y.data<E>();
  E* dss = ds.data<E>();
  E* dgs = dgate.data<E>();
  const auto silu = ops::ActivationKind::Silu;
  m.unfused = time_case(
      c, warmup,
      [&] {
        ops::activation_forward(silu, a, nullptr, s);
        map_pass(rows * cols, ys,
                 [=](int64_t i) OCTET_BENCH_INLINE { return load(ss[i]) * load(gs[i]); });
      },
      [&] {
        map_pass(rows * cols, dgs,
                 [=](int64_t i) OCTET_BENCH_INLINE { return load(dys[i]) * load(ss[i]); });
        map_pass(rows * cols, dss,
                 [=](int64_t i) OCTET_BENCH_INLINE { return load(dys[i]) * load(gs[i]); });
        ops::activation_backward(silu, ds, a, nullptr, da, nullptr);
      });
  return m;
}

// ---- softmax and attention -----------------------------------------------------------------

// Scaled, causally masked softmax of attention scores [B,H,T,T]. Unfused: scale pass, mask pass,
// octet's plain softmax; backward: octet's plain softmax backward, then a scale pass.
template <typename E>
Measured measure_softmax(const Case& c, int warmup) {
  const Shape shape = {c.batch(), c.heads(), c.T, c.T};
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const Tensor x = random_tensor(shape, c.dtype, 1, 8.0f);
  const Tensor dy = random_tensor(shape, c.dtype, 2);
  Tensor y = Tensor::empty(shape, c.dtype), dx = Tensor::empty(shape, c.dtype);
  const ops::SoftmaxMask causal{ops::SoftmaxMaskKind::Causal};
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::scaled_masked_softmax_forward(x, scale, causal, y); },
      [&] { ops::scaled_masked_softmax_backward(y, dy, scale, dx); });

  Tensor z = Tensor::empty(shape, c.dtype);
  const E* xs = x.data<E>();
  E* zs = z.data<E>();
  E* dxs = dx.data<E>();
  const int64_t T = c.T, rows = x.numel() / T;
  m.unfused = time_case(
      c, warmup,
      [&] {
        map_pass(x.numel(), zs, [=](int64_t i) OCTET_BENCH_INLINE { return load(xs[i]) * scale; });
        parallel_for(rows, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
          for (int64_t r = begin; r < end; ++r) {
            for (int64_t j = r % T + 1; j < T; ++j) store(-INFINITY, &zs[r * T + j]);
          }
        });
        ops::scaled_masked_softmax_forward(z, 1.0f, {}, y);
      },
      [&] {
        ops::scaled_masked_softmax_backward(y, dy, 1.0f, dx);
        map_pass(dx.numel(), dxs,
                 [=](int64_t i) OCTET_BENCH_INLINE { return load(dxs[i]) * scale; });
      });
  m.unfused_max_diff = compare_with_fused(
      {&y, &dx}, [&] { ops::scaled_masked_softmax_forward(x, scale, causal, y); },
      [&] { ops::scaled_masked_softmax_backward(y, dy, scale, dx); });
  return m;
}

// [B,T,H,D] <-> [B,H,T,D] (rows of D elements), the copies an explicit per-head GEMM needs.
template <typename E>
Tensor heads_first(const Tensor& x, int64_t B, int64_t T, int64_t H, bool inverse) {
  Tensor out = Tensor::empty({B * T * H, kHeadDim}, x.dtype());
  const E* in = x.data<E>();
  E* o = out.data<E>();
  parallel_for(B * T * H, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
    for (int64_t r = begin; r < end; ++r) {  // r indexes [B,T,H] rows
      const int64_t b = r / (T * H), t = (r / H) % T, h = r % H;
      const int64_t bhsd = (b * H + h) * T + t;
      const E* src = in + (inverse ? bhsd : r) * kHeadDim;
      E* dst = o + (inverse ? r : bhsd) * kHeadDim;
      for (int64_t d = 0; d < kHeadDim; ++d) dst[d] = src[d];
    }
  });
  return out;
}

// Causal attention, q k v [B,T,H,64]. Ours: flash attention (T x T never stored). Unfused:
// heads-first copies, per-head QK^T GEMMs (octet gemm) into [B,H,T,T], octet's scaled causal
// softmax, per-head PV GEMMs; backward: dP and dV GEMMs, softmax backward, dQ and dK GEMMs.
// Both allocate their outputs and workspace per call, as a module would, so peak bytes show.
template <typename E>
Measured measure_attention(const Case& c, int warmup) {
  const int64_t B = c.batch(), T = c.T, H = c.heads();
  const Shape shape = {B, T, H, kHeadDim};
  const Tensor q = random_tensor(shape, c.dtype, 1), k = random_tensor(shape, c.dtype, 2);
  const Tensor v = random_tensor(shape, c.dtype, 3), dout = random_tensor(shape, c.dtype, 4);
  ops::AttentionOptions options;
  options.causal = true;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  Tensor out, lse, dq, dk, dv;
  auto fused_forward = [&] {
    out = Tensor::empty(shape, c.dtype);
    lse = Tensor::empty({B, H, T}, DType::F32);
    ops::flash_attention_forward(q, k, v, options, out, lse);
  };
  auto fused_backward = [&] {
    dq = Tensor::empty(shape, c.dtype);
    dk = Tensor::empty(shape, c.dtype);
    dv = Tensor::empty(shape, c.dtype);
    ops::flash_attention_backward(q, k, v, out, lse, dout, options, dq, dk, dv);
  };

  Tensor qh, kh, vh, probs;  // saved by the unfused forward
  auto head = [T](const Tensor& rows_by_head, int64_t bh) {
    return rows_by_head.slice_rows(bh * T, (bh + 1) * T);
  };
  auto unfused_forward = [&] {
    qh = heads_first<E>(q, B, T, H, false);
    kh = heads_first<E>(k, B, T, H, false);
    vh = heads_first<E>(v, B, T, H, false);
    probs = Tensor::empty({B, H, T, T}, c.dtype);
    Tensor scores = probs.reshape({B * H * T, T});
    for (int64_t bh = 0; bh < B * H; ++bh) {
      Tensor s = head(scores, bh);
      gemm(head(qh, bh), head(kh, bh), s, false, true);
    }
    ops::scaled_masked_softmax_forward(probs, scale, {ops::SoftmaxMaskKind::Causal}, probs);
    Tensor oh = Tensor::empty({B * H * T, kHeadDim}, c.dtype);
    for (int64_t bh = 0; bh < B * H; ++bh) {
      Tensor o = head(oh, bh);
      gemm(head(scores, bh), head(vh, bh), o, false, false);
    }
    out = heads_first<E>(oh, B, T, H, true).reshape(shape);
  };
  auto unfused_backward = [&] {
    const Tensor doh = heads_first<E>(dout, B, T, H, false);
    Tensor dprobs = Tensor::empty({B, H, T, T}, c.dtype);
    Tensor dscores = dprobs.reshape({B * H * T, T});
    const Tensor p = probs.reshape({B * H * T, T});
    Tensor dqh = Tensor::empty({B * H * T, kHeadDim}, c.dtype);
    Tensor dkh = Tensor::empty({B * H * T, kHeadDim}, c.dtype);
    Tensor dvh = Tensor::empty({B * H * T, kHeadDim}, c.dtype);
    for (int64_t bh = 0; bh < B * H; ++bh) {
      Tensor dp = head(dscores, bh), dvb = head(dvh, bh);
      gemm(head(doh, bh), head(vh, bh), dp, false, true);
      gemm(head(p, bh), head(doh, bh), dvb, true, false);
    }
    ops::scaled_masked_softmax_backward(probs, dprobs, scale, dprobs);
    for (int64_t bh = 0; bh < B * H; ++bh) {
      Tensor dqb = head(dqh, bh), dkb = head(dkh, bh);
      gemm(head(dscores, bh), head(kh, bh), dqb, false, false);
      gemm(head(dscores, bh), head(qh, bh), dkb, true, false);
    }
    dq = heads_first<E>(dqh, B, T, H, true).reshape(shape);
    dk = heads_first<E>(dkh, B, T, H, true).reshape(shape);
    dv = heads_first<E>(dvh, B, T, H, true).reshape(shape);
  };
  auto clear = [&] { out = lse = dq = dk = dv = qh = kh = vh = probs = Tensor(); };
  // Bytes allocated beyond the inputs over one forward + backward.
  auto peak_bytes = [&](auto& forward, auto& backward) {
    clear();
    reset_peak_memory();
    const int64_t base = memory_stats().current_bytes;
    forward();
    backward();
    const int64_t peak = memory_stats().peak_bytes - base;
    clear();
    return peak;
  };

  Measured m;
  m.ours = time_case(c, warmup, fused_forward, fused_backward);
  m.peak_bytes = peak_bytes(fused_forward, fused_backward);
  m.unfused = time_case(c, warmup, unfused_forward, unfused_backward);
  m.unfused_peak_bytes = peak_bytes(unfused_forward, unfused_backward);
  unfused_forward();
  unfused_backward();
  m.unfused_max_diff = compare_with_fused({&out, &dq, &dk, &dv}, fused_forward, fused_backward);
  clear();
  return m;
}

// ---- rope ----------------------------------------------------------------------------------

// RoPE (rotate-half) on q and k [2,1024,H,64] in place. Unfused, per tensor: cos/sin tables,
// rotate-half copy pass, x*cos pass, rot*sin pass, add pass (backward: the same with -sin).
template <typename E>
Measured measure_rope(const Case& c, int warmup) {
  const int64_t B = c.batch(), T = c.T, H = c.heads(), half = kHeadDim / 2;
  const Shape shape = {B, T, H, kHeadDim};
  Tensor q = random_tensor(shape, c.dtype, 1), k = random_tensor(shape, c.dtype, 2);
  Tensor dq = random_tensor(shape, c.dtype, 3), dk = random_tensor(shape, c.dtype, 4);
  const ops::RopeOptions options;
  Measured m;
  m.ours = time_case(
      c, warmup,
      [&] {
        ops::rope_forward(q, options);
        ops::rope_forward(k, options);
      },
      [&] {
        ops::rope_backward(dq, options);
        ops::rope_backward(dk, options);
      });

  const int64_t n = q.numel(), heads_rows = n / kHeadDim;
  Tensor rotated = Tensor::empty(shape, c.dtype), with_cos = Tensor::empty(shape, c.dtype);
  Tensor with_sin = Tensor::empty(shape, c.dtype);
  Tensor cos = Tensor::empty({T, half}, DType::F32), sin = Tensor::empty({T, half}, DType::F32);
  E* rot = rotated.data<E>();
  E* wc = with_cos.data<E>();
  E* ws = with_sin.data<E>();
  auto rotate = [&](Tensor& x, float sign) {
    ops::rope_tables(T, kHeadDim, options, cos, sin);
    const float* cs = cos.data<float>();
    const float* sn = sin.data<float>();
    E* xs = x.data<E>();
    // Row r of 64 channels is head r % H at position t = (r / H) % T; channel d uses pair d % 32.
    map_rows(heads_rows, kHeadDim, rot, [=](int64_t r, int64_t d) OCTET_BENCH_INLINE {
      const E* row = xs + r * kHeadDim;
      return d < half ? -load(row[d + half]) : load(row[d - half]);
    });
    map_rows(heads_rows, kHeadDim, wc, [=](int64_t r, int64_t d) OCTET_BENCH_INLINE {
      return load(xs[r * kHeadDim + d]) * cs[((r / H) % T) * half + d % half];
    });
    map_rows(heads_rows, kHeadDim, ws, [=](int64_t r, int64_t d) OCTET_BENCH_INLINE {
      return sign * load(rot[r * kHeadDim + d]) * sn[((r / H) % T) * half + d % half];
    });
    map_pass(n, xs, [=](int64_t i) OCTET_BENCH_INLINE { return load(wc[i]) + load(ws[i]); });
  };
  m.unfused = time_case(
      c, warmup,
      [&] {
        rotate(q, 1.0f);
        rotate(k, 1.0f);
      },
      [&] {
        rotate(dq, -1.0f);
        rotate(dk, -1.0f);
      });
  return m;
}

// ---- bias + dropout + residual -------------------------------------------------------------

// Unfused: bias pass, dropout pass (Philox mask stored as bytes, scaled), residual-add pass;
// backward: masked-scale pass, then a dbias column-sum pass.
template <typename E>
Measured measure_bias_dropout_add(const Case& c, int warmup) {
  const int64_t rows = kTokens, cols = c.hidden, n = rows * cols;
  const Tensor x = random_tensor({rows, cols}, c.dtype, 1);
  const Tensor residual = random_tensor({rows, cols}, c.dtype, 2);
  const Tensor dout = random_tensor({rows, cols}, c.dtype, 3);
  const Tensor bias = random_tensor({cols}, DType::F32, 4);
  Tensor out = Tensor::empty({rows, cols}, c.dtype), dx = Tensor::empty({rows, cols}, c.dtype);
  Tensor dbias = Tensor::empty({cols}, DType::F32);
  ops::DropoutParams dropout{kDropout, 1234, 0};
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::bias_dropout_add_forward(x, &bias, residual, dropout, out); },
      [&] { ops::bias_dropout_add_backward(dout, dropout, dx, &dbias); });

  Tensor h = Tensor::empty({rows, cols}, c.dtype), dropped = Tensor::empty({rows, cols}, c.dtype);
  Tensor mask = Tensor::empty({n}, DType::U8);
  const E* xs = x.data<E>();
  const E* res = residual.data<E>();
  const E* douts = dout.data<E>();
  const float* b = bias.data<float>();
  E* hs = h.data<E>();
  E* ds = dropped.data<E>();
  E* os = out.data<E>();
  E* dxs = dx.data<E>();
  uint8_t* keep = mask.data<uint8_t>();
  const float kept_scale = 1.0f / (1.0f - kDropout);
  m.unfused = time_case(
      c, warmup,
      [&] {
        map_rows(rows, cols, hs, [=](int64_t r, int64_t k) OCTET_BENCH_INLINE {
          return load(xs[r * cols + k]) + b[k];
        });
        // Blocks of four elements share one Philox call, as in the fused kernel.
        parallel_for(n / 4, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
          for (int64_t block = begin; block < end; ++block) {
            const auto words = philox4x32(dropout.seed, dropout.offset + block);
            for (int lane = 0; lane < 4; ++lane) {
              const int64_t i = block * 4 + lane;
              keep[i] = uniform_from_bits(words[lane]) >= kDropout ? 1 : 0;
              store(keep[i] ? load(hs[i]) * kept_scale : 0.0f, &ds[i]);
            }
          }
        });
        map_pass(n, os, [=](int64_t i) OCTET_BENCH_INLINE { return load(res[i]) + load(ds[i]); });
      },
      [&] {
        map_pass(n, dxs, [=](int64_t i) OCTET_BENCH_INLINE {
          return keep[i] ? load(douts[i]) * kept_scale : 0.0f;
        });
        column_sum(
            rows, cols,
            [=](int64_t r, int64_t k) OCTET_BENCH_INLINE { return load(dxs[r * cols + k]); },
            dbias.data<float>());
      });
  return m;
}

// ---- cross-entropy -------------------------------------------------------------------------

// Loss and gradient over the GPT-2 vocabulary. Ours: the forward-only call (fwd), and the fused
// forward+backward call (ms, the headline; bwd = ms - fwd). Unfused: octet's softmax into an
// F32 [N,V] copy, a loss pass, then a gradient pass (p - onehot) / N.
template <typename E>
Measured measure_cross_entropy(const Case& c, int warmup, int64_t rows) {
  const Tensor logits = random_tensor({rows, kVocab}, c.dtype, 1, 4.0f);
  const Tensor targets = random_ids(rows, kVocab, 2);
  Tensor losses = Tensor::empty({rows}, DType::F32),
         dlogits = Tensor::empty({rows, kVocab}, c.dtype);
  ops::CrossEntropyOptions options;
  options.grad_scale = 1.0f / static_cast<float>(rows);
  Measured m;
  const FwdBwdTiming forward_only = time_case(
      c, warmup,
      [&] { ops::cross_entropy_forward_backward(logits, targets, losses, nullptr, options); },
      [] {});
  const FwdBwdTiming fused = time_case(
      c, warmup,
      [&] { ops::cross_entropy_forward_backward(logits, targets, losses, &dlogits, options); },
      [] {});
  m.ours = {forward_only.fwd_ms, fused.ms - forward_only.fwd_ms, fused.ms, fused.repeats};

  Tensor probs = Tensor::empty({1, 1, rows, kVocab}, DType::F32);
  const float* ps = probs.data<float>();
  const int32_t* ts = targets.data<int32_t>();
  float* ls = losses.data<float>();
  E* dls = dlogits.data<E>();
  const float grad_scale = options.grad_scale;
  float mean_loss = 0.0f;
  m.unfused = time_case(
      c, warmup,
      [&] {
        ops::scaled_masked_softmax_forward(logits.reshape({1, 1, rows, kVocab}), 1.0f, {}, probs);
        double total = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          ls[r] = -std::log(std::max(ps[r * kVocab + ts[r]], 1e-30f));
          total += ls[r];
        }
        mean_loss = static_cast<float>(total / static_cast<double>(rows));
      },
      [&] {
        map_rows(rows, kVocab, dls, [=](int64_t r, int64_t j) OCTET_BENCH_INLINE {
          return (ps[r * kVocab + j] - (j == ts[r] ? 1.0f : 0.0f)) * grad_scale;
        });
      });
  if (!std::isfinite(mean_loss)) std::fprintf(stderr, "bench ops: unfused loss not finite\n");
  return m;
}

// ---- embedding -----------------------------------------------------------------------------

// Token embedding, table [50257, h], 2048 ids. Both backward timings include zero-filling the
// F32 [V,h] gradient (torch's backward allocates a zeroed dense one). Nothing to fuse here:
// the baseline is the plain loops (parallel gather; serial scatter-add, the simple
// deterministic way) against octet's deterministic parallel scatter-add.
template <typename E>
Measured measure_embedding(const Case& c, int warmup) {
  const int64_t cols = c.hidden;
  const Tensor ids = random_ids(kTokens, kVocab, 1);
  const Tensor table = random_tensor({kVocab, cols}, c.dtype, 2);
  const Tensor dout = random_tensor({kTokens, cols}, c.dtype, 3);
  Tensor out = Tensor::empty({kTokens, cols}, c.dtype);
  Tensor dtable = Tensor::empty({kVocab, cols}, DType::F32);
  Measured m;
  m.ours = time_case(
      c, warmup, [&] { ops::embedding_forward(ids, table, out); },
      [&] {
        dtable.zero_();
        ops::embedding_backward(ids, dout, dtable);
      });

  const int32_t* is = ids.data<int32_t>();
  const E* ts = table.data<E>();
  const E* ds = dout.data<E>();
  E* os = out.data<E>();
  float* dts = dtable.data<float>();
  m.unfused = time_case(
      c, warmup,
      [&] {
        parallel_for(kTokens, [=](int64_t begin, int64_t end, int) OCTET_BENCH_INLINE {
          for (int64_t r = begin; r < end; ++r) {
            for (int64_t k = 0; k < cols; ++k) os[r * cols + k] = ts[is[r] * cols + k];
          }
        });
      },
      [&] {
        dtable.zero_();
        for (int64_t r = 0; r < kTokens; ++r) {
          for (int64_t k = 0; k < cols; ++k) dts[is[r] * cols + k] += load(ds[r * cols + k]);
        }
      });
  return m;
}

// ---- AdamW ---------------------------------------------------------------------------------

// A gpt-mini sized parameter set: six layers of width 384 (qkv, proj, fc, fc2 weights and
// biases, two norms each) and a final norm: 74 tensors, ~10.6M parameters.
std::vector<Shape> gpt_mini_shapes(int64_t hidden) {
  std::vector<Shape> shapes;
  for (int layer = 0; layer < 6; ++layer) {
    for (const Shape& s : std::vector<Shape>{{3 * hidden, hidden},
                                             {3 * hidden},
                                             {hidden, hidden},
                                             {hidden},
                                             {4 * hidden, hidden},
                                             {4 * hidden},
                                             {hidden, 4 * hidden},
                                             {hidden},
                                             {hidden},
                                             {hidden},
                                             {hidden},
                                             {hidden}}) {
      shapes.push_back(s);
    }
  }
  shapes.push_back({hidden});
  shapes.push_back({hidden});
  return shapes;
}

int64_t gpt_mini_params(int64_t hidden) {
  int64_t total = 0;
  for (const Shape& s : gpt_mini_shapes(hidden)) total += shape_numel(s);
  return total;
}

// One optimizer step. Ours: octet's multi-tensor AdamW, one pass per element (BF16 grads and a
// BF16 model copy for bf16). Unfused, per tensor as torch's single-tensor loop: decay pass,
// exp_avg pass, exp_avg_sq pass, denominator pass, update pass (and a BF16 copy pass).
template <typename E>
Measured measure_adamw(const Case& c, int warmup) {
  std::vector<ops::AdamWTensor> tensors;
  uint64_t seed = 1;
  for (const Shape& s : gpt_mini_shapes(c.hidden)) {
    ops::AdamWTensor t;
    t.param = random_tensor(s, DType::F32, seed++);
    t.grad = random_tensor(s, c.dtype, seed++, 1e-2f);
    t.exp_avg = Tensor::zeros(s, DType::F32);
    t.exp_avg_sq = Tensor::zeros(s, DType::F32);
    if (c.dtype == DType::BF16) t.model = Tensor::empty(s, DType::BF16);
    t.weight_decay = s.size() > 1 ? 0.1f : 0.0f;
    tensors.push_back(t);
  }
  ops::AdamWHyper hyper;
  hyper.step = 10;
  Measured m;
  m.has_backward = false;
  m.ours = time_case(
      c, warmup, [&] { ops::adamw_step(tensors, hyper); }, [] {});

  Tensor denom = Tensor::empty({4 * c.hidden * c.hidden}, DType::F32);
  const float beta1 = hyper.beta1, beta2 = hyper.beta2, lr = hyper.lr, eps = hyper.eps;
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(double{beta1}, 10.0)));
  const float bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(double{beta2}, 10.0)));
  m.unfused = time_case(
      c, warmup,
      [&] {
        for (ops::AdamWTensor& t : tensors) {
          const int64_t n = t.param.numel();
          float* p = t.param.data<float>();
          const E* g = t.grad.data<E>();
          float* ea = t.exp_avg.data<float>();
          float* eas = t.exp_avg_sq.data<float>();
          float* den = denom.data<float>();
          const float decay = 1.0f - lr * t.weight_decay;
          map_pass(n, p, [=](int64_t i) OCTET_BENCH_INLINE { return p[i] * decay; });
          map_pass(n, ea, [=](int64_t i) OCTET_BENCH_INLINE {
            return ea[i] + (load(g[i]) - ea[i]) * (1.0f - beta1);
          });
          map_pass(n, eas, [=](int64_t i) OCTET_BENCH_INLINE {
            const float gv = load(g[i]);
            return eas[i] * beta2 + (1.0f - beta2) * gv * gv;
          });
          map_pass(n, den, [=](int64_t i) OCTET_BENCH_INLINE {
            return std::sqrt(eas[i]) / bias_correction2_sqrt + eps;
          });
          map_pass(n, p,
                   [=](int64_t i) OCTET_BENCH_INLINE { return p[i] - step_size * ea[i] / den[i]; });
          if (t.model.defined()) {
            map_pass(n, t.model.data<bfloat16>(),
                     [=](int64_t i) OCTET_BENCH_INLINE { return p[i]; });
          }
        }
      },
      [] {});
  return m;
}

// ---- cases, the peer, and the report -------------------------------------------------------

std::vector<int64_t> parse_sizes(const std::string& text, const char* what) {
  std::vector<int64_t> sizes;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    OCTET_CHECK(used == item.size() && value > 0, "bench ops: ", what,
                " expected positive integers separated by commas, got '", item, "'");
    sizes.push_back(value);
  }
  OCTET_CHECK(!sizes.empty(), "bench ops: ", what, " is empty");
  return sizes;
}

std::vector<std::string> parse_names(const std::string& text) {
  std::vector<std::string> names;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (!item.empty()) names.push_back(item);
  }
  return names;
}

// Fewer repeats where one run moves hundreds of MB, so the default stays within minutes.
int repeats_for(const Case& c, int repeats) {
  const bool quadratic = c.op == "softmax" || c.op == "attention";
  if ((quadratic && c.T >= 2048) || c.op == "cross_entropy") return std::min(repeats, 2);
  if (quadratic && c.T >= 1024) return std::min(repeats, 3);
  return repeats;
}

std::vector<Case> make_cases(const Options& options) {
  const std::set<std::string> known = [] {
    const auto names = parse_names(kAllOps);
    return std::set<std::string>(names.begin(), names.end());
  }();
  const auto hidden_sizes = parse_sizes(options.hidden, "--hidden");
  const auto seq_lengths = parse_sizes(options.seq, "--seq");
  for (int64_t h : hidden_sizes) {
    OCTET_CHECK(h % kHeadDim == 0,
                "bench ops: --hidden expected multiples of 64 (head dim 64), got ", h);
  }
  for (int64_t t : seq_lengths) {
    OCTET_CHECK(kTokens % t == 0, "bench ops: --seq expected divisors of ", kTokens, ", got ", t);
  }
  std::vector<DType> dtypes;
  for (const std::string& name : parse_names(options.dtypes)) {
    const DType dtype = parse_dtype(name);
    OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
                "bench ops: --dtype expected bf16 or f32, got '", name, "'");
    dtypes.push_back(dtype);
  }
  OCTET_CHECK(!dtypes.empty(), "bench ops: --dtype is empty");
  std::vector<Case> cases;
  for (const std::string& op : parse_names(options.ops)) {
    OCTET_CHECK(known.count(op), "bench ops: --ops expected names from ", kAllOps, ", got '", op,
                "'");
    for (DType dtype : dtypes) {
      auto add = [&](int64_t T, int64_t hidden) {
        Case c{op, T, hidden, dtype, 1};
        c.repeats = repeats_for(c, options.repeats);
        c.min_ms = options.min_ms;
        cases.push_back(c);
      };
      if (op == "softmax" || op == "attention") {
        for (int64_t T : seq_lengths) {
          for (int64_t h : hidden_sizes) add(T, h);
        }
      } else if (op == "cross_entropy") {
        add(0, 0);
      } else if (op == "adamw") {
        add(0, kAdamwHidden);
      } else {
        for (int64_t h : hidden_sizes) add(op == "rope" ? kRopeSeq : kTokens, h);
      }
    }
  }
  return cases;
}

template <typename E>
Measured measure_typed(const Case& c, const Options& options) {
  const int w = options.warmup;
  if (c.op == "layernorm") return measure_layernorm<E>(c, w);
  if (c.op == "rmsnorm") return measure_rmsnorm<E>(c, w);
  if (c.op == "bias_gelu") return measure_bias_gelu<E>(c, w);
  if (c.op == "swiglu") return measure_swiglu<E>(c, w);
  if (c.op == "softmax") return measure_softmax<E>(c, w);
  if (c.op == "attention") return measure_attention<E>(c, w);
  if (c.op == "rope") return measure_rope<E>(c, w);
  if (c.op == "bias_dropout_add") return measure_bias_dropout_add<E>(c, w);
  if (c.op == "cross_entropy") return measure_cross_entropy<E>(c, w, options.ce_rows);
  if (c.op == "embedding") return measure_embedding<E>(c, w);
  return measure_adamw<E>(c, w);
}

Measured measure(const Case& c, const Options& options) {
  return c.dtype == DType::F32 ? measure_typed<float>(c, options)
                               : measure_typed<bfloat16>(c, options);
}

double ratio(double numerator, double denominator) {
  return denominator > 0.0 ? numerator / denominator : NAN;
}

// Each figure's median over the rounds; the repeats they add up to.
FwdBwdTiming median_timing(const std::vector<FwdBwdTiming>& rounds) {
  std::vector<double> fwd, bwd, ms;
  FwdBwdTiming out;
  for (const FwdBwdTiming& t : rounds) {
    fwd.push_back(t.fwd_ms);
    bwd.push_back(t.bwd_ms);
    ms.push_back(t.ms);
    out.repeats += t.repeats;
  }
  out.fwd_ms = bench::median(fwd);
  out.bwd_ms = bench::median(bwd);
  out.ms = bench::median(ms);
  return out;
}

nlohmann::json json_line(const Case& c, const Measured& m, const Options& options) {
  nlohmann::json line = {{"op", c.op},
                         {"T", c.T},
                         {"B", c.T > 0 ? kTokens / c.T : 0},
                         {"hidden", c.hidden},
                         {"heads", c.heads()},
                         {"dtype", dtype_name(c.dtype)},
                         {"ms", m.ours.ms},
                         {"fwd_ms", m.ours.fwd_ms},
                         {"bwd_ms", m.ours.bwd_ms},
                         {"unfused_ms", m.unfused.ms},
                         {"unfused_fwd_ms", m.unfused.fwd_ms},
                         {"unfused_bwd_ms", m.unfused.bwd_ms},
                         {"vs_unfused", bench::median(m.vs_unfused)},
                         {"vs_unfused_rounds", m.vs_unfused},
                         {"repeats", m.ours.repeats},
                         {"unfused_repeats", m.unfused.repeats},
                         {"threads", num_threads()}};
  if (m.torch) {
    line["torch_ms"] = m.torch->ms;
    line["torch_fwd_ms"] = m.torch->fwd_ms;
    line["torch_bwd_ms"] = m.torch->bwd_ms;
    line["vs_torch"] = bench::median(m.vs_torch);
    line["vs_torch_rounds"] = m.vs_torch;
    line["torch_repeats"] = m.torch->repeats;
  } else {
    line["torch_ms"] = nullptr;
    line["vs_torch"] = nullptr;
  }
  if (c.op == "cross_entropy") {
    line["rows"] = options.ce_rows;
    line["vocab"] = kVocab;
  }
  if (m.peak_bytes >= 0) {
    line["peak_bytes"] = m.peak_bytes;
    line["unfused_peak_bytes"] = m.unfused_peak_bytes;
  }
  if (!std::isnan(m.unfused_max_diff)) line["unfused_max_abs_diff"] = m.unfused_max_diff;
  if (!m.has_backward) line["fwd_bwd"] = "step";
  return line;
}

void print_row(const Case& c, const Measured& m) {
  const double torch_ms = m.torch ? m.torch->ms : NAN;
  const double torch_fwd = m.torch ? m.torch->fwd_ms : NAN;
  const double torch_bwd = m.torch ? m.torch->bwd_ms : NAN;
  std::printf(
      "%-16s %5lld %6lld %-4s | %8.2f %8.2f %9.2f | %8.2f %8.2f %9.2f | %8.2f %8.2f %9.2f | %6.2f "
      "%6.2f\n",
      c.op.c_str(), static_cast<long long>(c.T), static_cast<long long>(c.hidden),
      std::string(dtype_name(c.dtype)).c_str(), m.ours.fwd_ms, m.ours.bwd_ms, m.ours.ms,
      m.unfused.fwd_ms, m.unfused.bwd_ms, m.unfused.ms, torch_fwd, torch_bwd, torch_ms,
      bench::median(m.vs_unfused), m.vs_torch.empty() ? NAN : bench::median(m.vs_torch));
  std::fflush(stdout);
}

void print_header(const Options& options) {
  std::printf(
      "octet bench ops: ms per call, %d threads; median of >= %d repeats (more, up to 50, until "
      "%.0f ms)\nafter %d warm-up; B*T = %lld tokens, head dim 64. %d rounds per case (ours and "
      "torch in turn,\nwho goes first alternating): ms are medians over the rounds, vs_unf and "
      "vs_t medians of per-round ratios\n",
      num_threads(), options.repeats, options.min_ms, options.warmup,
      static_cast<long long>(kTokens), options.rounds);
  std::printf("%-16s %5s %6s %-4s | %8s %8s %9s | %8s %8s %9s | %8s %8s %9s | %6s %6s\n", "op", "T",
              "hidden", "type", "fwd", "bwd", "fwd+bwd", "unf_fwd", "unf_bwd", "unfused", "t_fwd",
              "t_bwd", "torch", "vs_unf", "vs_t");
}

void print_footer(const Options& options, const std::vector<Case>& cases,
                  const std::vector<Measured>& results) {
  bool any_attention = false;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (results[i].peak_bytes < 0) continue;
    if (!any_attention) {
      std::printf("\nattention: bytes allocated beyond q,k,v,dout over one forward+backward\n");
      std::printf("%5s %6s %-4s | %12s %14s %8s\n", "T", "hidden", "type", "flash_MiB",
                  "unfused_MiB", "ratio");
      any_attention = true;
    }
    std::printf("%5lld %6lld %-4s | %12.1f %14.1f %8.1f\n", static_cast<long long>(cases[i].T),
                static_cast<long long>(cases[i].hidden),
                std::string(dtype_name(cases[i].dtype)).c_str(),
                static_cast<double>(results[i].peak_bytes) / 1048576.0,
                static_cast<double>(results[i].unfused_peak_bytes) / 1048576.0,
                ratio(static_cast<double>(results[i].unfused_peak_bytes),
                      static_cast<double>(results[i].peak_bytes)));
  }
  int fused_met = 0;
  std::string below;
  for (size_t i = 0; i < cases.size(); ++i) {
    const double r = bench::median(results[i].vs_unfused);
    if (r >= 1.5) {
      ++fused_met;
    } else {
      below += " " + cases[i].op + "(T" + std::to_string(cases[i].T) + ",h" +
               std::to_string(cases[i].hidden) + "," + std::string(dtype_name(cases[i].dtype)) +
               ")=" + std::to_string(r).substr(0, 4);
    }
  }
  std::printf("\ngoal: fused >= 1.5x unfused: met in %d of %zu cases%s%s\n", fused_met,
              cases.size(), below.empty() ? "" : "; below:", below.c_str());
  for (size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].op != "attention" || cases[i].T != 1024 || cases[i].dtype != DType::BF16) continue;
    const double r = results[i].vs_torch.empty() ? NAN : bench::median(results[i].vs_torch);
    std::printf("goal: attention fwd+bwd >= 3x torch explicit at T=1024 bf16, hidden %lld: %s %s\n",
                static_cast<long long>(cases[i].hidden),
                bench::median_range(results[i].vs_torch).c_str(),
                std::isnan(r) ? "(no torch figure)"
                : r >= 3.0    ? "met"
                              : "not met");
  }
  std::printf(
      "\nours: octet's fused op. unfused: the same work as separate passes with octet's own pieces "
      "(same\nISA dispatch and threads). torch: PyTorch eager, autograd forward+backward, in this "
      "run, case by case.\nShapes: norms, bias_dropout_add [2048,h]; bias_gelu [2048,4h]; swiglu "
      "[2048,8h] -> [2048,4h];\nsoftmax [B,h/64,T,T] causal; attention q,k,v [B,T,h/64,64] causal; "
      "rope q and k [2,1024,h/64,64];\ncross_entropy [%lld,50257] (fewer rows than 2048 for time; "
      "ours: bwd = fused call - forward-only\ncall); embedding [50257,h] x 2048 ids (bwd includes "
      "zeroing the [V,h] grad, as torch's does);\nadamw: one step over %lld params in 74 tensors "
      "(fwd = the step; torch: F32 grads, plus a bf16\nmodel copy for bf16). On a shared machine, "
      "OMP_WAIT_POLICY=passive (both sides inherit it) steadies\nthe figures; short cases are "
      "noisy "
      "there either way.\n",
      static_cast<long long>(options.ce_rows),
      static_cast<long long>(gpt_mini_params(kAdamwHidden)));
}

void run_bench(const Options& options) {
  OCTET_CHECK(options.rounds >= 1, "bench ops: --rounds expected >= 1, got ", options.rounds);
  OCTET_CHECK(options.repeats >= 1, "bench ops: --repeats expected >= 1, got ", options.repeats);
  OCTET_CHECK(options.warmup >= 0, "bench ops: --warmup expected >= 0, got ", options.warmup);
  OCTET_CHECK(options.ce_rows >= 1, "bench ops: --ce-rows expected >= 1, got ", options.ce_rows);
  const std::vector<Case> cases = make_cases(options);

  bench::PeerProcess peer;
  bool have_peer = false;
  if (!options.no_torch) {
    const auto script = bench::find_peer_script("torch_ops.py");
    if (script.empty()) {
      std::fprintf(stderr, "bench ops: bench/peers/torch_ops.py not found; no torch figures\n");
    } else {
      have_peer = peer.start(
          {"/usr/bin/python3", script.string(), "--threads", std::to_string(num_threads()),
           "--warmup", std::to_string(options.warmup), "--tokens", std::to_string(kTokens),
           "--vocab", std::to_string(kVocab), "--ce-rows", std::to_string(options.ce_rows)});
      if (!have_peer) std::fprintf(stderr, "bench ops: the torch peer did not start\n");
    }
  }
  if (!options.json) print_header(options);
  std::vector<Measured> results;
  auto ask_peer = [&](const Case& c) -> std::optional<FwdBwdTiming> {
    if (!have_peer) return std::nullopt;
    const auto answer = peer.ask(c.peer_line());
    if (!answer) {
      std::fprintf(stderr, "bench ops: the torch peer stopped; no more torch figures\n");
      have_peer = false;
      return std::nullopt;
    }
    if (answer->contains("error")) {
      std::fprintf(stderr, "bench ops: torch %s: %s\n", c.peer_line().c_str(),
                   (*answer)["error"].get<std::string>().c_str());
      return std::nullopt;
    }
    return FwdBwdTiming{(*answer)["fwd_ms"].get<double>(), (*answer)["bwd_ms"].get<double>(),
                        (*answer)["ms"].get<double>(), (*answer)["repeats"].get<int>()};
  };
  for (const Case& c : cases) {
    // Rounds: ours (fused and unfused) and the peer in turn, who goes first alternating, so
    // that the machine's load in a minute falls on both sides of each round's ratio.
    std::vector<Measured> rounds;
    std::vector<FwdBwdTiming> torch_rounds;
    for (int round = 0; round < options.rounds; ++round) {
      std::optional<FwdBwdTiming> torch;
      if (round % 2 == 1) torch = ask_peer(c);
      Measured m = measure(c, options);
      if (round % 2 == 0) torch = ask_peer(c);
      if (torch) {
        torch_rounds.push_back(*torch);
        m.vs_torch.push_back(ratio(torch->ms, m.ours.ms));
      }
      rounds.push_back(std::move(m));
    }
    Measured m = rounds.front();
    m.vs_torch.clear();
    std::vector<FwdBwdTiming> ours, unfused;
    for (const Measured& r : rounds) {
      ours.push_back(r.ours);
      unfused.push_back(r.unfused);
      m.vs_unfused.push_back(ratio(r.unfused.ms, r.ours.ms));
      // A round whose peer answered gives a torch ratio (the peer may stop mid-way).
      m.vs_torch.insert(m.vs_torch.end(), r.vs_torch.begin(), r.vs_torch.end());
    }
    m.ours = median_timing(ours);
    m.unfused = median_timing(unfused);
    if (!torch_rounds.empty()) m.torch = median_timing(torch_rounds);
    results.push_back(m);
    if (options.json) {
      std::printf("%s\n", json_line(c, m, options).dump().c_str());
      std::fflush(stdout);
    } else {
      print_row(c, m);
    }
  }
  peer.stop();
  if (!options.json) print_footer(options, cases, results);
}

}  // namespace

void register_bench_ops(CLI::App& bench) {
  CLI::App* command = bench.add_subcommand(
      "ops", "Fused operators, forward+backward, beside their unfused composition and PyTorch");
  auto options = std::make_shared<Options>();
  command->add_option("--ops", options->ops, "operators, comma separated")->capture_default_str();
  command->add_option("--hidden", options->hidden, "hidden sizes (multiples of 64)")
      ->capture_default_str();
  command->add_option("--seq", options->seq, "sequence lengths for softmax and attention")
      ->capture_default_str();
  command->add_option("--dtype", options->dtypes, "bf16, f32, or both: bf16,f32")
      ->capture_default_str();
  command
      ->add_option("--rounds", options->rounds,
                   "rounds per case, ours and torch in turn (ratios: median of per-round ratios)")
      ->capture_default_str()
      ->check(at_least(1));
  command
      ->add_option("--repeats", options->repeats,
                   "timed runs per case (median; fewer for big cases)")
      ->capture_default_str()
      ->check(at_least(1));
  command->add_option("--warmup", options->warmup, "untimed runs first")
      ->capture_default_str()
      ->check(at_least(0));
  command
      ->add_option("--min-ms", options->min_ms,
                   "more timed runs (up to 50) until they add up to this many ms")
      ->capture_default_str()
      ->check(at_least(0));
  command->add_option("--ce-rows", options->ce_rows, "cross_entropy rows (vocab 50257)")
      ->capture_default_str()
      ->check(at_least(1));
  command->add_flag("--json", options->json, "one JSON object per line per op and shape");
  command->add_flag("--no-torch", options->no_torch, "skip the PyTorch peer");
  command->callback([options] { run_bench(*options); });
}

}  // namespace octet::cli
