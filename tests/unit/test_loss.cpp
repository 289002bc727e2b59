// Cross-entropy: fast path against the FP64 reference on every ISA path, both against PyTorch
// (F.cross_entropy with label smoothing and ignore_index), finite differences, in-place use,
// bad inputs, and the memory bound (no buffer of size N x V).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/ops/loss.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::run_torch;
using ops::CrossEntropyOptions;

struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

Tensor random_logits(int64_t rows, int64_t vocab, DType dtype, uint32_t seed, float stddev = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(static_cast<size_t>(rows * vocab));
  for (float& v : values) v = normal(rng);
  Tensor logits = Tensor::from_floats({rows, vocab}, values);
  return dtype == DType::F32 ? logits : logits.to(dtype);
}

// Targets in [0,V); rows listed in `ignored` get ignore_index.
Tensor make_targets(int64_t rows, int64_t vocab, DType dtype, uint32_t seed,
                    const std::vector<int64_t>& ignored, int64_t ignore_index) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
  Tensor targets = Tensor::empty({rows}, dtype);
  for (int64_t row = 0; row < rows; ++row) {
    int64_t value = pick(rng);
    for (int64_t skip : ignored) value = skip == row ? ignore_index : value;
    if (dtype == DType::I32) {
      targets.data<int32_t>()[row] = static_cast<int32_t>(value);
    } else {
      targets.data<int64_t>()[row] = value;
    }
  }
  return targets;
}

// |actual - expected| <= rtol * (|expected| + floor) elementwise.
void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, double rtol,
                  double floor, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double tolerance = rtol * (std::fabs(double{expected[i]}) + floor);
    if (!(std::fabs(double{actual[i]} - double{expected[i]}) <= tolerance) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << actual[i] << " vs " << expected[i]
                    << " (tolerance " << tolerance << ")";
    }
  }
}

struct Case {
  int64_t rows;
  int64_t vocab;
  DType dtype;
  DType target_dtype;
  float smoothing;
  std::vector<int64_t> ignored;
};

// Why these tolerances. Both paths see the same input values. F32 results: the fast path sums
// exp over V in F32 vector lanes with a ~2 ulp exp, so losses and probabilities carry a
// relative error of a few 1e-6 (1e-5 allowed); gradients p_j - eps/V may cancel, so their
// tolerance is relative to p_j's size: |g| + scale * eps / V. BF16 gradients are also rounded
// to 8 significant bits: one BF16 ulp, 2^-7 relative, covers a rounding on either side.
constexpr double kLossRtol = 1e-5;
constexpr double kGradRtolF32 = 2e-5;
constexpr double kGradRtolBF16 = 1.0 / 128;

double grad_rtol(DType dtype) {
  return dtype == DType::F32 ? kGradRtolF32 : kGradRtolBF16;
}

TEST(CrossEntropy, FastMatchesReferenceOnEveryIsa) {
  const std::vector<Case> cases = {
      {7, 50257, DType::F32, DType::I64, 0.1f, {3}},
      {33, 1000, DType::BF16, DType::I32, 0.0f, {0, 32}},
      {5, 2049, DType::F32, DType::I32, 0.3f, {}},  // one column past a chunk
      {4, 1, DType::BF16, DType::I64, 0.2f, {1}},   // V = 1: loss 0, gradient 0
  };
  IsaGuard guard;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "N=" << c.rows << " V=" << c.vocab << " " << dtype_name(c.dtype));
    const Tensor logits = random_logits(c.rows, c.vocab, c.dtype, 11);
    const Tensor targets = make_targets(c.rows, c.vocab, c.target_dtype, 12, c.ignored, -100);
    const CrossEntropyOptions options{c.smoothing, -100, 0.25f};
    Tensor ref_losses = Tensor::empty({c.rows}, DType::F32);
    Tensor ref_grad = Tensor::empty({c.rows, c.vocab}, c.dtype);
    const float ref_mean = ops::reference::cross_entropy_forward_backward(
        logits, targets, ref_losses, &ref_grad, options);
    const double floor = 0.25 * c.smoothing / static_cast<double>(c.vocab) + 1e-30;
    for (Isa isa : available_isas()) {
      set_active_isa(isa);
      SCOPED_TRACE(isa_name(active_isa()));
      Tensor losses = Tensor::empty({c.rows}, DType::F32);
      Tensor grad = Tensor::empty({c.rows, c.vocab}, c.dtype);
      const float mean =
          ops::cross_entropy_forward_backward(logits, targets, losses, &grad, options);
      EXPECT_NEAR(mean, ref_mean, kLossRtol * (std::fabs(ref_mean) + 1));
      expect_close(losses.to_floats(), ref_losses.to_floats(), kLossRtol, 1.0, "losses");
      expect_close(grad.to_floats(), ref_grad.to_floats(), grad_rtol(c.dtype), floor, "dlogits");
      for (int64_t row : c.ignored) EXPECT_EQ(losses.data<float>()[row], 0.0f);
    }
  }
}

