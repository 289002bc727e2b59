// Weight-only FP8 for memory-bound inference: a weight quantized once to E4M3 with one scale
// per output channel, and a matrix product for few rows (decode) that reads the weight's bytes
// and widens them in registers, so each step reads a quarter of an F32 weight's bytes (half of
// BF16's). More rows (prefill) widen the weight to BF16 once per call and run the BF16 GEMM:
// there the product's FLOPs, not the weight's bytes, set the time.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm/gemm_checks.h"
#include "gemm/small_m.h"
#include "octet/cpu_features.h"
#include "octet/gemm.h"
#include "octet/profile.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#define OCTET_FP8W_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,prefer-vector-width=512")))
#define OCTET_FP8W_AVX2 __attribute__((target("avx2,fma")))
#define OCTET_FP8W_INLINE inline __attribute__((always_inline))

namespace octet {

namespace {

constexpr int64_t kMaxSmallRows = 8;  // rows of A taken by the generic weight-reading kernel
// Past this (prefill) B is widened once and oneDNN's GEMM runs. Over GPT-2 124M's 48 layer
// weights called back to back (an AMD EPYC VM, 2 threads) widening won from 24 rows (21.7 ms
// against 20.2, 107 against 50 at 128), but in the decode step at 32 and 64 rows it took
// twice the kernel's time: each call widens into fresh tensors of 5-9 MB (2 MiB pages mapped
// and cleared), and the dequantization is profiled per row (65,000 scopes a step).
constexpr int64_t kMaxDotRows = 256;

template <int W>
struct V {
  typedef float F __attribute__((vector_size(sizeof(float) * W)));
  typedef uint32_t U __attribute__((vector_size(sizeof(uint32_t) * W)));
  typedef int32_t I __attribute__((vector_size(sizeof(int32_t) * W)));
};

// W E4M3 codes (OCP, no NaN in quantized weights: they saturate) widened to F32, exactly:
// normal codes by moving exponent and mantissa into F32's fields with the bias change, the
// subnormals (exponent 0: m * 2^-9) through an integer conversion.
template <int W>
OCTET_FP8W_INLINE typename V<W>::F widen_e4m3(const uint8_t* codes) {
  // Zero-extend W bytes to W words: one vector load of the W/4 words holding them, spread so
  // that lane i holds word i/4, a per-lane shift and mask pick byte i%4. (GCC lowers a byte
  // vector's conversion to scalar inserts, and a partial store then wide load stalls.)
  typename V<W>::U spread;
  if constexpr (W == 16) {
    typedef uint32_t Words __attribute__((vector_size(16)));
    Words words;
    std::memcpy(&words, codes, 16);
    spread = __builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  } else if constexpr (W == 8) {
    typedef uint32_t Words __attribute__((vector_size(8)));
    Words words;
    std::memcpy(&words, codes, 8);
    spread = __builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1);
  } else {
    uint32_t word;
    std::memcpy(&word, codes, 4);
    spread = typename V<W>::U{} + word;
  }
  typename V<W>::U shift;
  for (int i = 0; i < W; ++i) shift[i] = static_cast<uint32_t>(8 * (i % 4));
  const typename V<W>::U c = (spread >> shift) & 0xffu;
  const typename V<W>::U magnitude = c & 0x7fu;
  const typename V<W>::U sign = (c & 0x80u) << 24;
  const typename V<W>::U normal = (magnitude << 20) + (120u << 23);
  const typename V<W>::F tiny =
      __builtin_convertvector(reinterpret_cast<typename V<W>::I>(magnitude), typename V<W>::F) *
      (1.0f / 512.0f);
  const typename V<W>::U tiny_bits = reinterpret_cast<typename V<W>::U>(tiny);
  const typename V<W>::U is_tiny = magnitude < 8u;  // all ones where subnormal (or zero)
  const typename V<W>::U bits = ((tiny_bits & is_tiny) | (normal & ~is_tiny)) | sign;
  return reinterpret_cast<typename V<W>::F>(bits);
}

// Where a weight's scales are: per channel, scale_inv[n]; in 128 x 128 blocks, row n / 128
// of the [ceil(N / 128), ceil(K / 128)] table, one entry per 128 K.
struct WeightScales {
  const float* scale_inv = nullptr;
  bool blocks = false;
  int64_t span = 1;    // K per scale: K per channel (at least 1), 128 in blocks
  int64_t stride = 0;  // blocks: entries per block row of the table
  const float* of_row(int64_t n) const {
    return blocks ? scale_inv + (n / kFp8WeightBlock) * stride : scale_inv + n;
  }
};

WeightScales weight_scales(const Fp8WeightOnly& w) {
  if (w.scaling == Fp8WeightScaling::PerChannel) {
    return {w.scale_inv.data<float>(), false, std::max<int64_t>(w.codes.dim(1), 1), 0};
  }
  return {w.scale_inv.data<float>(), true, kFp8WeightBlock, w.scale_inv.dim(1)};
}

// C[m, n] for n in [n0, n1), all M rows (M <= kMaxSmallRows): each weight row read once, its
// sums times scale_inv[n] (none when null: A carries block scales, scale_by_k_blocks).
template <int W>
OCTET_FP8W_INLINE void small_rows(const float* a, int64_t M, int64_t K, const uint8_t* codes,
                                  const float* scale_inv, int64_t n0, int64_t n1, float* c,
                                  int64_t ldc) {
  using F = typename V<W>::F;
  const int64_t Kv = K / W * W;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = codes + n * K;
    F acc[kMaxSmallRows];
    for (int64_t m = 0; m < M; ++m) acc[m] = F{} + 0.0f;
    for (int64_t k = 0; k < Kv; k += W) {
      const F wv = widen_e4m3<W>(w + k);
      for (int64_t m = 0; m < M; ++m) {
        F av;
        std::memcpy(&av, a + m * K + k, sizeof av);
        acc[m] += av * wv;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int i = 0; i < W; ++i) sum += acc[m][i];
      for (int64_t k = Kv; k < K; ++k) sum += a[m * K + k] * fp8_to_float(w[k], DType::E4M3);
      c[m * ldc + n] = scale_inv != nullptr ? sum * scale_inv[n] : sum;
    }
  }
}

