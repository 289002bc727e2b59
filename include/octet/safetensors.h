// safetensors files: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes. Used for checkpoints and for
// exchanging tensors with the PyTorch reference in tests.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "octet/tensor.h"

namespace octet {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

// Writes to `path + ".tmp"` then renames, so an existing file is never half-overwritten.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});
// Validates the file against the format's limits and throws octet::Error naming the file and
// what was expected: an 8-byte header length of at most 100 MiB inside the file; a header that
// is a JSON object of objects (each tensor's dtype, shape and data_offsets [begin, end], and an
// optional "__metadata__" of strings); shape extents whose product fits the data section;
// end - begin = dtype bytes x elements; and byte ranges that, in order of offset, tile the data
// section from 0 to its end without holes or overlaps.
TensorMap load_safetensors(const std::string& path, Metadata* metadata = nullptr);
// The same for a whole file already in memory (`bytes`: header length, header, data);
// `source_name` stands for the file in error messages.
TensorMap parse_safetensors(std::span<const uint8_t> bytes, const std::string& source_name,
                            Metadata* metadata = nullptr);

std::string_view safetensors_dtype_name(DType dtype);  // "F32", "BF16", "F8_E4M3", ...

}  // namespace octet
