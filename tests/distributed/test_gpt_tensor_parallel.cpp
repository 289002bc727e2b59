// GPT split over a tensor group of the world size (CMake runs 1, 2, 4) against the single-process
// GPT made with the same config and seed, in the same process, on the same batch (F32), SP off and
// on: the gathered parameters equal GPT's exactly; the loss, every gathered gradient and the
// gradient norm agree within 1e-5 relative. Split GEMM sums and the cross-rank log-sum-exp
// reorder FP32 additions (see test_tensor_parallel.cpp for the bound), and the
// vocabulary-parallel loss computes softmax - onehot in FP64 per element where GPT's fused
// kernel has its own rounding, so even TP = 1 differs by ~1 ulp of the loss gradient.
// Measured: 5.2e-7 at TP = 1, 6.1e-7 at TP = 2 (SP), 7.9e-7 at TP = 4 (SP), printed per case.
// Two configs: GPT-2 style, and RMSNorm + SwiGLU + no biases + GQA (2 kv heads: not at TP = 4)
// + RoPE.
// The vocabulary (101) is odd, so the shards are uneven (51 / 50 rows; 26 x 3 / 23).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include "octet/comm.h"
#include "octet/model.h"
#include "octet/ops/optimizer.h"
#include "octet/recipe.h"
#include "octet/tensor_parallel.h"
#include "octet/train.h"

namespace octet {
namespace {

constexpr double kRelativeTolerance = 1e-5;
double g_worst_relative = 0;  // the largest relative difference of the running case

// gpt-2 style (LayerNorm, GELU, biases) or llama style (RMSNorm, SwiGLU, no biases, GQA with
// 2 kv heads, RoPE).
GPTConfig small_config(bool llama) {
  GPTConfig c;
  c.name = "gpt-test";
  c.vocab_size = 101;
  c.max_seq_len = 16;
  c.num_layers = 2;
  c.hidden = 32;
  c.num_heads = 4;
  if (llama) {
    c.normalization = "rmsnorm";
    c.activation = "swiglu";
    c.bias = false;
    c.num_gqa_groups = 2;
    c.position_embedding = "rope";  // rotated on each rank's heads
  }
  return c;
}

void batch(const GPTConfig& c, int64_t B, int64_t T, Tensor& ids, Tensor& targets) {
  ids = Tensor::empty({B, T}, DType::I32);
  targets = Tensor::empty({B, T}, DType::I32);
  for (int64_t i = 0; i < B * T; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + 11) % c.vocab_size);
    targets.data<int32_t>()[i] = i == 3 ? -100 : static_cast<int32_t>((i * 53 + 5) % c.vocab_size);
  }
}

// The whole model split over `tp` (with sequence parallelism when sp).
GPTLayout tensor_layout(bool sp, Communicator& tp) {
  GPTLayout layout;
  layout.tensor = &tp;
  layout.sequence_parallel = sp;
  return layout;
}

void expect_close(const Tensor& actual, const Tensor& expected, const std::string& what) {
  const std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  ASSERT_EQ(a.size(), e.size()) << what;
  double scale = 1e-30, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::fabs(double{e[i]}));
    worst = std::max(worst, std::fabs(double{a[i]} - e[i]));
  }
  g_worst_relative = std::max(g_worst_relative, worst / scale);
  EXPECT_LE(worst, kRelativeTolerance * scale)
      << what << ": max difference " << worst << " of max |expected| " << scale;
}

class GPTTensorParallel : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  void SetUp() override {
    std::shared_ptr<Communicator> world = world_communicator();
    state = std::make_unique<ParallelState>(world, world->size(), 1);
  }
  std::unique_ptr<ParallelState> state;
};

