// The pipeline executor against the single-process GPT: every schedule at PP = world size (2
// and 4 under mpiexec), two steps of plain SGD on the same micro-batches; the step's loss and
// every parameter gradient this rank holds equal the reference computed in this process. A
// broken schedule is an error (pre-flight check, or a receive timeout at run time), not a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "octet/comm.h"
#include "octet/error.h"
#include "octet/model.h"
#include "octet/pipeline.h"

namespace octet {
namespace {

using pipeline::Schedule;

// 8 layers: 8 stages at PP=4 with two chunks per rank (interleaved, DualPipeV).
GPTConfig tiny_config() {
  GPTConfig c;
  c.name = "gpt-pipeline-test";
  c.vocab_size = 64;
  c.max_seq_len = 8;
  c.num_layers = 8;
  c.hidden = 32;
  c.num_heads = 2;
  return c;
}

constexpr int64_t kBatch = 2, kSeqLen = 8;
constexpr uint64_t kSeed = 7;

void make_micro_batches(int step, int count, std::vector<Tensor>& ids,
                        std::vector<Tensor>& targets) {
  std::mt19937 rng(static_cast<unsigned>(1000 + step));
  std::uniform_int_distribution<int32_t> token(0, 63);
  ids.clear();
  targets.clear();
  for (int m = 0; m < count; ++m) {
    Tensor x = Tensor::empty({kBatch, kSeqLen}, DType::I32);
    Tensor y = Tensor::empty({kBatch, kSeqLen}, DType::I32);
    for (int64_t i = 0; i < x.numel(); ++i) {
      x.data<int32_t>()[i] = token(rng);
      y.data<int32_t>()[i] = token(rng);
    }
    ids.push_back(x);
    targets.push_back(y);
  }
}

void zero_grads(Module& module) {
  for (Parameter* p : module.parameters()) p->grad.zero_();
}

void sgd(Module& module, float lr) {
  for (Parameter* p : module.parameters()) {
    float* v = p->value.data<float>();
    const float* g = p->grad.data<float>();
    for (int64_t i = 0; i < p->value.numel(); ++i) v[i] -= lr * g[i];
  }
  module.on_parameters_updated();
}

// Runs `steps` steps of the schedule and of the single-process GPT on the same micro-batches.
// Tolerance: each micro-batch runs the same kernels on the same inputs; what differs is the
// order of FP32 sums: the tied wte gradient adds all output-layer contributions on the last
// stage and all embedding rows on the first, then sums the two (the reference interleaves
// them per micro-batch), and DualPipe sums its two model copies' gradients. That is a few ulp
// in step 1; the SGD update carries it into every parameter, so step 2's gradients differ
// everywhere by a few ulp more. Measured at PP=2 and 4: at most 9.5e-7 of the tensor's
// largest gradient (DualPipe, PP=4); we allow 1e-5 (10x), and 1e-5 relative on the loss.
void expect_matches_single_process(const Schedule& schedule, int steps = 2,
                                   DType dtype = DType::F32, bool overlap = false) {
  std::shared_ptr<Communicator> world = world_communicator();
  ParallelState parallel(world, 1, world->size());
  const GPTConfig config = tiny_config();
  const int rank = parallel.pipeline_rank();
  GPT reference(config, kSeed);
  GPT stage(config, kSeed, GPTLayout{schedule.stages, pipeline::stages_of_rank(schedule, rank)});
  pipeline::ExecutorOptions options;
  options.dtype = dtype;
  options.overlap_forward_backward = overlap;
  pipeline::PipelineExecutor executor(schedule, stage, parallel, options);
  std::map<std::string, Parameter*> by_name;
  for (Parameter* p : reference.parameters()) by_name[p->name] = p;
  for (Parameter* p : stage.parameters()) {
    ASSERT_TRUE(by_name.count(p->name)) << p->name;
    ASSERT_EQ(p->value.to_floats(), by_name[p->name]->value.to_floats()) << p->name;
  }
  const int M = schedule.micro_batches;
  double worst_ratio = 0.0;  // the largest difference seen / the tolerance's scale
  std::vector<Tensor> ids, targets;
  for (int step = 0; step < steps; ++step) {
    make_micro_batches(step, M, ids, targets);
    zero_grads(reference);
    zero_grads(stage);
    double reference_loss = 0.0;
    for (int m = 0; m < M; ++m) {
      reference_loss += reference.train_step(ids[m], targets[m], dtype, 1.0f / M);
    }
    reference_loss /= M;
    const float loss = executor.train_step(gpt_micro_batches(ids, targets), 1.0f / M);
    EXPECT_NEAR(loss, reference_loss, 1e-5 * std::abs(reference_loss))
        << pipeline::schedule_name(schedule.kind) << " step " << step << " rank " << rank;
    for (Parameter* p : stage.parameters()) {
      const std::vector<float> ours = p->grad.to_floats();
      const std::vector<float> theirs = by_name[p->name]->grad.to_floats();
      float scale = 0.0f, worst = 0.0f;
      for (size_t i = 0; i < ours.size(); ++i) {
        scale = std::max(scale, std::abs(theirs[i]));
        worst = std::max(worst, std::abs(ours[i] - theirs[i]));
      }
      EXPECT_GT(scale, 0.0f) << p->name;
      worst_ratio = std::max(worst_ratio, static_cast<double>(worst) / scale);
      EXPECT_LE(worst, 1e-5f * scale) << pipeline::schedule_name(schedule.kind) << " step " << step
                                      << " rank " << rank << " " << p->name << " scale " << scale;
    }
    // The owned parameters count each model parameter once: the squared gradient norm summed
    // over the pipeline equals the whole model's.
    double squares = 0.0, reference_squares = 0.0;
    for (Parameter* p : executor.owned_parameters()) {
      for (float g : p->grad.to_floats()) squares += static_cast<double>(g) * g;
    }
    for (Parameter* p : reference.parameters()) {
      for (float g : p->grad.to_floats()) reference_squares += static_cast<double>(g) * g;
    }
    squares = parallel.pipeline().all_reduce(squares);
    EXPECT_NEAR(squares, reference_squares, 1e-5 * reference_squares) << "step " << step;
    // Overlapped pairs ran where asked (DualPipe has F&B pairs at every PP).
    EXPECT_EQ(executor.last_step_timing().overlapped_pair_seconds > 0.0, overlap);
    sgd(reference, 0.1f);
    sgd(stage, 0.1f);
  }
  std::printf("%s rank %d: largest gradient difference %.2e of the tensor's largest gradient\n",
              pipeline::schedule_name(schedule.kind), rank, worst_ratio);
}

// A stage loads its part of a whole-model state dict: equal to the model it came from.
TEST(Pipeline, StageLoadsItsPartOfAWholeModelStateDict) {
  const GPTConfig config = tiny_config();
  GPT source(config, kSeed + 1);
  GPT stage(config, kSeed, GPTLayout{4, {1, 3}});
  stage.load_state_dict(source.state_dict());
  const TensorMap ours = stage.state_dict();
  TensorMap theirs = source.state_dict();
  // Stages 1 and 3 of 4: layers 2, 3, 6, 7, the final norm and wte (tied output), no wpe.
  size_t expected = 0;
  for (const auto& [name, tensor] : theirs) {
    for (const char* held : {"transformer.h.2.", "transformer.h.3.", "transformer.h.6.",
                             "transformer.h.7.", "transformer.ln_f.", "transformer.wte."}) {
      if (name.rfind(held, 0) == 0) ++expected;
    }
  }
  EXPECT_EQ(ours.size(), expected);
  EXPECT_EQ(ours.count("transformer.wpe.weight"), 0u);
  for (const auto& [name, tensor] : ours) {
    EXPECT_EQ(tensor.to_floats(), theirs.at(name).to_floats()) << name;
  }
  theirs.erase("transformer.ln_f.weight");
  EXPECT_THROW(stage.load_state_dict(theirs), Error);
}

int pipeline_size() {
  return world_communicator()->size();
}

TEST(Pipeline, OneFOneBMatchesSingleProcess) {
  expect_matches_single_process(pipeline::schedule_1f1b(pipeline_size(), 2 * pipeline_size()));
}

// BF16 activations and gradients cross the pipeline as BF16, as the reference keeps them: the
// same kernels on the same values, so the FP32 tolerance holds.
TEST(Pipeline, OneFOneBInBF16MatchesSingleProcess) {
  expect_matches_single_process(pipeline::schedule_1f1b(pipeline_size(), 2 * pipeline_size()), 1,
                                DType::BF16);
}

TEST(Pipeline, InterleavedMatchesSingleProcess) {
  expect_matches_single_process(
      pipeline::schedule_interleaved_1f1b(pipeline_size(), 2 * pipeline_size(), 2));
}

TEST(Pipeline, ZeroBubbleMatchesSingleProcess) {
  expect_matches_single_process(
      pipeline::schedule_zero_bubble_h1(pipeline_size(), 2 * pipeline_size()));
}

// ZB1P's split backward is executed: every BackwardInput defers its weight-gradient GEMMs and
// every BackwardWeight runs them (the gradients above match only if all of them ran).
TEST(Pipeline, ZeroBubbleRunsItsWeightGradientsInTheWActions) {
  const int P = pipeline_size();
  const Schedule schedule = pipeline::schedule_zero_bubble_h1(P, 2 * P);
  std::shared_ptr<Communicator> world = world_communicator();
  ParallelState parallel(world, 1, P);
  const int rank = parallel.pipeline_rank();
  GPT stage(tiny_config(), kSeed,
            GPTLayout{schedule.stages, pipeline::stages_of_rank(schedule, rank)});
  pipeline::PipelineExecutor executor(schedule, stage, parallel);
  std::vector<Tensor> ids, targets;
  make_micro_batches(0, 2 * P, ids, targets);
  executor.train_step(gpt_micro_batches(ids, targets), 0.5f);
  size_t inputs = 0, weights = 0;
  for (const pipeline::Action& a : schedule.actions[static_cast<size_t>(rank)]) {
    inputs += a.kind == pipeline::ActionKind::BackwardInput;
    weights += a.kind == pipeline::ActionKind::BackwardWeight;
  }
  const pipeline::StepTiming& t = executor.last_step_timing();
  EXPECT_GT(weights, 0u);
  EXPECT_EQ(t.backward_input_samples.size(), inputs);
  EXPECT_EQ(t.weight_samples.size(), weights);
  EXPECT_GT(t.weight_seconds, 0.0);
}

TEST(Pipeline, DualPipeVMatchesSingleProcess) {
  expect_matches_single_process(pipeline::schedule_dualpipev(pipeline_size(), 2 * pipeline_size()));
}

TEST(Pipeline, DualPipeMatchesSingleProcess) {
  expect_matches_single_process(pipeline::schedule_dualpipe(pipeline_size(), 2 * pipeline_size()));
}

// The F&B pairs overlapped on two threads (the threads share the tied table, whose embedding
// rows are added after each pair): the same model as one process, under the same tolerance.
TEST(Pipeline, DualPipeOverlappedMatchesSingleProcess) {
  expect_matches_single_process(pipeline::schedule_dualpipe(pipeline_size(), 2 * pipeline_size()),
                                2, DType::F32, /*overlap=*/true);
}

// Last: the timed-out receives stay posted until exit.
TEST(Pipeline, BrokenScheduleIsAnErrorNotAHang) {
  const int P = pipeline_size();
  if (P < 2) GTEST_SKIP() << "needs two ranks";
  Schedule broken = pipeline::schedule_1f1b(P, 2);
  std::vector<pipeline::Action>& first = broken.actions[0];
  first.erase(std::find_if(first.begin(), first.end(), [](const pipeline::Action& a) {
    return a.kind == pipeline::ActionKind::SendForward && a.micro_batch == 0;
  }));
  std::shared_ptr<Communicator> world = world_communicator();
  ParallelState parallel(world, 1, P);
  const int rank = parallel.pipeline_rank();
  const GPTConfig config = tiny_config();
  GPT stage(config, kSeed, GPTLayout{broken.stages, pipeline::stages_of_rank(broken, rank)});
  // Pre-flight: check_schedule finds the receive without a send.
  EXPECT_THROW(pipeline::PipelineExecutor(broken, stage, parallel), Error);
  // At run time (check off): every rank's first receive times out, naming the action. Leaked
  // on purpose: MPI may still touch its abandoned buffers until exit.
  pipeline::ExecutorOptions options;
  options.check = false;
  options.receive_timeout_seconds = 2;
  auto* executor = new pipeline::PipelineExecutor(broken, stage, parallel, options);
  std::vector<Tensor> ids, targets;
  make_micro_batches(0, 2, ids, targets);
  try {
    executor->train_step(gpt_micro_batches(ids, targets), 0.5f);
    ADD_FAILURE() << "rank " << rank << ": the broken schedule ran to the end";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(rank == 0 ? "RecvB(mb 0" : "RecvF(mb 0"), std::string::npos) << message;
    EXPECT_NE(message.find("still pending"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace octet
