// Output-path preflight and file digests (OpenSSL's SHA-256).
#include "octet/files.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "octet/error.h"

namespace octet {

namespace fs = std::filesystem;

namespace {

// The directory a path lives in ("." for a bare name), created if missing.
fs::path make_parent(const fs::path& path, const std::string& what) {
  fs::path parent = path.parent_path();
  if (parent.empty()) parent = ".";
  std::error_code error;
  if (!fs::is_directory(parent, error)) {
    fs::create_directories(parent, error);
    OCTET_CHECK(!error && fs::is_directory(parent), what, " '", path.string(),
                "': cannot create the directory '", parent.string(), "' (",
                error ? error.message() : "a file of that name exists", ")");
  }
  return parent;
}

// Creates and removes a file in `dir`: the one test of writability that holds for root, for
// read-only mounts and for full quotas alike.
void probe(const fs::path& dir, const fs::path& path, const std::string& what) {
  const fs::path file = dir / (".octet-probe-" + std::to_string(::getpid()));
  std::FILE* out = std::fopen(file.c_str(), "wb");
  const int code = errno;
  OCTET_CHECK(out != nullptr, what, " '", path.string(), "': cannot create files in '",
              dir.string(), "' (", std::strerror(code), ")");
  std::fclose(out);
  std::error_code ignored;
  fs::remove(file, ignored);
}

std::string to_hex(const unsigned char* digest, unsigned int length) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < length; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

}  // namespace

void check_writable_file(const std::string& path, const std::string& what) {
  OCTET_CHECK(!path.empty(), what, ": expected a file path, got an empty string");
  const fs::path target(path);
  std::error_code error;
  OCTET_CHECK(!fs::exists(target, error) || fs::is_regular_file(target, error), what, " '", path,
              "': exists and is not a regular file (a directory?)");
  probe(make_parent(target, what), target, what);
}

void check_writable_directory(const std::string& path, const std::string& what) {
  OCTET_CHECK(!path.empty(), what, ": expected a directory path, got an empty string");
  fs::path target(path);
  if (!target.has_filename()) target = target.parent_path();  // "ckpt/" names "ckpt"
  std::error_code error;
  OCTET_CHECK(!fs::exists(target, error) || fs::is_directory(target, error), what, " '", path,
              "': exists and is not a directory");
  probe(make_parent(target, what), target, what);
}

void sync_to_disk(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  OCTET_CHECK(fd >= 0, "sync: cannot open '", path, "' (", std::strerror(errno), ")");
  const int result = ::fsync(fd);
  const int code = errno;
  ::close(fd);
  OCTET_CHECK(result == 0, "sync: fsync of '", path, "' failed (", std::strerror(code), ")");
}

std::string sha256_hex(const void* data, size_t bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  OCTET_CHECK(EVP_Digest(data, bytes, digest, &length, EVP_sha256(), nullptr) == 1,
              "sha256: OpenSSL's digest failed");
  return to_hex(digest, length);
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  OCTET_CHECK(in.good(), "sha256: cannot open '", path, "'");
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  OCTET_CHECK(context && EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) == 1,
              "sha256: OpenSSL's digest failed to start");
  std::vector<char> buffer(size_t{1} << 22);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize got = in.gcount();
    if (got > 0) EVP_DigestUpdate(context.get(), buffer.data(), static_cast<size_t>(got));
  }
  OCTET_CHECK(in.eof(), "sha256: read of '", path, "' failed");
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  OCTET_CHECK(EVP_DigestFinal_ex(context.get(), digest, &length) == 1,
              "sha256: OpenSSL's digest failed to finish");
  return to_hex(digest, length);
}

}  // namespace octet
