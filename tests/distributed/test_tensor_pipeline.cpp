// Tensor x pipeline parallelism (TP = 2 x PP = world / 2; CMake runs 4 ranks): every pipeline
// schedule runs the stages of a GPT split over the tensor group through the executor, SP off and
// on, for two steps of plain SGD, against the single-process GPT made with the same config and seed
// in the same process on the same micro-batches. Each rank's gathered gradients, the loss and the
// global gradient norm (owned parameters over tensor x pipeline) agree within 1e-5 relative.
//
// Tolerance: what differs from the single process is the order of FP32 sums only: the split
// GEMMs and the cross-rank log-sum-exp of the tensor-parallel blocks (test_gpt_tensor_parallel:
// <= 7.9e-7 measured), the tied wte gradient summed once over the two pipeline ends instead of
// per micro-batch and DualPipe's two copies summed (test_pipeline: <= 9.5e-7 measured); the
// SGD step carries step 1's differences into step 2. The worst case is printed per schedule.
// The vocabulary (101) is odd, so the two tensor shards hold 51 and 50 rows.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include "octet/comm.h"
#include "octet/error.h"
#include "octet/model.h"
#include "octet/ops/optimizer.h"
#include "octet/pipeline.h"
#include "octet/tensor_parallel.h"

namespace octet {
namespace {

constexpr double kRelativeTolerance = 1e-5;
constexpr int kTensor = 2;
constexpr int64_t kBatch = 2, kSeqLen = 8;
constexpr uint64_t kSeed = 7;

// 8 layers: 8 stages at PP = 2 with interleaving (v = 2) or DualPipeV (2 chunks per rank).
GPTConfig small_config(bool llama) {
  GPTConfig c;
  c.name = "gpt-tp-pp-test";
  c.vocab_size = 101;
  c.max_seq_len = kSeqLen;
  c.num_layers = 8;
  c.hidden = 32;
  c.num_heads = 4;
  if (llama) {
    c.normalization = "rmsnorm";
    c.activation = "swiglu";
    c.bias = false;
    c.num_gqa_groups = 2;
  }
  return c;
}

void micro_batches(const GPTConfig& c, int step, int count, std::vector<Tensor>& ids,
                   std::vector<Tensor>& targets) {
  ids.clear();
  targets.clear();
  for (int m = 0; m < count; ++m) {
    Tensor x = Tensor::empty({kBatch, kSeqLen}, DType::I32);
    Tensor y = Tensor::empty({kBatch, kSeqLen}, DType::I32);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t k = i + 97 * m + 1009 * step;
      x.data<int32_t>()[i] = static_cast<int32_t>((k * 37 + 11) % c.vocab_size);
      y.data<int32_t>()[i] = i == 3 ? -100 : static_cast<int32_t>((k * 53 + 5) % c.vocab_size);
    }
    ids.push_back(x);
    targets.push_back(y);
  }
}

void sgd(Module& module, float lr) {
  for (Parameter* p : module.parameters()) {
    float* v = p->value.data<float>();
    const float* g = p->grad.data<float>();
    for (int64_t i = 0; i < p->value.numel(); ++i) v[i] -= lr * g[i];
  }
  module.on_parameters_updated();
}

// max |actual - expected| / max |expected|, checked against the tolerance.
double expect_close(const Tensor& actual, const Tensor& expected, const std::string& what) {
  const std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  EXPECT_EQ(a.size(), e.size()) << what;
  if (a.size() != e.size()) return INFINITY;
  double scale = 1e-30, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::fabs(double{e[i]}));
    worst = std::max(worst, std::fabs(double{a[i]} - e[i]));
  }
  EXPECT_LE(worst, kRelativeTolerance * scale)
      << what << ": max difference " << worst << " of max |expected| " << scale;
  return worst / scale;
}

using Param = std::tuple<pipeline::ScheduleKind, bool, bool>;  // schedule, SP, llama

class TensorPipeline : public ::testing::TestWithParam<Param> {};

