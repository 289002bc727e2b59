// Token shards: written through a temporary file and a rename, read through mmap.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian");

template <typename T>
void put(unsigned char* header, size_t offset, T value) {
  std::memcpy(header + offset, &value, sizeof value);
}

template <typename T>
T get(const unsigned char* header, size_t offset) {
  T value;
  std::memcpy(&value, header + offset, sizeof value);
  return value;
}

int id_bytes_for(int32_t vocab_size) {
  return vocab_size <= 65536 ? 2 : 4;
}

}  // namespace

void write_token_shard(const std::string& path, std::span<const int32_t> ids, int32_t vocab_size) {
  OCTET_CHECK(vocab_size > 0, "token shard ", path, ": expected vocab_size > 0, got ", vocab_size);
  const int id_bytes = id_bytes_for(vocab_size);
  std::vector<unsigned char> body(ids.size() * static_cast<size_t>(id_bytes));
  for (size_t i = 0; i < ids.size(); ++i) {
    OCTET_CHECK(ids[i] >= 0 && ids[i] < vocab_size, "token shard ", path, ": id ", i,
                " expected in [0, ", vocab_size, "), got ", ids[i]);
    if (id_bytes == 2) {
      put(body.data(), i * 2, static_cast<uint16_t>(ids[i]));
    } else {
      put(body.data(), i * 4, static_cast<uint32_t>(ids[i]));
    }
  }
  unsigned char header[kTokenShardHeaderBytes] = {};
  std::memcpy(header, kTokenShardMagic, sizeof kTokenShardMagic);
  put(header, 8, kTokenShardVersion);
  put(header, 12, static_cast<uint32_t>(id_bytes));
  put(header, 16, static_cast<uint64_t>(ids.size()));
  put(header, 24, static_cast<uint32_t>(vocab_size));

  const std::string temp_path = path + ".tmp." + std::to_string(::getpid());
  std::FILE* file = std::fopen(temp_path.c_str(), "wb");
  OCTET_CHECK(file != nullptr, "token shard: cannot create ", temp_path, ": ",
              std::strerror(errno));
  const bool written =
      std::fwrite(header, 1, sizeof header, file) == sizeof header &&
      (body.empty() || std::fwrite(body.data(), 1, body.size(), file) == body.size()) &&
      std::fflush(file) == 0 && ::fsync(::fileno(file)) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed || std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int error = !written ? write_errno : errno;
    std::remove(temp_path.c_str());
    fail(detail::concat("token shard: cannot write ", path, ": ", std::strerror(error)));
  }
}

TokenShard TokenShard::open(const std::string& path, bool check_ids) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  OCTET_CHECK(fd >= 0, "token shard: cannot open ", path, ": ", std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    fail(detail::concat("token shard: cannot stat ", path, ": ", std::strerror(error)));
  }
  const auto file_bytes = static_cast<size_t>(info.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    ::close(fd);
    fail(detail::concat("token shard ", path, ": truncated: expected a ", kTokenShardHeaderBytes,
                        "-byte header, got a ", file_bytes, "-byte file"));
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file open
  OCTET_CHECK(map != MAP_FAILED, "token shard: cannot mmap ", path, ": ", std::strerror(map_errno));

  TokenShard shard;
  shard.map_ = map;
  shard.map_bytes_ = file_bytes;  // from here on the destructor unmaps, also when a check throws
  shard.bytes_ = static_cast<const unsigned char*>(map);
  shard.validate(path, file_bytes, check_ids);
  return shard;
}

TokenShard TokenShard::view(std::span<const uint8_t> bytes, const std::string& source_name,
                            bool check_ids) {
  OCTET_CHECK(bytes.size() >= kTokenShardHeaderBytes, "token shard ", source_name,
              ": truncated: expected a ", kTokenShardHeaderBytes, "-byte header, got a ",
              bytes.size(), "-byte file");
  TokenShard shard;
  shard.bytes_ = bytes.data();
  shard.validate(source_name, bytes.size(), check_ids);
  return shard;
}

