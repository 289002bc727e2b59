// RoPE: fast path against the reference (every ISA path) and both against PyTorch in
// float64, forward and backward, both pair layouts, partial rotary_dim and a position offset.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/cpu_features.h"
#include "octet/ops/rope.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using ops::RopeLayout;
using ops::RopeOptions;

Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = dist(gen);
  Tensor t = Tensor::from_floats(shape, values);
  return dtype == DType::F32 ? t : t.to(dtype);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  double worst = 0.0;
  for (size_t n = 0; n < x.size(); ++n) worst = std::max(worst, std::fabs(double{x[n]} - y[n]));
  return worst;
}

// Values are in [-1, 1] and a rotation keeps their size. F32: cos/sin rounded to F32 once
// and two F32 products, ~2e-7 absolute. BF16: the result is rounded to bf16 (2^-9 relative
// half-spacing), and the fast path and the reference may round a tie-near value differently.
double tolerance(DType dtype) {
  return dtype == DType::F32 ? 1e-6 : 8e-3;
}

struct Case {
  const char* name;
  int64_t B, T, H, D;
  RopeOptions options;
  DType dtype = DType::F32;
};

class RopeCase : public ::testing::TestWithParam<Case> {};

TEST_P(RopeCase, FastMatchesReferenceOnEveryIsaAndTorch) {
  const Case& c = GetParam();
  const Shape shape{c.B, c.T, c.H, c.D};
  const Tensor x = random_tensor(shape, c.dtype, 1);
  const Tensor dy = random_tensor(shape, c.dtype, 2);
  const double tol = tolerance(c.dtype);
  Tensor y_ref = x.clone(), dx_ref = dy.clone();
  ops::reference::rope_forward(y_ref, c.options);
  ops::reference::rope_backward(dx_ref, c.options);
  const Isa saved = active_isa();
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    Tensor y = x.clone(), dx = dy.clone();
    ops::rope_forward(y, c.options);
    ops::rope_backward(dx, c.options);
    EXPECT_LE(max_abs_diff(y, y_ref), tol) << isa_name(isa);
    EXPECT_LE(max_abs_diff(dx, dx_ref), tol) << isa_name(isa);
  }
  set_active_isa(saved);

  const RopeOptions& o = c.options;
  std::string args = "{\"rotary_dim\": " + std::to_string(o.rotary_dim) +
                     ", \"theta\": " + std::to_string(o.theta) +
                     ", \"offset\": " + std::to_string(o.position_offset) + ", \"interleaved\": " +
                     (o.layout == RopeLayout::Interleaved ? "true" : "false") + "}";
  TensorMap torch = testing::run_torch("rope", {{"x", x}, {"dy", dy}}, args);
  EXPECT_LE(max_abs_diff(y_ref, torch.at("y")), tol);
  EXPECT_LE(max_abs_diff(dx_ref, torch.at("dx")), tol);
  Tensor y = x.clone(), dx = dy.clone();
  ops::rope_forward(y, o);
  ops::rope_backward(dx, o);
  EXPECT_LE(max_abs_diff(y, torch.at("y")), tol);
  EXPECT_LE(max_abs_diff(dx, torch.at("dx")), tol);

  // Channels past rotary_dim are untouched, bit for bit.
  const int64_t rotary = o.rotary_dim == 0 ? c.D : o.rotary_dim;
  std::vector<float> before = x.to_floats(), after = y.to_floats();
  for (size_t n = 0; n < before.size(); ++n) {
    if (static_cast<int64_t>(n) % c.D >= rotary) {
      ASSERT_EQ(before[n], after[n]) << n;
    }
  }
}

RopeOptions options(int64_t rotary_dim, float theta, int64_t offset, RopeLayout layout) {
  RopeOptions o;
  o.rotary_dim = rotary_dim;
  o.theta = theta;
  o.position_offset = offset;
  o.layout = layout;
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RopeCase,
    ::testing::Values(Case{"neox_full_d64", 2, 7, 3, 64,
                           options(0, 10000.0f, 0, RopeLayout::RotateHalf)},
                      Case{"neox_partial_d80_rot32_offset", 1, 65, 2, 80,
                           options(32, 10000.0f, 100, RopeLayout::RotateHalf)},
                      Case{"interleaved_d128_t130", 1, 130, 2, 128,
                           options(0, 500000.0f, 0, RopeLayout::Interleaved)},
                      Case{"interleaved_partial_d40_rot24", 2, 1, 3, 40,
                           options(24, 10000.0f, 37, RopeLayout::Interleaved)},
                      Case{"bf16_neox_d128_offset", 2, 5, 4, 128,
                           options(0, 10000.0f, 17, RopeLayout::RotateHalf), DType::BF16},
                      Case{"bf16_interleaved_d64_rot32", 1, 9, 2, 64,
                           options(32, 10000.0f, 0, RopeLayout::Interleaved), DType::BF16}),
    [](const ::testing::TestParamInfo<Case>& param) { return std::string(param.param.name); });

