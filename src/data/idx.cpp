// IDX files (MNIST / Fashion-MNIST images and labels): each file is read whole through zlib,
// which inflates gzip and passes plain files through, then its header and size are checked.
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // uint8 data, 3 dimensions
constexpr uint32_t kLabelsMagic = 0x00000801;  // uint8 data, 1 dimension
constexpr int64_t kMaxDimension = 65536;
constexpr int64_t kMaxCount = int64_t{1} << 30;
constexpr size_t kMaxReadBytes = 16u << 20;  // per gzread call

std::string hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08X", value);
  return text;
}

uint32_t big_endian32(const uint8_t* bytes) {
  return uint32_t{bytes[0]} << 24 | uint32_t{bytes[1]} << 16 | uint32_t{bytes[2]} << 8 |
         uint32_t{bytes[3]};
}

// How many bytes reading the file will give, to size the buffer once: a plain file's size, or
// a gzip file's ISIZE (its last 4 bytes: the inflated size mod 2^32), believed only as far as
// deflate can expand (1032:1). Only a hint: the read below goes past it or stops short of it.
size_t size_hint(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return 0;  // a directory, a pipe
  const uintmax_t file_bytes = std::filesystem::file_size(path, error);
  if (error) return 0;
  size_t hint = file_bytes;
  std::FILE* file = file_bytes >= 18 ? std::fopen(path.c_str(), "rbe") : nullptr;
  if (file == nullptr) return hint;
  unsigned char magic[2] = {}, trailer[4] = {};
  if (std::fread(magic, 1, 2, file) == 2 && magic[0] == 0x1F && magic[1] == 0x8B &&
      std::fseek(file, -4, SEEK_END) == 0 && std::fread(trailer, 1, 4, file) == 4) {
    const size_t inflated = size_t{trailer[0]} | size_t{trailer[1]} << 8 |
                            size_t{trailer[2]} << 16 | size_t{trailer[3]} << 24;
    hint = std::min(inflated, 1032 * hint);
  }
  std::fclose(file);
  return hint;
}

// The whole file's bytes, inflated when it is gzip. `what` ("IDX images file") starts errors.
std::vector<uint8_t> read_whole(const std::string& path, const char* what) {
  errno = 0;
  gzFile file = gzopen(path.c_str(), "rbe");
  OCTET_CHECK(file != nullptr, what, " ", path,
              ": cannot open: ", errno != 0 ? std::strerror(errno) : "out of memory");
  const size_t expected = size_hint(path);
  // zlib's buffer: its 8 KiB default for small files (cheap under the fuzzer), 256 KiB for the
  // datasets.
  gzbuffer(file, static_cast<unsigned>(std::clamp<size_t>(expected, 8u << 10, 256u << 10)));
  // One spare byte: a read that fills the buffer has not met the end of the file.
  std::vector<uint8_t> bytes(expected + 1);
  size_t size = 0;
  for (;;) {
    if (size == bytes.size()) bytes.resize(2 * size);  // the hint was short: grow
    const size_t want = std::min(bytes.size() - size, kMaxReadBytes);
    const int got = gzread(file, bytes.data() + size, static_cast<unsigned>(want));
    if (got > 0) size += static_cast<size_t>(got);
    if (got < static_cast<int>(want)) break;  // gzread fills what it is asked unless it ended
  }
  bytes.resize(size);
  int error = Z_OK;
  std::string message = gzerror(file, &error);
  gzclose(file);
  if (error != Z_OK) {
    // zlib's messages start with the path; the error names it once.
    if (message.rfind(path + ": ", 0) == 0) message.erase(0, path.size() + 2);
    fail(detail::concat(what, " ", path, ": cannot read",
                        error == Z_ERRNO ? "" : " (corrupt or truncated gzip stream)", ": ",
                        message));
  }
  return bytes;
}

