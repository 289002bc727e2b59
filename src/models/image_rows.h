// What the image models (ViT, CLIP) share: images cut into patch rows, and rows taken out of a
// token matrix and put back (the class tokens, a caption's [EOS] token).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "octet/tensor.h"

namespace octet::models_detail {

// pixels [B, C*S*S] F32 (channel-major images) -> patches [B*N, C*P*P] F32, N = (S/P)^2:
// patch (py, px) holds pixel (ch, py*P + i, px*P + j) at ch*P*P + i*P + j (a convolution's
// weight layout [hidden, C, P, P], flattened).
inline Tensor image_patches(const Tensor& pixels, int64_t channels, int64_t image_size,
                            int64_t patch_size) {
  const int64_t B = pixels.dim(0), P = patch_size, S = image_size, per_row = S / P;
  const int64_t N = per_row * per_row, D = channels * P * P;
  Tensor patches = Tensor::empty({B * N, D}, DType::F32);
  const float* image = pixels.data<float>();
  float* out = patches.data<float>();
#pragma omp parallel for
  for (int64_t bn = 0; bn < B * N; ++bn) {
    const int64_t b = bn / N, n = bn % N, py = n / per_row, px = n % per_row;
    float* row = out + bn * D;
    for (int64_t ch = 0; ch < channels; ++ch) {
      const float* plane = image + (b * channels + ch) * S * S;
      for (int64_t i = 0; i < P; ++i) {
        std::memcpy(row + (ch * P + i) * P, plane + (py * P + i) * S + px * P,
                    static_cast<size_t>(P) * sizeof(float));
      }
    }
  }
  return patches;
}

// The given rows of x [N, C] (any dtype) -> [rows.size(), C]; and the adjoint: y's rows into
// those rows of a zeroed [total, C].
inline Tensor take_rows(const Tensor& x, const std::vector<int64_t>& rows) {
  const int64_t C = x.dim(-1);
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(x.dtype());
  Tensor out = Tensor::empty({static_cast<int64_t>(rows.size()), C}, x.dtype());
  const auto* src = static_cast<const char*>(x.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
  }
  return out;
}

inline Tensor put_rows(const Tensor& y, int64_t total, const std::vector<int64_t>& rows) {
  const int64_t C = y.dim(-1);
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(y.dtype());
  Tensor out = Tensor::zeros({total, C}, y.dtype());
  const auto* src = static_cast<const char*>(y.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(dst + rows[i] * row_bytes, src + i * row_bytes, row_bytes);
  }
  return out;
}

// Rows first, first + stride, ... (count of them).
inline std::vector<int64_t> strided_rows(int64_t first, int64_t stride, int64_t count) {
  std::vector<int64_t> rows(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) rows[static_cast<size_t>(i)] = first + i * stride;
  return rows;
}

// Token rows [B*T, C] F32, T = N + 1: row (b, 0) = cls [1, C] + pos[0], row (b, t) = patch row
// (b, t-1) of patch_rows [B*N, C] F32 + pos[t] (pos [T, C] F32).
inline Tensor class_and_patches(const Tensor& patch_rows, const Tensor& cls, const Tensor& pos,
                                int64_t batch) {
  const int64_t C = patch_rows.dim(1), N = patch_rows.dim(0) / batch, T = N + 1;
  Tensor x = Tensor::empty({batch * T, C}, DType::F32);
  const float* c = cls.data<float>();
  const float* p = pos.data<float>();
  const float* rows = patch_rows.data<float>();
  float* xs = x.data<float>();
#pragma omp parallel for
  for (int64_t bt = 0; bt < batch * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    const float* from = t == 0 ? c : rows + (b * N + t - 1) * C;
    for (int64_t k = 0; k < C; ++k) xs[bt * C + k] = from[k] + p[t * C + k];
  }
  return x;
}

// Its backward: dx [B*T, C] F32 -> the patch rows' gradient [B*N, C] F32; the class token's and
// the positions' gradients added into dcls [1, C] and dpos [T, C].
inline Tensor class_and_patches_backward(const Tensor& dx, int64_t batch, Tensor& dcls,
                                         Tensor& dpos) {
  const int64_t C = dx.dim(1), T = dx.dim(0) / batch, N = T - 1;
  const float* d = dx.data<float>();
  float* dc = dcls.data<float>();
  float* dp = dpos.data<float>();
  Tensor dpatch = Tensor::empty({batch * N, C}, DType::F32);
  float* out = dpatch.data<float>();
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = d + (b * T + t) * C;
      for (int64_t k = 0; k < C; ++k) dp[t * C + k] += row[k];
      if (t == 0) {
        for (int64_t k = 0; k < C; ++k) dc[k] += row[k];
      } else {
        std::memcpy(out + (b * N + t - 1) * C, row, static_cast<size_t>(C) * sizeof(float));
      }
    }
  }
  return dpatch;
}

}  // namespace octet::models_detail
