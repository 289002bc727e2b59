// Tensor storage (64-byte aligned, counted), views, copies and conversions.
#include "octet/tensor.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/convert.h"

namespace octet {
namespace {

std::atomic<int64_t> g_current_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};
std::atomic<int64_t> g_allocations{0};

void count_allocation(int64_t bytes) {
  int64_t now = g_current_bytes.fetch_add(bytes) + bytes;
  int64_t peak = g_peak_bytes.load();
  while (now > peak && !g_peak_bytes.compare_exchange_weak(peak, now)) {
  }
  g_allocations.fetch_add(1);
}

constexpr size_t kHugePage = size_t{2} << 20;

// Storages from kMidBlock up are rounded to 64 KiB multiples, from 4 MiB to 2 MiB multiples.
constexpr size_t kMidBlock = size_t{256} << 10;
constexpr size_t kMidGranule = size_t{64} << 10;

// Freed storages of 256 KiB and more, kept for the next storage of the same (rounded) size:
// a training step allocates the same activations, gradients and weight copies every step,
// and a fresh block costs a page fault and the kernel's zeroing of every page on first touch
// (gpt-tiny's step spent 30% of its time in clear_page before). Blocks under 4 MiB are kept
// too: malloc gives them back to the kernel when they are freed (munmap, or trimming the
// heap's top), so the next call faults them in again, and flash attention's backward (six 3 MiB F32
// packs per call at 2048 tokens, h384) spent more time in page faults than in its tiles. At most
// OCTET_STORAGE_CACHE_MB (default 1024) are kept, the oldest freed first; 0 keeps none. Off
// under AddressSanitizer, which must see every block freed.
class BlockCache {
 public:
  BlockCache() {
    const char* text = std::getenv("OCTET_STORAGE_CACHE_MB");
    if (text != nullptr && *text != '\0') {
      char* end = nullptr;
      const long long mb = std::strtoll(text, &end, 10);
      OCTET_CHECK(end != nullptr && *end == '\0' && mb >= 0,
                  "OCTET_STORAGE_CACHE_MB expected a number of MiB >= 0, got '", text, "'");
      limit_ = static_cast<size_t>(mb) << 20;
    }
  }
  void* take(size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = blocks_.size(); i-- > 0;) {  // the most recently freed first
      if (blocks_[i].bytes != bytes) continue;
      void* data = blocks_[i].data;
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i));
      total_ -= bytes;
      return data;
    }
    return nullptr;
  }
  void give(void* data, size_t bytes) {
    std::vector<void*> evicted;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > limit_) {
        evicted.push_back(data);
      } else {
        blocks_.push_back({data, bytes});
        total_ += bytes;
        while (total_ > limit_) {
          evicted.push_back(blocks_.front().data);
          total_ -= blocks_.front().bytes;
          blocks_.erase(blocks_.begin());
        }
      }
    }
    for (void* block : evicted) std::free(block);
  }
  void release() {
    std::vector<Block> blocks;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(blocks_);
      total_ = 0;
    }
    for (const Block& block : blocks) std::free(block.data);
  }
  size_t bytes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return total_;
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  std::mutex mutex_;
  std::vector<Block> blocks_;  // oldest first
  size_t total_ = 0;
  size_t limit_ = size_t{1024} << 20;
};

// AddressSanitizer as GCC (__SANITIZE_ADDRESS__) and clang (__has_feature) announce it.
#if defined(__SANITIZE_ADDRESS__)
#define OCTET_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define OCTET_ADDRESS_SANITIZER 1
#endif
#endif

BlockCache* block_cache() {
#if defined(OCTET_ADDRESS_SANITIZER)
  return nullptr;
#else
  // Never destroyed: storages freed by other static objects' destructors still find it.
  static BlockCache* const cache = new BlockCache;
  return cache;
#endif
}

