// libFuzzer target: load_checkpoint on a directory made from the input. The input is split at
// each kPartSeparator line into trainer.json, model.safetensors and optimizer.safetensors (a
// part left out is a missing file), written into a per-process directory under /dev/shm (or
// /tmp), then loaded as `octet train --resume` loads it. The files are real because
// load_checkpoint's own checks are on the directory (missing files, shard names in
// trainer.json naming other files); the safetensors parser is fuzzed from memory on its own.
// Every input must give a checkpoint or an octet::Error.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "octet/train.h"

namespace {

constexpr std::string_view kPartSeparator = "\n--octet-checkpoint-part--\n";
constexpr const char* kPartNames[] = {"trainer.json", "model.safetensors", "optimizer.safetensors"};

std::filesystem::path g_dir;

void remove_dir() {
  std::error_code error;
  std::filesystem::remove_all(g_dir, error);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
  g_dir = std::filesystem::path(base) / ("octet-fuzz-checkpoint-" + std::to_string(::getpid()));
  std::filesystem::create_directories(g_dir);
  std::atexit(remove_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  for (const char* name : kPartNames) {
    std::filesystem::remove(g_dir / name);
    if (input.data() == nullptr) continue;  // no part left
    size_t end = input.find(kPartSeparator);
    std::ofstream(g_dir / name, std::ios::binary)
        .write(input.data(), static_cast<std::streamsize>(std::min(end, input.size())));
    input = end == std::string_view::npos ? std::string_view()
                                          : input.substr(end + kPartSeparator.size());
  }
  try {
    octet::Checkpoint checkpoint = octet::load_checkpoint(g_dir.string());
    if (!checkpoint.trainer.is_object()) __builtin_trap();
  } catch (const octet::Error&) {
  }
  return 0;
}
