// Runs the PyTorch 1.13 reference (tests/reference/torch_ref.py) live, on the same inputs.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "octet/safetensors.h"

namespace octet::testing {

inline std::string temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "octet-test-XXXXXX").string();
  OCTET_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary directory");
  return pattern;
}

// FNV-1a over a file's bytes, continuing from `hash`.
inline uint64_t hash_file(const std::string& path, uint64_t hash) {
  std::ifstream file(path, std::ios::binary);
  OCTET_CHECK(file.good(), "cannot read ", path);
  for (std::istreambuf_iterator<char> it(file), end; it != end; ++it) {
    hash = (hash ^ static_cast<unsigned char>(*it)) * 1099511628211ull;
  }
  return hash;
}

// Asks the reference server at OCTET_TORCH_SERVER (a Unix socket: `torch_ref.py --serve`, which
// scripts/test.sh starts once for the whole pass) to compute `op`. Its answer: "ok", or "error"
// and the traceback; nothing when no server is set or it cannot be reached (the caller then
// starts Python itself).
inline std::optional<std::string> ask_torch_server(const std::string& op, const std::string& in,
                                                   const std::string& out,
                                                   const std::string& args_json) {
  const char* path = std::getenv("OCTET_TORCH_SERVER");
  if (path == nullptr || *path == '\0') return std::nullopt;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (std::strlen(path) >= sizeof(address.sun_path)) return std::nullopt;
  std::strcpy(address.sun_path, path);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return std::nullopt;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return std::nullopt;
  }
  const std::string request = nlohmann::json::array({op, in, out, args_json}).dump() + "\n";
  bool sent = true;
  for (size_t done = 0; sent && done < request.size();) {
    // MSG_NOSIGNAL: a server gone away is an error return here, not a SIGPIPE ending the test.
    const ssize_t n = send(fd, request.data() + done, request.size() - done, MSG_NOSIGNAL);
    sent = n > 0;
    done += sent ? static_cast<size_t>(n) : 0;
  }
  std::string answer;
  char buffer[4096];
  for (ssize_t n; sent && (n = read(fd, buffer, sizeof(buffer))) > 0;) {
    answer.append(buffer, static_cast<size_t>(n));
    if (answer.back() == '\n') break;
  }
  close(fd);
  if (!sent || answer.empty()) return std::nullopt;  // the server went away: run it here
  if (answer.back() == '\n') answer.pop_back();
  return answer;
}

// Writes `inputs`, runs `torch_ref.py op` (through the reference server when one is set),
// returns its outputs. Fails loudly (no skip) when
// python or torch is missing: scripts/setup.sh installs them.
//
// With OCTET_TORCH_CACHE=DIR, the outputs are kept in DIR under a hash of the exact input
// bytes, the op, its arguments and the reference scripts, and a later call with the same
// bytes reads them instead of starting Python again (scripts/test.sh: the sanitizer pass
// reuses what the Release pass computed; any input that differs by one bit runs PyTorch).
inline TensorMap run_torch(const std::string& op, const TensorMap& inputs,
                           const std::string& args_json = "{}") {
  std::string dir = temp_dir();
  std::string in = dir + "/in.safetensors";
  std::string out = dir + "/out.safetensors";
  save_safetensors(in, inputs);
  const char* cache = std::getenv("OCTET_TORCH_CACHE");
  std::string cached;
  if (cache != nullptr && *cache != '\0') {
    uint64_t hash = 14695981039346656037ull;
    for (char c : op + '\n' + args_json + '\n') {
      hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    }
    for (const auto& entry :
         std::filesystem::directory_iterator(OCTET_SOURCE_DIR "/tests/reference")) {
      if (entry.path().extension() == ".py") hash = hash_file(entry.path().string(), hash);
    }
    hash = hash_file(in, hash);
    std::filesystem::create_directories(cache);
    char name[32];
    std::snprintf(name, sizeof(name), "/%016llx.safetensors",
                  static_cast<unsigned long long>(hash));
    cached = std::string(cache) + name;
    if (std::filesystem::exists(cached)) {
      std::filesystem::remove_all(dir);
      return load_safetensors(cached);
    }
  }
  if (const std::optional<std::string> answer = ask_torch_server(op, in, out, args_json)) {
    OCTET_CHECK(*answer == "ok", "PyTorch reference '", op,
                "' failed in the reference server: ", *answer);
  } else {
    std::string command = "/usr/bin/python3 " OCTET_SOURCE_DIR "/tests/reference/torch_ref.py " +
                          op + " " + in + " " + out + " '" + args_json + "'";
    int status = std::system(command.c_str());
    OCTET_CHECK(status == 0, "PyTorch reference failed (exit ", status, "): ", command);
  }
  TensorMap outputs = load_safetensors(out);
  if (!cached.empty()) {
    // Another test process may write the same entry: copy under a private name, then rename.
    std::string temp = cached + "." + std::to_string(getpid()) + ".tmp";
    std::filesystem::copy_file(out, temp, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(temp, cached);
  }
  std::filesystem::remove_all(dir);
  return outputs;
}

}  // namespace octet::testing
