// GEMM: C = act(alpha * op(A) op(B) + beta * C + bias), FP32 accumulation.
//
// Row-major operands. op(A) is [M,K]: A is [M,K], or [K,M] with trans_a. op(B) is [K,N]:
// B is [K,N], or [N,K] with trans_b (a Linear weight [out,in] is used with trans_b).
// beta = 1 accumulates into C (weight-gradient accumulation). bias is [N].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "octet/fp4.h"
#include "octet/fp8.h"
#include "octet/tensor.h"

namespace octet {

enum class Activation { None, GeluTanh, GeluErf, Relu };

struct Epilogue {
  const Tensor* bias = nullptr;  // [N], F32 or BF16; added before the activation
  Activation activation = Activation::None;
};

// A: F32 or BF16, B: same dtype as A, C: F32 (or BF16 when A is BF16).
void gemm(const Tensor& A, const Tensor& B, Tensor& C, bool trans_a, bool trans_b,
          float alpha = 1.0f, float beta = 0.0f, const Epilogue& epilogue = {});

// A weight (the B operand) kept in the layout oneDNN prefers for it, packed once and reused
// until the weight changes: call mark_updated() after each optimizer step.
// Holds either an F32/BF16 tensor or a Float8Tensor.
class PackedWeight {
 public:
  PackedWeight();
  PackedWeight(const Tensor& weight, bool trans);        // [K,N], or [N,K] with trans
  PackedWeight(const Float8Tensor& weight, bool trans);  // FP8, widened to BF16 when packed
  ~PackedWeight();
  void mark_updated();
  bool trans() const;
  int64_t k() const;
  int64_t n() const;

 private:
  friend struct PackedWeightAccess;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

void gemm(const Tensor& A, PackedWeight& B, Tensor& C, bool trans_a, float alpha = 1.0f,
          float beta = 0.0f, const Epilogue& epilogue = {});

// FP8 GEMM in any recipe layout: per-tensor (E4M3 x E4M3, E4M3 x E5M2 ...), MXFP8 1x32,
// 1x128 and 128x128 blocks. Needs each operand's scaling blocks along K: A with trans_a and
// B without trans_b must carry columnwise data (their transposed copy).
// Power-of-two block scales are folded into an exact BF16 widening; FP32 block scales are
// applied per K block. The result equals the dequantized product to FP32 rounding.
void gemm(const Float8Tensor& A, const Float8Tensor& B, Tensor& C, bool trans_a, bool trans_b,
          float alpha = 1.0f, float beta = 0.0f, const Epilogue& epilogue = {});
void gemm(const Float8Tensor& A, PackedWeight& B, Tensor& C, bool trans_a, float alpha = 1.0f,
          float beta = 0.0f, const Epilogue& epilogue = {});

// FP4 GEMM (NVFP4, MXFP4): each operand's blocks must lie along K (A without trans_a, B with
// trans_b; the other orientation needs 16x16 blocks). Both operands are widened to BF16 as
// e2m1 * block scale, exact, multiplied with FP32 accumulation, and alpha takes the two
// global scales: the numbers of a native FP4 GEMM with FP32 accumulation.
void gemm(const Float4Tensor& A, const Float4Tensor& B, Tensor& C, bool trans_a, bool trans_b,
          float alpha = 1.0f, float beta = 0.0f, const Epilogue& epilogue = {});

// Weight-only FP8 for memory-bound inference (decode): W [N, K] quantized once to E4M3, real
// value = e4m3(code) * scale_inv of the code's scaling block, each block's scale_inv its
// amax / 448 (1 for an all-zero block):
//   PerChannel: one scale per output channel (row n of W), scale_inv [N];
//   Block128:   one per 128 x 128 block (rows and columns; the last ones may be partial),
//               scale_inv [ceil(N / 128), ceil(K / 128)] row-major: DeepSeek-V3's FP8 weights
//               (`weight_scale_inv`), TransformerEngine's Float8BlockScaling for weights. A
//               row's outlier then coarsens only its own 128 columns.
enum class Fp8WeightScaling { PerChannel, Block128 };
constexpr int64_t kFp8WeightBlock = 128;
struct Fp8WeightOnly {
  Tensor codes;      // [N, K] E4M3
  Tensor scale_inv;  // F32, [N] or [ceil(N / 128), ceil(K / 128)] (see Fp8WeightScaling)
  Fp8WeightScaling scaling = Fp8WeightScaling::PerChannel;
  size_t nbytes() const { return codes.nbytes() + scale_inv.nbytes(); }
};
// "channel" / "block128", and back (throws naming the accepted names).
const char* fp8_weight_scaling_name(Fp8WeightScaling scaling);
Fp8WeightScaling parse_fp8_weight_scaling(const std::string& name);
// W [N, K] F32|BF16 (finite) -> codes rounded to nearest even, saturating.
Fp8WeightOnly quantize_weight_fp8(const Tensor& weight,
                                  Fp8WeightScaling scaling = Fp8WeightScaling::PerChannel);
// The real values, [N, K] in dtype (F32 exact; BF16 rounds the scaled value once).
Tensor dequantize_weight_fp8(const Fp8WeightOnly& weight, DType dtype);
// C [M, N] = epilogue(A [M, K] . dequantized(B)^T), A F32|BF16, C A's dtype or F32, FP32
// accumulation. B's bytes are read and widened in registers: BF16 A on AVX-512 BF16 up to 256
// rows (gemm/small_m.h, passes of 8 rows, epilogue fused), otherwise up to 8 rows (AVX-512,
// AVX2 or scalar by the processor); more rows widen B once and run the BF16/F32 GEMM. Under
// Block128 the kernels read, for each block row of B (128 columns), A widened to F32 and
// multiplied by that row's K-block scales (one rounding), then the codes' exact products in
// F32 sums: within FP32 rounding of the dequantized product. BF16 A takes the AVX2 form of the
// few-rows kernel on every processor that has AVX2 (the AVX-512 BF16 one has no block scales).
void gemm(const Tensor& A, const Fp8WeightOnly& B, Tensor& C, const Epilogue& epilogue = {});

// Whether BF16 GEMMs run as oneDNN BF16 matmuls (AVX-512 BF16 / AMX, or AVX-512 emulation),
// or widened: the operands, exact in F32, widened and the F32 matmul run with the same FP32
// accumulation (a BF16 C rounded to nearest even after). Widened where oneDNN 2.6 has no BF16
// matmul (no AVX-512), and where the processor's BF16 dot product (VDPBF16PS) does fewer than
// 0.75x the F32 FMA's flops per second without AMX (gemm_bf16_dot_rate(): a Xeon VM measured
// 0.5, its F32 matmul 300 GFLOP/s beside the BF16 one's 165). Chosen once per process;
// OCTET_GEMM_BF16=widen|native forces a path (native only where oneDNN has one; tests run
// both), auto (or unset) chooses.
bool gemm_bf16_native();
// VDPBF16PS's flops per second over the AVX-512 FMA's, measured by register-only loops (0 where
// the processor lacks either).
double gemm_bf16_dot_rate();

// Naive triple loop with FP64 accumulation over F32 views of the operands (the test oracle).
void gemm_reference(const Tensor& A, const Tensor& B, Tensor& C, bool trans_a, bool trans_b,
                    float alpha = 1.0f, float beta = 0.0f, const Epilogue& epilogue = {});
// The plain FP32 loop a newcomer would write (the benchmark's naive_f32 baseline).
void gemm_naive_f32(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K);

// Scalar activation used by the epilogues (and their references).
float apply_activation(Activation activation, float x);

}  // namespace octet
