// Module basics, the per-module FP8 state and its optional statistics (fp8_stats_scope).
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <variant>

#include "modules/common.h"
#include "octet/modules.h"

namespace octet {

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  collect_parameters(out);
  return out;
}

void Module::zero_grad() {
  for (Parameter* p : parameters()) p->grad.zero_();
}

void Fp8State::ensure_metas(const recipe::Recipe& recipe) {
  int history = 1;
  if (const auto* delayed = std::get_if<recipe::DelayedScaling>(&recipe)) {
    history = delayed->amax_history_len;
  }
  bool same_kind = recipe_.index() == recipe.index();
  if (!same_kind || forward_meta_.history_len() != history) {
    std::vector<TensorRole> forward_roles, backward_roles;
    for (int g = 0; g < num_gemms_; ++g) {
      forward_roles.push_back(TensorRole::Input);
      forward_roles.push_back(TensorRole::Weight);
      backward_roles.push_back(TensorRole::GradOutput);
    }
    forward_meta_ = FP8Meta(forward_roles, history);
    backward_meta_ = FP8Meta(backward_roles, history);
    forward_calls_ = 0;
    backward_calls_ = 0;
  }
  recipe_ = recipe;
}

void Fp8State::begin_forward(const recipe::Recipe& recipe) {
  if (recomputing_) return;
  ensure_metas(recipe);
  // Delayed scaling: this step's scales come from the amaxes recorded in earlier steps.
  if (const auto* delayed = std::get_if<recipe::DelayedScaling>(&recipe_)) {
    if (forward_calls_ > 0) forward_meta_.update(*delayed);
  }
  ++forward_calls_;
}

void Fp8State::begin_backward(const recipe::Recipe& recipe) {
  ensure_metas(recipe);
  if (const auto* delayed = std::get_if<recipe::DelayedScaling>(&recipe_)) {
    if (backward_calls_ > 0) backward_meta_.update(*delayed);
  }
  ++backward_calls_;
}

namespace {

Tensor floats_tensor(const std::vector<float>& values) {
  return Tensor::from_floats({static_cast<int64_t>(values.size())}, values);
}

std::vector<float> floats_of(const TensorMap& in, const std::string& name) {
  auto it = in.find(name);
  OCTET_CHECK(it != in.end(), "FP8 state: missing tensor '", name, "' in the checkpoint");
  check_dtype(it->second, DType::F32, "FP8 state: " + name);
  return it->second.to_floats();
}

}  // namespace

void Fp8State::save_state(TensorMap& out, const std::string& prefix) const {
  if (forward_meta_.history_len() == 0) return;
  for (auto [part, meta] : {std::pair<const char*, const FP8Meta*>{"forward.", &forward_meta_},
                            {"backward.", &backward_meta_}}) {
    out[prefix + part + "scale"] = floats_tensor(meta->scales());
    out[prefix + part + "scale_inv"] = floats_tensor(meta->scale_invs());
    out[prefix + part + "amax_history"] = floats_tensor(meta->amax_history_data());
  }
  Tensor calls = Tensor::empty({2}, DType::I64);
  calls.data<int64_t>()[0] = forward_calls_;
  calls.data<int64_t>()[1] = backward_calls_;
  out[prefix + "calls"] = calls;
}

void Fp8State::load_state(const TensorMap& in, const std::string& prefix,
                          const recipe::Recipe& recipe) {
  ensure_metas(recipe);
  for (auto [part, meta] : {std::pair<const char*, FP8Meta*>{"forward.", &forward_meta_},
                            {"backward.", &backward_meta_}}) {
    meta->restore(floats_of(in, prefix + part + "scale"),
                  floats_of(in, prefix + part + "scale_inv"),
                  floats_of(in, prefix + part + "amax_history"));
  }
  auto it = in.find(prefix + "calls");
  OCTET_CHECK(it != in.end(), "FP8 state: missing tensor '", prefix, "calls' in the checkpoint");
  check_shape(it->second, {2}, "FP8 state: " + prefix + "calls");
  check_dtype(it->second, DType::I64, "FP8 state: " + prefix + "calls");
  forward_calls_ = static_cast<int>(it->second.data<int64_t>()[0]);
  backward_calls_ = static_cast<int>(it->second.data<int64_t>()[1]);
}

Quantizer Fp8State::input_quantizer(int gemm) {
  return make_quantizer(recipe_, TensorRole::Input, &forward_meta_, 2 * gemm);
}

Quantizer Fp8State::weight_quantizer(int gemm) {
  return make_quantizer(recipe_, TensorRole::Weight, &forward_meta_, 2 * gemm + 1);
}

Quantizer Fp8State::grad_output_quantizer(int gemm) {
  return make_quantizer(recipe_, TensorRole::GradOutput, &backward_meta_, gemm);
}

bool Fp8State::input_scale_known() const {
  return std::holds_alternative<recipe::DelayedScaling>(recipe_);
}

float Fp8State::input_scale(int gemm) const {
  return forward_meta_.scale(2 * gemm);
}

