// Run-time processor feature detection (cpuid + xgetbv) and the active instruction set.
#include "octet/cpu_features.h"

#include <cpuid.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "octet/error.h"

namespace octet {
namespace {

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  bool osxsave = ecx & bit_OSXSAVE;
  bool has_fma = ecx & bit_FMA;
  bool has_f16c = ecx & bit_F16C;
  bool has_avx = ecx & bit_AVX;
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  bool os_ymm = (xcr0 & 0x6) == 0x6;          // SSE and AVX state
  bool os_zmm = (xcr0 & 0xe6) == 0xe6;        // plus opmask and the upper ZMM registers
  bool os_amx = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = has_avx && os_ymm && (ebx & bit_AVX2);
    f.fma = f.avx2 && has_fma;
    f.f16c = has_avx && os_ymm && has_f16c;
    f.avx512f = os_zmm && (ebx & bit_AVX512F);
    f.avx512bw = f.avx512f && (ebx & bit_AVX512BW);
    f.avx512vl = f.avx512f && (ebx & bit_AVX512VL);
    f.amx_bf16 = os_amx && (edx & (1u << 22));
    f.amx_tile = os_amx && (edx & (1u << 24));
    unsigned eax1 = 0, ebx1 = 0, ecx1 = 0, edx1 = 0;
    __cpuid_count(7, 1, eax1, ebx1, ecx1, edx1);
    f.avx512_bf16 = f.avx512f && (eax1 & (1u << 5));
  }
  unsigned brand[12] = {};
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002u + i, &brand[4 * i], &brand[4 * i + 1], &brand[4 * i + 2],
                  &brand[4 * i + 3]);
    }
    char text[49] = {};
    std::memcpy(text, brand, 48);
    f.brand = text;
    while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
  }
  return f;
}

// The features `isa`'s kernels need that `f` lacks, by name ("" when it has them all).
// One list, so that best_isa and the reason a path is unavailable cannot disagree.
std::string missing_features(const CpuFeatures& f, Isa isa) {
  std::string missing;
  auto need = [&missing](bool have, const char* name) {
    if (have) return;
    if (!missing.empty()) missing += ", ";
    missing += name;
  };
  if (isa == Isa::Avx512) {
    need(f.avx512f, "AVX512F");
    need(f.avx512bw, "AVX512BW");
    need(f.avx512vl, "AVX512VL");
    need(f.f16c, "F16C");
  } else if (isa == Isa::Avx2) {
    need(f.avx2, "AVX2");
    need(f.fma, "FMA");
    need(f.f16c, "F16C");
  }
  return missing;
}

Isa best_isa(const CpuFeatures& f) {
  if (missing_features(f, Isa::Avx512).empty()) return Isa::Avx512;
  if (missing_features(f, Isa::Avx2).empty()) return Isa::Avx2;
  return Isa::Scalar;
}

Isa clamp_isa(Isa wanted) {
  static const Isa best = best_isa(cpu_features());
  return static_cast<int>(wanted) < static_cast<int>(best) ? wanted : best;
}

Isa initial_isa() {
  const char* env = std::getenv("OCTET_ISA");
  if (env == nullptr || *env == '\0') return best_isa(cpu_features());
  std::string_view name(env);
  if (name == "scalar") return Isa::Scalar;
  if (name == "avx2") return clamp_isa(Isa::Avx2);
  if (name == "avx512") return clamp_isa(Isa::Avx512);
  fail(detail::concat("OCTET_ISA='", name, "': expected scalar, avx2 or avx512"));
}

std::atomic<Isa>& isa_slot() {
  static std::atomic<Isa> slot{initial_isa()};
  return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa active_isa() {
  return isa_slot().load(std::memory_order_relaxed);
}

void set_active_isa(Isa isa) {
  isa_slot().store(clamp_isa(isa), std::memory_order_relaxed);
}

std::string isa_unavailable_reason(Isa isa) {
  const std::string missing = missing_features(cpu_features(), isa);
  return missing.empty() ? missing : "no " + missing;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return "scalar";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
  }
  return "unknown";
}

int num_threads() {
  return omp_get_max_threads();
}

}  // namespace octet