// The bytes a storage of `bytes` takes: 64-byte multiples, 64 KiB multiples from 256 KiB,
// 2 MiB multiples from 4 MiB.
size_t storage_capacity(size_t bytes) {
  size_t rounded =
      (bytes + kTensorAlignmentBytes - 1) / kTensorAlignmentBytes * kTensorAlignmentBytes;
  if (rounded == 0) rounded = kTensorAlignmentBytes;
  if (rounded >= kMidBlock) rounded = (rounded + kMidGranule - 1) / kMidGranule * kMidGranule;
  if (rounded >= 2 * kHugePage) rounded = (rounded + kHugePage - 1) / kHugePage * kHugePage;
  return rounded;
}

}  // namespace

int64_t cached_storage_bytes() {
  BlockCache* cache = block_cache();
  return cache != nullptr ? static_cast<int64_t>(cache->bytes()) : 0;
}

void release_cached_storage() {
  if (BlockCache* cache = block_cache()) cache->release();
}

std::string shape_str(const Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ",";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

int64_t shape_numel(const Shape& shape) {
  // A zero extent anywhere gives zero elements, whatever the others are (a shape read from a
  // file such as [2^32, 2^32, 0] must not overflow on the way to that zero).
  for (int64_t extent : shape)
    if (extent == 0) return 0;
  int64_t count = 1;
  for (int64_t extent : shape)
    OCTET_CHECK(!__builtin_mul_overflow(count, extent, &count), "shape ", shape_str(shape),
                " has more elements than int64 can count");
  return count;
}

MemoryStats memory_stats() {
  return {g_current_bytes.load(), g_peak_bytes.load(), g_allocations.load()};
}

void reset_peak_memory() {
  g_peak_bytes.store(g_current_bytes.load());
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  OCTET_CHECK(device == Device::CPU, "storage on device ", device_name(device),
              " needs a build with that backend");
  const size_t rounded = storage_capacity(bytes);
  // Large tensors (weights, activations) in 2 MiB pages where the kernel gives them on request
  // (transparent huge pages in "madvise" mode): streaming a decode step's weights through
  // 4 KiB pages costs a page walk every 4 KiB. From 256 KiB, a block freed earlier is reused
  // first.
  if (rounded >= kMidBlock) {
    BlockCache* cache = block_cache();
    const bool huge = rounded >= 2 * kHugePage;
    const size_t alignment = huge ? kHugePage : kTensorAlignmentBytes;
    if (cache != nullptr) data_ = cache->take(rounded);
    if (data_ == nullptr) {
      data_ = std::aligned_alloc(alignment, rounded);
      if (data_ == nullptr && cache != nullptr) {  // out of memory: give the cache back, retry
        cache->release();
        data_ = std::aligned_alloc(alignment, rounded);
      }
      // Advice: failure is harmless.
      if (data_ != nullptr && huge) madvise(data_, rounded, MADV_HUGEPAGE);
    }
  } else {
    data_ = std::aligned_alloc(kTensorAlignmentBytes, rounded);
  }
  OCTET_CHECK(data_ != nullptr, "out of memory allocating ", bytes, " bytes");
  count_allocation(static_cast<int64_t>(bytes));
}

Storage::~Storage() {
  const size_t rounded = storage_capacity(bytes_);
  BlockCache* cache = rounded >= kMidBlock ? block_cache() : nullptr;
  if (cache != nullptr) {
    cache->give(data_, rounded);
  } else {
    std::free(data_);
  }
  g_current_bytes.fetch_sub(static_cast<int64_t>(bytes_));
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t extent : shape) {
    OCTET_CHECK(extent >= 0, "tensor shape ", shape_str(shape), " has a negative extent");
  }
  Tensor tensor;
  tensor.numel_ = shape_numel(shape);
  tensor.shape_ = std::move(shape);
  tensor.dtype_ = dtype;
  tensor.device_ = device;
  tensor.storage_ = std::make_shared<Storage>(tensor.nbytes(), device);
  return tensor;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor tensor = empty(std::move(shape), dtype, device);
  tensor.zero_();
  return tensor;
}

