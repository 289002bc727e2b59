// The FP8 output an operator can write in the same pass as its result, so the GEMM that
// follows reads FP8 without a separate cast (TransformerEngine's fused cast).
#pragma once

#include <cstdint>

#include "octet/dtype.h"

namespace octet::ops {

// Per-tensor: codes = fp8(y * scale), saturating; the kernel writes amax = max |y|
// (NaN if any y is NaN, so delayed scaling keeps its previous scale).
struct Fp8Store {
  DType format = DType::E4M3;
  float scale = 1.0f;
  uint8_t* codes = nullptr;  // as many elements as y
  float amax = 0.0f;
};

}  // namespace octet::ops
