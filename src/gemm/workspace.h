// Reusable, 64-byte aligned scratch buffers (FP8 operands widened for the matmul).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace octet::gemm_detail {

class Buffer {
 public:
  // At least `bytes` of scratch; contents are not kept when it grows.
  void* reserve(size_t bytes) {
    if (bytes > capacity_) {
      const size_t rounded = (bytes + 63) / 64 * 64;
      data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
      if (!data_) throw std::bad_alloc();
      capacity_ = rounded;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t capacity_ = 0;
};

// Per-thread widening buffers for the two FP8 operands, kept between calls.
struct Fp8Workspace {
  Buffer a;
  Buffer b;
};
inline Fp8Workspace& fp8_workspace() {
  thread_local Fp8Workspace workspace;
  return workspace;
}

}  // namespace octet::gemm_detail
