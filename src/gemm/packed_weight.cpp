#include "gemm/packed_weight.h"

#include <memory>

#include "core/convert.h"
#include "gemm/matmul.h"
#include "gemm/workspace.h"

namespace octet {

using gemm_detail::PackedWeightState;

struct PackedWeight::Impl {
  PackedWeightState state;
};

PackedWeight::PackedWeight() = default;
PackedWeight::~PackedWeight() = default;

PackedWeight::PackedWeight(const Tensor& weight, bool trans) : impl_(std::make_shared<Impl>()) {
  OCTET_CHECK(weight.defined(), "PackedWeight: weight is undefined");
  OCTET_CHECK(weight.ndim() == 2, "PackedWeight: weight expected a matrix ",
              trans ? "[N,K]" : "[K,N]", ", got ", shape_str(weight.shape()));
  check_dtype_in(weight, {DType::F32, DType::BF16}, "PackedWeight: weight");
  OCTET_CHECK(weight.device() == Device::CPU, "PackedWeight: weight expected on cpu, got ",
              device_name(weight.device()));
  PackedWeightState& s = impl_->state;
  s.trans = trans;
  s.k = trans ? weight.dim(1) : weight.dim(0);
  s.n = trans ? weight.dim(0) : weight.dim(1);
  s.tensor = weight;
}

PackedWeight::PackedWeight(const Float8Tensor& weight, bool trans)
    : impl_(std::make_shared<Impl>()) {
  PackedWeightState& s = impl_->state;
  s.trans = trans;
  s.k = trans ? weight.cols : weight.rows;
  s.n = trans ? weight.rows : weight.cols;
  s.is_fp8 = true;
  s.fp8 = weight;
  // From the state's own copy: the operand points at its scale tensor, which must outlive
  // the caller's Float8Tensor.
  s.operand = gemm_detail::select_b_operand(s.fp8, trans, "PackedWeight: FP8 weight");
  s.foldable = gemm_detail::bf16_foldable(s.operand.matrix);
}

void PackedWeight::mark_updated() {
  if (impl_) impl_->state.refresh();
}
bool PackedWeight::trans() const {
  return impl_ ? impl_->state.trans : false;
}
int64_t PackedWeight::k() const {
  return impl_ ? impl_->state.k : 0;
}
int64_t PackedWeight::n() const {
  return impl_ ? impl_->state.n : 0;
}

gemm_detail::PackedWeightState& PackedWeightAccess::state(PackedWeight& weight) {
  OCTET_CHECK(weight.impl_ != nullptr, "gemm: PackedWeight is empty (default-constructed)");
  return weight.impl_->state;
}

int64_t PackedWeightAccess::pack_count(PackedWeight& weight) {
  PackedWeightState& s = state(weight);
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.pack_count;
}

size_t PackedWeightAccess::packed_layouts(PackedWeight& weight) {
  PackedWeightState& s = state(weight);
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.packed.size();
}

namespace gemm_detail {

float PackedWeightState::fp8_scale_inv() const {
  return is_fp8 ? tensor_scale_inv(operand.matrix) : 1.0f;
}

namespace {

// The width W when `desc` is a [K, N] BF16 layout BA16a{W}b2a without offset: blocks of W
// columns, each [ceil(K/32)][16][W][2] (K blocked by 16 x 2 = 32, zero-padded); else 0.
int64_t pair_blocked_width(const dnnl::memory::desc& desc, int64_t k, int64_t n) {
  const dnnl_memory_desc_t& d = desc.data;
  if (d.ndims != 2 || d.data_type != dnnl_bf16 || d.format_kind != dnnl_blocked || d.offset0 != 0 ||
      d.dims[0] != k || d.dims[1] != n) {
    return 0;
  }
  const dnnl_blocking_desc_t& b = d.format_desc.blocking;
  if (b.inner_nblks != 3 || b.inner_idxs[0] != 0 || b.inner_idxs[1] != 1 || b.inner_idxs[2] != 0 ||
      b.inner_blks[0] != 16 || b.inner_blks[2] != 2) {
    return 0;
  }
  const int64_t width = b.inner_blks[1];
  const int64_t padded_k = (k + 31) / 32 * 32;
  if (width % 16 != 0 || width < 16 || width > 64 || d.padded_dims[0] != padded_k ||
      d.padded_dims[1] != (n + width - 1) / width * width || b.strides[0] != 32 * width ||
      b.strides[1] != padded_k * width) {
    return 0;
  }
  return width;
}

}  // namespace

dnnl::memory PackedWeightState::pair_blocked(int64_t& width) {
  width = 0;
  if (is_fp8 || tensor.dtype() != DType::BF16 || !gemm_bf16_native()) return {};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (pair_width < 0) {
      pair_width = 0;
      try {
        // The layout the matmul asks for (the same at every M from 1 to 512 here, measured).
        using dnnl::memory;
        const memory::desc a({128, k}, memory::data_type::bf16, memory::format_tag::ab);
        const memory::desc b({k, n}, memory::data_type::bf16, memory::format_tag::any);
        const memory::desc c({128, n}, memory::data_type::bf16, memory::format_tag::ab);
        const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), cpu_engine());
        pair_width = pair_blocked_width(pd.weights_desc(), k, n);
        if (pair_width > 0) pair_desc = pd.weights_desc();
      } catch (const dnnl::error&) {
        pair_width = 0;
      }
    }
    if (pair_width == 0) return {};
  }
  dnnl::memory packed_copy = packed_for(pair_desc);
  width = pair_width;
  return packed_copy;
}

