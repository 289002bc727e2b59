// Output-path preflight and SHA-256 digests (octet/files.h).
#include "octet/files.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>

#include "octet/error.h"

namespace octet {
namespace {

namespace fs = std::filesystem;

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("octet-files-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "-" + std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST_F(Files, Sha256MatchesTheStandardVectors) {
  // FIPS 180-2 examples (what `sha256sum` prints).
  EXPECT_EQ(sha256_hex("abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  // A file larger than the 4 MiB read buffer, against the digest of the same bytes in memory.
  std::string bytes(9 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + (i >> 13));
  std::ofstream(path("big"), std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  EXPECT_EQ(sha256_file(path("big")), sha256_hex(bytes.data(), bytes.size()));
  bytes[5 << 20] ^= 1;  // one flipped bit changes the digest
  EXPECT_NE(sha256_file(path("big")), sha256_hex(bytes.data(), bytes.size()));
  EXPECT_NE(message_of([&] { sha256_file(path("missing")); }).find("cannot open"),
            std::string::npos);
}

TEST_F(Files, WritableOutputsPassAndCreateTheirDirectory) {
  check_writable_file(path("a/b/metrics.jsonl"), "--metrics");
  EXPECT_TRUE(fs::is_directory(dir_ / "a" / "b"));
  EXPECT_TRUE(fs::is_empty(dir_ / "a" / "b"));  // the probe file is gone
  check_writable_directory(path("c/ckpt"), "--save");
  check_writable_directory(path("c/ckpt/"), "--save");
  EXPECT_TRUE(fs::is_empty(dir_ / "c"));
  std::ofstream(path("existing.jsonl")) << "x";
  check_writable_file(path("existing.jsonl"), "--metrics");  // replaced later, not now
  EXPECT_EQ(fs::file_size(dir_ / "existing.jsonl"), 1u);
}

TEST_F(Files, UnwritableOutputsNameTheFlagAndTheReason) {
  std::ofstream(path("file")) << "x";
  fs::create_directories(dir_ / "dir");
  EXPECT_NE(message_of([&] {
              check_writable_directory(path("file/ckpt"), "--save");
            }).find("--save '" + path("file/ckpt") + "': cannot create the directory"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              check_writable_directory(path("file"), "--save");
            }).find("exists and is not a directory"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              check_writable_file(path("dir"), "--plot");
            }).find("--plot '" + path("dir") + "': exists and is not a regular file"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              check_writable_file("/proc/octet-test.jsonl", "--metrics");
            }).find("cannot create files in '/proc'"),
            std::string::npos);
  EXPECT_NE(message_of([&] { check_writable_file("", "-o"); }).find("-o: expected a file path"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