TEST_P(TensorPipeline, EqualsTheSingleProcessGPT) {
  const auto [kind, sp, llama] = GetParam();
  std::shared_ptr<Communicator> world = world_communicator();
  if (world->size() % kTensor != 0 || world->size() / kTensor < 2) {
    GTEST_SKIP() << "needs TP=2 x PP>=2 ranks, got " << world->size();
  }
  ParallelState parallel(world, kTensor, world->size() / kTensor);
  const int P = parallel.pipeline_size();
  const GPTConfig config = small_config(llama);
  const pipeline::Schedule schedule = pipeline::make_schedule(kind, P, 2 * P, 2);
  const int M = schedule.micro_batches;
  GPT reference(config, kSeed);
  GPT model(config, kSeed,
            GPTLayout{schedule.stages, pipeline::stages_of_rank(schedule, parallel.pipeline_rank()),
                      &parallel.tensor(), sp});
  pipeline::PipelineExecutor executor(schedule, model, parallel);

  // The stage's gathered parameters are GPT's tensors of those stages, bit for bit.
  const TensorMap expected_values = reference.state_dict();
  for (const auto& [name, tensor] : model.state_dict()) {
    ASSERT_TRUE(expected_values.count(name)) << name;
    EXPECT_EQ(tensor.to_floats(), expected_values.at(name).to_floats()) << name;
  }

  double worst = 0;
  std::vector<Tensor> ids, targets;
  for (int step = 0; step < 2; ++step) {
    micro_batches(config, step, M, ids, targets);
    reference.zero_grad();
    model.zero_grad();
    double expected_loss = 0;
    for (int m = 0; m < M; ++m) {
      expected_loss += reference.train_step(ids[m], targets[m], DType::F32, 1.0f / M);
    }
    expected_loss /= M;
    const float loss = executor.train_step(gpt_micro_batches(ids, targets), 1.0f / M);
    EXPECT_NEAR(loss, expected_loss, kRelativeTolerance * std::fabs(expected_loss))
        << "step " << step;
    all_reduce_sequence_parallel_gradients(model.sequence_parallel_parameters(), parallel.tensor());
    std::map<std::string, Tensor> reference_grads;
    std::vector<Tensor> all_grads;
    for (Parameter* p : reference.parameters()) {
      reference_grads[p->name] = p->grad;
      all_grads.push_back(p->grad);
    }
    for (Parameter* p : model.parameters()) {
      ASSERT_TRUE(reference_grads.count(p->name)) << p->name;
      worst = std::max(worst, expect_close(model.gather(*p, p->grad), reference_grads[p->name],
                                           p->name + " gradient, step " + std::to_string(step)));
    }
    // Owned parameters over tensor x pipeline count each model parameter exactly once.
    const double norm = ops::global_grad_norm(all_grads);
    EXPECT_NEAR(
        grad_norm_over(model.counted_in_norm(executor.owned_parameters()), parallel.model()), norm,
        kRelativeTolerance * norm)
        << "step " << step;
    sgd(reference, 0.1f);
    sgd(model, 0.1f);
  }
  worst = parallel.world().all_reduce(worst, ReduceOp::Max);
  if (parallel.rank() == 0) {
    std::printf("TP=%d x PP=%d %s%s%s: worst relative gradient difference %.2e (tolerance %.0e)\n",
                kTensor, P, pipeline::schedule_name(kind), sp ? " SP" : "", llama ? " llama" : "",
                worst, kRelativeTolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, TensorPipeline,
                         ::testing::Values(Param{pipeline::ScheduleKind::OneFOneB, false, false},
                                           Param{pipeline::ScheduleKind::OneFOneB, true, false},
                                           Param{pipeline::ScheduleKind::OneFOneB, true, true},
                                           Param{pipeline::ScheduleKind::Interleaved, true, false},
                                           Param{pipeline::ScheduleKind::ZeroBubbleH1, false, true},
                                           Param{pipeline::ScheduleKind::DualPipe, true, false},
                                           Param{pipeline::ScheduleKind::DualPipeV, false, false}),
                         [](const auto& param_info) {
                           std::string name =
                               pipeline::schedule_name(std::get<0>(param_info.param));
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name + (std::get<1>(param_info.param) ? "_SP" : "_NoSP") +
                                  (std::get<2>(param_info.param) ? "_llama" : "_gpt2");
                         });

// A stage's checkpoint part: state_dict() of TP x PP holds exactly its stages' whole tensors,
// and load_state_dict() of a whole-model map takes back this rank's slices of them.
TEST(TensorPipelineState, StageLoadsItsSlicesOfAWholeModel) {
  std::shared_ptr<Communicator> world = world_communicator();
  if (world->size() % kTensor != 0 || world->size() / kTensor < 2) {
    GTEST_SKIP() << "needs TP=2 x PP>=2 ranks, got " << world->size();
  }
  ParallelState parallel(world, kTensor, world->size() / kTensor);
  const GPTConfig config = small_config(false);
  const pipeline::Schedule schedule =
      pipeline::make_schedule(pipeline::ScheduleKind::OneFOneB, parallel.pipeline_size(), 2);
  const std::vector<int> held = pipeline::stages_of_rank(schedule, parallel.pipeline_rank());
  GPT source(config, kSeed + 1);
  GPT model(config, kSeed, GPTLayout{schedule.stages, held, &parallel.tensor(), false});
  model.load_state_dict(source.state_dict());
  const TensorMap expected = source.state_dict();
  const TensorMap ours = model.state_dict();
  EXPECT_LT(ours.size(), expected.size());
  for (const auto& [name, tensor] : ours) {
    EXPECT_EQ(tensor.to_floats(), expected.at(name).to_floats()) << name;
  }
  // A whole-model map without one of this stage's tensors is an error naming it.
  TensorMap missing = expected;
  const std::string dropped = model.parameters().back()->name;
  missing.erase(dropped);
  try {
    model.load_state_dict(missing);
    ADD_FAILURE() << "a map without '" << dropped << "' loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dropped), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace octet
