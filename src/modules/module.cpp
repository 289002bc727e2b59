// Module basics and the per-module FP8 state.
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

void add_column_sums(const Tensor& x, Tensor& out) {
  const int64_t rows = x.rows(), cols = x.cols();
  float* o = out.data<float>();
  std::vector<float> x32 = x.dtype() == DType::F32 ? std::vector<float>() : x.to_floats();
  const float* xs = x.dtype() == DType::F32 ? x.data<float>() : x32.data();
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < cols; c0 += 64) {
    const int64_t c1 = std::min(cols, c0 + 64);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = c0; c < c1; ++c) o[c] += xs[r * cols + c];
    }
  }
}

void add_into(const Tensor& source, Tensor& target) {
  const float* s = source.data<float>();
  float* t = target.data<float>();
  for (int64_t i = 0; i < target.numel(); ++i) t[i] += s[i];
}

Float8Tensor columnwise_only(Float8Tensor x) {
  x.data = Tensor();
  x.scale_inv = Tensor();
  return x;
}

}  // namespace modules_detail
}  // namespace octet
