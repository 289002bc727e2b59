// Expert parallelism at the world sizes CMake runs this under (1, 2, 4 ranks): the expert
// groups of ParallelState, the ExpertDispatcher's exchange (every row reaches its expert's
// rank in [expert][source] order and comes back in place; FP8 rows arrive as their 1x128
// block quantization), and an MoELayer split over the ranks against the whole layer run on
// the same tokens in one process: outputs, input gradients and every expert's gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "octet/comm.h"
#include "octet/modules.h"
#include "unit/test_util.h"

namespace octet {
namespace {

using testing::random_tensor;

class ExpertParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    world = world_communicator();
    n = world->size();
    r = world->rank();
  }
  std::shared_ptr<Communicator> world;
  int n = 1, r = 0;
};

TEST_F(ExpertParallel, GroupsSplitTheDataRanks) {
  for (int ep : {1, 2, 4}) {
    if (n % ep != 0) continue;
    ParallelState state(world, 1, 1, ep);
    EXPECT_EQ(state.expert().size(), ep);
    EXPECT_EQ(state.expert_data().size(), n / ep);
    EXPECT_EQ(state.expert_rank(), r % ep);
    EXPECT_EQ(state.expert().rank(), r % ep);
    EXPECT_EQ(state.expert_data().rank(), r / ep);
    // The expert group is EP consecutive data ranks; the expert-data group strides by EP.
    const double sum = state.expert().all_reduce(static_cast<double>(r));
    const int first = r - r % ep;
    EXPECT_EQ(sum, ep * first + ep * (ep - 1) / 2);
    const double peers = state.expert_data().all_reduce(static_cast<double>(r));
    double want = 0;
    for (int q = r % ep; q < n; q += ep) want += q;
    EXPECT_EQ(peers, want);
  }
  if (n % 3 != 0) {
    EXPECT_THROW(ParallelState(world, 1, 1, 3), Error);
  }
}

// Rows grouped by global expert: rank r sends counts[e] rows to expert e, row values
// (r, e, i, column) encoded so the receiver can tell where each came from.
float tag(int rank, int64_t expert, int64_t i, int64_t column) {
  return static_cast<float>(rank * 1000 + expert * 100 + i) + 0.125f * static_cast<float>(column);
}

TEST_F(ExpertParallel, DispatchDeliversEveryRowToItsExpertAndCombineBringsItBack) {
  const int64_t experts = 2 * n, local = 2, cols = 3;
  ExpertDispatcher dispatcher(*world, experts);
  EXPECT_EQ(dispatcher.local_experts(), local);
  auto count = [&](int rank, int64_t e) { return (rank * 5 + e * 3) % 4; };  // 0..3, some 0
  Tensor counts = Tensor::empty({experts}, DType::I32);
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) total += counts.data<int32_t>()[e] = count(r, e);
  Tensor rows = Tensor::empty({total, cols}, DType::F32);
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = 0; i < count(r, e); ++i, ++at) {
      for (int64_t c = 0; c < cols; ++c) rows.data<float>()[at * cols + c] = tag(r, e, i, c);
    }
  }
  const ExpertDispatcher::Layout layout = dispatcher.layout(counts);
  ExpertDispatcher::Pending pending = dispatcher.start_dispatch(rows, layout);
  const Tensor got = dispatcher.finish_dispatch(pending, layout);
  // [local expert][source][i]
  int64_t row = 0;
  for (int64_t l = 0; l < local; ++l) {
    const int64_t e = r * local + l;
    int64_t expected_rows = 0;
    for (int s = 0; s < n; ++s) {
      expected_rows += count(s, e);
      for (int64_t i = 0; i < count(s, e); ++i, ++row) {
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(got.data<float>()[row * cols + c], tag(s, e, i, c))
              << "row " << row << " of local expert " << l;
        }
      }
    }
    EXPECT_EQ(layout.expert_rows()[static_cast<size_t>(l)], expected_rows);
  }
  EXPECT_EQ(row, got.rows());
  // The experts' "outputs" (here the inputs doubled) go back to their sources in place.
  Tensor doubled = got.clone();
  for (int64_t i = 0; i < doubled.numel(); ++i) doubled.data<float>()[i] *= 2;
  ExpertDispatcher::Pending back = dispatcher.start_combine(doubled, layout);
  const Tensor returned = dispatcher.finish_combine(back);
  ASSERT_EQ(returned.rows(), total);
  for (int64_t i = 0; i < returned.numel(); ++i) {
    ASSERT_EQ(returned.data<float>()[i], 2 * rows.data<float>()[i]) << i;
  }
  const ExpertDispatcher::Stats stats = dispatcher.take_stats();
  EXPECT_EQ(stats.exchanges, 2);
  // Bytes sent to other ranks (a rank's rows for its own experts are copied): there and back.
  int64_t own = 0;
  for (int64_t l = 0; l < local; ++l) own += count(r, r * local + l);
  EXPECT_EQ(stats.bytes, (total - own + got.rows() - own) * cols * 4);
}

