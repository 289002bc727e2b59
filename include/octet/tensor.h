// Tensor: a shape, a dtype, a device and a view into shared, 64-byte aligned storage.
// Tensors are dense and row-major (the last dimension is contiguous).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "octet/dtype.h"
#include "octet/error.h"

namespace octet {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);  // "[8,256,384]"
int64_t shape_numel(const Shape& shape);

inline constexpr size_t kTensorAlignmentBytes = 64;

// Bytes held by live CPU storages; tests use it to prove a kernel's peak memory.
struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;
};
MemoryStats memory_stats();
void reset_peak_memory();  // peak := current
// Freed storages of 256 KiB and more are kept for reuse by a storage of the same size (at most
// OCTET_STORAGE_CACHE_MB, default 1024; not under AddressSanitizer): the bytes kept, not
// counted in memory_stats(), and a call that frees them all.
int64_t cached_storage_bytes();
void release_cached_storage();

class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = Device::CPU);
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::CPU);
  // F32 tensor holding `values` (numel must match).
  static Tensor from_floats(Shape shape, const std::vector<float>& values);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int index) const;  // negative counts from the end
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_bytes(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // The tensor seen as a matrix: rows = product of all but the last dimension.
  int64_t rows() const;
  int64_t cols() const;

  void* raw();
  const void* raw() const;
  template <typename T>
  T* data() {
    check_element<T>();
    return static_cast<T*>(raw());
  }
  template <typename T>
  const T* data() const {
    check_element<T>();
    return static_cast<const T*>(raw());
  }

  Tensor reshape(Shape shape) const;                    // shares storage; one -1 is inferred
  Tensor slice_rows(int64_t begin, int64_t end) const;  // rows [begin,end) of dim 0, shared
  Tensor view_as(DType dtype) const;  // same bytes read as another dtype of the same width
  Tensor clone() const;
  Tensor to(DType dtype) const;  // converted copy (round to nearest even)
  void zero_();
  void copy_from(const Tensor& source);  // same shape and dtype

  std::vector<float> to_floats() const;  // any float dtype, converted to F32 (for tests)

 private:
  template <typename T>
  void check_element() const {
    OCTET_CHECK(dtype_of<T>::value == dtype_, "tensor of dtype ", dtype_name(dtype_),
                " accessed as ", dtype_name(dtype_of<T>::value));
  }

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

// Boundary checks with messages such as "gemm: C expected [M,N]=[8,256], got [8,512]".
// `names` spells the symbolic shape ("M,N"); empty means print only numbers.
void check_shape(const Tensor& tensor, const Shape& expected, std::string_view what,
                 std::string_view names = "");
void check_dtype(const Tensor& tensor, DType expected, std::string_view what);
void check_dtype_in(const Tensor& tensor, std::initializer_list<DType> allowed,
                    std::string_view what);

// Copies columns [begin, begin + width) of x [N, C] into out [N, W] at column `at` (same
// dtype; both seen as [rows, cols]).
void copy_columns(const Tensor& x, int64_t begin, int64_t width, Tensor& out, int64_t at);

}  // namespace octet
