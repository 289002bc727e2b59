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