TEST_F(ExpertParallel, Fp8DispatchDeliversTheBlockQuantizedRows) {
  const int64_t experts = n, cols = 200;  // two 1x128 blocks per row, the second partial
  ExpertDispatcher dispatcher(*world, experts);
  Tensor counts = Tensor::empty({experts}, DType::I32);
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) total += counts.data<int32_t>()[e] = 3 + r + e;
  // Large and tiny magnitudes: the scales follow each block.
  Tensor rows = random_tensor({total, cols}, DType::BF16, 11 + r, 0.0f, 1.0f);
  for (int64_t i = 0; i < total; ++i) {
    const float scale = i % 3 == 0 ? 1e4f : (i % 3 == 1 ? 1e-4f : 1.0f);
    Tensor row = rows.slice_rows(i, i + 1);
    std::vector<float> v = row.to_floats();
    for (float& x : v) x *= scale;
    row.copy_from(Tensor::from_floats({1, cols}, v).to(DType::BF16));
  }
  const ExpertDispatcher::Layout layout = dispatcher.layout(counts);
  ExpertDispatcher::Pending pending = dispatcher.start_dispatch(rows, layout, /*fp8=*/true);
  const Tensor got = dispatcher.finish_dispatch(pending, layout);
  EXPECT_EQ(got.dtype(), DType::BF16);
  // Fewer bytes than BF16: one byte per value and a 4-byte scale per 128 (0.52 x here).
  EXPECT_LT(dispatcher.take_stats().bytes, static_cast<int64_t>(rows.nbytes()) * 11 / 20);
  ExpertDispatcher::Pending back = dispatcher.start_combine(got, layout);
  const Tensor returned = dispatcher.finish_combine(back);
  const Tensor want =
      Quantizer::block(DType::E4M3, 1, 128, true).quantize(rows).dequantize().to(DType::BF16);
  const std::vector<float> a = returned.to_floats(), b = want.to_floats(), x = rows.to_floats();
  // Within E4M3's half step of each value, or of its subnormal step below the normal range
  // (2^-10 of the block's scale, itself below amax / 224).
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i], b[i]) << "element " << i;
    const size_t row = i / cols, block = (i % cols) / 128;
    double amax = 0;
    for (size_t j = row * cols + block * 128;
         j < std::min((row + 1) * cols, row * cols + (block + 1) * 128); ++j)
      amax = std::max(amax, std::fabs(double(x[j])));
    ASSERT_LE(std::fabs(double(a[i]) - x[i]), std::fabs(x[i]) / 16 + amax / 224 / 1024) << i;
  }
}

MoELayerOptions layer_options(ops::ActivationKind activation, double capacity) {
  MoELayerOptions o;
  o.hidden = 32;
  o.num_experts = 4;
  o.ffn_hidden = 24;
  o.shared_expert_ffn_hidden = 16;
  o.activation = activation;
  o.norm.hidden = 32;
  o.norm.name = "moe.norm";
  o.router.topk = 2;
  o.router.aux_loss_coeff = 0.01f;
  o.router.z_loss_coeff = 0.001f;
  o.capacity_factor = capacity;
  o.seed = 5;
  o.name = "moe";
  return o;
}

TEST_F(ExpertParallel, SplitLayerEqualsTheWholeLayerOnEachRanksTokens) {
  ASSERT_EQ(4 % n, 0) << "run at 1, 2 or 4 ranks (4 experts)";
  for (auto [activation, capacity] : {std::pair{ops::ActivationKind::GeluTanh, 0.0},
                                      {ops::ActivationKind::SwiGlu, 0.0},
                                      {ops::ActivationKind::GeluTanh, 0.75}}) {
    SCOPED_TRACE(std::string(ops::activation_name(activation)) + " capacity " +
                 std::to_string(capacity));
    const MoELayerOptions o = layer_options(activation, capacity);
    MoELayer split(o, nullptr, world.get());
    MoELayer whole(o);
    ASSERT_EQ(split.fc1.weights.size(), static_cast<size_t>(4 / n));
    // Each rank's tokens differ; the whole layer runs them in this process.
    const Tensor x = random_tensor({12, 32}, DType::F32, 100 + r, 0.0f, 1.0f);
    const Tensor dy = random_tensor({12, 32}, DType::F32, 200 + r, 0.0f, 1.0f);
    MoELayer::Context a, b;
    const Tensor ya = split.forward(x, a), yb = whole.forward(x, b);
    const Tensor dxa = split.backward(dy, a), dxb = whole.backward(dy, b);
    EXPECT_LE(testing::relative_rms(ya, yb), 1e-6);
    EXPECT_LE(testing::relative_rms(dxa, dxb), 1e-6);
    // An expert's gradient on its rank sums every rank's tokens: the whole layers' summed.
    for (int64_t l = 0; l < 4 / n; ++l) {
      const int64_t e = r * (4 / n) + l;
      EXPECT_EQ(split.fc1.weights[l].name, "moe.experts.fc1.weight" + std::to_string(e));
      EXPECT_TRUE(split.fc1.weights[l].shard.expert);
    }
    for (GroupedLinear* pair : {&whole.fc1, &whole.fc2}) {
      for (Parameter* p : pair->parameters()) world->all_reduce(p->grad);
    }
    for (auto [mine, all] : {std::pair{&split.fc1, &whole.fc1}, {&split.fc2, &whole.fc2}}) {
      for (int64_t l = 0; l < 4 / n; ++l) {
        const int64_t e = r * (4 / n) + l;
        EXPECT_LE(testing::relative_rms(mine->weights[l].grad, all->weights[e].grad), 1e-6)
            << mine->weights[l].name;
        EXPECT_LE(testing::relative_rms(mine->biases[l].grad, all->biases[e].grad), 1e-6)
            << mine->biases[l].name;
      }
    }
    // The router's and the shared expert's gradients are this rank's tokens' alone, as the
    // whole layer's.
    EXPECT_LE(testing::relative_rms(split.router.weight.grad, whole.router.weight.grad), 1e-6);
  }
}

}  // namespace
}  // namespace octet
