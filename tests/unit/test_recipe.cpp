// Recipes and delayed-scaling metadata against TransformerEngine's rules, the expected values
// coming from a small independent model of those rules (a sliding window of step amaxes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "octet/recipe.h"
#include "test_util.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

TEST(Recipe, RolesAndFormats) {
  EXPECT_FALSE(is_gradient(TensorRole::Input));
  EXPECT_FALSE(is_gradient(TensorRole::Weight));
  EXPECT_FALSE(is_gradient(TensorRole::Output));
  EXPECT_TRUE(is_gradient(TensorRole::GradOutput));
  EXPECT_TRUE(is_gradient(TensorRole::GradInput));
  using recipe::Format;
  EXPECT_EQ(fp8_dtype(Format::E4M3, TensorRole::Input), DType::E4M3);
  EXPECT_EQ(fp8_dtype(Format::E4M3, TensorRole::GradOutput), DType::E4M3);
  EXPECT_EQ(fp8_dtype(Format::HYBRID, TensorRole::Weight), DType::E4M3);
  EXPECT_EQ(fp8_dtype(Format::HYBRID, TensorRole::GradOutput), DType::E5M2);
  EXPECT_EQ(fp8_dtype(Format::HYBRID, TensorRole::GradInput), DType::E5M2);
}

TEST(Recipe, DescribeNamesRecipeAndOptions) {
  recipe::DelayedScaling delayed;
  delayed.margin = 2;
  delayed.amax_compute_algo = recipe::AmaxComputeAlgo::MostRecent;
  const std::string text = recipe::describe(delayed);
  EXPECT_NE(text.find("DelayedScaling"), std::string::npos) << text;
  EXPECT_NE(text.find("margin=2"), std::string::npos) << text;
  EXPECT_NE(text.find("most_recent"), std::string::npos) << text;
  EXPECT_NE(text.find("HYBRID"), std::string::npos) << text;
  EXPECT_NE(recipe::describe(recipe::Float8CurrentScaling{}).find("Float8CurrentScaling"),
            std::string::npos);
  EXPECT_NE(recipe::describe(recipe::MXFP8BlockScaling{}).find("MXFP8BlockScaling"),
            std::string::npos);
  const std::string block = recipe::describe(recipe::Float8BlockScaling{});
  EXPECT_NE(block.find("Float8BlockScaling"), std::string::npos) << block;
  EXPECT_NE(block.find("128x128"), std::string::npos) << block;
  EXPECT_EQ(block.find('\n'), std::string::npos);
}

