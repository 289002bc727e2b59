// Runs the PyTorch 1.13 reference (tests/reference/torch_ref.py) live, on the same inputs.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "octet/safetensors.h"

namespace octet::testing {

inline std::string temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "octet-test-XXXXXX").string();
  OCTET_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary directory");
  return pattern;
}

// Writes `inputs`, runs `torch_ref.py op`, returns its outputs. Fails loudly (no skip) when
// python or torch is missing: scripts/setup.sh installs them.
inline TensorMap run_torch(const std::string& op, const TensorMap& inputs,
                           const std::string& args_json = "{}") {
  std::string dir = temp_dir();
  std::string in = dir + "/in.safetensors";
  std::string out = dir + "/out.safetensors";
  save_safetensors(in, inputs);
  std::string command = "/usr/bin/python3 " OCTET_SOURCE_DIR "/tests/reference/torch_ref.py " + op +
                        " " + in + " " + out + " '" + args_json + "'";
  int status = std::system(command.c_str());
  OCTET_CHECK(status == 0, "PyTorch reference failed (exit ", status, "): ", command);
  TensorMap outputs = load_safetensors(out);
  std::filesystem::remove_all(dir);
  return outputs;
}

}  // namespace octet::testing
