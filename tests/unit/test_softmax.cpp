// Scaled masked softmax: fast path against the reference (every ISA path) and both against
// PyTorch in float64, forward and backward, every mask kind, F32 and BF16.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/cpu_features.h"
#include "octet/ops/softmax.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::IsaGuard;
using ops::SoftmaxMask;
using ops::SoftmaxMaskKind;

Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed, float range = 4.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-range, range);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = dist(gen);
  Tensor t = Tensor::from_floats(shape, values);
  return dtype == DType::F32 ? t : t.to(dtype);
}

// |a - e| <= tol * (max|e| + |e|): probabilities are <= 1 and gradients O(1).
void expect_close(const Tensor& actual, const Tensor& expected, double tol,
                  const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  double scale = 1e-3;
  for (float x : e) scale = std::max(scale, std::fabs(double{x}));
  double worst = 0.0;
  size_t worst_at = 0;
  for (size_t n = 0; n < a.size(); ++n) {
    double err = std::fabs(double{a[n]} - e[n]) / (scale + std::fabs(double{e[n]}));
    if (!(err <= worst)) {
      worst = err;
      worst_at = n;
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst at " << worst_at << " got " << a[worst_at]
                        << " expected " << e[worst_at];
}

// F32: F32 exp2 polynomial (2e-7) and F32 row sums over <= 130 keys. BF16: y and dx are
// rounded to bf16 (2^-8 spacing), and backward starts from the rounded y.
double tolerance(DType dtype) {
  return dtype == DType::F32 ? 2e-5 : 1e-2;
}

struct Case {
  const char* name;
  int64_t B, H, Tq, Tk;
  SoftmaxMaskKind kind;
  DType dtype = DType::F32;
};

const char* kind_name(SoftmaxMaskKind kind) {
  switch (kind) {
    case SoftmaxMaskKind::Causal:
      return "causal";
    case SoftmaxMaskKind::Padding:
      return "padding";
    case SoftmaxMaskKind::Arbitrary:
      return "arbitrary";
    default:
      return "none";
  }
}

class SoftmaxCase : public ::testing::TestWithParam<Case> {};

TEST_P(SoftmaxCase, FastMatchesReferenceOnEveryIsaAndTorch) {
  const Case& c = GetParam();
  const Shape shape{c.B, c.H, c.Tq, c.Tk};
  Tensor x = random_tensor(shape, c.dtype, 1);
  Tensor dy = random_tensor(shape, c.dtype, 2, 1.0f);
  const float scale = 0.7f;
  TensorMap inputs{{"x", x}, {"dy", dy}};
  SoftmaxMask mask;
  mask.kind = c.kind;
  Tensor lengths = Tensor::empty({c.B}, DType::I32);
  for (int64_t b = 0; b < c.B; ++b)
    lengths.data<int32_t>()[b] = static_cast<int32_t>((b * 5) % (c.Tk + 1));
  Tensor masked = Tensor::empty({c.B, 1, c.Tq, c.Tk}, DType::U8);
  std::mt19937 gen(3);
  for (int64_t n = 0; n < masked.numel(); ++n) masked.data<uint8_t>()[n] = gen() % 3 == 0;
  for (int64_t j = 0; j < c.Tk; ++j) masked.data<uint8_t>()[j] = 1;  // row 0 fully masked
  if (c.kind == SoftmaxMaskKind::Padding) {
    mask.key_lengths = &lengths;
    inputs["key_lengths"] = lengths;
  }
  if (c.kind == SoftmaxMaskKind::Arbitrary) {
    mask.mask = &masked;
    inputs["mask"] = masked;
  }
  const double tol = tolerance(c.dtype);

  Tensor y_ref = Tensor::empty(shape, c.dtype), dx_ref = Tensor::empty(shape, c.dtype);
  ops::reference::scaled_masked_softmax_forward(x, scale, mask, y_ref);
  ops::reference::scaled_masked_softmax_backward(y_ref, dy, scale, dx_ref);
  const Isa saved = active_isa();
  Tensor y = Tensor::empty(shape, c.dtype), dx = Tensor::empty(shape, c.dtype);
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    ops::scaled_masked_softmax_forward(x, scale, mask, y);
    ops::scaled_masked_softmax_backward(y, dy, scale, dx);
    expect_close(y, y_ref, tol, std::string("y/") + isa_name(isa));
    expect_close(dx, dx_ref, tol, std::string("dx/") + isa_name(isa));
  }
  set_active_isa(saved);

  std::string args = std::string("{\"scale\": 0.7, \"mask\": \"") + kind_name(c.kind) + "\"}";
  TensorMap torch = testing::run_torch("scaled_masked_softmax", inputs, args);
  expect_close(y_ref, torch.at("y"), tol, "reference y vs torch");
  expect_close(dx_ref, torch.at("dx"), tol, "reference dx vs torch");
  ops::scaled_masked_softmax_forward(x, scale, mask, y);
  ops::scaled_masked_softmax_backward(y, dy, scale, dx);
  expect_close(y, torch.at("y"), tol, "fast y vs torch");
  expect_close(dx, torch.at("dx"), tol, "fast dx vs torch");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SoftmaxCase,
    ::testing::Values(Case{"none_t1", 2, 3, 1, 7, SoftmaxMaskKind::None},
                      Case{"causal_square", 2, 2, 65, 65, SoftmaxMaskKind::Causal},
                      Case{"causal_tq_lt_tk", 1, 2, 7, 130, SoftmaxMaskKind::Causal},
                      Case{"causal_tq_gt_tk", 1, 2, 9, 5, SoftmaxMaskKind::Causal},
                      Case{"padding", 3, 2, 5, 17, SoftmaxMaskKind::Padding},
                      Case{"arbitrary", 2, 2, 6, 33, SoftmaxMaskKind::Arbitrary},
                      Case{"bf16_causal", 2, 2, 65, 130, SoftmaxMaskKind::Causal, DType::BF16},
                      Case{"bf16_arbitrary", 2, 3, 7, 65, SoftmaxMaskKind::Arbitrary, DType::BF16}),
    [](const ::testing::TestParamInfo<Case>& param) { return std::string(param.param.name); });

TEST(Softmax, FullyMaskedRowsAreZerosAndInPlaceWorks) {
  Tensor x = random_tensor({1, 1, 4, 6}, DType::F32, 4);
  Tensor lengths = Tensor::empty({1}, DType::I32);
  lengths.data<int32_t>()[0] = 0;
  SoftmaxMask mask{SoftmaxMaskKind::Padding, &lengths, nullptr};
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  ops::scaled_masked_softmax_forward(x, 1.0f, mask, y);
  for (float value : y.to_floats()) EXPECT_EQ(value, 0.0f);

  Tensor expected = Tensor::empty(x.shape(), DType::F32);
  ops::reference::scaled_masked_softmax_forward(x, 2.0f, {}, expected);
  Tensor in_place = x.clone();
  ops::scaled_masked_softmax_forward(in_place, 2.0f, {}, in_place);
  expect_close(in_place, expected, 2e-5, "in place");
}

// Central differences of L = sum(y * dy) against the fast backward (F32, causal, tiny).
TEST(Softmax, FiniteDifferencesMatchBackward) {
  Tensor x = random_tensor({1, 2, 3, 5}, DType::F32, 5, 1.0f);
  Tensor dy = random_tensor(x.shape(), DType::F32, 6, 1.0f);
  SoftmaxMask mask{SoftmaxMaskKind::Causal, nullptr, nullptr};
  Tensor y = Tensor::empty(x.shape(), DType::F32), dx = Tensor::empty(x.shape(), DType::F32);
  ops::scaled_masked_softmax_forward(x, 1.5f, mask, y);
  ops::scaled_masked_softmax_backward(y, dy, 1.5f, dx);
  auto loss = [&]() {
    Tensor out = Tensor::empty(x.shape(), DType::F32);
    ops::scaled_masked_softmax_forward(x, 1.5f, mask, out);
    double sum = 0.0;
    for (int64_t n = 0; n < out.numel(); ++n)
      sum += double{out.data<float>()[n]} * dy.data<float>()[n];
    return sum;
  };
  const float eps = 1e-2f;  // F32 rounding of L ~1e-7/eps and O(eps^2) truncation ~1e-4
  for (int64_t n = 0; n < x.numel(); ++n) {
    float& v = x.data<float>()[n];
    const float saved = v;
    v = saved + eps;
    const double up = loss();
    v = saved - eps;
    const double down = loss();
    v = saved;
    EXPECT_NEAR(dx.data<float>()[n], (up - down) / (2.0 * eps), 1e-3) << n;
  }
}

// Rows shifted by a constant c (softmax is shift-invariant) keep F32 accuracy at any magnitude:
// each probability within 1e-5 of the float64 result relative to itself, on every ISA path.
// (Scaling before subtracting the row maximum loses ~4e-5 at c = 1e3 and ~4e-3 at c = 1e5.)
TEST(Softmax, ShiftedRowsKeepF32AccuracyAtAnyMagnitude) {
  const Shape shape{1, 2, 5, 130};
  IsaGuard guard;
  for (const float scale : {1.0f, 0.7f, -0.3f}) {
    for (const float c : {0.0f, 100.0f, -1e3f, 1e4f, 1e5f, -1e5f}) {
      Tensor x = random_tensor(shape, DType::F32, 7);
      for (int64_t n = 0; n < x.numel(); ++n) x.data<float>()[n] += c;
      Tensor expected = Tensor::empty(shape, DType::F32);
      ops::reference::scaled_masked_softmax_forward(x, scale, {}, expected);
      for (Isa isa : available_isas()) {
        set_active_isa(isa);
        Tensor y = Tensor::empty(shape, DType::F32);
        ops::scaled_masked_softmax_forward(x, scale, {}, y);
        double worst = 0.0;
        for (int64_t n = 0; n < y.numel(); ++n) {
          const double e = expected.data<float>()[n];
          ASSERT_GT(e, 0.0);
          worst = std::max(worst, std::fabs(y.data<float>()[n] - e) / e);
        }
        EXPECT_LE(worst, 1e-5) << "scale " << scale << ", shift " << c << ", " << isa_name(isa);
      }
    }
  }
}

TEST(Softmax, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({2, 2, 3, 4}, DType::F32);
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  EXPECT_THROW(
      ops::scaled_masked_softmax_forward(Tensor::zeros({2, 3, 4}, DType::F32), 1.0f, {}, y), Error);
  Tensor y_bad = Tensor::empty({2, 2, 3, 5}, DType::F32);
  EXPECT_THROW(ops::scaled_masked_softmax_forward(x, 1.0f, {}, y_bad), Error);
  SoftmaxMask padding{SoftmaxMaskKind::Padding, nullptr, nullptr};
  EXPECT_THROW(ops::scaled_masked_softmax_forward(x, 1.0f, padding, y), Error);
  Tensor lengths = Tensor::empty({2}, DType::I32);
  lengths.data<int32_t>()[0] = 1;
  lengths.data<int32_t>()[1] = 5;  // past Tk = 4
  padding.key_lengths = &lengths;
  EXPECT_THROW(ops::scaled_masked_softmax_forward(x, 1.0f, padding, y), Error);
  Tensor mask = Tensor::zeros({2, 2, 3, 4}, DType::U8);  // second dim must be 1
  SoftmaxMask arbitrary{SoftmaxMaskKind::Arbitrary, nullptr, &mask};
  EXPECT_THROW(ops::scaled_masked_softmax_forward(x, 1.0f, arbitrary, y), Error);
  Tensor x_i32 = Tensor::zeros({2, 2, 3, 4}, DType::I32);
  EXPECT_THROW(ops::scaled_masked_softmax_forward(x_i32, 1.0f, {}, y), Error);
  EXPECT_THROW(ops::scaled_masked_softmax_backward(x, y_bad, 1.0f, y), Error);
}

}  // namespace
}  // namespace octet
