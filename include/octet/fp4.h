// FP4 (E2M1) block-scaled tensors, TransformerEngine's NVFP4BlockScaling semantics and OCP
// MXFP4, plus the 16-point random Hadamard transform NVFP4 applies to the operands of the
// weight-gradient GEMM.
//
// NVFP4: one E4M3 scale per block of 16 (1x16, or 16x16 for weights) and one FP32 scale per
// tensor. With A = amax of the tensor, global_encode = 448 * 6 / A (1 when A = 0). A block
// with amax a gets the E4M3 code s = e4m3(a / 6 * global_encode) and its elements the E2M1
// codes of x * global_encode / s; real value = e2m1 * s * global_scale_inv, global_scale_inv
// = 1 / global_encode.
// MXFP4: one E8M0 scale per 1x32 block, 2^e = the smallest power of two >= a / 6 (as octet's
// MXFP8); real value = e2m1 * 2^e (global_scale_inv = 1).
// In both, e2m1 * block scale is exact in BF16 (at most 2 + 4 significant bits), so a GEMM of
// the widened operands with FP32 accumulation, times the two global scales, gives the numbers
// of a native FP4 GEMM.
#pragma once

#include <cstdint>
#include <string>

#include "octet/tensor.h"

namespace octet {

enum class Fp4Recipe { NVFP4, MXFP4 };
const char* fp4_recipe_name(Fp4Recipe recipe);  // "nvfp4", "mxfp4"
Fp4Recipe parse_fp4_recipe(const std::string& name);

struct Fp4Options {
  Fp4Recipe recipe = Fp4Recipe::NVFP4;
  bool block_2d = false;    // NVFP4 only: 16x16 blocks (weights) instead of 1x16
  bool stochastic = false;  // stochastic rounding (gradients), from philox(seed, offset)
  uint64_t seed = 0;
  uint64_t offset = 0;  // element i of the flattened tensor uses philox_uniform(seed, offset, i)
};

// A quantized matrix [rows, cols] (leading dimensions flattened into rows).
struct Float4Tensor {
  Fp4Recipe recipe = Fp4Recipe::NVFP4;
  int64_t rows = 0;
  int64_t cols = 0;
  int block_rows = 1;
  int block_cols = 16;
  // U8 [rows, ceil(cols / 2)]: element 2j of a row in the low nibble, 2j + 1 in the high one
  // (a last odd element leaves the high nibble 0).
  Tensor data;
  // U8 [ceil(rows / block_rows), ceil(cols / block_cols)]: E4M3 codes (NVFP4), E8M0 (MXFP4).
  Tensor scale;
  float global_scale_inv = 1.0f;
  float amax = 0.0f;  // max |x| of the input (NaN if any element was NaN)

  uint8_t code(int64_t r, int64_t c) const;       // the E2M1 code of element (r, c)
  float block_scale(int64_t r, int64_t c) const;  // the decoded scale of its block
  Tensor dequantize() const;  // F32 [rows, cols]: e2m1 * block scale * global_scale_inv
  Tensor widen_bf16() const;  // BF16 [rows, cols]: e2m1 * block scale, exact
};

// fp4_autocast: while a scope with enabled = true is innermost on this thread, the Linear
// layers run their GEMMs in FP4 (inputs 1x16 / 1x32, weights 16x16 under NVFP4, output
// gradients with stochastic rounding, the weight gradient's operands through the random
// Hadamard transform under NVFP4), as TransformerEngine's NVFP4BlockScaling recipe does.
class fp4_autocast {
 public:
  fp4_autocast(bool enabled, Fp4Options options = {});
  ~fp4_autocast();
  fp4_autocast(const fp4_autocast&) = delete;
  fp4_autocast& operator=(const fp4_autocast&) = delete;
};
bool fp4_enabled();
const Fp4Options& fp4_options();  // the innermost scope's (defaults outside any)

// x [*, cols] F32|BF16, at least one element; 2-D blocks need NVFP4.
Float4Tensor quantize_fp4(const Tensor& x, const Fp4Options& options);

// The random Hadamard transform along the last dimension, in blocks of 16 (cols % 16 == 0):
// each block x becomes x * diag(signs) * H16 / 4, H16 the Sylvester Hadamard matrix and the
// signs +-1 from philox(seed) (the same 16 for every block). It is orthogonal, so applied to
// both operands of a GEMM along K it leaves the product unchanged while spreading outliers
// over their block; inverse = true undoes it. F32|BF16 in, F32 out.
Tensor random_hadamard_transform(const Tensor& x, uint64_t seed, bool inverse = false);

}  // namespace octet
