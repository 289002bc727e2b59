// Data parallelism against the single-process run, in one test process per rank: every rank
// also computes the whole global batch alone (the reference), then the data-parallel run
// (its share of micro-batches, buckets reduced during backward) must give the same
// gradients, and after AdamW steps (plain or ZeRO-1) the same parameters.
//
// Tolerance: the reference accumulates the global batch's micro-batch gradients in one
// order, the data-parallel run sums per-rank partial sums; FP32 addition is not associative,
// so results differ by rounding: relative 1e-5 of each tensor's largest magnitude (FP32's
// epsilon 1.2e-7 times the few dozen additions that follow), and for parameters 1e-4 of the
// learning rate besides: AdamW's update lr * m / (sqrt(v) + eps) of an element whose
// gradient is near eps turns a rounding-level gradient difference into a visible fraction of
// lr (measured: up to 3e-5 lr with eps 1e-6).
#include <gtest/gtest.h>

#include <cmath>

#include "octet/comm.h"
#include "octet/data_parallel.h"
#include "octet/model.h"
#include "octet/train.h"

namespace octet {
namespace {

GPTConfig small_config() {
  return GPTConfig::from_json({{"name", "dp-test"},
                               {"vocab_size", 97},
                               {"max_seq_len", 16},
                               {"num_layers", 2},
                               {"hidden", 32},
                               {"num_heads", 4},
                               {"position_embedding", "learned"}});
}

// Micro-batch `index` of the global batch: [2, 16] ids and targets from a fixed formula.
void batch(int64_t index, Tensor& ids, Tensor& targets) {
  ids = Tensor::empty({2, 16}, DType::I32);
  targets = Tensor::empty({2, 16}, DType::I32);
  for (int64_t i = 0; i < 32; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>((index * 37 + i * 11 + i * i) % 97);
    targets.data<int32_t>()[i] = static_cast<int32_t>((index * 13 + i * 5 + 3) % 97);
  }
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.to_floats()) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

void expect_close(const Tensor& actual, const Tensor& expected, const std::string& what,
                  double absolute = 0) {
  const std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  ASSERT_EQ(a.size(), e.size()) << what;
  const double tolerance = 1e-5 * std::max(max_abs(expected), 1e-6) + absolute;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - e[i]));
  EXPECT_LE(worst, tolerance) << what << ": max difference " << worst;
}

class DataParallel : public ::testing::TestWithParam<bool> {};  // param: distributed optimizer

