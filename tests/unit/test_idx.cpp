// IDX image and label files (ImageDataset::load_idx): small files written here, plain and
// gzip, load exactly; every defect is an octet::Error saying what was expected; and the real
// Fashion-MNIST from Debian's dataset-fashion-mnist, where it is installed.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "octet/data.h"
#include "octet/error.h"

namespace octet {
namespace {

namespace fs = std::filesystem;

// A per-process scratch folder, removed at exit.
const std::string& scratch_dir() {
  static const std::string dir = [] {
    const fs::path path =
        fs::temp_directory_path() / ("octet_test_idx_" + std::to_string(::getpid()));
    fs::create_directories(path);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(fs::temp_directory_path() / ("octet_test_idx_" + std::to_string(::getpid())),
                     ignored);
    });
    return path.string();
  }();
  return dir;
}

std::string scratch_path(const std::string& name) {
  return scratch_dir() + "/" + name;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_gzip(const std::string& path, const std::string& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(file), Z_OK);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void put_big_endian32(std::string& bytes, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) bytes += static_cast<char>((value >> shift) & 0xFF);
}

// An IDX file: magic, the dimensions, then the data.
std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& shape,
                      const std::vector<uint8_t>& data) {
  std::string bytes;
  put_big_endian32(bytes, magic);
  for (uint32_t size : shape) put_big_endian32(bytes, size);
  bytes.append(data.begin(), data.end());
  return bytes;
}

// 3 images of 4 x 5 and their labels.
constexpr int kCount = 3, kRows = 4, kCols = 5;
std::vector<uint8_t> some_pixels() {
  std::vector<uint8_t> pixels(kCount * kRows * kCols);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 37 + 11);
  return pixels;
}
const std::vector<uint8_t> kLabels = {9, 0, 4};

std::string images_file() {
  return idx_bytes(0x803, {kCount, kRows, kCols}, some_pixels());
}
std::string labels_file() {
  return idx_bytes(0x801, {kCount}, kLabels);
}

void expect_loads_exactly(const std::string& images_path, const std::string& labels_path) {
  const ImageDataset dataset = ImageDataset::load_idx(images_path, labels_path, 10);
  EXPECT_EQ(dataset.count, kCount);
  EXPECT_EQ(dataset.rows, kRows);
  EXPECT_EQ(dataset.cols, kCols);
  EXPECT_EQ(dataset.num_classes, 10);
  EXPECT_EQ(dataset.pixels, some_pixels());
  EXPECT_EQ(dataset.labels, kLabels);
  EXPECT_EQ(dataset.image(2)[0], some_pixels()[2 * kRows * kCols]);
  EXPECT_EQ(dataset.image(1)[kRows * kCols - 1], some_pixels()[2 * kRows * kCols - 1]);
}

// load_idx on the given bytes must throw an octet::Error naming the file and holding `needle`.
void expect_error(const std::string& name, const std::string& images, const std::string& labels,
                  const std::string& needle, int64_t num_classes = 10) {
  SCOPED_TRACE(name);
  const std::string images_path = scratch_path(name + "-images");
  const std::string labels_path = scratch_path(name + "-labels");
  write_bytes(images_path, images);
  write_bytes(labels_path, labels);
  try {
    ImageDataset::load_idx(images_path, labels_path, num_classes);
    ADD_FAILURE() << "expected octet::Error containing: " << needle;
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(needle), std::string::npos)
        << "message: " << message << "\nexpected to contain: " << needle;
    EXPECT_TRUE(message.find(images_path) != std::string::npos ||
                message.find(labels_path) != std::string::npos)
        << "message names neither file: " << message;
  }
}

TEST(Idx, PlainAndGzipFilesLoadExactly) {
  write_bytes(scratch_path("images"), images_file());
  write_bytes(scratch_path("labels"), labels_file());
  write_gzip(scratch_path("images.gz"), images_file());
  write_gzip(scratch_path("labels.gz"), labels_file());
  ASSERT_NE(read_bytes(scratch_path("images.gz")), images_file());  // really compressed
  {
    SCOPED_TRACE("plain");
    expect_loads_exactly(scratch_path("images"), scratch_path("labels"));
  }
  {
    SCOPED_TRACE("gzip");
    expect_loads_exactly(scratch_path("images.gz"), scratch_path("labels.gz"));
  }
  {
    SCOPED_TRACE("mixed");
    expect_loads_exactly(scratch_path("images.gz"), scratch_path("labels"));
  }
  {
    // Two gzip members one after the other (as `cat a.gz b.gz`): the last member's size in
    // the trailer is short of the whole, and the read grows past it.
    SCOPED_TRACE("two gzip members");
    const std::string images = images_file();
    write_gzip(scratch_path("first.gz"), images.substr(0, 50));
    write_gzip(scratch_path("second.gz"), images.substr(50));
    write_bytes(scratch_path("members.gz"),
                read_bytes(scratch_path("first.gz")) + read_bytes(scratch_path("second.gz")));
    expect_loads_exactly(scratch_path("members.gz"), scratch_path("labels.gz"));
  }
}