// Checks the header (magic, then one big-endian uint32 per dimension) and that the data after
// it is exactly the product of the dimensions; returns the dimensions and drops the header.
std::vector<int64_t> strip_header(std::vector<uint8_t>& bytes, const std::string& path,
                                  const char* what, uint32_t magic, const char* data_name) {
  const size_t dimensions = magic & 0xFF;
  const size_t header_bytes = 4 + 4 * dimensions;
  OCTET_CHECK(bytes.size() >= 4, what, " ", path, ": truncated: expected a ", header_bytes,
              "-byte header, found a ", bytes.size(), "-byte file");
  const uint32_t found = big_endian32(bytes.data());
  OCTET_CHECK(found == magic, what, " ", path, ": expected magic ", hex32(magic), " (uint8, ",
              dimensions, " dimension", dimensions == 1 ? "" : "s", "), found ", hex32(found),
              found == kImagesMagic || found == kLabelsMagic ? " (images and labels swapped?)"
                                                             : " (not an IDX file?)");
  OCTET_CHECK(bytes.size() >= header_bytes, what, " ", path, ": truncated: expected a ",
              header_bytes, "-byte header, found a ", bytes.size(), "-byte file");
  std::vector<int64_t> shape;
  int64_t expected = 1;  // at most 2^30 x 65536^2 = 2^62: no overflow
  for (size_t d = 0; d < dimensions; ++d) {
    const int64_t size = big_endian32(bytes.data() + 4 + 4 * d);
    // The count (dimension 0) may be large (EMNIST holds 800k images); the others are sizes.
    const int64_t limit = d == 0 ? kMaxCount : kMaxDimension;
    OCTET_CHECK(size > 0 && size <= limit, what, " ", path, ": dimension ", d, " expected in [1, ",
                limit, "], found ", size);
    shape.push_back(size);
    expected *= size;
  }
  const auto found_bytes = static_cast<int64_t>(bytes.size() - header_bytes);
  OCTET_CHECK(found_bytes <= expected, what, " ", path, ": expected ", expected, " bytes of ",
              data_name, ", found ", found_bytes, " (", found_bytes - expected,
              " trailing bytes after the data)");
  OCTET_CHECK(found_bytes == expected, what, " ", path, ": expected ", expected, " bytes of ",
              data_name, ", found ", found_bytes, " (truncated)");
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(header_bytes));
  return shape;
}

// DIR/NAME.gz if it exists, else DIR/NAME; neither is an error telling how to install them.
std::string existing_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  for (const std::string& candidate : {name + ".gz", name}) {
    const fs::path path = fs::path(dir) / candidate;
    std::error_code error;
    if (fs::is_regular_file(path, error)) return path.string();
  }
  fail(detail::concat("Fashion-MNIST: expected ", dir, "/", name, ".gz (or ", name,
                      " uncompressed), found neither: install the Debian package "
                      "dataset-fashion-mnist (scripts/setup.sh does)"));
}

}  // namespace

ImageDataset ImageDataset::load_idx(const std::string& images_path, const std::string& labels_path,
                                    int64_t num_classes) {
  OCTET_CHECK(num_classes >= 1 && num_classes <= 256, "IDX files ", images_path, " and ",
              labels_path, ": num_classes expected in [1, 256] (uint8 labels), got ", num_classes);
  ImageDataset dataset;
  dataset.num_classes = num_classes;
  dataset.pixels = read_whole(images_path, "IDX images file");
  const std::vector<int64_t> shape =
      strip_header(dataset.pixels, images_path, "IDX images file", kImagesMagic, "pixels");
  dataset.count = shape[0];
  dataset.rows = shape[1];
  dataset.cols = shape[2];

  dataset.labels = read_whole(labels_path, "IDX labels file");
  const int64_t label_count =
      strip_header(dataset.labels, labels_path, "IDX labels file", kLabelsMagic, "labels")[0];
  OCTET_CHECK(label_count == dataset.count, "IDX labels file ", labels_path, ": expected ",
              dataset.count, " labels (one per image of ", images_path, "), found ", label_count);
  for (int64_t i = 0; i < label_count; ++i) {
    OCTET_CHECK(dataset.labels[i] < num_classes, "IDX labels file ", labels_path, ": label ", i,
                " is ", int{dataset.labels[i]}, ", expected < ", num_classes, " (num_classes)");
  }
  return dataset;
}

const std::vector<std::string>& fashion_mnist_classes() {
  static const std::vector<std::string> classes = {
      "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
      "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return classes;
}

std::string default_fashion_mnist_dir() {
  return "/usr/share/datasets/fashion-mnist";
}

ImageDataset load_fashion_mnist(const std::string& dir, bool train) {
  std::error_code error;
  OCTET_CHECK(std::filesystem::is_directory(dir, error), "Fashion-MNIST: directory ", dir,
              " not found: install the Debian package dataset-fashion-mnist "
              "(scripts/setup.sh does)");
  const std::string split = train ? "train" : "t10k";
  const std::string images_path = existing_file(dir, split + "-images-idx3-ubyte");
  const std::string labels_path = existing_file(dir, split + "-labels-idx1-ubyte");
  return ImageDataset::load_idx(images_path, labels_path,
                                static_cast<int64_t>(fashion_mnist_classes().size()));
}

}  // namespace octet