TEST(ComputeScale, NormalAmax) {
  EXPECT_EQ(compute_scale_from_amax(2.0f, 448.0f, false, 0.0f), 224.0f);
  EXPECT_EQ(compute_scale_from_amax(3.0f, 448.0f, false, 0.0f), 448.0f / 3.0f);
  EXPECT_EQ(compute_scale_from_amax(448.0f, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(compute_scale_from_amax(1000.0f, 57344.0f, false, 0.0f), 57.344f);
}

TEST(ComputeScale, ZeroInfNaNGiveOne) {
  EXPECT_EQ(compute_scale_from_amax(0.0f, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(compute_scale_from_amax(kInf, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(compute_scale_from_amax(kNaN, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(compute_scale_from_amax(0.0f, 448.0f, true, 0.0f), 1.0f);
  EXPECT_EQ(compute_scale_from_amax(kNaN, 57344.0f, true, 1e-3f), 1.0f);
}

TEST(ComputeScale, TinyAmaxOverflowsToFloatMax) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(compute_scale_from_amax(tiny, 448.0f, false, 0.0f), FLT_MAX);
  EXPECT_EQ(compute_scale_from_amax(1e-40f, 57344.0f, false, 0.0f), FLT_MAX);
  // FLT_MAX rounded down to a power of two is 2^127.
  EXPECT_EQ(compute_scale_from_amax(tiny, 448.0f, true, 0.0f), std::ldexp(1.0f, 127));
}

TEST(ComputeScale, EpsilonClampsAmaxFromBelow) {
  EXPECT_EQ(compute_scale_from_amax(0.0f, 448.0f, false, 4.0f), 112.0f);
  EXPECT_EQ(compute_scale_from_amax(1.0f, 448.0f, false, 4.0f), 112.0f);
  EXPECT_EQ(compute_scale_from_amax(8.0f, 448.0f, false, 4.0f), 56.0f);
  EXPECT_EQ(compute_scale_from_amax(1e-40f, 448.0f, false, 1e-3f), 448.0f / 1e-3f);
}

TEST(ComputeScale, PowerOfTwoRoundsDown) {
  EXPECT_EQ(compute_scale_from_amax(3.0f, 448.0f, true, 0.0f), 128.0f);  // 149.3 -> 128
  EXPECT_EQ(compute_scale_from_amax(1.0f, 448.0f, true, 0.0f), 256.0f);  // 448 -> 256
  EXPECT_EQ(compute_scale_from_amax(448.0f, 448.0f, true, 0.0f), 1.0f);  // exact stays
  EXPECT_EQ(compute_scale_from_amax(449.0f, 448.0f, true, 0.0f), 0.5f);  // 0.998 -> 0.5
  EXPECT_EQ(compute_scale_from_amax(1e30f, 448.0f, true, 0.0f), std::ldexp(1.0f, -91));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  for (int i = 0; i < 2000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const float plain = compute_scale_from_amax(amax, 448.0f, false, 0.0f);
    const float pow2 = compute_scale_from_amax(amax, 448.0f, true, 0.0f);
    int e = 0;
    const float mantissa = std::frexp(pow2, &e);
    ASSERT_EQ(mantissa, 0.5f) << "not a power of two: " << pow2;
    ASSERT_LE(pow2, plain);
    ASSERT_GT(2.0f * pow2, plain);
  }
}

TEST(ComputeScale, RejectsBadArguments) {
  EXPECT_THROW(compute_scale_from_amax(-1.0f, 448.0f, false, 0.0f), Error);
  EXPECT_THROW(compute_scale_from_amax(1.0f, 0.0f, false, 0.0f), Error);
  EXPECT_THROW(compute_scale_from_amax(1.0f, 448.0f, false, -1.0f), Error);
}

TEST(FP8Meta, StartsAtScaleOneWithZeroHistory) {
  FP8Meta meta({TensorRole::Input, TensorRole::Weight, TensorRole::GradOutput}, 5);
  EXPECT_EQ(meta.num_tensors(), 3);
  EXPECT_EQ(meta.history_len(), 5);
  EXPECT_EQ(meta.role(2), TensorRole::GradOutput);
  EXPECT_EQ(meta.amax_history_data().size(), 15u);
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(meta.scale(t), 1.0f);
    EXPECT_EQ(meta.scale_inv(t), 1.0f);
    for (int row = 0; row < 5; ++row) EXPECT_EQ(meta.amax_history(row, t), 0.0f);
  }
}

TEST(FP8Meta, RecordAmaxMergesMaxAndKeepsNaN) {
  FP8Meta meta({TensorRole::Input, TensorRole::Weight}, 2);
  meta.record_amax(0, 3.0f);
  meta.record_amax(0, 1.0f);
  EXPECT_EQ(meta.amax_history(0, 0), 3.0f);
  meta.record_amax(0, 5.0f);
  EXPECT_EQ(meta.amax_history(0, 0), 5.0f);
  EXPECT_EQ(meta.amax_history(0, 1), 0.0f);
  meta.record_amax(1, kNaN);
  meta.record_amax(1, 7.0f);
  EXPECT_TRUE(std::isnan(meta.amax_history(0, 1)));
  meta.record_amax(0, kInf);
  EXPECT_EQ(meta.amax_history(0, 0), kInf);
  EXPECT_EQ(meta.amax_history(1, 0), 0.0f);
}

TEST(FP8Meta, RejectsBadArguments) {
  EXPECT_THROW(FP8Meta({TensorRole::Input}, 0), Error);
  EXPECT_THROW(FP8Meta({}, 4), Error);
  FP8Meta meta({TensorRole::Input}, 4);
  EXPECT_THROW(meta.record_amax(1, 1.0f), Error);
  EXPECT_THROW(meta.record_amax(-1, 1.0f), Error);
  EXPECT_THROW(meta.amax_history(4, 0), Error);
  EXPECT_THROW(meta.amax_history(0, 1), Error);
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 8;
  EXPECT_THROW(meta.update(recipe), Error);  // the meta holds 4 rows
  recipe.amax_history_len = 4;
  recipe.margin = -1;
  EXPECT_THROW(meta.update(recipe), Error);
  FP8Meta empty;
  EXPECT_THROW(empty.update(recipe::DelayedScaling{}), Error);
}

// ---- The scripted sequence and its independent model. ----

// What each tensor records in each step (several values in a step are max-merged; an empty
// list records nothing, so the step's amax stays 0).
struct Step {
  std::vector<float> input;     // tensor 0, TensorRole::Input
  std::vector<float> grad_out;  // tensor 1, TensorRole::GradOutput
};

std::vector<Step> scripted_steps() {
  return {
      {{2.0f}, {100.0f}},       {{0.5f, 0.25f}, {3.0f}},
      {{}, {1000.0f, 2000.0f}},  // nothing recorded for the input: amax 0 this step
      {{8.0f}, {kNaN}},         {{kInf}, {}},
      {{1.0f}, {5.0f, kNaN}},   {{0.25f}, {7.0f}},
      {{3.0f}, {1e-40f}},  // tiny: the quotient overflows, scale becomes FLT_MAX
      {{0.125f}, {0.001f}},     {{0.0f}, {6.0f}},
  };
}

// Max-merge with NaN winning, as record_amax and torch.max do.
float merged_amax(const std::vector<float>& values) {
  float amax = 0.0f;
  for (float v : values) {
    if (std::isnan(v) || std::isnan(amax)) {
      amax = kNaN;
    } else if (v > amax) {
      amax = v;
    }
  }
  return amax;
}

// The rules written out directly: the window is the last L step amaxes (earlier "steps" are 0),
// the scale changes only for a finite positive amax.
struct ModelTensor {
  float fp8_max;
  std::vector<float> step_amax;  // one per step so far
  float scale = 1.0f;
};

void model_update(ModelTensor& tensor, int history_len, int margin, recipe::AmaxComputeAlgo algo) {
  const int t = static_cast<int>(tensor.step_amax.size()) - 1;
  float amax = tensor.step_amax[t];
  if (algo == recipe::AmaxComputeAlgo::Max) {
    bool saw_nan = false;
    for (int s = std::max(0, t - history_len + 1); s <= t; ++s) {
      const float v = tensor.step_amax[s];
      if (std::isnan(v)) saw_nan = true;
      amax = std::max(amax, v);
    }
    if (saw_nan) amax = kNaN;
  }
  if (!(amax > 0.0f) || std::isinf(amax) || std::isnan(amax)) return;
  const double quotient = static_cast<double>(tensor.fp8_max) / amax / std::pow(2.0, margin);
  tensor.scale = quotient > FLT_MAX ? FLT_MAX : static_cast<float>(quotient);
}

// After the update of step t: row 0 is cleared, row i (i >= 1) holds step t - (L-1) + i.
float model_history(const ModelTensor& tensor, int history_len, int row) {
  if (row == 0) return 0.0f;
  const int t = static_cast<int>(tensor.step_amax.size()) - 1;
  const int step = t - (history_len - 1) + row;
  return step >= 0 ? tensor.step_amax[step] : 0.0f;
}

using MetaParam =
    std::tuple<recipe::AmaxComputeAlgo, int /*margin*/, recipe::Format, int /*history_len*/>;

class FP8MetaSequence : public ::testing::TestWithParam<MetaParam> {};

TEST_P(FP8MetaSequence, MatchesModelAfterEveryUpdate) {
  const auto [algo, margin, format, history_len] = GetParam();
  recipe::DelayedScaling recipe;
  recipe.margin = margin;
  recipe.fp8_format = format;
  recipe.amax_history_len = history_len;
  recipe.amax_compute_algo = algo;

  FP8Meta meta({TensorRole::Input, TensorRole::GradOutput}, history_len);
  const bool hybrid = format == recipe::Format::HYBRID;
  std::vector<ModelTensor> model = {{448.0f, {}}, {hybrid ? 57344.0f : 448.0f, {}}};

  const std::vector<Step> steps = scripted_steps();
  for (size_t step = 0; step < steps.size(); ++step) {
    const std::vector<float>* recorded[2] = {&steps[step].input, &steps[step].grad_out};
    for (int t = 0; t < 2; ++t) {
      for (float amax : *recorded[t]) meta.record_amax(t, amax);
      model[t].step_amax.push_back(merged_amax(*recorded[t]));
    }
    meta.update(recipe);
    for (int t = 0; t < 2; ++t) {
      model_update(model[t], history_len, margin, algo);
      SCOPED_TRACE(::testing::Message() << "step " << step << " tensor " << t);
      EXPECT_EQ(meta.scale(t), model[t].scale);
      EXPECT_EQ(meta.scale_inv(t), 1.0f / model[t].scale);
      for (int row = 0; row < history_len; ++row) {
        const float expected = model_history(model[t], history_len, row);
        EXPECT_TRUE(same_float(meta.amax_history(row, t), expected))
            << "row " << row << ": got " << meta.amax_history(row, t) << ", expected " << expected;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptions, FP8MetaSequence,
                         ::testing::Combine(::testing::Values(recipe::AmaxComputeAlgo::Max,
                                                              recipe::AmaxComputeAlgo::MostRecent),
                                            ::testing::Values(0, 2),
                                            ::testing::Values(recipe::Format::E4M3,
                                                              recipe::Format::HYBRID),
                                            ::testing::Values(1, 4)));

// A few values written out by hand, so the model itself is checked.
TEST(FP8Meta, HandWorkedMaxWindow) {
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 3;
  recipe.margin = 1;
  recipe.fp8_format = recipe::Format::HYBRID;
  FP8Meta meta({TensorRole::Weight, TensorRole::GradOutput}, 3);

  meta.record_amax(0, 4.0f);
  meta.record_amax(1, 8.0f);
  meta.update(recipe);
  EXPECT_EQ(meta.scale(0), 56.0f);    // 448 / 4 / 2
  EXPECT_EQ(meta.scale(1), 3584.0f);  // 57344 / 8 / 2
  EXPECT_EQ(meta.scale_inv(0), 1.0f / 56.0f);
  EXPECT_EQ(meta.amax_history(2, 0), 4.0f);  // the step moved to the last row
  EXPECT_EQ(meta.amax_history(0, 0), 0.0f);

  meta.record_amax(0, 1.0f);
  meta.update(recipe);  // window {1, 4}: still 4; tensor 1 window {0, 8}: still 8
  EXPECT_EQ(meta.scale(0), 56.0f);
  EXPECT_EQ(meta.scale(1), 3584.0f);
  EXPECT_EQ(meta.amax_history(1, 0), 4.0f);
  EXPECT_EQ(meta.amax_history(2, 0), 1.0f);

  meta.record_amax(0, 2.0f);
  meta.update(recipe);  // window {2, 1, 4}: the 4 is still inside (3 steps)
  EXPECT_EQ(meta.scale(0), 56.0f);
  meta.record_amax(0, 2.0f);
  meta.update(recipe);  // window {2, 2, 1}: the 4 has left
  EXPECT_EQ(meta.scale(0), 112.0f);
  meta.update(recipe);  // window {0, 2, 2}
  EXPECT_EQ(meta.scale(0), 112.0f);
  meta.update(recipe);  // window {0, 0, 2}
  meta.update(recipe);  // window all zero: scale kept
  EXPECT_EQ(meta.scale(0), 112.0f);
  EXPECT_EQ(meta.scale(1), 3584.0f);  // tensor 1's window was all zeros after step 3
}

}  // namespace
}  // namespace octet
