// Writes the seed inputs of the fuzz targets that octet itself produces (safetensors files, a
// checkpoint, token shards), and small IDX image and label pairs, into tests/fuzz/corpus/<target>/.
// Run once by hand after a format change: build-fuzz/tests/fuzz/fuzz_make_seeds; the files are
// committed.
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "octet/data.h"
#include "octet/safetensors.h"

namespace {

namespace fs = std::filesystem;
using namespace octet;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string safetensors_bytes(const TensorMap& tensors, const Metadata& metadata) {
  const fs::path temp = fs::temp_directory_path() / "octet-seed.safetensors";
  save_safetensors(temp.string(), tensors, metadata);
  std::string bytes = read_bytes(temp);
  fs::remove(temp);
  return bytes;
}

TensorMap small_tensors() {
  TensorMap tensors;
  tensors["a.f32"] = Tensor::from_floats({2, 3}, {1, -2, 3.5f, 4, 5, 6});
  tensors["b.bf16"] = Tensor::from_floats({3}, {0.5f, -1.25f, 3.0f}).to(DType::BF16);
  tensors["c.e4m3"] = Tensor::from_floats({2, 2}, {1, 2, 448, -0.5f}).to(DType::E4M3);
  Tensor ids = Tensor::empty({2}, DType::I64);
  ids.data<int64_t>()[0] = 7;
  ids.data<int64_t>()[1] = -1;
  tensors["d.i64"] = ids;
  tensors["e.empty"] = Tensor::empty({0, 5}, DType::F32);
  return tensors;
}

// An IDX file: big-endian magic and dimensions, then the uint8 data.
std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& shape,
                      const std::vector<uint8_t>& data) {
  std::string bytes;
  auto put = [&](uint32_t word) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes += static_cast<char>((word >> shift) & 0xFF);
  };
  put(magic);
  for (uint32_t size : shape) put(size);
  bytes.append(data.begin(), data.end());
  return bytes;
}

std::string gzip_bytes(const std::string& bytes) {
  const fs::path temp = fs::temp_directory_path() / "octet-seed.gz";
  gzFile file = gzopen(temp.c_str(), "wb");
  gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
  std::string compressed = read_bytes(temp);
  fs::remove(temp);
  return compressed;
}

// A fuzz_idx input: the images file's length in one byte, the images file, the labels file.
std::string idx_pair(const std::string& images, const std::string& labels) {
  return std::string(1, static_cast<char>(images.size())) + images + labels;
}

}  // namespace

int main() {
  const fs::path corpus = fs::path(OCTET_SOURCE_DIR) / "tests/fuzz/corpus";
  write_bytes(corpus / "safetensors/small.safetensors",
              safetensors_bytes(small_tensors(), {{"format", "pt"}, {"step", "3"}}));
  write_bytes(corpus / "safetensors/empty.safetensors", safetensors_bytes({}, {}));

  // A checkpoint as fuzz_checkpoint splits it: trainer.json, model, optimizer.
  const std::string separator = "\n--octet-checkpoint-part--\n";
  TensorMap model;
  model["wte"] = Tensor::from_floats({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  model["ln.weight"] = Tensor::from_floats({2}, {1, 1});
  TensorMap optimizer;
  optimizer["wte.exp_avg"] = Tensor::from_floats({4, 2}, {0, 0, 0, 0, 0, 0, 0, 0});
  optimizer["wte.exp_avg_sq"] = Tensor::from_floats({4, 2}, {0, 0, 0, 0, 0, 0, 0, 0});
  const std::string model_bytes = safetensors_bytes(model, {});
  const std::string optimizer_bytes = safetensors_bytes(optimizer, {});
  write_bytes(corpus / "checkpoint/whole",
              R"({"step": 10, "config": {"name": "gpt-tiny"}, "rng": [1, 2]})" + separator +
                  model_bytes + separator + optimizer_bytes);
  write_bytes(corpus / "checkpoint/sharded",
              R"({"step": 1, "shards": {"model": ["model.safetensors"], )"
              R"("optimizer": ["optimizer.safetensors", "model.safetensors"]}, )"
              R"("layout": {"tensor": 1, "pipeline": 2, "data": 1}})" +
                  separator + model_bytes + separator + optimizer_bytes);

  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 24; ++i) ids.push_back((i * 7919 + 13) % 50257);
  const fs::path temp = fs::temp_directory_path() / "octet-seed.bin";
  write_token_shard(temp.string(), ids, 50257);
  write_bytes(corpus / "token_shard/gpt2.bin", read_bytes(temp));
  write_token_shard(temp.string(), ids, 100277);  // 4-byte ids
  write_bytes(corpus / "token_shard/wide.bin", read_bytes(temp));
  write_token_shard(temp.string(), {}, 16);
  write_bytes(corpus / "token_shard/empty.bin", read_bytes(temp));
  fs::remove(temp);

  std::vector<uint8_t> pixels(3 * 4 * 5);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 37 + 11);
  write_bytes(corpus / "idx/three_4x5",
              idx_pair(idx_bytes(0x803, {3, 4, 5}, pixels), idx_bytes(0x801, {3}, {9, 0, 4})));
  write_bytes(corpus / "idx/one_1x1",
              idx_pair(idx_bytes(0x803, {1, 1, 1}, {200}), idx_bytes(0x801, {1}, {0})));
  pixels.resize(2 * 3 * 3);
  write_bytes(corpus / "idx/two_3x3_gzip", idx_pair(gzip_bytes(idx_bytes(0x803, {2, 3, 3}, pixels)),
                                                    gzip_bytes(idx_bytes(0x801, {2}, {1, 8}))));
  std::printf("seeds written under %s\n", corpus.c_str());
  return 0;
}
