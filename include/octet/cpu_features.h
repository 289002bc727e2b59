// Processor features, detected once at run time; kernels dispatch on them.
#pragma once

#include <string>

namespace octet {

enum class Isa { Scalar, Avx2, Avx512 };

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
  std::string brand;
};

const CpuFeatures& cpu_features();
// The instruction set kernels use: the best the processor has, lowered by the environment
// variable OCTET_ISA=scalar|avx2|avx512 (for testing every path on one machine).
Isa active_isa();
void set_active_isa(Isa isa);  // clamps to what the processor supports
const char* isa_name(Isa isa);
// Why this processor cannot run `isa`'s kernels, e.g. "no AVX512BW, AVX512VL" (features the
// processor lacks or the OS does not enable); empty when it can. set_active_isa clamps such
// an isa to the best one available.
std::string isa_unavailable_reason(Isa isa);
int num_threads();  // OpenMP threads kernels use
// VDPBF16PS's flops per second over the AVX-512 F32 FMA's, measured once per process by
// register-only loops (0 where the processor lacks either): 0.5 on a Xeon VM without AMX, 1.84
// on an AMD EPYC (Zen 5). BF16 GEMMs and flash attention's BF16 tiles run where it is >= 0.75.
double bf16_dot_rate();

}  // namespace octet
