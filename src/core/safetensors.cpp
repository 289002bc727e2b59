// safetensors reader and writer (the format of Hugging Face's safetensors library).
#include "octet/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>
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

namespace {

// One tensor's entry in the header: where its bytes lie in the data section.
struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data section, [begin, end)
  uint64_t end = 0;
};

uint64_t header_length(const unsigned char* bytes) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{bytes[i]} << (8 * i);
  return length;
}

void check_header_length(uint64_t header_bytes, uint64_t file_bytes, const std::string& path) {
  OCTET_CHECK(file_bytes >= 8, "'", path,
              "' is not a safetensors file: expected at least 8 bytes, got ", file_bytes);
  OCTET_CHECK(header_bytes <= kMaxHeaderBytes && header_bytes <= file_bytes - 8, "'", path,
              "': header length ", header_bytes, " does not fit the file of ", file_bytes,
              " bytes (at most ", kMaxHeaderBytes, "; corrupt or truncated)");
}

// The shape of `entry`, its extents checked before multiplying: the elements must fit in
// `data_bytes` (so neither the product nor the byte count can overflow).
Shape parse_shape(const nlohmann::json& shape_json, DType dtype, uint64_t data_bytes,
                  const std::string& where) {
  OCTET_CHECK(shape_json.is_array(), where, ": shape must be an array, got ",
              shape_json.type_name());
  Shape shape;
  bool any_zero = false;
  for (const auto& extent : shape_json) {
    OCTET_CHECK(extent.is_number_unsigned() && extent.get<uint64_t>() <= uint64_t{INT64_MAX}, where,
                ": shape entries must be integers in [0, 2^63)");
    shape.push_back(extent.get<int64_t>());
    any_zero = any_zero || shape.back() == 0;
  }
  if (any_zero) return shape;
  const uint64_t max_elements = data_bytes / dtype_bytes(dtype);
  uint64_t elements = 1;
  for (int64_t extent : shape) {
    OCTET_CHECK(static_cast<uint64_t>(extent) <= max_elements / elements, where, ": shape ",
                shape_str(shape), " of ", safetensors_dtype_name(dtype),
                " needs more bytes than the data section's ", data_bytes);
    elements *= static_cast<uint64_t>(extent);
  }
  return shape;
}

// Parses and checks the JSON header against a data section of `data_bytes`.
std::vector<TensorEntry> parse_header(std::string_view text, uint64_t data_bytes,
                                      const std::string& path, Metadata* metadata) {
  nlohmann::json header = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  OCTET_CHECK(!header.is_discarded() && header.is_object(), "'", path,
              "': header is not a JSON object (corrupt file)");
  std::vector<TensorEntry> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      OCTET_CHECK(entry.is_object(), "'", path, "': __metadata__ must be an object, got ",
                  entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        OCTET_CHECK(value.is_string(), "'", path, "': metadata '", key, "' must be a string");
        if (metadata) (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    std::string where = detail::concat("'", path, "' tensor '", name, "'");
    OCTET_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets"),
                where, ": expected an object with dtype, shape and data_offsets, got ",
                entry.is_object() ? "an object missing some" : entry.type_name());
    OCTET_CHECK(entry["dtype"].is_string(), where, ": dtype must be a string");
    TensorEntry tensor;
    tensor.name = name;
    tensor.dtype = parse_safetensors_dtype(entry["dtype"].get<std::string>(), where);
    tensor.shape = parse_shape(entry["shape"], tensor.dtype, data_bytes, where);
    const auto& offsets = entry["data_offsets"];
    OCTET_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                where, ": data_offsets must be [begin, end]");
    tensor.begin = offsets[0].get<uint64_t>();
    tensor.end = offsets[1].get<uint64_t>();
    OCTET_CHECK(tensor.begin <= tensor.end && tensor.end <= data_bytes, where, ": bytes [",
                tensor.begin, ",", tensor.end, ") lie outside the data section of ", data_bytes,
                " bytes (truncated file?)");
    // parse_shape bounded the elements by data_bytes / dtype bytes: no overflow here.
    uint64_t expected =
        static_cast<uint64_t>(shape_numel(tensor.shape)) * dtype_bytes(tensor.dtype);
    OCTET_CHECK(tensor.end - tensor.begin == expected, where, ": shape ", shape_str(tensor.shape),
                " of ", safetensors_dtype_name(tensor.dtype), " needs ", expected,
                " bytes, header gives ", tensor.end - tensor.begin);
    entries.push_back(std::move(tensor));
  }
  // The format's rule: in order of offset, the tensors tile the data section exactly.
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& entry : entries) by_offset.push_back(&entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  uint64_t next = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* entry : by_offset) {
    OCTET_CHECK(entry->begin >= next, "'", path, "': tensors '", previous ? previous->name : "",
                "' and '", entry->name, "' overlap in the data section at byte ", entry->begin,
                " (corrupt header)");
    OCTET_CHECK(entry->begin == next, "'", path, "': bytes [", next, ",", entry->begin,
                ") of the data section belong to no tensor (expected tensor '", entry->name,
                "' to start at ", next, ")");
    next = entry->end;
    previous = entry;
  }
  OCTET_CHECK(next == data_bytes, "'", path, "': bytes [", next, ",", data_bytes,
              ") at the end of the data section belong to no tensor (trailing bytes)");
  return entries;
}

}  // namespace

