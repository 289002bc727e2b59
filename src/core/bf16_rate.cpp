// How fast this processor's BF16 dot-product instruction (VDPBF16PS) runs against its F32 FMA,
// per floating-point operation: where it issues at half the FMA's rate (measured 0.5 on a
// Xeon VM without AMX: oneDNN's BF16 matmul 165 GFLOP/s beside its F32 matmul 300), BF16
// GEMMs are faster widened to F32 (exact) on the FMA units; where it matches or beats the FMA
// (AMD Zen 4, or AMX behind oneDNN), the native BF16 matmul is. A register-only loop: the
// ratio does not depend on memory or on the machine's load the way a GEMM's time does. In core:
// the GEMMs and flash attention's tiles (ops) choose their path by it.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "octet/cpu_features.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace octet {

namespace {

constexpr int64_t kIterations = 4096;

// 12 independent accumulators cover the instructions' latency at full issue rate; the loops
// return their first lanes' sum (the work stays observable).
#define OCTET_RATE_ACCUMULATORS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define OCTET_RATE_DECLARE(i) __m512 acc##i = _mm512_set1_ps(seed[i]);
#define OCTET_RATE_LANE(i)        \
  _mm512_store_ps(lanes, acc##i); \
  total += lanes[0];
#define OCTET_RATE_RETURN_SUM()            \
  alignas(64) float lanes[16];             \
  float total = 0;                         \
  OCTET_RATE_ACCUMULATORS(OCTET_RATE_LANE) \
  return total;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline)) float dot_loop(
    const float* seed) {
  OCTET_RATE_ACCUMULATORS(OCTET_RATE_DECLARE)
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_ps(seed[12]));
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_ps(seed[13]));
  for (int64_t i = 0; i < kIterations; ++i) {
#define OCTET_STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
    OCTET_RATE_ACCUMULATORS(OCTET_STEP)
#undef OCTET_STEP
  }
  OCTET_RATE_RETURN_SUM()
}

__attribute__((target("avx512f,fma"), noinline)) float fma_loop(const float* seed) {
  OCTET_RATE_ACCUMULATORS(OCTET_RATE_DECLARE)
  const __m512 a = _mm512_set1_ps(seed[12]);
  const __m512 b = _mm512_set1_ps(seed[13]);
  for (int64_t i = 0; i < kIterations; ++i) {
#define OCTET_STEP(i) acc##i = _mm512_fmadd_ps(a, b, acc##i);
    OCTET_RATE_ACCUMULATORS(OCTET_STEP)
#undef OCTET_STEP
  }
  OCTET_RATE_RETURN_SUM()
}

#undef OCTET_RATE_RETURN_SUM
#undef OCTET_RATE_LANE
#undef OCTET_RATE_DECLARE
#undef OCTET_RATE_ACCUMULATORS

template <class Loop>
double seconds_of(Loop loop, const float* seed, volatile float& sink) {
  const auto start = std::chrono::steady_clock::now();
  sink = sink + loop(seed);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace {

double measure_bf16_dot_rate() {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f || !f.avx512_bf16 || !f.fma) return 0.0;
  // Inputs the compiler cannot see: products of 1 (normal numbers: a subnormal FMA can take a
  // microcode assist), sums up to kIterations, exact.
  static volatile float seed_source[14] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f};
  float seed[14];
  for (int i = 0; i < 14; ++i) seed[i] = seed_source[i];
  volatile float sink = 0;
  // The fastest of rounds that alternate the two loops: a round the scheduler interrupts is
  // slower, never faster.
  double dot = 1e30, fma = 1e30;
  for (int round = 0; round < 9; ++round) {
    dot = std::min(dot, seconds_of(dot_loop, seed, sink));
    fma = std::min(fma, seconds_of(fma_loop, seed, sink));
  }
  // Per instruction: VDPBF16PS does 16 lanes x 2 products and sums (64 flops), FMA 32.
  const double dot_flops_per_s = 64.0 / dot, fma_flops_per_s = 32.0 / fma;
  return dot_flops_per_s / fma_flops_per_s;
}

}  // namespace

double bf16_dot_rate() {
  static const double rate = measure_bf16_dot_rate();
  return rate;
}

}  // namespace octet