// Logits shifted by a constant c (the loss and gradient do not change) keep F32 accuracy at any
// magnitude on every ISA path: the gradient exponentiates (x - max) - log(sum), not x - lse
// with lse rounded to F32 (which is off by |x| * 2^-24: ~4e-3 relative at c = 1e5).
TEST(CrossEntropy, ShiftedLogitsKeepF32AccuracyAtAnyMagnitude) {
  const int64_t rows = 3, vocab = 3000;  // two chunks
  const Tensor targets = make_targets(rows, vocab, DType::I64, 12, {}, -100);
  IsaGuard guard;
  for (const float c : {0.0f, 1e3f, -1e4f, 1e5f, -1e5f}) {
    SCOPED_TRACE(::testing::Message() << "shift " << c);
    Tensor logits = random_logits(rows, vocab, DType::F32, 13);
    for (int64_t n = 0; n < logits.numel(); ++n) logits.data<float>()[n] += c;
    Tensor ref_losses = Tensor::empty({rows}, DType::F32);
    Tensor ref_grad = Tensor::empty({rows, vocab}, DType::F32);
    ops::reference::cross_entropy_forward_backward(logits, targets, ref_losses, &ref_grad, {});
    for (Isa isa : available_isas()) {
      set_active_isa(isa);
      SCOPED_TRACE(isa_name(active_isa()));
      Tensor losses = Tensor::empty({rows}, DType::F32);
      Tensor grad = Tensor::empty({rows, vocab}, DType::F32);
      ops::cross_entropy_forward_backward(logits, targets, losses, &grad, {});
      expect_close(losses.to_floats(), ref_losses.to_floats(), kLossRtol, 1.0, "losses");
      expect_close(grad.to_floats(), ref_grad.to_floats(), kGradRtolF32, 1e-30, "dlogits");
    }
  }
}

TEST(CrossEntropy, InPlaceAndForwardOnlyAgreeWithSeparateOutput) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor logits = random_logits(9, 4099, dtype, 21);
    const Tensor targets = make_targets(9, 4099, DType::I64, 22, {4}, -1);
    const CrossEntropyOptions options{0.1f, -1, 1.0f / 8};
    Tensor losses = Tensor::empty({9}, DType::F32);
    Tensor grad = Tensor::empty({9, 4099}, dtype);
    const float mean = ops::cross_entropy_forward_backward(logits, targets, losses, &grad, options);

    Tensor in_place = logits.clone();
    Tensor losses_in_place = Tensor::empty({9}, DType::F32);
    EXPECT_EQ(
        ops::cross_entropy_forward_backward(in_place, targets, losses_in_place, &in_place, options),
        mean);
    EXPECT_EQ(in_place.to_floats(), grad.to_floats());
    EXPECT_EQ(losses_in_place.to_floats(), losses.to_floats());

    Tensor losses_forward = Tensor::empty({9}, DType::F32);
    EXPECT_EQ(
        ops::cross_entropy_forward_backward(logits, targets, losses_forward, nullptr, options),
        mean);
    EXPECT_EQ(losses_forward.to_floats(), losses.to_floats());
  }
}

