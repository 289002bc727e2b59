// safetensors files: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes. Used for checkpoints and for
// exchanging tensors with the PyTorch reference in tests.
#pragma once

#include <map>
#include <string>

#include "octet/tensor.h"

namespace octet {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

// Writes to `path + ".tmp"` then renames, so an existing file is never half-overwritten.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});
// Validates the header (size, JSON, dtypes, shapes, byte ranges inside the file, no overlap)
// and throws octet::Error naming the file and what was wrong.
TensorMap load_safetensors(const std::string& path, Metadata* metadata = nullptr);

std::string_view safetensors_dtype_name(DType dtype);  // "F32", "BF16", "F8_E4M3", ...

}  // namespace octet
