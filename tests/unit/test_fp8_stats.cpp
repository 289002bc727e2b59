// FP8 statistics (fp8_stats_scope): the underflow and saturation fractions a Linear reports
// under fp8_autocast equal an independent per-element count, for every scaling recipe, and the
// training-side gathering and summary see every quantized tensor of a GPT.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/fp8.h"
#include "octet/model.h"
#include "octet/train.h"
#include "test_util.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

// Bulk values in [0.5, 2] with random signs, plus `tiny` values below half the format's
// smallest subnormal (they round to zero at scale 1), `huge` values past its max, and exact
// zeros (not underflow).
Tensor crafted(int64_t rows, int64_t cols, int64_t tiny, float tiny_value, int64_t huge,
               float huge_value, int64_t zeros, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.5f, 2.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = (rng() & 1 ? -1.0f : 1.0f) * uniform(rng);
  size_t i = 0;
  for (int64_t k = 0; k < tiny; ++k, i += 7) v[i] = (k & 1 ? -tiny_value : tiny_value);
  for (int64_t k = 0; k < huge; ++k, i += 7) v[i] = (k & 1 ? -huge_value : huge_value);
  for (int64_t k = 0; k < zeros; ++k, i += 7) v[i] = 0.0f;
  return Tensor::from_floats({rows, cols}, v);
}

struct Count {
  double underflow = 0, saturated = 0;
  float amax = 0;
};

// Per element, with the scalar conversions: zero codes from nonzero values, and values that
// a non-saturating cast would turn into NaN / Inf.
Count count_per_tensor(const Tensor& x, float scale, DType format) {
  Count c;
  std::vector<float> v = x.to_floats();
  for (float value : v) {
    const uint8_t code = float_to_fp8(value * scale, format, /*saturate=*/true);
    if (value != 0.0f && fp8_to_float(code, format) == 0.0f) c.underflow += 1;
    const uint8_t unsaturated = float_to_fp8(value * scale, format, /*saturate=*/false);
    if (!std::isfinite(fp8_to_float(unsaturated, format))) c.saturated += 1;
    c.amax = std::max(c.amax, std::fabs(value));
  }
  c.underflow /= static_cast<double>(v.size());
  c.saturated /= static_cast<double>(v.size());
  return c;
}

const Fp8TensorStats& find(const Fp8State& state, const std::string& name) {
  for (const auto& [key, stats] : state.stats()) {
    if (key == name) return stats;
  }
  throw Error("no stats for " + name);
}

LinearOptions linear_options() {
  LinearOptions o;
  o.in_features = 64;
  o.out_features = 48;
  o.name = "probe";
  o.seed = 5;
  return o;
}

TEST(Fp8Stats, DelayedScalingLinearMatchesAnIndependentCount) {
  Linear linear(linear_options());
  recipe::DelayedScaling recipe;  // HYBRID: E4M3 forward, E5M2 gradients; first scales are 1
  // E4M3 at scale 1: smallest subnormal 2^-9, so 1e-4 underflows; 1000 > 448 saturates.
  Tensor x = crafted(32, 64, 10, 1e-4f, 6, 1000.0f, 5, 1);
  // E5M2 at scale 1: smallest subnormal 2^-16, so 1e-6 underflows; 1e5 > 57344 saturates.
  Tensor dy = crafted(32, 48, 12, 1e-6f, 3, 1e5f, 4, 2);
  fp8_stats_scope stats;
  Linear::Context ctx;
  {
    fp8_autocast scope(true, recipe);
    linear.forward(x, ctx);
    linear.backward(dy, ctx);
  }
  const Fp8State& state = linear.fp8_state();
  ASSERT_EQ(state.stats().size(), 3u);
  const Fp8TensorStats& input = find(state, "probe.input");
  Count expected = count_per_tensor(x, 1.0f, DType::E4M3);
  EXPECT_EQ(input.underflow, expected.underflow);
  EXPECT_EQ(input.saturated, expected.saturated);
  EXPECT_EQ(input.underflow, 10.0 / (32 * 64));  // the zeros are not underflow
  EXPECT_EQ(input.saturated, 6.0 / (32 * 64));
  EXPECT_EQ(input.amax, 1000.0f);
  EXPECT_EQ(input.scale, 1.0f);
  EXPECT_EQ(input.numel, 32 * 64);

  const Fp8TensorStats& weight = find(state, "probe.weight");
  expected = count_per_tensor(linear.weight.value, 1.0f, DType::E4M3);
  EXPECT_EQ(weight.underflow, expected.underflow);
  EXPECT_GT(weight.underflow, 0.0);  // N(0, 0.02) has values below 2^-10
  EXPECT_EQ(weight.saturated, 0.0);
  EXPECT_EQ(weight.amax, expected.amax);

  const Fp8TensorStats& grad = find(state, "probe.grad_output");
  expected = count_per_tensor(dy, 1.0f, DType::E5M2);
  EXPECT_EQ(grad.underflow, expected.underflow);
  EXPECT_EQ(grad.saturated, expected.saturated);
  EXPECT_EQ(grad.underflow, 12.0 / (32 * 48));
  EXPECT_EQ(grad.saturated, 3.0 / (32 * 48));

  // Next step: the scale follows the recorded amax (448 / 1000), nothing saturates any more.
  {
    fp8_autocast scope(true, recipe);
    linear.forward(x, ctx);
  }
  const Fp8TensorStats& next = find(state, "probe.input");
  EXPECT_FLOAT_EQ(next.scale, 448.0f / 1000.0f);
  expected = count_per_tensor(x, next.scale, DType::E4M3);
  EXPECT_EQ(next.saturated, 0.0);
  EXPECT_EQ(next.underflow, expected.underflow);
}