OCTET_FP8W_AVX512 void small_rows_avx512(const float* a, int64_t M, int64_t K, const uint8_t* codes,
                                         const float* scale_inv, int64_t n0, int64_t n1, float* c,
                                         int64_t ldc) {
  small_rows<16>(a, M, K, codes, scale_inv, n0, n1, c, ldc);
}
OCTET_FP8W_AVX2 void small_rows_avx2(const float* a, int64_t M, int64_t K, const uint8_t* codes,
                                     const float* scale_inv, int64_t n0, int64_t n1, float* c,
                                     int64_t ldc) {
  small_rows<8>(a, M, K, codes, scale_inv, n0, n1, c, ldc);
}
void small_rows_scalar(const float* a, int64_t M, int64_t K, const uint8_t* codes,
                       const float* scale_inv, int64_t n0, int64_t n1, float* c, int64_t ldc) {
  small_rows<4>(a, M, K, codes, scale_inv, n0, n1, c, ldc);
}

}  // namespace

const char* fp8_weight_scaling_name(Fp8WeightScaling scaling) {
  return scaling == Fp8WeightScaling::PerChannel ? "channel" : "block128";
}

Fp8WeightScaling parse_fp8_weight_scaling(const std::string& name) {
  if (name == "channel") return Fp8WeightScaling::PerChannel;
  if (name == "block128") return Fp8WeightScaling::Block128;
  fail(detail::concat("FP8 weight scaling: expected channel or block128, got '", name, "'"));
}

