// PackedWeight's state: the source weight and its copies packed in the layouts oneDNN chose.
#pragma once

#include <mutex>
#include <utility>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "gemm/fp8_operand.h"
#include "octet/gemm.h"

namespace octet::gemm_detail {

struct PackedWeightState {
  bool trans = false;  // the source is [N,K]
  int64_t k = 0;
  int64_t n = 0;
  bool is_fp8 = false;
  Tensor tensor;         // F32 / BF16 source (shares the caller's storage)
  Float8Tensor fp8;      // FP8 source
  Fp8Operand operand;    // FP8: the usage with blocks along K, seen as a B operand
  bool foldable = true;  // FP8: exact BF16 widening possible

  std::mutex mutex;
  std::vector<std::pair<dnnl::memory::desc, dnnl::memory>> packed;
  int64_t pack_count = 0;   // reorders done (tests prove reuse with it)
  int64_t pair_width = -1;  // pair_blocked()'s probe: -1 not yet, 0 another layout
  dnnl::memory::desc pair_desc;

  // The weight as [K,N] in `desc` (a layout from a primitive created with weights `any`),
  // reordered on first request and reused until mark_updated(). An FP8 source is widened
  // first (BF16 with block scales folded, or F32); its per-tensor scale is left out.
  dnnl::memory packed_for(const dnnl::memory::desc& desc);
  // A BF16 weight as oneDNN's BF16 matmul packs it, when that layout is blocks of `width`
  // columns of K pairs (BA16a{width}b2a, what the few-rows kernel reads): packed on first
  // request, the same copy the matmul reuses (the caller holds the returned memory while it
  // reads, as a matmul holds its arguments). Empty (width 0) for an FP8 or F32 source, where
  // BF16 GEMMs run widened, and where oneDNN chose another layout (probed once per weight).
  dnnl::memory pair_blocked(int64_t& width);
  float fp8_scale_inv() const;  // per-tensor scale_inv of an FP8 source, else 1
  void refresh();               // drops packed copies, re-reads FP8 scales
};

}  // namespace octet::gemm_detail

namespace octet {

struct PackedWeightAccess {
  static gemm_detail::PackedWeightState& state(PackedWeight& weight);
  static int64_t pack_count(PackedWeight& weight);
  static size_t packed_layouts(PackedWeight& weight);
};

}  // namespace octet