TEST_P(GPTTensorParallel, EqualsTheSingleProcessGPT) {
  const auto [sp, llama] = GetParam();
  const GPTConfig config = small_config(llama);
  g_worst_relative = 0;
  Communicator& tp = state->tensor();
  if (config.num_gqa_groups % tp.size() != 0 && config.num_gqa_groups > 0) {
    GTEST_SKIP() << config.num_gqa_groups << " kv heads do not split over TP=" << tp.size();
  }
  GPT reference(config, 7);
  GPT model(config, 7, tensor_layout(sp, tp));

  // Parameters: the gathered shards are GPT's tensors, bit for bit.
  const TensorMap whole = model.state_dict(), expected = reference.state_dict();
  ASSERT_EQ(whole.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(whole.count(name)) << name;
    EXPECT_EQ(whole.at(name).to_floats(), tensor.to_floats()) << name;
  }

  Tensor ids, targets;
  batch(config, 2, 8, ids, targets);
  const float loss = model.train_step(ids, targets, DType::F32, 0.5f);
  const float expected_loss = reference.train_step(ids, targets, DType::F32, 0.5f);
  EXPECT_NEAR(loss, expected_loss, kRelativeTolerance * std::fabs(expected_loss));
  all_reduce_sequence_parallel_gradients(model.sequence_parallel_parameters(), tp);

  std::map<std::string, Tensor> reference_grads;
  std::vector<Tensor> grads;
  for (Parameter* p : reference.parameters()) {
    reference_grads[p->name] = p->grad;
    grads.push_back(p->grad);
  }
  for (Parameter* p : model.parameters()) {
    expect_close(model.gather(*p, p->grad), reference_grads.at(p->name), p->name + " gradient");
  }
  const double norm = ops::global_grad_norm(grads);
  EXPECT_NEAR(grad_norm_over(model.counted_in_norm(model.parameters()), tp), norm,
              kRelativeTolerance * norm);

  EXPECT_NEAR(model.evaluate(ids, targets, DType::F32),
              reference.evaluate(ids, targets, DType::F32),
              kRelativeTolerance * std::fabs(expected_loss));

  if (tp.rank() == 0) {
    std::printf("TP=%d%s%s: worst relative gradient difference %.2e (tolerance %.0e)\n", tp.size(),
                sp ? " SP" : "", llama ? " llama" : "", g_worst_relative, kRelativeTolerance);
  }

  // Slicing a whole map gives back this rank's shards.
  GPT loaded(config, 8, tensor_layout(sp, tp));
  loaded.load_state_dict(whole);
  std::vector<Parameter*> mine = model.parameters(), theirs = loaded.parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(theirs[i]->value.to_floats(), mine[i]->value.to_floats()) << mine[i]->name;
  }
}

// FP8 (DelayedScaling HYBRID) under TP, SP off and on, against the single-process GPT: with
// the amaxes reduced (max) over the tensor group after each micro-batch, a shard's weight,
// input and output-gradient amaxes become the whole tensor's, so every tensor rank quantizes
// with the single-process scales (equal across tensor ranks exactly, and to GPT's within
// 1e-5 relative: the inputs differ by FP32 summation order only), and the FP8 codes are
// GPT's. Four micro-batches, so later ones run on scales derived from reduced amaxes.
//
// Compute is F32: FP8 rounding amplifies any difference that crosses a rounding boundary (an
// element moves by a whole FP8 step, 2^-3 in E4M3, and the next GEMMs spread it), so the test
// needs inputs whose split-sum differences (~1e-7) almost never cross one. In BF16 compute the
// BF16 roundings between the GEMMs cross boundaries often enough to cascade to ~2% of a
// gradient's norm on this model (measured), which says nothing about the parallel logic.
// Measured here: <= 3.5e-7 relative L2 per gradient and 0 on the loss at TP = 1, 2 and 4; held to
// 1e-4 and 1e-5.
// One FP8 config is enough: GPT-2's, with and without sequence parallelism.
class GPTTensorParallelFp8 : public GPTTensorParallel {};

