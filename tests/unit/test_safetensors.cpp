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