namespace {

// quantize_weight_fp8 over the weight's own values (F32 or BF16), with the bulk kernels of
// fp8.h (vectorized, exact ports of float_to_fp8): each scaling block's amax, then its codes.
template <typename In>
void quantize_blocks(const In* w, int64_t N, int64_t K, bool blocks, Fp8WeightOnly& q) {
  const int64_t B = kFp8WeightBlock;
  // Scaling blocks: rows [r * rows, (r + 1) * rows) x columns [j * span, (j + 1) * span).
  const int64_t rows = blocks ? B : 1, span = blocks ? B : std::max<int64_t>(K, 1);
  const int64_t block_rows = (N + rows - 1) / rows, block_cols = blocks ? q.scale_inv.dim(1) : 1;
  float* scale_inv = q.scale_inv.data<float>();
  uint8_t* codes = static_cast<uint8_t*>(q.codes.raw());
  // The amaxes first (NaN where a block holds one): a non-finite weight is refused before any
  // codes are written, and outside the parallel loop, which must not throw.
  std::vector<float> amax(static_cast<size_t>(block_rows * block_cols), 0.0f);
#pragma omp parallel for
  for (int64_t r = 0; r < block_rows; ++r) {
    for (int64_t n = r * rows; n < std::min(N, (r + 1) * rows); ++n) {
      for (int64_t j = 0; j < block_cols; ++j) {
        const int64_t k0 = j * span, k1 = std::min(K, k0 + span);
        if (k1 <= k0) continue;
        const float m = amax_of(w + n * K + k0, static_cast<size_t>(k1 - k0));
        float& block = amax[static_cast<size_t>(r * block_cols + j)];
        block = std::isnan(m) || std::isnan(block) ? m + block : std::max(block, m);
      }
    }
  }
  for (int64_t i = 0; i < block_rows * block_cols; ++i) {
    if (std::isfinite(amax[static_cast<size_t>(i)])) continue;
    const int64_t r = i / block_cols, j = i % block_cols;
    for (int64_t n = r * rows; n < std::min(N, (r + 1) * rows); ++n) {
      for (int64_t k = j * span; k < std::min(K, (j + 1) * span); ++k) {
        float v;
        if constexpr (std::is_same_v<In, float>) {
          v = w[n * K + k];
        } else {
          v = bf16_to_float(w[n * K + k].bits);
        }
        if (std::isfinite(v)) continue;
        fail(detail::concat("quantize_weight_fp8: weight [", n, ", ", k, "] is ", v,
                            ": expected finite values (row ", n,
                            blocks ? detail::concat(", 128 x 128 block [", r, ", ", j, "]") : "",
                            ")"));
      }
    }
  }
  const float max = fp8_max(DType::E4M3);
#pragma omp parallel for
  for (int64_t r = 0; r < block_rows; ++r) {
    for (int64_t j = 0; j < block_cols; ++j) {
      const float a = amax[static_cast<size_t>(r * block_cols + j)];
      const float scale = a > 0.0f ? max / a : 1.0f;
      scale_inv[r * block_cols + j] = 1.0f / scale;
      const int64_t k0 = j * span, k1 = std::min(K, k0 + span);
      if (k1 <= k0) continue;
      for (int64_t n = r * rows; n < std::min(N, (r + 1) * rows); ++n) {
        quantize_fp8(w + n * K + k0, static_cast<size_t>(k1 - k0), scale, DType::E4M3,
                     codes + n * K + k0);
      }
    }
  }
}

}  // namespace

Fp8WeightOnly quantize_weight_fp8(const Tensor& weight, Fp8WeightScaling scaling) {
  OCTET_CHECK(weight.ndim() == 2 && (weight.dtype() == DType::F32 || weight.dtype() == DType::BF16),
              "quantize_weight_fp8: weight expected [N, K] f32 or bf16, got ",
              shape_str(weight.shape()), " ", dtype_name(weight.dtype()));
  const int64_t N = weight.dim(0), K = weight.dim(1), B = kFp8WeightBlock;
  const bool blocks = scaling == Fp8WeightScaling::Block128;
  Fp8WeightOnly q;
  q.scaling = scaling;
  q.codes = Tensor::empty({N, K}, DType::E4M3);
  q.scale_inv = blocks ? Tensor::empty({(N + B - 1) / B, (K + B - 1) / B}, DType::F32)
                       : Tensor::empty({N}, DType::F32);
  if (weight.dtype() == DType::F32) {
    quantize_blocks(weight.data<float>(), N, K, blocks, q);
  } else {
    quantize_blocks(weight.data<bfloat16>(), N, K, blocks, q);
  }
  return q;
}

namespace {

void check_fp8_weight(const Fp8WeightOnly& w, const char* what) {
  OCTET_CHECK(w.codes.ndim() == 2 && w.codes.dtype() == DType::E4M3, what,
              ": B expected [N, K] e4m3 codes, got ", shape_str(w.codes.shape()), " ",
              dtype_name(w.codes.dtype()));
  const int64_t N = w.codes.dim(0), K = w.codes.dim(1), B = kFp8WeightBlock;
  const Shape expected = w.scaling == Fp8WeightScaling::PerChannel
                             ? Shape{N}
                             : Shape{(N + B - 1) / B, (K + B - 1) / B};
  OCTET_CHECK(w.scale_inv.dtype() == DType::F32 && w.scale_inv.shape() == expected, what,
              ": B's scales (", fp8_weight_scaling_name(w.scaling), ") expected ",
              shape_str(expected), " f32 for codes ", shape_str(w.codes.shape()), ", got ",
              shape_str(w.scale_inv.shape()), " ", dtype_name(w.scale_inv.dtype()));
}

}  // namespace

