// Tensor, storage, dtype and processor-feature basics.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "octet/cpu_features.h"
#include "octet/tensor.h"
#include "test_util.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

TEST(DType, NamesSizesAndParsing) {
  EXPECT_EQ(dtype_bytes(DType::F32), 4u);
  EXPECT_EQ(dtype_bytes(DType::BF16), 2u);
  EXPECT_EQ(dtype_bytes(DType::F16), 2u);
  EXPECT_EQ(dtype_bytes(DType::E4M3), 1u);
  EXPECT_EQ(dtype_bytes(DType::E5M2), 1u);
  EXPECT_EQ(dtype_bytes(DType::I32), 4u);
  EXPECT_EQ(dtype_bytes(DType::I64), 8u);
  EXPECT_EQ(dtype_bytes(DType::U8), 1u);
  for (DType d : {DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::E5M2, DType::I32,
                  DType::I64, DType::U8}) {
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  }
  EXPECT_THROW(parse_dtype("fp9"), Error);
  try {
    parse_dtype("fp9");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected one of"), std::string::npos);
  }
}

TEST(Tensor, AlignedAndCounted) {
  MemoryStats before = memory_stats();
  {
    Tensor a = Tensor::empty({3, 5, 7}, DType::BF16);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.raw()) % kTensorAlignmentBytes, 0u);
    EXPECT_EQ(a.numel(), 105);
    EXPECT_EQ(a.nbytes(), 210u);
    EXPECT_EQ(a.rows(), 15);
    EXPECT_EQ(a.cols(), 7);
    EXPECT_EQ(a.dim(-1), 7);
    EXPECT_THROW(a.dim(3), Error);
    EXPECT_EQ(memory_stats().current_bytes, before.current_bytes + 210);
    EXPECT_GE(memory_stats().peak_bytes, before.current_bytes + 210);
  }
  EXPECT_EQ(memory_stats().current_bytes, before.current_bytes);
}

// Storages of 4 MiB and more: 2 MiB-aligned, and a freed one is reused by the next storage of
// the same rounded size (not counted as in use while kept), except under AddressSanitizer.
TEST(Tensor, LargeStoragesAreKeptAndReusedBySize) {
  release_cached_storage();
  const MemoryStats before = memory_stats();
  const size_t bytes = (size_t{5} << 20) + 100;  // rounds to 6 MiB
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8);
    first = a.raw();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % (size_t{2} << 20), 0u);
    std::memset(a.raw(), 0x5a, bytes);
  }
  EXPECT_EQ(memory_stats().current_bytes, before.current_bytes);
#if defined(__SANITIZE_ADDRESS__)
  EXPECT_EQ(cached_storage_bytes(), 0);
#else
  EXPECT_EQ(cached_storage_bytes(), int64_t{6} << 20);
  {
    // Another size does not take it; the same rounded size does (contents unspecified).
    Tensor other = Tensor::empty({int64_t{9} << 20}, DType::U8);
    EXPECT_NE(other.raw(), first);
    EXPECT_EQ(cached_storage_bytes(), int64_t{6} << 20);
    Tensor again = Tensor::empty({int64_t{6} << 20}, DType::U8);
    EXPECT_EQ(again.raw(), first);
    EXPECT_EQ(cached_storage_bytes(), 0);
    Tensor zeros = Tensor::zeros({int64_t{1} << 20}, DType::F32);  // 4 MiB, fresh and zeroed
    EXPECT_EQ(zeros.data<float>()[12345], 0.0f);
  }
  EXPECT_EQ(cached_storage_bytes(), (int64_t{6} + 10 + 4) << 20);
  Tensor reused_zeros = Tensor::zeros({int64_t{1} << 20}, DType::F32);  // reuses, zeroes again
  EXPECT_EQ(reused_zeros.data<float>()[12345], 0.0f);
  release_cached_storage();
  EXPECT_EQ(cached_storage_bytes(), 0);
#endif
}

TEST(Tensor, MidSizeStoragesAreKeptIn64KiBSizes) {
  release_cached_storage();
  [[maybe_unused]] void* first = nullptr;  // unused under AddressSanitizer
  {
    Tensor a = Tensor::empty({(int64_t{3} << 20) + 1}, DType::U8);  // 3 MiB + 1: 3 MiB + 64 KiB
    first = a.raw();
    Tensor small = Tensor::empty({int64_t{200} << 10}, DType::U8);  // under 256 KiB: malloc's
  }
#if defined(__SANITIZE_ADDRESS__)
  EXPECT_EQ(cached_storage_bytes(), 0);
#else
  EXPECT_EQ(cached_storage_bytes(), (int64_t{3} << 20) + (int64_t{64} << 10));
  {
    Tensor same = Tensor::zeros({(int64_t{3} << 20) + 1000}, DType::U8);  // same rounded size
    EXPECT_EQ(same.raw(), first);
    EXPECT_EQ(same.data<uint8_t>()[(int64_t{3} << 20) + 999], 0);
    EXPECT_EQ(cached_storage_bytes(), 0);
  }
  release_cached_storage();
  EXPECT_EQ(cached_storage_bytes(), 0);
#endif
}