TEST(Rope, BackwardUndoesForward) {
  for (RopeLayout layout : {RopeLayout::RotateHalf, RopeLayout::Interleaved}) {
    const Tensor x = random_tensor({2, 33, 2, 64}, DType::F32, 3);
    Tensor y = x.clone();
    RopeOptions o = options(48, 10000.0f, 5, layout);
    ops::rope_forward(y, o);
    EXPECT_GT(max_abs_diff(x, y), 0.1);
    ops::rope_backward(y, o);  // R(-a) R(a) = I: the gradient rule is the inverse rotation
    EXPECT_LE(max_abs_diff(x, y), 1e-6);
  }
}

// Decoding one token at offset t equals row t of the whole sequence.
TEST(Rope, OffsetMatchesPositionInSequence) {
  const Tensor x = random_tensor({1, 10, 2, 32}, DType::F32, 4);
  Tensor whole = x.clone();
  ops::rope_forward(whole, {});
  Tensor last = Tensor::empty({1, 1, 2, 32}, DType::F32);
  std::vector<float> values = x.to_floats();
  std::vector<float> row(values.begin() + 9 * 64, values.end());
  last = Tensor::from_floats({1, 1, 2, 32}, row);
  RopeOptions o;
  o.position_offset = 9;
  ops::rope_forward(last, o);
  std::vector<float> expected = whole.to_floats();
  std::vector<float> got = last.to_floats();
  for (size_t n = 0; n < got.size(); ++n) EXPECT_NEAR(got[n], expected[9 * 64 + n], 1e-6);
}

// Central differences of L = sum(rope(x) * dy) against rope_backward (F32, tiny).
TEST(Rope, FiniteDifferencesMatchBackward) {
  Tensor x = random_tensor({1, 3, 2, 8}, DType::F32, 5);
  const Tensor dy = random_tensor(x.shape(), DType::F32, 6);
  RopeOptions o = options(6, 10000.0f, 2, RopeLayout::RotateHalf);
  Tensor dx = dy.clone();
  ops::rope_backward(dx, o);
  auto loss = [&]() {
    Tensor y = x.clone();
    ops::rope_forward(y, o);
    double sum = 0.0;
    for (int64_t n = 0; n < y.numel(); ++n) sum += double{y.data<float>()[n]} * dy.data<float>()[n];
    return sum;
  };
  const float eps = 1e-2f;  // linear map: only the F32 rounding of L (~1e-7/eps) remains
  for (int64_t n = 0; n < x.numel(); ++n) {
    float& v = x.data<float>()[n];
    const float saved = v;
    v = saved + eps;
    const double up = loss();
    v = saved - eps;
    const double down = loss();
    v = saved;
    EXPECT_NEAR(dx.data<float>()[n], (up - down) / (2.0 * eps), 1e-4) << n;
  }
}

TEST(Rope, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({1, 2, 2, 8}, DType::F32);
  EXPECT_THROW(ops::rope_forward(x, options(5, 10000.0f, 0, RopeLayout::RotateHalf)), Error);
  EXPECT_THROW(ops::rope_forward(x, options(10, 10000.0f, 0, RopeLayout::RotateHalf)), Error);
  EXPECT_THROW(ops::rope_forward(x, options(0, -1.0f, 0, RopeLayout::RotateHalf)), Error);
  EXPECT_THROW(ops::rope_backward(x, options(0, 10000.0f, -3, RopeLayout::RotateHalf)), Error);
  Tensor x3 = Tensor::zeros({2, 2, 8}, DType::F32);
  EXPECT_THROW(ops::rope_forward(x3, {}), Error);
  Tensor xi = Tensor::zeros({1, 2, 2, 8}, DType::I32);
  EXPECT_THROW(ops::rope_forward(xi, {}), Error);
}

}  // namespace
}  // namespace octet