// PyTorch computes in FP64 from the same (F32 or BF16) logits, gradient of the mean loss.
void check_against_torch(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "N=" << c.rows << " V=" << c.vocab << " "
                                    << dtype_name(c.dtype) << " eps=" << c.smoothing);
  const Tensor logits = random_logits(c.rows, c.vocab, c.dtype, 31);
  const Tensor targets = make_targets(c.rows, c.vocab, c.target_dtype, 32, c.ignored, -100);
  TensorMap inputs{{"logits", logits}, {"targets", targets}};
  const TensorMap torch = run_torch(
      "cross_entropy", inputs,
      "{\"label_smoothing\": " + std::to_string(c.smoothing) + ", \"ignore_index\": -100}");
  const int64_t valid = ops::count_valid_targets(targets, -100);
  ASSERT_EQ(valid, c.rows - static_cast<int64_t>(c.ignored.size()));
  const float scale = 1.0f / static_cast<float>(valid);
  const CrossEntropyOptions options{c.smoothing, -100, scale};
  const double floor = scale * c.smoothing / static_cast<double>(c.vocab) + 1e-30;
  const float torch_mean = torch.at("mean").to_floats()[0];
  for (bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    Tensor losses = Tensor::empty({c.rows}, DType::F32);
    Tensor grad = Tensor::empty({c.rows, c.vocab}, c.dtype);
    const float mean =
        fast ? ops::cross_entropy_forward_backward(logits, targets, losses, &grad, options)
             : ops::reference::cross_entropy_forward_backward(logits, targets, losses, &grad,
                                                              options);
    EXPECT_NEAR(mean, torch_mean, kLossRtol * (std::fabs(torch_mean) + 1));
    expect_close(losses.to_floats(), torch.at("losses").to_floats(), kLossRtol, 1.0, "losses");
    expect_close(grad.to_floats(), torch.at("dlogits").to_floats(), grad_rtol(c.dtype), floor,
                 "dlogits");
  }
}

TEST(CrossEntropy, MatchesTorchGpt2VocabSmoothingIgnoreIndex) {
  check_against_torch({7, 50257, DType::F32, DType::I64, 0.1f, {2, 5}});
}

TEST(CrossEntropy, MatchesTorchBf16Logits) {
  check_against_torch({33, 1000, DType::BF16, DType::I32, 0.0f, {0, 17}});
  check_against_torch({33, 1000, DType::BF16, DType::I64, 0.2f, {}});
}

// Central differences of sum_i loss_i (grad_scale = 1) against the analytic gradient.
// h = 1e-2 on logits of size ~1: truncation ~h^2 * |f'''| / 6 ~ 2e-5, F32 rounding of the
// loss ~1e-7 / h ~ 1e-5; 2e-4 absolute leaves margin.
TEST(CrossEntropy, FiniteDifferenceGradient) {
  const int64_t rows = 3;
  const int64_t vocab = 5;
  const Tensor targets = make_targets(rows, vocab, DType::I32, 41, {1}, 7);
  const CrossEntropyOptions options{0.2f, 7, 1.0f};
  for (bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    auto run = [&](const Tensor& x, Tensor* grad) {
      Tensor losses = Tensor::empty({rows}, DType::F32);
      if (fast) {
        ops::cross_entropy_forward_backward(x, targets, losses, grad, options);
      } else {
        ops::reference::cross_entropy_forward_backward(x, targets, losses, grad, options);
      }
      double sum = 0.0;
      for (float value : losses.to_floats()) sum += value;
      return sum;
    };
    const Tensor logits = random_logits(rows, vocab, DType::F32, 42, 1.0f);
    Tensor grad = Tensor::empty({rows, vocab}, DType::F32);
    run(logits, &grad);
    const float h = 1e-2f;
    for (int64_t i = 0; i < rows * vocab; ++i) {
      Tensor plus = logits.clone();
      Tensor minus = logits.clone();
      plus.data<float>()[i] += h;
      minus.data<float>()[i] -= h;
      const double numeric = (run(plus, nullptr) - run(minus, nullptr)) / (2.0 * h);
      EXPECT_NEAR(grad.data<float>()[i], numeric, 2e-4) << "element " << i;
    }
  }
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CrossEntropy, BadInputsGetClearErrorsAndWriteNothing) {
  Tensor logits = random_logits(4, 50257, DType::F32, 51);
  const Tensor saved = logits.clone();
  Tensor targets = make_targets(4, 50257, DType::I64, 52, {}, -100);
  targets.data<int64_t>()[2] = 50300;
  Tensor losses = Tensor::empty({4}, DType::F32);
  for (bool fast : {false, true}) {
    auto call = [&](const Tensor& t, Tensor& l, Tensor* grad, const CrossEntropyOptions& o) {
      return [&, grad, o] {
        fast ? ops::cross_entropy_forward_backward(logits, t, l, grad, o)
             : ops::reference::cross_entropy_forward_backward(logits, t, l, grad, o);
      };
    };
    std::string message = error_of(call(targets, losses, &logits, {}));
    EXPECT_NE(message.find("target id 50300 at row 2"), std::string::npos) << message;
    EXPECT_NE(message.find("V=50257"), std::string::npos) << message;
    EXPECT_EQ(logits.to_floats(), saved.to_floats()) << "in-place logits touched before the throw";

    Tensor negative = make_targets(4, 50257, DType::I32, 53, {}, -100);
    negative.data<int32_t>()[1] = -5;  // not the ignore_index (-100)
    message = error_of(call(negative, losses, nullptr, {}));
    EXPECT_NE(message.find("target id -5 at row 1"), std::string::npos) << message;

    Tensor short_targets = make_targets(3, 50257, DType::I64, 54, {}, -100);
    message = error_of(call(short_targets, losses, nullptr, {}));
    EXPECT_NE(message.find("targets expected [N]=[4], got [3]"), std::string::npos) << message;

    Tensor float_targets = Tensor::zeros({4}, DType::F32);
    message = error_of(call(float_targets, losses, nullptr, {}));
    EXPECT_NE(message.find("targets"), std::string::npos) << message;

    Tensor bf16_grad = Tensor::empty({4, 50257}, DType::BF16);
    Tensor good_targets = make_targets(4, 50257, DType::I64, 55, {}, -100);
    message = error_of(call(good_targets, losses, &bf16_grad, {}));
    EXPECT_NE(message.find("dlogits"), std::string::npos) << message;

    message = error_of(call(good_targets, losses, nullptr, {1.5f, -100, 1.0f}));
    EXPECT_NE(message.find("label_smoothing"), std::string::npos) << message;
  }
}

