// safetensors: round trip, corrupt files, and interchange with the Python reader.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "octet/safetensors.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::run_torch;
using octet::testing::temp_dir;

TensorMap sample_tensors() {
  TensorMap tensors;
  tensors["a.f32"] = Tensor::from_floats({2, 3}, {1, -2, 3.5f, 4, 5, 6});
  tensors["b.bf16"] = Tensor::from_floats({3}, {0.5f, -1.25f, 3.0f}).to(DType::BF16);
  Tensor ids = Tensor::empty({4}, DType::I64);
  for (int i = 0; i < 4; ++i) ids.data<int64_t>()[i] = int64_t{1} << (10 * i);
  tensors["c.i64"] = ids;
  tensors["d.e4m3"] = Tensor::from_floats({2, 2}, {1, 2, 448, -0.5f}).to(DType::E4M3);
  tensors["empty"] = Tensor::empty({0, 5}, DType::F32);
  return tensors;
}

void expect_same(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    const Tensor& other = b.at(name);
    EXPECT_EQ(tensor.dtype(), other.dtype()) << name;
    EXPECT_EQ(tensor.shape(), other.shape()) << name;
    EXPECT_EQ(0, std::memcmp(tensor.raw(), other.raw(), tensor.nbytes())) << name;
  }
}

std::string write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string message_of(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripWithMetadataAndNoTempLeft) {
  std::string dir = temp_dir();
  std::string path = dir + "/x.safetensors";
  save_safetensors(path, sample_tensors(), {{"step", "12"}});
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  Metadata metadata;
  TensorMap loaded = load_safetensors(path, &metadata);
  expect_same(sample_tensors(), loaded);
  EXPECT_EQ(metadata.at("step"), "12");
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, CorruptFilesGetClearErrors) {
  std::string dir = temp_dir();
  std::string good = dir + "/good.safetensors";
  save_safetensors(good, sample_tensors());
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  EXPECT_NE(message_of(dir + "/missing").find("cannot open"), std::string::npos);
  EXPECT_NE(message_of(write_bytes(dir + "/short", "abc")).find("at least 8 bytes"),
            std::string::npos);
  EXPECT_NE(message_of(write_bytes(dir + "/truncated", bytes.substr(0, bytes.size() - 3)))
                .find("outside the data section"),
            std::string::npos);
  std::string huge = bytes;
  huge[6] = 1;  // header length far past the end of the file
  EXPECT_NE(message_of(write_bytes(dir + "/huge", huge)).find("does not fit"), std::string::npos);
  std::string garbage = bytes;
  garbage[8] = '#';
  EXPECT_NE(message_of(write_bytes(dir + "/garbage", garbage)).find("not a JSON object"),
            std::string::npos);
  std::string dtype = bytes;
  size_t at = dtype.find("\"F32\"");
  dtype.replace(at, 5, "\"Q32\"");
  EXPECT_NE(message_of(write_bytes(dir + "/dtype", dtype)).find("unsupported dtype 'Q32'"),
            std::string::npos);
  std::string shape = bytes;
  at = shape.find("[2,3]");
  shape.replace(at, 5, "[3,3]");
  EXPECT_NE(message_of(write_bytes(dir + "/shape", shape)).find("needs 36 bytes"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

// A file of one header (JSON text, padded as the writer does) and `data_bytes` zero bytes.
std::string file_of(std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(uint64_t{header.size()} >> (8 * i));
  return bytes + header + std::string(data_bytes, '\0');
}

std::string parse_message(const std::string& bytes) {
  try {
    parse_safetensors({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, "mem");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, ParsesFromMemoryAsFromTheFile) {
  std::string dir = temp_dir();
  std::string path = dir + "/x.safetensors";
  save_safetensors(path, sample_tensors(), {{"step", "12"}});
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Metadata metadata;
  TensorMap parsed = parse_safetensors(
      {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, path, &metadata);
  expect_same(sample_tensors(), parsed);
  EXPECT_EQ(metadata.at("step"), "12");
  EXPECT_EQ(parse_message(file_of("{}", 0)), "");  // no tensors at all is a valid file
  std::filesystem::remove_all(dir);
}

// Each of the format's limits, one file breaking it; the valid neighbour parses.
TEST(Safetensors, FormatLimitsAreEnforced) {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  EXPECT_EQ(parse_message(file_of("{" + a + "}", 8)), "");
  // Header length past the 100 MiB cap (even if the file were that long).
  std::string capped = file_of("{}", 0);
  capped[3] = 0x07;  // 0x07000000 + ... bytes
  EXPECT_NE(parse_message(capped).find("at most 104857600"), std::string::npos);
  // A hole in the data section: the tensor starts past 0.
  EXPECT_NE(parse_message(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12))
                .find("bytes [0,4) of the data section belong to no tensor"),
            std::string::npos);
  // Trailing data no tensor claims.
  EXPECT_NE(parse_message(file_of("{" + a + "}", 12)).find("bytes [8,12) at the end"),
            std::string::npos);
  // Two tensors over the same bytes.
  const std::string b = R"("b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]})";
  EXPECT_NE(parse_message(file_of("{" + a + "," + b + "}", 12)).find("'a' and 'b' overlap"),
            std::string::npos);
  // Out of order in the header but tiling the data section is fine (offsets are sorted).
  const std::string c = R"("c":{"dtype":"U8","shape":[4],"data_offsets":[8,12]})";
  EXPECT_EQ(parse_message(file_of("{" + c + "," + a + "}", 12)), "");
  // An object of objects: a tensor entry that is not an object, metadata that is not one.
  EXPECT_NE(parse_message(file_of(R"({"a":[1,2]})", 0)).find("expected an object"),
            std::string::npos);
  EXPECT_NE(parse_message(file_of(R"({"__metadata__":3})", 0)).find("__metadata__ must be"),
            std::string::npos);
  EXPECT_NE(parse_message(file_of(R"({"__metadata__":{"k":1}})", 0)).find("must be a string"),
            std::string::npos);
  // Extents whose product wraps around 2^64 to a small byte count must not pass.
  EXPECT_NE(
      parse_message(
          file_of(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,1],"data_offsets":[0,0]}})",
                  0))
          .find("needs more bytes than the data section"),
      std::string::npos);
  // 2^62 F32 elements are 2^64 bytes = 0 after wrapping: rejected before multiplying.
  EXPECT_NE(
      parse_message(
          file_of(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0))
          .find("needs more bytes"),
      std::string::npos);
  // An extent past int64 would turn negative in the Shape.
  EXPECT_NE(
      parse_message(
          file_of(R"({"a":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}})",
                  0))
          .find("integers in [0, 2^63)"),
      std::string::npos);
  // Too short for the length field.
  EXPECT_NE(parse_message("1234567").find("at least 8 bytes"), std::string::npos);
}

TEST(Safetensors, DirectoryIsNotAFile) {
  std::string dir = temp_dir();
  EXPECT_NE(message_of(dir).find("not a regular file"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, PythonReaderAgrees) {
  TensorMap inputs;
  inputs["x"] = Tensor::from_floats({2, 2}, {1.5f, -2, 0.25f, 7});
  inputs["y"] = Tensor::from_floats({3}, {1, 2.5f, -3}).to(DType::BF16);
  TensorMap outputs = run_torch("echo", inputs);
  EXPECT_EQ(outputs.at("x").to_floats(), (std::vector<float>{3, -4, 0.5f, 14}));
  EXPECT_EQ(outputs.at("y").to_floats(), (std::vector<float>{2, 5, -6}));
  EXPECT_EQ(outputs.at("y").shape(), (Shape{3}));
}

}  // namespace
}  // namespace octet
