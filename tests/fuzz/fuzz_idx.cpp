// libFuzzer target: ImageDataset::load_idx on an images file and a labels file made from the
// input. Its first byte is the images file's length; the images file is the next that many
// bytes (fewer if the input ends first) and the labels file the rest. Both are written into a
// per-process directory under /dev/shm (or /tmp) because load_idx reads paths through zlib,
// which also inflates either file when it is gzip. Every input must give a dataset whose
// sizes agree, or an octet::Error.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "octet/data.h"
#include "octet/error.h"

namespace {

std::filesystem::path g_dir;

void remove_dir() {
  std::error_code error;
  std::filesystem::remove_all(g_dir, error);
}

void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
  g_dir = std::filesystem::path(base) / ("octet-fuzz-idx-" + std::to_string(::getpid()));
  std::filesystem::create_directories(g_dir);
  std::atexit(remove_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t images_bytes = std::min<size_t>(data[0], size - 1);
  write_file(g_dir / "images", data + 1, images_bytes);
  write_file(g_dir / "labels", data + 1 + images_bytes, size - 1 - images_bytes);
  try {
    const octet::ImageDataset dataset =
        octet::ImageDataset::load_idx((g_dir / "images").string(), (g_dir / "labels").string(), 10);
    const bool consistent =
        dataset.count > 0 && dataset.num_classes == 10 &&
        dataset.pixels.size() == static_cast<size_t>(dataset.count * dataset.rows * dataset.cols) &&
        dataset.labels.size() == static_cast<size_t>(dataset.count) &&
        std::all_of(dataset.labels.begin(), dataset.labels.end(),
                    [](uint8_t label) { return label < 10; });
    if (!consistent) __builtin_trap();
  } catch (const octet::Error&) {
  }
  return 0;
}