TEST(CrossEntropy, AllRowsIgnoredGiveNanMeanAndZeroGradient) {
  const Tensor logits = random_logits(3, 17, DType::F32, 61);
  const Tensor targets = make_targets(3, 17, DType::I64, 62, {0, 1, 2}, -100);
  Tensor losses = Tensor::empty({3}, DType::F32);
  Tensor grad = Tensor::empty({3, 17}, DType::F32);
  EXPECT_TRUE(std::isnan(ops::cross_entropy_forward_backward(logits, targets, losses, &grad, {})));
  EXPECT_EQ(losses.to_floats(), std::vector<float>(3, 0.0f));
  EXPECT_EQ(grad.to_floats(), std::vector<float>(3 * 17, 0.0f));
}

TEST(CrossEntropy, NanLogitPropagatesToItsRowOnly) {
  Tensor logits = random_logits(2, 3000, DType::F32, 71);
  logits.data<float>()[2500] = std::numeric_limits<float>::quiet_NaN();  // row 0
  const Tensor targets = make_targets(2, 3000, DType::I64, 72, {}, -100);
  Tensor losses = Tensor::empty({2}, DType::F32);
  Tensor grad = Tensor::empty({2, 3000}, DType::F32);
  IsaGuard guard;
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    ops::cross_entropy_forward_backward(logits, targets, losses, &grad, {});
    EXPECT_TRUE(std::isnan(losses.data<float>()[0])) << isa_name(isa);
    EXPECT_TRUE(std::isnan(grad.data<float>()[2500])) << isa_name(isa);
    EXPECT_TRUE(std::isfinite(losses.data<float>()[1])) << isa_name(isa);
  }
}

// The op may allocate a per-thread chunk buffer (threads x 2048 floats for BF16), never
// anything proportional to N x V.
TEST(CrossEntropy, AllocatesNoBufferProportionalToRowsTimesVocab) {
  const int64_t rows = 64;
  const int64_t vocab = 50257;
  const int64_t bound = int64_t{num_threads()} * 2048 * 4 + 4096;
  ASSERT_LT(bound, rows * vocab * 2 / 16);
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor logits = random_logits(rows, vocab, dtype, 81);
    const Tensor targets = make_targets(rows, vocab, DType::I32, 82, {5}, -100);
    Tensor losses = Tensor::empty({rows}, DType::F32);
    const int64_t before = memory_stats().current_bytes;
    reset_peak_memory();
    ops::cross_entropy_forward_backward(logits, targets, losses, &logits, {0.1f, -100, 1.0f});
    const MemoryStats after = memory_stats();
    EXPECT_LE(after.peak_bytes - before, bound);
    EXPECT_EQ(after.current_bytes, before);
  }
}

}  // namespace
}  // namespace octet
