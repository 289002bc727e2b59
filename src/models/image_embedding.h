// The embedding every image model (ViT, CLIP, the captioner) starts with: patches embedded by one
// GEMM in high precision (the first GEMM stays out of FP8 / FP4), then the class token and the
// learned positions; and its backward.
#pragma once

#include <cstdint>

#include "models/image_rows.h"
#include "models/precision_scope.h"
#include "octet/modules.h"

namespace octet::models_detail {

// pixels [B, C*S*S] F32 -> [B*T, hidden] F32, T = patches + 1 (the class token first).
inline Tensor embed_images(const Tensor& pixels, int64_t channels, int64_t image_size,
                           int64_t patch_size, Linear& patch_embed, const Parameter& class_token,
                           const Parameter& positions, DType dtype, Linear::Context& patch_ctx) {
  const Tensor patches = image_patches(pixels, channels, image_size, patch_size);
  Tensor embedded;
  {
    HighPrecisionScope scope;
    embedded = patch_embed.forward(to_dtype(patches, dtype), patch_ctx);
  }
  return class_and_patches(to_dtype(embedded, DType::F32), class_token.value, positions.value,
                           pixels.dim(0));
}

// dx [B*T, hidden] F32 -> gradients added into the class token, the positions and the patch
// GEMM's weight.
inline void embed_images_backward(const Tensor& dx, int64_t batch, Linear& patch_embed,
                                  Parameter& class_token, Parameter& positions,
                                  Linear::Context& patch_ctx) {
  const Tensor dpatch = class_and_patches_backward(dx, batch, class_token.grad, positions.grad);
  HighPrecisionScope scope;
  patch_embed.backward(to_dtype(dpatch, patch_ctx.dtype), patch_ctx);
}

}  // namespace octet::models_detail