TEST(Tensor, ZerosReshapeSliceShareStorage) {
  Tensor a = Tensor::zeros({4, 6}, DType::F32);
  for (float v : a.to_floats()) EXPECT_EQ(v, 0.0f);
  Tensor b = a.reshape({2, -1, 3});
  EXPECT_EQ(b.shape(), (Shape{2, 4, 3}));
  b.data<float>()[5] = 2.5f;
  EXPECT_EQ(a.data<float>()[5], 2.5f);
  Tensor rows = a.slice_rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 6}));
  EXPECT_EQ(rows.data<float>(), a.data<float>() + 6);
  EXPECT_THROW(a.reshape({5, 5}), Error);
  EXPECT_THROW(a.reshape({-1, -1}), Error);
  EXPECT_THROW(a.slice_rows(2, 5), Error);
  Tensor c = a.clone();
  c.data<float>()[5] = 1.0f;
  EXPECT_EQ(a.data<float>()[5], 2.5f);
}

TEST(Tensor, ErrorsNameExpectedAndGot) {
  Tensor a = Tensor::empty({8, 256, 512}, DType::F32);
  try {
    check_shape(a, {8, 256, 384}, "layernorm: input", "B,T,C");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "layernorm: input expected [B,T,C]=[8,256,384], got [8,256,512]");
  }
  try {
    check_dtype(a, DType::BF16, "gemm: A");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "gemm: A expected dtype bf16, got f32");
  }
  EXPECT_THROW(check_dtype_in(a, {DType::BF16, DType::F16}, "x"), Error);
  EXPECT_NO_THROW(check_dtype_in(a, {DType::BF16, DType::F32}, "x"));
  EXPECT_THROW(a.data<bfloat16>(), Error);
  EXPECT_THROW(Tensor::empty({2, -3}, DType::F32), Error);
  EXPECT_THROW(Tensor::empty({2}, DType::F32, Device::CUDA), Error);
  Tensor undefined;
  EXPECT_THROW(undefined.raw(), Error);
}

// Error texts: pieces that are all text are appended (the checks' names, on every call),
// anything else goes through a stream, and both read alike.
TEST(Errors, ConcatOfTextAndOfNumbers) {
  const std::string name = "layernorm_forward";
  const std::string_view view = ": gamma";
  const char* pointer = " expected [C]";
  EXPECT_EQ(detail::concat(name, view, pointer, "!"), "layernorm_forward: gamma expected [C]!");
  EXPECT_EQ(detail::concat("rows ", 3, ", scale ", 0.5f, ' ', name),
            "rows 3, scale 0.5 layernorm_forward");
  EXPECT_EQ(detail::concat(), "");
  try {
    OCTET_CHECK(name.empty(), name, view, " got ", 768);
    FAIL() << "OCTET_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "layernorm_forward: gamma got 768");
  }
}

TEST(Tensor, ConversionsRoundTrip) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               1.00390625f,
                               3.14159265f,
                               -65504.0f,
                               1e-8f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  Tensor x = Tensor::from_floats({static_cast<int64_t>(values.size())}, values);
  std::vector<float> bf16 = x.to(DType::BF16).to_floats();
  std::vector<float> f16 = x.to(DType::F16).to_floats();
  for (size_t i = 0; i < values.size(); ++i) {
    float expect_bf16 = bf16_to_float(float_to_bf16(values[i]));
    float expect_f16 = f16_to_float(float_to_f16(values[i]));
    if (std::isnan(values[i])) {
      EXPECT_TRUE(std::isnan(bf16[i]) && std::isnan(f16[i]));
    } else {
      EXPECT_EQ(bf16[i], expect_bf16) << values[i];
      EXPECT_EQ(f16[i], expect_f16) << values[i];
    }
  }
  // 1 + 2^-8 is the midpoint between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one.
  EXPECT_EQ(bf16[3], 1.0f);
  EXPECT_EQ(bf16[4], 3.140625f);
  EXPECT_EQ(f16[6], 0.0f);  // 1e-8 is below half the smallest f16 subnormal (2^-25)
}

TEST(Cpu, FeaturesAreConsistent) {
  const CpuFeatures& f = cpu_features();
  EXPECT_TRUE(!f.avx512bw || f.avx512f);
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512f);
  EXPECT_TRUE(!f.amx_bf16 || f.amx_tile);
  Isa original = active_isa();
  set_active_isa(Isa::Scalar);
  EXPECT_EQ(active_isa(), Isa::Scalar);
  set_active_isa(Isa::Avx512);  // clamps to what the processor has
  EXPECT_TRUE(f.avx512f || active_isa() != Isa::Avx512);
  // A path is unavailable exactly when set_active_isa clamps it away, and then names what
  // the processor lacks.
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    set_active_isa(isa);
    EXPECT_EQ(isa_unavailable_reason(isa).empty(), active_isa() == isa)
        << isa_name(isa) << ": '" << isa_unavailable_reason(isa) << "'";
  }
  EXPECT_EQ(isa_unavailable_reason(Isa::Scalar), "");
  EXPECT_EQ(isa_unavailable_reason(Isa::Avx512).empty(),
            f.avx512f && f.avx512bw && f.avx512vl && f.f16c);
  if (!f.avx512bw) {
    EXPECT_NE(isa_unavailable_reason(Isa::Avx512).find("AVX512BW"), std::string::npos);
  }
  set_active_isa(original);
  EXPECT_GE(num_threads(), 1);
}

}  // namespace
}  // namespace octet
