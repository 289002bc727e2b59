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
// out[c] += sum_r x[r, c]; x F32 or BF16, out F32.
void add_column_sums(const Tensor& x, Tensor& out);
// target += source (both F32, same size).
void add_into(const Tensor& source, Tensor& target);
// The FP8 tensor with its rowwise copy dropped: what backward needs, in half the bytes.
Float8Tensor columnwise_only(Float8Tensor x);

}  // namespace octet::modules_detail