TensorMap parse_safetensors(std::span<const uint8_t> bytes, const std::string& source_name,
                            Metadata* metadata) {
  const uint64_t file_bytes = bytes.size();
  OCTET_CHECK(file_bytes >= 8, "'", source_name,
              "' is not a safetensors file: expected at least 8 bytes, got ", file_bytes);
  const uint64_t header_bytes = header_length(bytes.data());
  check_header_length(header_bytes, file_bytes, source_name);
  std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, header_bytes);
  const uint8_t* data = bytes.data() + 8 + header_bytes;
  TensorMap tensors;
  for (const TensorEntry& entry :
       parse_header(text, file_bytes - 8 - header_bytes, source_name, metadata)) {
    Tensor tensor = Tensor::empty(entry.shape, entry.dtype);
    if (entry.end > entry.begin)
      std::memcpy(tensor.raw(), data + entry.begin, entry.end - entry.begin);
    tensors.emplace(entry.name, std::move(tensor));
  }
  return tensors;
}

TensorMap load_safetensors(const std::string& path, Metadata* metadata) {
  // A directory would open as a stream and read as garbage: only regular files are files here.
  namespace fs = std::filesystem;
  std::error_code error;  // a name too long, a denied directory: reported as not a file
  const fs::file_type type = fs::status(path, error).type();
  OCTET_CHECK(type == fs::file_type::regular, "load_safetensors: cannot open '", path,
              "': ", type == fs::file_type::not_found ? "no such file" : "not a regular file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  OCTET_CHECK(in.good(), "load_safetensors: cannot open '", path, "'");
  const uint64_t file_bytes = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  OCTET_CHECK(file_bytes >= 8, "'", path,
              "' is not a safetensors file: expected at least 8 bytes, got ", file_bytes);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  OCTET_CHECK(in.good(), "'", path, "': read failed");
  const uint64_t header_bytes = header_length(length);
  check_header_length(header_bytes, file_bytes, path);
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  OCTET_CHECK(in.good(), "'", path, "': read failed");
  // The tensors are read one by one from the file: a checkpoint is never held twice.
  TensorMap tensors;
  for (const TensorEntry& entry :
       parse_header(text, file_bytes - 8 - header_bytes, path, metadata)) {
    Tensor tensor = Tensor::empty(entry.shape, entry.dtype);
    in.seekg(static_cast<std::streamoff>(8 + header_bytes + entry.begin));
    in.read(static_cast<char*>(tensor.raw()),
            static_cast<std::streamsize>(entry.end - entry.begin));
    OCTET_CHECK(in.good(), "'", path, "' tensor '", entry.name, "': read failed");
    tensors.emplace(entry.name, std::move(tensor));
  }
  return tensors;
}

}  // namespace octet