void Fp8State::record_input_amax(int gemm, float amax) {
  forward_meta_.record_amax(2 * gemm, amax);
}

float Fp8State::grad_output_scale(int gemm) const {
  return backward_meta_.scale(gemm);
}

void Fp8State::record_grad_output_amax(int gemm, float amax) {
  backward_meta_.record_amax(gemm, amax);
}

const Fp8State::QuantizedWeight& Fp8State::quantized_weight(int gemm, const Tensor& weight,
                                                            const std::string& name,
                                                            const std::string& role) {
  if (weights_.size() != static_cast<size_t>(num_gemms_)) weights_.resize(num_gemms_);
  // Everything the quantization depends on besides the weight itself: the recipe and, under
  // delayed scaling, this step's scale (current and block scales follow from the weight).
  std::string key = recipe::describe(recipe_);
  const bool delayed = std::holds_alternative<recipe::DelayedScaling>(recipe_);
  if (delayed)
    key += " scale=" + std::to_string(std::bit_cast<uint32_t>(forward_meta_.scale(2 * gemm + 1)));
  std::optional<QuantizedWeight>& cached = weights_[static_cast<size_t>(gemm)];
  if (!cached || cached->key != key) {
    const Quantizer quantizer = weight_quantizer(gemm);
    Float8Tensor q = quantizer.quantize(weight, true, modules_detail::needs_columnwise(quantizer));
    PackedWeight packed(q, /*trans=*/true);
    cached = QuantizedWeight{std::move(q), std::move(packed), std::move(key)};
  } else if (delayed) {
    forward_meta_.record_amax(2 * gemm + 1, cached->weight.amax);
  }
  if (fp8_stats_enabled()) record_stats(name, role, weight, cached->weight);
  return *cached;
}

namespace {

thread_local bool stats_enabled = false;

float element_of(const float* x, int64_t i) {
  return x[i];
}
float element_of(const bfloat16* x, int64_t i) {
  return std::bit_cast<float>(static_cast<uint32_t>(x[i].bits) << 16);
}

// The scale element (r, c) of q was quantized with, one entry per scaling block:
// scales[(r / block_rows) * block_cols_count + c / block_cols].
struct BlockScales {
  std::vector<float> scales;
  int64_t block_rows = 1, block_cols = 1, block_cols_count = 1;
};

BlockScales block_scales(const Float8Tensor& q) {
  BlockScales b;
  if (q.mode == ScalingMode::PerTensor) {
    b.block_rows = q.rows;
    b.block_cols = q.cols;
    b.scales = {q.scale};
    return b;
  }
  b.block_rows = q.block_rows;
  b.block_cols = q.block_cols;
  b.block_cols_count = (q.cols + q.block_cols - 1) / q.block_cols;
  const int64_t count = q.scale_inv.numel();
  b.scales.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const float scale_inv = q.mode == ScalingMode::MXFP8
                                ? e8m0_to_float(static_cast<const uint8_t*>(q.scale_inv.raw())[i])
                                : q.scale_inv.data<float>()[i];
    b.scales[static_cast<size_t>(i)] = 1.0f / scale_inv;
  }
  return b;
}

template <typename T>
Fp8TensorStats measure_typed(const T* x, const Float8Tensor& q) {
  const BlockScales b = block_scales(q);
  const auto* codes = static_cast<const uint8_t*>(q.data.raw());
  // Saturated: |x| * scale rounds past the format's max (a non-saturating cast would give NaN
  // or Inf), so the quantizer clamped it. That is beyond max + half its unit in the last place,
  // or on that midpoint when round-to-nearest-even picks the overflow.
  const float max_value = fp8_max(q.format);
  const uint8_t max_code = float_to_fp8(max_value, q.format, true);
  const float midpoint =
      max_value + (max_value - fp8_to_float(static_cast<uint8_t>(max_code - 1), q.format)) / 2;
  const bool midpoint_overflows =
      !std::isfinite(fp8_to_float(float_to_fp8(midpoint, q.format, false), q.format));
  const int64_t rows = q.rows, cols = q.cols;
  int64_t underflow = 0, saturated = 0;
  float amax = 0.0f;
#pragma omp parallel for schedule(static) reduction(+ : underflow, saturated) reduction(max : amax)
  for (int64_t r = 0; r < rows; ++r) {
    const float* scales = b.scales.data() + (r / b.block_rows) * b.block_cols_count;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = element_of(x, r * cols + c);
      const float magnitude = std::fabs(v);
      amax = std::max(amax, magnitude);
      // +-0 codes (0x00, 0x80) from a nonzero source lost the value entirely.
      underflow += (v != 0.0f && (codes[r * cols + c] & 0x7F) == 0) ? 1 : 0;
      const float scaled = magnitude * scales[c / b.block_cols];  // as the quantizer rounds it
      saturated += scaled > midpoint || (midpoint_overflows && scaled == midpoint) ? 1 : 0;
    }
  }
  Fp8TensorStats stats;
  stats.amax = amax;
  stats.scale = *std::min_element(b.scales.begin(), b.scales.end());
  stats.numel = rows * cols;
  stats.underflow = static_cast<double>(underflow) / static_cast<double>(stats.numel);
  stats.saturated = static_cast<double>(saturated) / static_cast<double>(stats.numel);
  return stats;
}

}  // namespace