TEST(Idx, MissingAndUnreadableFilesAreErrors) {
  write_bytes(scratch_path("labels"), labels_file());
  const std::string missing = scratch_path("does_not_exist");
  try {
    ImageDataset::load_idx(missing, scratch_path("labels"), 10);
    ADD_FAILURE() << "a missing file loaded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("IDX images file " + missing + ": cannot open"),
              std::string::npos)
        << error.what();
  }
  try {
    ImageDataset::load_idx(scratch_dir(), scratch_path("labels"), 10);  // a directory
    ADD_FAILURE() << "a directory loaded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(scratch_dir() + ": cannot read"), std::string::npos)
        << error.what();
  }
}

TEST(Idx, HeaderDefectsAreErrors) {
  const std::string images = images_file(), labels = labels_file();
  expect_error("swapped", labels, labels,
               "expected magic 0x00000803 (uint8, 3 dimensions), found 0x00000801");
  expect_error("labels_magic", images, images,
               "expected magic 0x00000801 (uint8, 1 dimension), found 0x00000803");
  expect_error("float_images", idx_bytes(0xD03, {kCount, kRows, kCols}, some_pixels()), labels,
               "found 0x00000D03 (not an IDX file?)");
  expect_error("empty", "", labels, "truncated: expected a 16-byte header, found a 0-byte file");
  expect_error("short_header", images.substr(0, 10), labels,
               "truncated: expected a 16-byte header, found a 10-byte file");
  expect_error("zero_rows", idx_bytes(0x803, {kCount, 0, kCols}, {}), labels,
               "dimension 1 expected in [1, 65536], found 0");
  expect_error("zero_count", idx_bytes(0x803, {0, kRows, kCols}, {}), labels,
               "dimension 0 expected in [1, 1073741824], found 0");
  expect_error("wide", idx_bytes(0x803, {1, 1, 65537}, {}), labels,
               "dimension 2 expected in [1, 65536], found 65537");
  expect_error("huge", idx_bytes(0x803, {0xFFFFFFFF, kRows, kCols}, some_pixels()), labels,
               "dimension 0 expected in [1, 1073741824], found 4294967295");
  expect_error("zero_labels", images, idx_bytes(0x801, {0}, {}),
               "dimension 0 expected in [1, 1073741824], found 0");
}

TEST(Idx, SizeAndLabelDefectsAreErrors) {
  const std::string images = images_file(), labels = labels_file();
  expect_error("truncated_pixels", images.substr(0, images.size() - 1), labels,
               "expected 60 bytes of pixels, found 59 (truncated)");
  expect_error("header_only", images.substr(0, 16), labels,
               "expected 60 bytes of pixels, found 0 (truncated)");
  expect_error("trailing_pixels", images + "xyz", labels,
               "expected 60 bytes of pixels, found 63 (3 trailing bytes after the data)");
  expect_error("truncated_labels", images, labels.substr(0, labels.size() - 1),
               "expected 3 bytes of labels, found 2 (truncated)");
  expect_error("trailing_labels", images, labels + "z",
               "expected 3 bytes of labels, found 4 (1 trailing bytes after the data)");
  expect_error("fewer_labels", images, idx_bytes(0x801, {2}, {1, 2}),
               "expected 3 labels (one per image of ");
  expect_error("more_labels", images, idx_bytes(0x801, {4}, {1, 2, 3, 4}), "found 4");
  expect_error("label_range", images, idx_bytes(0x801, {3}, {0, 9, 10}),
               "label 2 is 10, expected < 10 (num_classes)");
  expect_error("label_range_5", images, labels, "label 0 is 9, expected < 5 (num_classes)", 5);
  expect_error("no_classes", images, labels, "num_classes expected in [1, 256]", 0);
  expect_error("many_classes", images, labels, "num_classes expected in [1, 256]", 257);
}

