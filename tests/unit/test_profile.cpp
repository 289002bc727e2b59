// The step breakdown's sums: exclusive time per category on the profiled thread only, nothing
// counted while off, and the operators' entry points opening their categories.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "octet/gemm.h"
#include "octet/ops/normalization.h"
#include "octet/ops/optimizer.h"
#include "octet/profile.h"
#include "octet/tensor.h"

namespace octet {
namespace {

using profile::Category;

int index_of(Category c) {
  return static_cast<int>(c);
}

TEST(Profile, NestedScopesCountExclusiveTime) {
  profile::start();
  const auto start = std::chrono::steady_clock::now();
  {
    const profile::Scope outer(Category::Gemm);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    {
      const profile::Scope inner(Category::Attention);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
  }
  const double outer_inclusive =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const profile::Totals t = profile::totals();
  profile::stop();
  const double gemm = t.seconds[index_of(Category::Gemm)];
  const double attention = t.seconds[index_of(Category::Attention)];
  EXPECT_EQ(t.calls[index_of(Category::Gemm)], 1);
  EXPECT_EQ(t.calls[index_of(Category::Attention)], 1);
  EXPECT_GE(attention, 0.030);
  EXPECT_GE(gemm, 0.020);
  // The inner scope's time is not the outer's: the outer keeps at most its inclusive time
  // less the inner's.
  EXPECT_LE(gemm, outer_inclusive - attention + 1e-6);
  EXPECT_LE(gemm + attention, outer_inclusive + 1e-6);
}

TEST(Profile, NothingCountsWhileOffOrOnAnotherThread) {
  profile::start();
  profile::stop();
  { const profile::Scope off(Category::Gemm); }
  profile::start();
  std::thread other([] { const profile::Scope elsewhere(Category::Optimizer); });
  other.join();
  const profile::Totals t = profile::totals();
  profile::stop();
  for (int c = 0; c < profile::kCategories; ++c) {
    EXPECT_EQ(t.calls[c], 0) << profile::category_name(static_cast<Category>(c));
    EXPECT_EQ(t.seconds[c], 0.0);
  }
  // start() clears what an earlier run summed.
  profile::start();
  { const profile::Scope counted(Category::Optimizer); }
  profile::stop();
  EXPECT_EQ(profile::totals().calls[index_of(Category::Optimizer)], 1);
  profile::start();
  EXPECT_EQ(profile::totals().calls[index_of(Category::Optimizer)], 0);
  profile::stop();
}

TEST(Profile, OperatorEntryPointsOpenTheirCategories) {
  const Tensor a = Tensor::from_floats({4, 8}, std::vector<float>(32, 1.0f));
  const Tensor b = Tensor::from_floats({8, 3}, std::vector<float>(24, 1.0f));
  Tensor c = Tensor::zeros({4, 3}, DType::F32);
  const Tensor gamma = Tensor::from_floats({8}, std::vector<float>(8, 1.0f));
  Tensor y = Tensor::empty({4, 8}, DType::F32);
  Tensor mean = Tensor::empty({4}, DType::F32);
  Tensor rstd = Tensor::empty({4}, DType::F32);
  profile::start();
  gemm(a, b, c, /*trans_a=*/false, /*trans_b=*/false);
  gemm(a, b, c, /*trans_a=*/false, /*trans_b=*/false);
  ops::layernorm_forward(a, gamma, nullptr, 1e-5f, /*zero_centered_gamma=*/false, y, mean, rstd);
  const Tensor grads[] = {b};
  ops::global_grad_norm(grads);
  const profile::Totals t = profile::totals();
  profile::stop();
  EXPECT_EQ(c.data<float>()[0], 8.0f);
  EXPECT_EQ(t.calls[index_of(Category::Gemm)], 2);
  EXPECT_EQ(t.calls[index_of(Category::NormActivation)], 1);
  EXPECT_EQ(t.calls[index_of(Category::Optimizer)], 1);
  EXPECT_EQ(t.calls[index_of(Category::Attention)], 0);
  EXPECT_GT(t.seconds[index_of(Category::Gemm)], 0.0);
}

}  // namespace
}  // namespace octet