TEST_P(GPTTensorParallelFp8, DelayedScalingEqualsTheSingleProcessGPT) {
  const auto [sp, llama] = GetParam();
  const GPTConfig config = small_config(llama);
  Communicator& tp = state->tensor();
  GPT reference(config, 7);
  GPT model(config, 7, tensor_layout(sp, tp));
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 4;
  double worst_loss = 0, worst_grad = 0;
  for (int micro = 0; micro < 4; ++micro) {
    Tensor ids, targets;
    batch(config, 2, 8, ids, targets);
    int32_t* x = ids.data<int32_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      x[i] = static_cast<int32_t>((x[i] + 13 * micro) % config.vocab_size);
    }
    reference.zero_grad();
    model.zero_grad();
    float expected_loss = 0, loss = 0;
    {
      fp8_autocast scope(true, recipe);
      expected_loss = reference.train_step(ids, targets, DType::F32, 1.0f);
      loss = model.train_step(ids, targets, DType::F32, 1.0f);
    }
    reduce_fp8_amax(model.fp8_states(), tp);
    all_reduce_sequence_parallel_gradients(model.sequence_parallel_parameters(), tp);
    worst_loss = std::max(worst_loss, std::fabs(double{loss} - expected_loss) / expected_loss);
    EXPECT_NEAR(loss, expected_loss, 1e-5 * std::fabs(expected_loss)) << "micro-batch " << micro;
    std::map<std::string, Tensor> reference_grads;
    for (Parameter* p : reference.parameters()) reference_grads[p->name] = p->grad;
    for (Parameter* p : model.parameters()) {
      const std::vector<float> a = model.gather(*p, p->grad).to_floats();
      const std::vector<float> e = reference_grads.at(p->name).to_floats();
      ASSERT_EQ(a.size(), e.size()) << p->name;
      double difference = 0, norm = 1e-30;
      for (size_t i = 0; i < a.size(); ++i) {
        difference += (double{a[i]} - e[i]) * (double{a[i]} - e[i]);
        norm += double{e[i]} * e[i];
      }
      const double relative = std::sqrt(difference / norm);
      worst_grad = std::max(worst_grad, relative);
      EXPECT_LE(relative, 1e-4) << p->name << " gradient, micro-batch " << micro;
    }
  }
  // Scales: equal on every tensor rank, and the single process's, entry for entry (the same
  // checkpoint names fp8.{i}.).
  const std::vector<Fp8State*> ours = model.fp8_states(), theirs = reference.fp8_states();
  ASSERT_EQ(ours.size(), theirs.size());
  std::vector<float> scales, expected_scales;
  for (size_t i = 0; i < ours.size(); ++i) {
    for (const auto& [mine, other] :
         {std::pair{&ours[i]->forward_meta(), &theirs[i]->forward_meta()},
          std::pair{&ours[i]->backward_meta(), &theirs[i]->backward_meta()}}) {
      ASSERT_EQ(mine->num_tensors(), other->num_tensors());
      for (int t = 0; t < mine->num_tensors(); ++t) {
        scales.push_back(mine->scale(t));
        expected_scales.push_back(other->scale(t));
      }
    }
  }
  ASSERT_FALSE(scales.empty());
  Tensor largest = Tensor::from_floats({static_cast<int64_t>(scales.size())}, scales);
  Tensor smallest = largest.clone();
  tp.all_reduce(largest, ReduceOp::Max);
  tp.all_reduce(smallest, ReduceOp::Min);
  EXPECT_EQ(largest.to_floats(), smallest.to_floats()) << "scales differ across tensor ranks";
  double worst_scale = 0;
  int moved = 0;  // scales that left their initial 1: the amaxes did reach them
  for (size_t i = 0; i < scales.size(); ++i) {
    worst_scale = std::max(worst_scale, std::fabs(double{scales[i]} - expected_scales[i]) /
                                            std::fabs(double{expected_scales[i]}));
    EXPECT_NEAR(scales[i], expected_scales[i], 1e-5 * std::fabs(expected_scales[i])) << i;
    moved += scales[i] != 1.0f;
  }
  EXPECT_GT(moved, static_cast<int>(scales.size()) / 2);
  if (tp.rank() == 0) {
    std::printf("TP=%d%s FP8: worst loss %.2e, gradient %.2e (relative L2), scale %.2e\n",
                tp.size(), sp ? " SP" : "", worst_loss, worst_grad, worst_scale);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GPTTensorParallel,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "SP" : "NoSP") +
                                  (std::get<1>(param_info.param) ? "_llama" : "_gpt2");
                         });
INSTANTIATE_TEST_SUITE_P(Layouts, GPTTensorParallelFp8,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(false)),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "SP" : "NoSP") +
                                  "_gpt2";
                         });

}  // namespace
}  // namespace octet
