// Cache-blocked out-of-place transpose used by the quantizers and Float8Tensor.
#pragma once

#include <algorithm>
#include <cstdint>

namespace octet::detail {

// in [rows, cols] -> out [cols, rows], any trivially copyable element.
template <typename T>
void transpose_matrix(const T* in, int64_t rows, int64_t cols, T* out) {
  constexpr int64_t kTile = 32;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < row_tiles; ++tile) {
    const int64_t r0 = tile * kTile;
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) out[c * rows + r] = in[r * cols + c];
      }
    }
  }
}

}  // namespace octet::detail
