// Bulk conversions between F32 and the 16-bit float formats, dispatched on active_isa().
// Each is an exact port of the scalar conversion in dtype.h (round to nearest even, NaN kept).
#pragma once

#include <cstddef>

#include "octet/dtype.h"

namespace octet {

void convert_f32_to_bf16(const float* in, bfloat16* out, size_t n);
void convert_bf16_to_f32(const bfloat16* in, float* out, size_t n);
void convert_f32_to_f16(const float* in, float16* out, size_t n);
void convert_f16_to_f32(const float16* in, float* out, size_t n);
// x[i] = the BF16 value nearest x[i] (ties to even), kept in F32: bf16_to_f32(f32_to_bf16(x)).
void round_f32_to_bf16(float* x, size_t n);

}  // namespace octet