Tensor Tensor::from_floats(Shape shape, const std::vector<float>& values) {
  OCTET_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "from_floats: shape ",
              shape_str(shape), " holds ", shape_numel(shape), " values, got ", values.size());
  Tensor tensor = empty(std::move(shape), DType::F32);
  std::memcpy(tensor.raw(), values.data(), values.size() * sizeof(float));
  return tensor;
}

int64_t Tensor::dim(int index) const {
  int rank = ndim();
  int resolved = index < 0 ? index + rank : index;
  OCTET_CHECK(resolved >= 0 && resolved < rank, "dim(", index, ") out of range for shape ",
              shape_str(shape_));
  return shape_[resolved];
}

int64_t Tensor::rows() const {
  if (shape_.empty()) return 1;
  return cols() == 0 ? shape_numel(Shape(shape_.begin(), shape_.end() - 1)) : numel_ / cols();
}

int64_t Tensor::cols() const {
  return shape_.empty() ? 1 : shape_.back();
}

void* Tensor::raw() {
  OCTET_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_bytes_;
}

const void* Tensor::raw() const {
  OCTET_CHECK(defined(), "access to an undefined tensor");
  return static_cast<const char*>(storage_->data()) + offset_bytes_;
}

Tensor Tensor::reshape(Shape shape) const {
  int infer_at = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      OCTET_CHECK(infer_at < 0, "reshape to ", shape_str(shape), ": at most one -1");
      infer_at = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer_at >= 0) {
    OCTET_CHECK(known > 0 && numel_ % known == 0, "reshape ", shape_str(shape_), " to ",
                shape_str(shape), ": sizes do not divide");
    shape[infer_at] = numel_ / known;
  }
  OCTET_CHECK(shape_numel(shape) == numel_, "reshape ", shape_str(shape_), " (", numel_,
              " elements) to ", shape_str(shape), " (", shape_numel(shape), " elements)");
  Tensor view = *this;
  view.shape_ = std::move(shape);
  return view;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  OCTET_CHECK(ndim() >= 1, "slice_rows on a scalar tensor");
  OCTET_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice_rows [", begin, ",", end,
              ") out of range for shape ", shape_str(shape_));
  Tensor view = *this;
  int64_t row_elements = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  view.offset_bytes_ += static_cast<size_t>(begin * row_elements) * dtype_bytes(dtype_);
  view.shape_[0] = end - begin;
  view.numel_ = shape_numel(view.shape_);
  return view;
}

Tensor Tensor::view_as(DType dtype) const {
  OCTET_CHECK(dtype_bytes(dtype) == dtype_bytes(dtype_), "view_as ", dtype_name(dtype),
              ": element width differs from ", dtype_name(dtype_));
  Tensor view = *this;
  view.dtype_ = dtype;
  return view;
}

Tensor Tensor::clone() const {
  Tensor copy = empty(shape_, dtype_, device_);
  if (nbytes()) std::memcpy(copy.raw(), raw(), nbytes());
  return copy;
}

void Tensor::zero_() {
  if (nbytes()) std::memset(raw(), 0, nbytes());
}

void Tensor::copy_from(const Tensor& source) {
  OCTET_CHECK(source.shape_ == shape_ && source.dtype_ == dtype_, "copy_from: expected ",
              dtype_name(dtype_), shape_str(shape_), ", got ", dtype_name(source.dtype_),
              shape_str(source.shape_));
  if (nbytes()) std::memmove(raw(), source.raw(), nbytes());
}

