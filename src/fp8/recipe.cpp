// Scaling recipes and delayed-scaling metadata, following TransformerEngine:
// compute_scale_from_amax mirrors transformer_engine/common/recipe/recipe_common.cuh, and
// FP8Meta::update mirrors PyTorch's _default_get_amax_and_update_history + _default_sf_compute.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <type_traits>

#include "octet/error.h"
#include "octet/recipe.h"

namespace octet {
namespace recipe {
namespace {

const char* format_name(Format format) {
  return format == Format::E4M3 ? "E4M3" : "HYBRID";
}

}  // namespace

std::string describe(const Recipe& recipe) {
  std::ostringstream out;
  std::visit(
      [&out](const auto& r) {
        using R = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<R, DelayedScaling>) {
          out << "DelayedScaling(margin=" << r.margin
              << ", fp8_format=" << format_name(r.fp8_format)
              << ", amax_history_len=" << r.amax_history_len << ", amax_compute_algo="
              << (r.amax_compute_algo == AmaxComputeAlgo::Max ? "max" : "most_recent")
              << (r.fp8_dpa ? ", fp8_dpa=true" : "") << ")";
        } else if constexpr (std::is_same_v<R, Float8CurrentScaling>) {
          out << "Float8CurrentScaling(fp8_format=" << format_name(r.fp8_format)
              << ", power_2_scale=" << (r.power_2_scale ? "true" : "false")
              << ", amax_epsilon=" << r.amax_epsilon << ")";
        } else if constexpr (std::is_same_v<R, MXFP8BlockScaling>) {
          out << "MXFP8BlockScaling(fp8_format=" << format_name(r.fp8_format) << ", block=1x32)";
        } else {
          out << "Float8BlockScaling(fp8_format=" << format_name(r.fp8_format)
              << ", power_2_scale=" << (r.power_2_scale ? "true" : "false")
              << ", amax_epsilon=" << r.amax_epsilon << ", activation_block=1x"
              << r.activation_block << ", weight_block=" << r.weight_block << "x" << r.weight_block
              << ")";
        }
      },
      recipe);
  return out.str();
}

}  // namespace recipe

bool is_gradient(TensorRole role) {
  return role == TensorRole::GradOutput || role == TensorRole::GradInput;
}

DType fp8_dtype(recipe::Format format, TensorRole role) {
  return format == recipe::Format::HYBRID && is_gradient(role) ? DType::E5M2 : DType::E4M3;
}

namespace {

// The largest power of two <= value, for finite value > 0, read off the exponent bits.
float round_down_to_power_of_2(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7F800000u) == 0) {
    // Subnormal: keep only the highest set mantissa bit.
    return std::bit_cast<float>(std::bit_floor(bits & 0x007FFFFFu));
  }
  return std::bit_cast<float>(bits & 0xFF800000u);
}

}  // namespace

float compute_scale_from_amax(float amax, float fp8_max_value, bool power_2_scale,
                              float amax_epsilon) {
  OCTET_CHECK(std::isfinite(fp8_max_value) && fp8_max_value > 0.0f,
              "compute_scale_from_amax: fp8_max expected finite and > 0, got ", fp8_max_value);
  OCTET_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0f,
              "compute_scale_from_amax: amax_epsilon expected finite and >= 0, got ", amax_epsilon);
  OCTET_CHECK(!(amax < 0.0f), "compute_scale_from_amax: amax expected >= 0, got ", amax);
  if (amax < amax_epsilon) amax = amax_epsilon;
  // NaN or Inf amax, or nothing to scale: leave the values as they are.
  if (std::isnan(amax) || std::isinf(amax) || amax == 0.0f) return 1.0f;
  float scale = fp8_max_value / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
  if (power_2_scale) scale = round_down_to_power_of_2(scale);
  return scale;
}