void PackedWeightState::refresh() {
  std::lock_guard<std::mutex> lock(mutex);
  packed.clear();
  if (is_fp8) foldable = bf16_foldable(operand.matrix);
}

dnnl::memory PackedWeightState::packed_for(const dnnl::memory::desc& desc) {
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [packed_desc, memory] : packed) {
    if (packed_desc == desc) return memory;
  }
  dnnl::engine& engine = cpu_engine();
  dnnl::memory source;
  std::unique_ptr<Buffer> widened;
  if (is_fp8) {
    const DType dtype =
        desc.data_type() == dnnl::memory::data_type::bf16 ? DType::BF16 : DType::F32;
    OCTET_CHECK(dtype == DType::F32 || foldable,
                "PackedWeight: FP8 weight scales cannot be folded into BF16 exactly");
    const Fp8Matrix& m = operand.matrix;
    widened = std::make_unique<Buffer>();
    void* data = widened->reserve(static_cast<size_t>(m.rows * m.cols) * dtype_bytes(dtype));
    widen(m, dtype, data);
    source = dnnl::memory(matrix_desc(k, n, dtype, operand.transposed), engine, data);
  } else if (tensor.dtype() == DType::BF16 && desc.data_type() == dnnl::memory::data_type::f32) {
    // A BF16 weight for the widened F32 matmul (no oneDNN BF16 matmul here): exact.
    widened = std::make_unique<Buffer>();
    void* data = widened->reserve(static_cast<size_t>(k * n) * sizeof(float));
    convert_bf16_to_f32(static_cast<const bfloat16*>(tensor.raw()), static_cast<float*>(data),
                        static_cast<size_t>(k * n));
    source = dnnl::memory(matrix_desc(k, n, DType::F32, trans), engine, data);
  } else {
    source = dnnl::memory(matrix_desc(k, n, tensor.dtype(), trans), engine,
                          const_cast<void*>(tensor.raw()));
  }
  dnnl::memory destination(desc, engine);
  dnnl::reorder(source, destination).execute(cpu_stream(), source, destination);
  cpu_stream().wait();
  packed.emplace_back(desc, destination);
  ++pack_count;
  return destination;
}

}  // namespace gemm_detail
}  // namespace octet
