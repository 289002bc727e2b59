// The lane sums of 16 vectors of 16 floats, in order, into one vector: a transposing tree of
// two-source shuffles (15 adds and 30 shuffles, against 16 halving trees of 4 shuffles and 4
// adds each). Shared by the decode attention's scores and the FP8 decode GEMM's columns;
// inlined into their AVX-512 functions. (Pointers in and out: clang refuses 64-byte vectors
// passed by value into a function compiled for AVX-512 from one that is not.)
#pragma once

// The 64-byte vectors never cross a call boundary (always inlined), so the ABI note GCC
// prints for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace octet {

template <typename V>  // a GCC vector of 16 floats
inline __attribute__((always_inline)) void lane_sums16(const V* v, V* sums) {
  V l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {  // [row 2i: 8 partial sums | row 2i+1: 8]
    const V a = v[2 * i], b = v[2 * i + 1];
    l1[i] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i+3: 4 partial sums each
    const V a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
        __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // rows 8i .. 8i+7: 2 partial sums each
    const V a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] =
        __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
        __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  *sums = __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                  28, 30) +
          __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                  29, 31);
}

}  // namespace octet
