// Helpers shared by the module implementations.
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "octet/modules.h"

namespace octet::modules_detail {

// Normal(0, init_std) from a seeded generator (init_std 0 gives zeros); gradient zeroed.
Parameter make_parameter(std::string name, Shape shape, float init_std, uint64_t seed);
Parameter constant_parameter(std::string name, Shape shape, float value);
// The FP8 tensor with its rowwise copy dropped: what backward needs, in half the bytes.
Float8Tensor columnwise_only(Float8Tensor x);
// Whether a GEMM operand quantized by `quantizer` needs its columnwise copy. Per-tensor
// scaling does not: every GEMM reads the rowwise codes, transposed where it must (the
// scale is the same either way). Block scaling needs blocks along K, which the backward
// GEMMs find only in the transposed copy.
bool needs_columnwise(const Quantizer& quantizer);
// What the weight gradient needs of a quantized GEMM input: per-tensor, the rowwise codes;
// block scaling, the columnwise copy.
Float8Tensor kept_for_backward(Float8Tensor x);
// A quantizer giving x's codes again from the same source: x's own scale under per-tensor
// scaling (a delayed-scaling scale may have moved on since), else `quantizer` (block scales
// follow from the data). It records no amax.
Quantizer requantizer_for(const Float8Tensor& x, const Quantizer& quantizer);
// norm(x) quantized for GEMM 0 of `fp8` (begin_forward already called), x [..., hidden]:
// written as FP8 by the norm kernel when the scale is known before (delayed scaling), else
// normalized then quantized. Stats recorded as `name`.input under fp8_stats_scope.
Float8Tensor norm_to_fp8(Norm& norm, Fp8State& fp8, const Tensor& x, Norm::Context& ctx,
                         const std::string& name);

}  // namespace octet::modules_detail
