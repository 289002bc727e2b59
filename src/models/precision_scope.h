// Outside FP8 and FP4 for a scope's lifetime: the GEMMs TransformerEngine's recipes keep in
// high precision (embeddings, heads) and Megatron's --first-last-layers-bf16 layers.
#pragma once

#include <optional>

#include "octet/fp4.h"
#include "octet/recipe.h"

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

}  // namespace octet::models_detail