TEST(Fp8Stats, CurrentScalingNeverSaturates) {
  Linear linear(linear_options());
  Tensor x = crafted(16, 64, 9, 1e-6f, 2, 3000.0f, 0, 3).to(DType::BF16);
  fp8_stats_scope stats;
  Linear::Context ctx;
  fp8_autocast scope(true, recipe::Float8CurrentScaling{});
  linear.forward(x, ctx);
  const Fp8TensorStats& input = find(linear.fp8_state(), "probe.input");
  const float amax = std::fabs(x.to_floats()[7 * 9]);  // the first huge value, rounded to BF16
  EXPECT_EQ(input.amax, amax);
  EXPECT_EQ(input.scale, 448.0f / amax);
  const Count expected = count_per_tensor(x, input.scale, DType::E4M3);
  EXPECT_EQ(input.saturated, 0.0);
  EXPECT_EQ(input.underflow, expected.underflow);
  EXPECT_GE(input.underflow, 9.0 / (16 * 64));  // the tiny values, and maybe more
}

TEST(Fp8Stats, BlockScalingUnderflowMatchesTheDequantizedTensor) {
  for (recipe::Recipe r : {recipe::Recipe{recipe::MXFP8BlockScaling{}},
                           recipe::Recipe{recipe::Float8BlockScaling{}}}) {
    Linear linear(linear_options());
    Tensor x = crafted(8, 64, 6, 1e-5f, 4, 5000.0f, 3, 4);
    fp8_stats_scope stats;
    Linear::Context ctx;
    fp8_autocast scope(true, r);
    linear.forward(x, ctx);
    const Fp8TensorStats& input = find(linear.fp8_state(), "probe.input");
    Float8Tensor q = make_quantizer(r, TensorRole::Input).quantize(x);
    std::vector<float> source = x.to_floats(), dequantized = q.dequantize().to_floats();
    double underflow = 0;
    for (size_t i = 0; i < source.size(); ++i) {
      underflow += source[i] != 0.0f && dequantized[i] == 0.0f ? 1 : 0;
    }
    EXPECT_EQ(input.underflow, underflow / static_cast<double>(source.size()))
        << recipe::describe(r);
    EXPECT_GT(input.underflow, 0.0);
    EXPECT_EQ(input.saturated, 0.0);
    EXPECT_EQ(input.amax, 5000.0f);
  }
}

TEST(Fp8Stats, OffByDefaultAndOutsideTheScope) {
  Linear linear(linear_options());
  Tensor x = crafted(4, 64, 0, 0, 0, 0, 0, 6);
  Linear::Context ctx;
  fp8_autocast scope(true, recipe::DelayedScaling{});
  EXPECT_FALSE(fp8_stats_enabled());
  linear.forward(x, ctx);
  EXPECT_TRUE(linear.fp8_state().stats().empty());
  {
    fp8_stats_scope on;
    fp8_stats_scope off(false);
    EXPECT_FALSE(fp8_stats_enabled());
  }
  linear.forward(x, ctx);
  EXPECT_TRUE(linear.fp8_state().stats().empty());
}