std::vector<float> Tensor::to_floats() const {
  std::vector<float> out(static_cast<size_t>(numel_));
  size_t n = out.size();
  const void* in = raw();
  switch (dtype_) {
    case DType::F32:
      std::memcpy(out.data(), in, n * sizeof(float));
      break;
    case DType::BF16:
      convert_bf16_to_f32(static_cast<const bfloat16*>(in), out.data(), n);
      break;
    case DType::F16:
      convert_f16_to_f32(static_cast<const float16*>(in), out.data(), n);
      break;
    case DType::E4M3:
    case DType::E5M2:
      for (size_t i = 0; i < n; ++i) {
        out[i] = fp8_to_float(static_cast<const uint8_t*>(in)[i], dtype_);
      }
      break;
    case DType::I32:
      for (size_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(static_cast<const int32_t*>(in)[i]);
      break;
    case DType::I64:
      for (size_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(static_cast<const int64_t*>(in)[i]);
      break;
    case DType::U8:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<const uint8_t*>(in)[i];
      break;
  }
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  auto is_float = [](DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; };
  OCTET_CHECK(is_float(dtype_) || is_fp8(dtype_), "to(", dtype_name(dtype), "): source dtype ",
              dtype_name(dtype_), " is not a floating-point type");
  OCTET_CHECK(is_float(dtype) || is_fp8(dtype), "to(", dtype_name(dtype),
              "): expected a floating-point target");
  Tensor out = empty(shape_, dtype, device_);
  size_t n = static_cast<size_t>(numel_);
  // Go through F32 unless a direct kernel exists.
  Tensor wide;
  const float* f32 = nullptr;
  if (dtype_ == DType::F32) {
    f32 = data<float>();
  } else {
    wide = Tensor::from_floats(shape_, to_floats());
    f32 = wide.data<float>();
  }
  switch (dtype) {
    case DType::F32:
      std::memcpy(out.raw(), f32, n * sizeof(float));
      break;
    case DType::BF16:
      convert_f32_to_bf16(f32, out.data<bfloat16>(), n);
      break;
    case DType::F16:
      convert_f32_to_f16(f32, out.data<float16>(), n);
      break;
    default: {  // FP8: unscaled and saturating, as a quantizer with scale 1
      uint8_t* codes = static_cast<uint8_t*>(out.raw());
      for (size_t i = 0; i < n; ++i) codes[i] = float_to_fp8(f32[i], dtype, /*saturate=*/true);
      break;
    }
  }
  return out;
}

void check_shape(const Tensor& tensor, const Shape& expected, std::string_view what,
                 std::string_view names) {
  if (tensor.shape() == expected) return;
  std::string symbolic = names.empty() ? "" : detail::concat("[", names, "]=");
  fail(detail::concat(what, " expected ", symbolic, shape_str(expected), ", got ",
                      tensor.defined() ? shape_str(tensor.shape()) : "an undefined tensor"));
}

void check_dtype(const Tensor& tensor, DType expected, std::string_view what) {
  OCTET_CHECK(tensor.dtype() == expected, what, " expected dtype ", dtype_name(expected), ", got ",
              dtype_name(tensor.dtype()));
}

void check_dtype_in(const Tensor& tensor, std::initializer_list<DType> allowed,
                    std::string_view what) {
  std::string names;
  for (DType dtype : allowed) {
    if (dtype == tensor.dtype()) return;
    names += names.empty() ? "" : " or ";
    names += dtype_name(dtype);
  }
  fail(detail::concat(what, " expected dtype ", names, ", got ", dtype_name(tensor.dtype())));
}

void copy_columns(const Tensor& x, int64_t begin, int64_t width, Tensor& out, int64_t at) {
  OCTET_CHECK(x.dtype() == out.dtype() && x.rows() == out.rows() && begin >= 0 &&
                  begin + width <= x.cols() && at >= 0 && at + width <= out.cols(),
              "copy_columns: columns [", begin, ",", begin + width, ") of ", shape_str(x.shape()),
              " ", dtype_name(x.dtype()), " do not fit ", shape_str(out.shape()), " ",
              dtype_name(out.dtype()), " at column ", at);
  const int64_t rows = x.rows(), cols = x.cols(), out_cols = out.cols();
  const size_t element = dtype_bytes(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(out.raw());
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + (r * out_cols + at) * element, src + (r * cols + begin) * element,
                static_cast<size_t>(width) * element);
  }
}

}  // namespace octet