TEST(Idx, CorruptAndTruncatedGzipAreErrors) {
  write_gzip(scratch_path("good.gz"), images_file());
  const std::string good = read_bytes(scratch_path("good.gz"));
  ASSERT_GT(good.size(), 30u);
  const std::string labels = labels_file();
  // A valid gzip header (magic, deflate, no flags, mtime, xfl, OS) and garbage after it.
  const std::string header("\x1F\x8B\x08\x00\x00\x00\x00\x00\x00\x03", 10);
  expect_error("garbage.gz", header + std::string(40, '\xFF'), labels,
               "corrupt or truncated gzip stream");
  expect_error("truncated.gz", good.substr(0, good.size() / 2), labels,
               "corrupt or truncated gzip stream");
  expect_error("no_trailer.gz", good.substr(0, good.size() - 8), labels,
               "corrupt or truncated gzip stream");
  std::string bad_crc = good;
  bad_crc[bad_crc.size() - 8] ^= 0x01;  // the CRC-32 of the trailer
  expect_error("bad_crc.gz", bad_crc, labels, "corrupt or truncated gzip stream");
  expect_error("header_only.gz", header, labels, "corrupt or truncated gzip stream");
}

TEST(Idx, FashionMnistFilesAreFoundGzipFirstThenPlain) {
  const std::string dir = scratch_path("fashion");
  fs::create_directories(dir);
  // The images plain, the labels compressed.
  write_bytes(dir + "/t10k-images-idx3-ubyte", images_file());
  write_gzip(dir + "/t10k-labels-idx1-ubyte.gz", labels_file());
  const ImageDataset test = load_fashion_mnist(dir, /*train=*/false);
  EXPECT_EQ(test.count, kCount);
  EXPECT_EQ(test.labels, kLabels);
  // A .gz beside a plain file wins: this one has other labels.
  write_bytes(dir + "/t10k-labels-idx1-ubyte", idx_bytes(0x801, {kCount}, {1, 1, 1}));
  EXPECT_EQ(load_fashion_mnist(dir, false).labels, kLabels);

  auto expect_install_hint = [](const std::function<void()>& load, const std::string& needle) {
    try {
      load();
      ADD_FAILURE() << "expected octet::Error containing: " << needle;
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(needle), std::string::npos) << message;
      EXPECT_NE(message.find("install the Debian package dataset-fashion-mnist"), std::string::npos)
          << message;
    }
  };
  expect_install_hint([&] { load_fashion_mnist(dir, /*train=*/true); },
                      dir + "/train-images-idx3-ubyte.gz");
  expect_install_hint([&] { load_fashion_mnist(scratch_path("no_such_dir"), true); },
                      scratch_path("no_such_dir"));
}

TEST(Idx, FashionMnistClassNames) {
  const std::vector<std::string>& classes = fashion_mnist_classes();
  ASSERT_EQ(classes.size(), 10u);
  EXPECT_EQ(classes[0], "T-shirt/top");
  EXPECT_EQ(classes[9], "Ankle boot");
  EXPECT_EQ(default_fashion_mnist_dir(), "/usr/share/datasets/fashion-mnist");
}

TEST(Idx, RealFashionMnist) {
  const std::string dir = default_fashion_mnist_dir();
  if (!fs::is_directory(dir)) {
    GTEST_SKIP() << dir << " not found (Debian package dataset-fashion-mnist)";
  }
  for (bool train : {true, false}) {
    SCOPED_TRACE(train ? "train" : "t10k");
    const auto start = std::chrono::steady_clock::now();
    const ImageDataset dataset = load_fashion_mnist(dir, train);
    const double load_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("[ Fashion-MNIST ] %s: %lld images loaded in %.0f ms\n", train ? "train" : "t10k",
                static_cast<long long>(dataset.count), load_ms);
    const int64_t count = train ? 60000 : 10000;
    EXPECT_EQ(dataset.count, count);
    EXPECT_EQ(dataset.rows, 28);
    EXPECT_EQ(dataset.cols, 28);
    EXPECT_EQ(dataset.num_classes, 10);
    EXPECT_EQ(dataset.pixels.size(), static_cast<size_t>(count * 28 * 28));
    ASSERT_EQ(dataset.labels.size(), static_cast<size_t>(count));
    std::vector<int64_t> per_class(10, 0);
    for (uint8_t label : dataset.labels) ++per_class[label];
    EXPECT_EQ(per_class, std::vector<int64_t>(10, count / 10));
    if (train) {
      EXPECT_EQ(dataset.labels[0], 9);  // "Ankle boot"
      EXPECT_EQ(fashion_mnist_classes()[dataset.labels[0]], "Ankle boot");
    }
    // Not blank: pixels span the whole uint8 range.
    uint8_t lowest = 255, highest = 0;
    for (uint8_t pixel : dataset.pixels) {
      lowest = std::min(lowest, pixel);
      highest = std::max(highest, pixel);
    }
    EXPECT_EQ(lowest, 0);
    EXPECT_EQ(highest, 255);
  }
}

}  // namespace
}  // namespace octet