TEST(Fp8Stats, GptStepReportsEveryQuantizedTensor) {
  GPTConfig config = GPTConfig::from_json({{"vocab_size", 64},
                                           {"max_seq_len", 16},
                                           {"num_layers", 2},
                                           {"hidden", 32},
                                           {"num_heads", 4}});
  GPT model(config, 1);
  Tensor ids = Tensor::zeros({2, 16}, DType::I32), targets = Tensor::zeros({2, 16}, DType::I32);
  for (int64_t i = 0; i < 32; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>(i * 7 % 64);
    targets.data<int32_t>()[i] = static_cast<int32_t>(i * 5 % 64);
  }
  Fp8StatsSummary summary;
  for (int step = 0; step < 2; ++step) {
    {
      fp8_stats_scope stats;
      fp8_autocast scope(true, recipe::DelayedScaling{});
      model.train_step(ids, targets, DType::BF16, 1.0f);
    }
    nlohmann::json taken = take_fp8_stats(model.fp8_states());
    // 2 layers x (qkv, proj, fc1, fc2) x (input, weight, grad_output).
    ASSERT_EQ(taken.size(), 24u);
    const auto& qkv = taken.at("transformer.h.0.self_attention.layernorm_qkv.input");
    EXPECT_GT(qkv.at("amax").get<double>(), 0.0);
    EXPECT_TRUE(taken.contains("transformer.h.1.layernorm_mlp.fc2.grad_output"));
    EXPECT_TRUE(take_fp8_stats(model.fp8_states()).empty());  // taking clears
    summary.add(taken);
  }
  nlohmann::json s = summary.to_json();
  EXPECT_EQ(s.size(), 24u);
  const auto& entry = s.at("transformer.h.0.self_attention.proj.weight");
  EXPECT_EQ(entry.at("steps").get<int64_t>(), 2);
  EXPECT_LE(entry.at("min_scale").get<double>(), entry.at("max_scale").get<double>());
  EXPECT_NE(summary.table().find("transformer.h.1.layernorm_mlp.fc1.input"), std::string::npos);
}

// Checkpoints name FP8 states by their index in the whole GPT's list: a pipeline stage's
// states (here interleaved: stages 1 and 3 of 4 on one rank) map to the same GEMMs there.
TEST(Fp8Stats, StageStateIndicesNameTheWholeModelsGemms) {
  GPTConfig config = GPTConfig::from_json({{"vocab_size", 64},
                                           {"max_seq_len", 16},
                                           {"num_layers", 8},
                                           {"hidden", 32},
                                           {"num_heads", 4}});
  GPT model(config, 1);
  GPT stage(config, 1, GPTLayout{/*stages=*/4, /*stage_of_chunk=*/{3, 1}});
  const std::vector<Fp8State*> whole = model.fp8_states(), part = stage.fp8_states();
  // Five per layer: QKV, projection, FP8 attention (DotProductAttention), FC1, FC2.
  ASSERT_EQ(whole.size(), 40u);
  ASSERT_EQ(part.size(), 20u);
  const std::vector<int64_t> index = fp8_state_indices(stage, part.size(), config.num_layers);
  // Stage 1 holds layers 2-3 (states 10-19), stage 3 layers 6-7 (30-39), in stage order.
  std::vector<int64_t> expected;
  for (int64_t i = 10; i < 20; ++i) expected.push_back(i);
  for (int64_t i = 30; i < 40; ++i) expected.push_back(i);
  EXPECT_EQ(index, expected);
  // The same GEMMs: one FP8 forward each, then the stats carry the module names.
  Tensor ids = Tensor::zeros({1, 16}, DType::I32), targets = Tensor::zeros({1, 16}, DType::I32);
  {
    fp8_stats_scope stats;
    fp8_autocast scope(true, recipe::DelayedScaling{});
    model.evaluate(ids, targets, DType::BF16);
    GPT::Context ctx;
    Tensor h = Tensor::zeros({1, 16, 32}, DType::BF16);
    stage.forward(1, h, gpt_micro_batch(ids, targets), DType::BF16, 1.0f, ctx);
    stage.forward(0, h, gpt_micro_batch(ids, targets), DType::BF16, 1.0f, ctx);
  }
  for (size_t i = 0; i < part.size(); ++i) {
    const auto theirs = whole[static_cast<size_t>(index[i])]->stats();
    const auto ours = part[i]->stats();
    ASSERT_EQ(ours.size(), theirs.size());
    for (size_t k = 0; k < ours.size(); ++k) EXPECT_EQ(ours[k].first, theirs[k].first);
  }
  EXPECT_EQ(fp8_state_indices(3), (std::vector<int64_t>{0, 1, 2}));
}

TEST(Fp8Stats, SummaryAggregatesSteps) {
  Fp8StatsSummary summary;
  summary.add({{"a", {{"amax", 2.0}, {"scale", 100.0}, {"underflow", 0.1}, {"saturated", 0.0}}}});
  summary.add({{"a", {{"amax", 5.0}, {"scale", 50.0}, {"underflow", 0.3}, {"saturated", 0.2}}}});
  nlohmann::json s = summary.to_json().at("a");
  EXPECT_EQ(s.at("max_amax").get<double>(), 5.0);
  EXPECT_EQ(s.at("min_scale").get<double>(), 50.0);
  EXPECT_EQ(s.at("max_scale").get<double>(), 100.0);
  EXPECT_DOUBLE_EQ(s.at("mean_underflow").get<double>(), 0.2);
  EXPECT_EQ(s.at("max_saturated").get<double>(), 0.2);
}

}  // namespace
}  // namespace octet
