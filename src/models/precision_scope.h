// A model step's precision. Outside FP8 and FP4 for a scope's lifetime: the GEMMs
// TransformerEngine's recipes keep in high precision (embeddings, heads) and Megatron's
// --first-last-layers-bf16 layers.
#pragma once

#include <optional>

#include "octet/fp4.h"
#include "octet/recipe.h"
#include "octet/tensor.h"

namespace octet::models_detail {

// With `plain` (the default) FP8 and FP4 autocast are off until the scope ends; else nothing
// changes.
struct HighPrecisionScope {
  explicit HighPrecisionScope(bool plain = true) {
    if (plain) {
      fp8.emplace(false);
      fp4.emplace(false);
    }
  }
  std::optional<fp8_autocast> fp8;
  std::optional<fp4_autocast> fp4;
};

// x in `dtype` (itself when it already is): a model's activations between F32 and the step's
// compute dtype.
inline Tensor to_dtype(const Tensor& x, DType dtype) {
  return x.dtype() == dtype ? x : x.to(dtype);
}

}  // namespace octet::models_detail