Tensor dequantize_weight_fp8(const Fp8WeightOnly& weight, DType dtype) {
  check_fp8_weight(weight, "dequantize_weight_fp8");
  const int64_t N = weight.codes.dim(0), K = weight.codes.dim(1);
  Tensor out = Tensor::empty({N, K}, DType::F32);
  const uint8_t* codes = static_cast<const uint8_t*>(weight.codes.raw());
  const WeightScales scales = weight_scales(weight);
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const float* scale_inv = scales.of_row(n);
    for (int64_t k0 = 0, j = 0; k0 < K; k0 += scales.span, ++j) {
      dequantize_fp8(codes + n * K + k0, static_cast<size_t>(std::min(scales.span, K - k0)),
                     DType::E4M3, scale_inv[j], out.data<float>() + n * K + k0);
    }
  }
  return dtype == DType::F32 ? out : out.to(dtype);
}

void gemm(const Tensor& A, const Fp8WeightOnly& B, Tensor& C, const Epilogue& epilogue) {
  const profile::Scope scope(profile::Category::Gemm);
  check_fp8_weight(B, "gemm (fp8 weight)");
  const int64_t N = B.codes.dim(0), K = B.codes.dim(1);
  OCTET_CHECK(
      A.ndim() == 2 && A.dim(1) == K && (A.dtype() == DType::F32 || A.dtype() == DType::BF16),
      "gemm (fp8 weight): A expected [M, K=", K, "] f32 or bf16, got ", shape_str(A.shape()), " ",
      dtype_name(A.dtype()));
  const int64_t M = A.dim(0);
  OCTET_CHECK(C.ndim() == 2 && C.dim(0) == M && C.dim(1) == N &&
                  (C.dtype() == A.dtype() || C.dtype() == DType::F32),
              "gemm (fp8 weight): C expected [", M, ", ", N, "] ", dtype_name(A.dtype()),
              " or f32, got ", shape_str(C.shape()), " ", dtype_name(C.dtype()));
  const bool bf16_dot = A.dtype() == DType::BF16 && gemm_detail::small_m_supported();
  if (M > (bf16_dot ? kMaxDotRows : kMaxSmallRows)) {  // compute-bound: widen once, GEMM
    const Tensor widened = dequantize_weight_fp8(B, A.dtype());
    gemm(A, widened, C, /*trans_a=*/false, /*trans_b=*/true, 1.0f, 0.0f, epilogue);
    return;
  }
  const uint8_t* codes = static_cast<const uint8_t*>(B.codes.raw());
  const WeightScales scales = weight_scales(B);
  if (bf16_dot) {  // widened in registers, epilogue fused, C written in its own dtype
    gemm_detail::SmallM p;
    p.a = static_cast<const uint16_t*>(A.raw());
    p.b = codes;
    p.b_e4m3 = true;
    if (!scales.blocks) {
      p.column_scale = scales.scale_inv;
    } else {
      p.block_scale = scales.scale_inv;
      p.block_scale_stride = scales.stride;
    }
    p.m = M;
    p.n = N;
    p.k = K;
    p.c = C.raw();
    p.c_bf16 = C.dtype() == DType::BF16;
    p.activation = epilogue.activation;
    std::vector<float> bias;
    if (epilogue.bias != nullptr) {
      bias = epilogue.bias->to_floats();
      p.bias = bias.data();
    }
    gemm_detail::run_small_m(p);
    return;
  }
  Tensor c32 = C.dtype() == DType::F32 ? C : Tensor::empty({M, N}, DType::F32);
  const Tensor a32 = A.dtype() == DType::F32 ? A : A.to(DType::F32);
  auto kernel = small_rows_scalar;
  if (active_isa() == Isa::Avx512) kernel = small_rows_avx512;
  if (active_isa() == Isa::Avx2) kernel = small_rows_avx2;
  const float* a = a32.data<float>();
  float* c = c32.data<float>();
#pragma omp parallel
  {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t n0 = N * t / threads, n1 = N * (t + 1) / threads;
    if (!scales.blocks) {
      kernel(a, M, K, codes, scales.scale_inv, n0, n1, c, N);
    } else {  // each block row of B against A times its K blocks' scales
      std::vector<float> scaled(static_cast<size_t>(M * K));
      for (int64_t b0 = n0, b1 = n0; b0 < n1; b0 = b1) {
        b1 = std::min(n1, (b0 / kFp8WeightBlock + 1) * kFp8WeightBlock);
        gemm_detail::scale_by_k_blocks(a, M, K, scales.of_row(b0), scaled.data());
        kernel(scaled.data(), M, K, codes, nullptr, b0, b1, c, N);
      }
    }
  }
  if (epilogue.bias != nullptr || epilogue.activation != Activation::None) {
    gemm_detail::apply_epilogue_only(c32, M, N, 1.0f, epilogue);
  }
  if (C.dtype() != DType::F32) C.copy_from(c32.to(C.dtype()));
}

}  // namespace octet