TEST_P(DataParallel, GradientsAndStepsEqualTheSingleProcessRun) {
  const bool distributed_optimizer = GetParam();
  std::shared_ptr<Communicator> world = world_communicator();
  const int dp = world->size(), rank = world->rank();
  const int64_t per_rank = 2, micro_batches = per_rank * dp;  // the global batch
  const GPTConfig config = small_config();
  AdamWOptions adam;
  adam.clip_grad = 0.05f;  // small enough to clip: the global norm must be the true one
  // AdamW's first updates are lr * g / (|g| + eps): for gradients near eps, rounding-level
  // differences in g move the update by a large fraction of lr. A larger eps keeps that
  // amplification out of a comparison meant to test the reduction.
  adam.eps = 1e-6f;

  GPT reference(config, 7);
  AdamW reference_optimizer(reference.parameters(), adam);
  GPT model(config, 7);
  DataParallelOptions options;
  options.bucket_elements = 2000;  // several buckets
  options.distributed_optimizer = distributed_optimizer;
  DistributedDataParallel ddp(model.parameters_in_backward_order(), *world, options);
  model.on_parameters_updated();
  model.set_grad_ready_hook([&](const std::vector<Parameter*>& p) { ddp.grads_ready(p); });
  model.set_embedding_grad_hook([&](Parameter& table, const Tensor& ids, const Tensor& rows) {
    ddp.add_embedding_rows(table, ids, rows);
  });
  ASSERT_GT(ddp.buckets().size(), 2u);
  std::unique_ptr<AdamW> plain;
  std::unique_ptr<DistributedOptimizer> zero;
  if (distributed_optimizer) {
    zero = std::make_unique<DistributedOptimizer>(ddp, adam);
  } else {
    plain = std::make_unique<AdamW>(model.parameters(), adam);
  }

  for (int step = 0; step < 3; ++step) {
    reference.zero_grad();
    double reference_loss = 0;
    for (int64_t m = 0; m < micro_batches; ++m) {
      Tensor ids, targets;
      batch(step * micro_batches + m, ids, targets);
      reference_loss += reference.train_step(ids, targets, DType::F32, 1.0f / micro_batches);
    }
    ddp.zero_grad();
    double loss = 0;
    for (int64_t k = 0; k < per_rank; ++k) {
      Tensor ids, targets;
      batch(step * micro_batches + k * dp + rank, ids, targets);
      ddp.set_sync(k + 1 == per_rank);
      loss += model.train_step(ids, targets, DType::F32, 1.0f / micro_batches);
    }
    ddp.finish_grad_sync();
    loss = world->all_reduce(loss, ReduceOp::Sum);
    EXPECT_NEAR(loss, reference_loss, 1e-5 * std::fabs(reference_loss)) << "step " << step;
    if (!distributed_optimizer) {
      std::vector<Parameter*> mine = model.parameters(), theirs = reference.parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        expect_close(mine[i]->grad, theirs[i]->grad,
                     "step " + std::to_string(step) + " grad " + mine[i]->name);
      }
    }
    const float lr = 1e-2f;
    const double reference_norm = reference_optimizer.step(lr);
    const double norm = zero ? zero->step(lr) : plain->step(lr);
    EXPECT_NEAR(norm, reference_norm, 1e-5 * reference_norm) << "step " << step;
    reference.on_parameters_updated();
    model.on_parameters_updated();
    std::vector<Parameter*> mine = model.parameters(), theirs = reference.parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      expect_close(mine[i]->value, theirs[i]->value,
                   "step " + std::to_string(step) + " value " + mine[i]->name, 1e-4 * lr);
    }
  }
  CommStats stats = ddp.take_stats();
  if (dp > 1) {
    EXPECT_GT(stats.operations, 0);
    EXPECT_GT(stats.bytes, 0);
  }
  if (zero) {
    // The gathered optimizer state loads back into a plain AdamW of any size.
    TensorMap state = zero->state();
    EXPECT_EQ(state.size(), 2 * model.parameters().size());
    TensorMap reference_state = reference_optimizer.state();
    for (auto& [name, tensor] : reference_state) expect_close(state.at(name), tensor, name);
  }
}

std::string layout_name(const ::testing::TestParamInfo<bool>& param) {
  return param.param ? "DistributedOptimizer" : "AllReduce";
}
INSTANTIATE_TEST_SUITE_P(AllReduceAndZero1, DataParallel, ::testing::Bool(), layout_name);

TEST(DataParallelFp8, AmaxReductionKeepsEveryRanksScalesEqual) {
  std::shared_ptr<Communicator> world = world_communicator();
  const GPTConfig config = small_config();
  GPT model(config, 11);
  recipe::DelayedScaling recipe;
  for (int step = 0; step < 3; ++step) {
    Tensor ids, targets;
    batch(100 + world->rank() * 10 + step, ids, targets);  // different data on every rank
    {
      fp8_autocast scope(true, recipe);
      model.train_step(ids, targets, DType::BF16, 1.0f);
    }
    reduce_fp8_amax(model.fp8_states(), *world);
  }
  Tensor ids, targets;
  batch(0, ids, targets);
  {
    fp8_autocast scope(true, recipe);  // the next forward updates the scales from the amaxes
    model.train_step(ids, targets, DType::BF16, 1.0f);
  }
  std::vector<float> scales;
  for (Fp8State* state : model.fp8_states()) {
    for (float s : state->forward_meta().scales()) scales.push_back(s);
  }
  ASSERT_FALSE(scales.empty());
  Tensor mine = Tensor::from_floats({static_cast<int64_t>(scales.size())}, scales);
  Tensor high = mine.clone(), low = mine.clone();
  world->all_reduce(high, ReduceOp::Max);
  world->all_reduce(low, ReduceOp::Min);
  EXPECT_EQ(high.to_floats(), low.to_floats()) << "FP8 scales differ across ranks";
}

}  // namespace
}  // namespace octet