void TokenShard::validate(const std::string& path, size_t file_bytes, bool check_ids) {
  const unsigned char* header = bytes_;
  OCTET_CHECK(std::memcmp(header, kTokenShardMagic, sizeof kTokenShardMagic) == 0, "token shard ",
              path, ": expected magic \"OCTETTOK\", got \"",
              std::string(reinterpret_cast<const char*>(header), 8), "\" (not a token shard?)");
  const auto version = get<uint32_t>(header, 8);
  OCTET_CHECK(version == kTokenShardVersion, "token shard ", path, ": expected version ",
              kTokenShardVersion, ", got ", version);
  const auto id_bytes = get<uint32_t>(header, 12);
  OCTET_CHECK(id_bytes == 2 || id_bytes == 4, "token shard ", path,
              ": expected id width 2 or 4 bytes, got ", id_bytes);
  const auto token_count = get<uint64_t>(header, 16);
  const auto vocab_size = get<uint32_t>(header, 24);
  OCTET_CHECK(vocab_size > 0 && vocab_size <= (id_bytes == 2 ? 65536u : 0x7FFFFFFFu),
              "token shard ", path, ": expected a vocab size in [1, ",
              id_bytes == 2 ? 65536u : 0x7FFFFFFFu, "] for ", id_bytes, "-byte ids, got ",
              vocab_size);
  // Divided, not multiplied: a huge declared count must not wrap around to the file's size.
  const uint64_t body_bytes = file_bytes - kTokenShardHeaderBytes;
  const bool truncated = token_count > body_bytes / id_bytes;
  OCTET_CHECK(!truncated && token_count * id_bytes == body_bytes, "token shard ", path,
              ": expected ", kTokenShardHeaderBytes, " + ", token_count, " x ", id_bytes,
              " bytes, got ", file_bytes, " bytes (", truncated ? "truncated" : "trailing bytes",
              ")");
  token_count_ = static_cast<int64_t>(token_count);
  id_bytes_ = static_cast<int>(id_bytes);
  vocab_size_ = static_cast<int32_t>(vocab_size);
  if (check_ids) {
    for (int64_t i = 0; i < token_count_; ++i) {
      const int32_t id = (*this)[i];
      OCTET_CHECK(id >= 0 && id < vocab_size_, "token shard ", path, ": id ", i,
                  " expected in [0, ", vocab_size_, "), got ", id);
    }
  }
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : bytes_(std::exchange(other.bytes_, nullptr)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      token_count_(std::exchange(other.token_count_, 0)),
      id_bytes_(std::exchange(other.id_bytes_, 0)),
      vocab_size_(std::exchange(other.vocab_size_, 0)) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    bytes_ = std::exchange(other.bytes_, nullptr);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    token_count_ = std::exchange(other.token_count_, 0);
    id_bytes_ = std::exchange(other.id_bytes_, 0);
    vocab_size_ = std::exchange(other.vocab_size_, 0);
  }
  return *this;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

int32_t TokenShard::operator[](int64_t index) const {
  const size_t offset = static_cast<size_t>(index) * id_bytes_;
  if (id_bytes_ == 2) return get<uint16_t>(ids(), offset);
  return static_cast<int32_t>(get<uint32_t>(ids(), offset));
}

void TokenShard::read(int64_t begin, int64_t count, int32_t* out) const {
  OCTET_CHECK(begin >= 0 && count >= 0 && begin + count <= token_count_,
              "token shard: expected a range within [0, ", token_count_, "), got [", begin, ", ",
              begin + count, ")");
  for (int64_t i = 0; i < count; ++i) out[i] = (*this)[begin + i];
}

std::vector<int32_t> TokenShard::to_vector() const {
  std::vector<int32_t> out(static_cast<size_t>(token_count_));
  read(0, token_count_, out.data());
  return out;
}

}  // namespace octet
