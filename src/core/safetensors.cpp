// safetensors reader and writer (the format of Hugging Face's safetensors library).
#include "octet/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

namespace octet {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;

DType parse_safetensors_dtype(const std::string& name, const std::string& where) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::E5M2, DType::I32,
                      DType::I64, DType::U8}) {
    if (safetensors_dtype_name(dtype) == name) return dtype;
  }
  fail(detail::concat(where, ": unsupported dtype '", name,
                      "', expected F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64 or U8"));
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::E4M3:
      return "F8_E4M3";
    case DType::E5M2:
      return "F8_E5M2";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
  }
  return "?";
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    OCTET_CHECK(tensor.defined(), "save_safetensors: tensor '", name, "' is undefined");
    header[name] = {{"dtype", safetensors_dtype_name(tensor.dtype())},
                    {"shape", tensor.shape()},
                    {"data_offsets", {offset, offset + tensor.nbytes()}}};
    offset += tensor.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes
  uint64_t header_bytes = text.size();

  std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    OCTET_CHECK(out.good(), "save_safetensors: cannot open '", temp, "' for writing");
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(header_bytes >> (8 * i));
    out.write(reinterpret_cast<const char*>(length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& [name, tensor] : tensors) {
      out.write(static_cast<const char*>(tensor.raw()),
                static_cast<std::streamsize>(tensor.nbytes()));
    }
    out.flush();
    OCTET_CHECK(out.good(), "save_safetensors: write to '", temp, "' failed (disk full?)");
  }
  OCTET_CHECK(std::rename(temp.c_str(), path.c_str()) == 0, "save_safetensors: rename '", temp,
              "' to '", path, "' failed");
}

TensorMap load_safetensors(const std::string& path, Metadata* metadata) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  OCTET_CHECK(in.good(), "load_safetensors: cannot open '", path, "'");
  uint64_t file_bytes = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  OCTET_CHECK(file_bytes >= 8, "'", path,
              "' is not a safetensors file: expected at least 8 bytes, got ", file_bytes);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{length[i]} << (8 * i);
  OCTET_CHECK(header_bytes <= kMaxHeaderBytes && 8 + header_bytes <= file_bytes, "'", path,
              "': header length ", header_bytes, " does not fit the file of ", file_bytes,
              " bytes (corrupt or truncated)");
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  nlohmann::json header = nlohmann::json::parse(text, nullptr, false);
  OCTET_CHECK(!header.is_discarded() && header.is_object(), "'", path,
              "': header is not a JSON object (corrupt file)");
  uint64_t data_bytes = file_bytes - 8 - header_bytes;

  TensorMap tensors;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (metadata) {
        OCTET_CHECK(entry.is_object(), "'", path, "': __metadata__ must be an object");
        for (const auto& [key, value] : entry.items()) {
          OCTET_CHECK(value.is_string(), "'", path, "': metadata '", key, "' must be a string");
          (*metadata)[key] = value.get<std::string>();
        }
      }
      continue;
    }
    std::string where = detail::concat("'", path, "' tensor '", name, "'");
    OCTET_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets"),
                where, ": expected dtype, shape and data_offsets");
    OCTET_CHECK(entry["dtype"].is_string(), where, ": dtype must be a string");
    DType dtype = parse_safetensors_dtype(entry["dtype"].get<std::string>(), where);
    Shape shape;
    OCTET_CHECK(entry["shape"].is_array(), where, ": shape must be an array");
    for (const auto& extent : entry["shape"]) {
      OCTET_CHECK(extent.is_number_unsigned(), where, ": shape entries must be non-negative");
      shape.push_back(extent.get<int64_t>());
    }
    const auto& offsets = entry["data_offsets"];
    OCTET_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                where, ": data_offsets must be [begin, end]");
    uint64_t begin = offsets[0].get<uint64_t>();
    uint64_t end = offsets[1].get<uint64_t>();
    uint64_t expected = static_cast<uint64_t>(shape_numel(shape)) * dtype_bytes(dtype);
    OCTET_CHECK(begin <= end && end <= data_bytes, where, ": bytes [", begin, ",", end,
                ") lie outside the data section of ", data_bytes, " bytes (truncated file?)");
    OCTET_CHECK(end - begin == expected, where, ": shape ", shape_str(shape), " of ",
                safetensors_dtype_name(dtype), " needs ", expected, " bytes, header gives ",
                end - begin);
    ranges.emplace_back(begin, end);
    Tensor tensor = Tensor::empty(shape, dtype);
    in.seekg(static_cast<std::streamoff>(8 + header_bytes + begin));
    in.read(static_cast<char*>(tensor.raw()), static_cast<std::streamsize>(expected));
    OCTET_CHECK(in.good(), where, ": read failed");
    tensors.emplace(name, std::move(tensor));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    OCTET_CHECK(ranges[i].first >= ranges[i - 1].second, "'", path,
                "': tensors overlap in the data section (corrupt header)");
  }
  return tensors;
}

}  // namespace octet