FP8Meta::FP8Meta(std::vector<TensorRole> roles, int amax_history_len)
    : roles_(std::move(roles)), history_len_(amax_history_len) {
  OCTET_CHECK(amax_history_len >= 1, "FP8Meta: amax_history_len expected >= 1, got ",
              amax_history_len);
  OCTET_CHECK(!roles_.empty(), "FP8Meta: expected at least one tensor role, got none");
  scale_.assign(roles_.size(), 1.0f);
  scale_inv_.assign(roles_.size(), 1.0f);
  amax_history_.assign(static_cast<size_t>(history_len_) * roles_.size(), 0.0f);
}

float FP8Meta::amax_history(int row, int index) const {
  OCTET_CHECK(row >= 0 && row < history_len_, "FP8Meta::amax_history: row expected in [0,",
              history_len_, "), got ", row);
  OCTET_CHECK(index >= 0 && index < num_tensors(), "FP8Meta::amax_history: index expected in [0,",
              num_tensors(), "), got ", index);
  return amax_history_[static_cast<size_t>(row) * roles_.size() + static_cast<size_t>(index)];
}

void FP8Meta::record_amax(int index, float amax) {
  OCTET_CHECK(index >= 0 && index < num_tensors(), "FP8Meta::record_amax: index expected in [0,",
              num_tensors(), "), got ", index);
  float& slot = amax_history_[static_cast<size_t>(index)];
  // NaN wins so update() sees it and keeps the old scale (torch.max propagates NaN too).
  if (std::isnan(amax) || std::isnan(slot)) {
    slot = std::nanf("");
  } else if (amax > slot) {
    slot = amax;
  }
}

void FP8Meta::restore(const std::vector<float>& scale, const std::vector<float>& scale_inv,
                      const std::vector<float>& amax_history) {
  OCTET_CHECK(scale.size() == scale_.size() && scale_inv.size() == scale_inv_.size() &&
                  amax_history.size() == amax_history_.size(),
              "FP8Meta::restore: expected ", scale_.size(), " scales and ", amax_history_.size(),
              " history values, got ", scale.size(), " and ", amax_history.size(),
              " (saved with another amax_history_len or model?)");
  scale_ = scale;
  scale_inv_ = scale_inv;
  amax_history_ = amax_history;
}

void FP8Meta::update(const recipe::DelayedScaling& recipe) {
  OCTET_CHECK(num_tensors() > 0, "FP8Meta::update: meta has no tensors (default-constructed)");
  OCTET_CHECK(recipe.amax_history_len == history_len_,
              "FP8Meta::update: recipe amax_history_len expected ", history_len_,
              " (the meta's), got ", recipe.amax_history_len);
  OCTET_CHECK(recipe.margin >= 0 && recipe.margin < 128, "FP8Meta::update: margin expected in ",
              "[0,128), got ", recipe.margin);
  const size_t n = roles_.size();
  const size_t len = static_cast<size_t>(history_len_);
  const float margin_factor = std::ldexp(1.0f, recipe.margin);

  for (size_t t = 0; t < n; ++t) {
    float amax = amax_history_[t];
    if (recipe.amax_compute_algo == recipe::AmaxComputeAlgo::Max) {
      for (size_t row = 1; row < len && !std::isnan(amax); ++row) {
        float value = amax_history_[row * n + t];
        if (std::isnan(value) || value > amax) amax = value;
      }
    }
    const float max_value = fp8_max(fp8_dtype(recipe.fp8_format, roles_[t]));
    if (amax > 0.0f && std::isfinite(amax)) {
      float scale = (max_value / amax) / margin_factor;
      if (std::isinf(scale)) scale = FLT_MAX;
      scale_[t] = scale;
      scale_inv_[t] = 1.0f / scale;
    }
  }

  // torch.roll(history, -1, 0): row i takes row i+1, row 0 moves to the end; then clear row 0.
  if (len > 1) {
    std::vector<float> first(amax_history_.begin(), amax_history_.begin() + n);
    std::copy(amax_history_.begin() + n, amax_history_.end(), amax_history_.begin());
    std::copy(first.begin(), first.end(), amax_history_.end() - n);
  }
  std::fill(amax_history_.begin(), amax_history_.begin() + n, 0.0f);
}

}  // namespace octet