Fp8TensorStats measure_fp8(const Tensor& x, const Float8Tensor& q) {
  check_dtype_in(x, {DType::F32, DType::BF16}, "measure_fp8: x");
  OCTET_CHECK(q.has_rowwise(), "measure_fp8: the FP8 tensor needs its rowwise data");
  OCTET_CHECK(x.numel() == q.rows * q.cols && q.rows * q.cols > 0, "measure_fp8: x ",
              shape_str(x.shape()), " does not match the FP8 tensor [", q.rows, ",", q.cols, "]");
  return x.dtype() == DType::F32 ? measure_typed(x.data<float>(), q)
                                 : measure_typed(x.data<bfloat16>(), q);
}

fp8_stats_scope::fp8_stats_scope(bool enabled) : previous_(stats_enabled) {
  stats_enabled = enabled;
}

fp8_stats_scope::~fp8_stats_scope() {
  stats_enabled = previous_;
}

bool fp8_stats_enabled() {
  return stats_enabled;
}

Fp8TensorStats measure_fp4(const Tensor& x, const Float4Tensor& q) {
  check_dtype_in(x, {DType::F32, DType::BF16}, "measure_fp4: x");
  OCTET_CHECK(x.numel() == q.rows * q.cols && q.rows * q.cols > 0, "measure_fp4: x ",
              shape_str(x.shape()), " does not match the FP4 tensor [", q.rows, ",", q.cols, "]");
  const std::vector<float> values = x.to_floats();
  Fp8TensorStats stats;
  stats.numel = x.numel();
  stats.scale = std::numeric_limits<float>::infinity();
  int64_t underflow = 0, saturated = 0;
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const float v = std::fabs(values[static_cast<size_t>(r * q.cols + c)]);
      stats.amax = std::max(stats.amax, v);
      const float block = q.block_scale(r, c) * q.global_scale_inv;
      const float scale = block > 0.0f ? 1.0f / block : 0.0f;
      if (c % q.block_cols == 0 && r % q.block_rows == 0 && block > 0.0f)
        stats.scale = std::min(stats.scale, scale);
      if (v > 0.0f && (q.code(r, c) & 0x7) == 0) ++underflow;
      if (v * scale >= 7.0f) ++saturated;  // rounds past 6 (to 8, were there one): clamped
    }
  }
  if (!std::isfinite(stats.scale)) stats.scale = 1.0f;
  stats.underflow = static_cast<double>(underflow) / static_cast<double>(stats.numel);
  stats.saturated = static_cast<double>(saturated) / static_cast<double>(stats.numel);
  return stats;
}

namespace {

void keep_stats(std::vector<std::pair<std::string, Fp8TensorStats>>& all, const std::string& name,
                const Fp8TensorStats& stats) {
  for (auto& [key, value] : all) {
    if (key == name) {
      value = stats;
      return;
    }
  }
  all.emplace_back(name, stats);
}

}  // namespace

void Fp8State::record_stats(const std::string& module, const std::string& role, const Tensor& x,
                            const Float4Tensor& q) {
  if (stats_enabled) keep_stats(stats_, module + "." + role, measure_fp4(x, q));
}

void Fp8State::record_stats(const std::string& module, const std::string& role, const Tensor& x,
                            const Float8Tensor& q) {
  if (!stats_enabled) return;
  const std::string name = module + "." + role;
  Fp8TensorStats stats = measure_fp8(x, q);
  for (auto& [key, value] : stats_) {
    if (key == name) {
      value = stats;
      return;
    }
  }
  stats_.emplace_back(name, stats);
}

namespace modules_detail {

Parameter make_parameter(std::string name, Shape shape, float init_std, uint64_t seed) {
  Parameter p{std::move(name), Tensor::empty(shape, DType::F32), Tensor::zeros(shape, DType::F32)};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, init_std);
  float* v = p.value.data<float>();
  for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = init_std == 0.0f ? 0.0f : normal(rng);
  return p;
}

Parameter constant_parameter(std::string name, Shape shape, float value) {
  Parameter p{std::move(name), Tensor::empty(shape, DType::F32), Tensor::zeros(shape, DType::F32)};
  float* v = p.value.data<float>();
  for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = value;
  return p;
}

Float8Tensor columnwise_only(Float8Tensor x) {
  x.data = Tensor();
  x.scale_inv = Tensor();
  return x;
}

bool needs_columnwise(const Quantizer& quantizer) {
  return quantizer.mode() != ScalingMode::PerTensor;
}

Float8Tensor kept_for_backward(Float8Tensor x) {
  return x.mode == ScalingMode::PerTensor ? x : columnwise_only(std::move(x));
}

Quantizer requantizer_for(const Float8Tensor& x, const Quantizer& quantizer) {
  return x.mode == ScalingMode::PerTensor ? Quantizer::fixed(x.format, x.scale) : quantizer;
}

}  // namespace modules_detail
}  // namespace octet
