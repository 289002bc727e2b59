// Elementwise operators: the fast path against the reference bit for bit on every ISA path
// (F32 and BF16 inputs, sizes past the OpenMP threshold and odd ones), both against PyTorch
// (out + alpha x, x + bias and the bias gradient in FP64), and clear errors for bad shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/error.h"
#include "octet/ops/elementwise.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::IsaGuard;
using octet::testing::random_tensor;
using octet::testing::run_torch;

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(Elementwise, FastMatchesReferenceBitForBitOnEveryIsa) {
  IsaGuard guard;
  // [3, 37]: odd, below the thread threshold; [640, 129]: past it, with a ragged column block.
  for (Shape shape : {Shape{3, 37}, Shape{640, 129}}) {
    for (float magnitude : {1.0f, 1e30f, 1e-30f}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(::testing::Message()
                     << shape_str(shape) << " " << dtype_name(dtype) << " x" << magnitude);
        const Tensor x = random_tensor(shape, dtype, 1, 0.0f, magnitude);
        const Tensor start = random_tensor(shape, DType::F32, 2, 0.0f, magnitude);
        const Tensor bias = random_tensor({shape[1]}, DType::F32, 3, 0.0f, magnitude);
        const Tensor sums = random_tensor({shape[1]}, DType::F32, 4, 0.0f, magnitude);
        Tensor ref_scaled = start.clone(), ref_biased = x.clone(), ref_sums = sums.clone();
        // alpha = -1 and 0.25 give exact products, so a fused multiply-add rounds as the
        // reference's multiply then add: the same bits. Other alphas: below, within a rounding.
        ops::reference::add_scaled(x, -1.0f, ref_scaled);
        ops::reference::add_scaled(x, 0.25f, ref_scaled);
        Tensor ref_general = start.clone();
        ops::reference::add_scaled(x, 0.3f, ref_general);
        ops::reference::add_bias(ref_biased, bias);
        ops::reference::add_column_sums(x, ref_sums);
        Tensor ref_clipped[] = {start.clone(), bias.clone()};
        ops::reference::scale(ref_clipped, 0.3f);
        for (Isa isa : available_isas()) {
          set_active_isa(isa);
          SCOPED_TRACE(isa_name(active_isa()));
          Tensor scaled = start.clone(), biased = x.clone(), column_sums = sums.clone();
          ops::add_scaled(x, -1.0f, scaled);
          ops::add_scaled(x, 0.25f, scaled);
          Tensor general = start.clone();
          ops::add_scaled(x, 0.3f, general);
          const std::vector<float> g = general.to_floats(), eg = ref_general.to_floats(),
                                   xs = x.to_floats(), s0 = start.to_floats();
          for (size_t i = 0; i < g.size(); ++i) {
            // One F32 rounding of alpha * x (the FMA skips it) relative to the terms.
            const float terms = std::fabs(0.3f * xs[i]) + std::fabs(s0[i]);
            ASSERT_LE(std::fabs(g[i] - eg[i]), 1.2e-7f * terms) << i;
          }
          ops::add_bias(biased, bias);
          ops::add_column_sums(x, column_sums);
          Tensor clipped[] = {start.clone(), bias.clone()};
          ops::scale(clipped, 0.3f);
          EXPECT_TRUE(same_bytes(scaled, ref_scaled));
          EXPECT_TRUE(same_bytes(biased, ref_biased));
          EXPECT_TRUE(same_bytes(column_sums, ref_sums));
          EXPECT_TRUE(same_bytes(clipped[0], ref_clipped[0]));
          EXPECT_TRUE(same_bytes(clipped[1], ref_clipped[1]));
        }
      }
    }
  }
}

// PyTorch in FP64: out + alpha x and x + bias are one F32 rounding away (BF16 x: the biased
// result is rounded to BF16, 2^-8 relative); the bias gradient sums N = 50 F32 values.
TEST(Elementwise, MatchesTorch) {
  const int64_t rows = 50, cols = 23;
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random_tensor({rows, cols}, dtype, 5);
    const Tensor out = random_tensor({rows, cols}, DType::F32, 6);
    const Tensor bias = random_tensor({cols}, DType::F32, 7);
    const Tensor dy = random_tensor({rows, cols}, dtype, 8);
    const float alpha = 0.3f;
    const TensorMap torch = run_torch("elementwise", {{"x", x.to(DType::F32)},
                                                      {"out", out},
                                                      {"alpha", Tensor::from_floats({1}, {alpha})},
                                                      {"bias", bias},
                                                      {"dy", dy.to(DType::F32)}});
    for (bool fast : {false, true}) {
      SCOPED_TRACE(fast ? "fast" : "reference");
      Tensor scaled = out.clone(), biased = x.clone();
      Tensor dbias = Tensor::zeros({cols}, DType::F32);
      if (fast) {
        ops::add_scaled(x, alpha, scaled);
        ops::add_bias(biased, bias);
        ops::add_column_sums(dy, dbias);
      } else {
        ops::reference::add_scaled(x, alpha, scaled);
        ops::reference::add_bias(biased, bias);
        ops::reference::add_column_sums(dy, dbias);
      }
      const double biased_tolerance = dtype == DType::F32 ? 1e-6 : 4e-3;
      const std::vector<float> s = scaled.to_floats(), b = biased.to_floats(),
                               g = dbias.to_floats();
      const std::vector<float> es = torch.at("scaled").to_floats(),
                               eb = torch.at("biased").to_floats(),
                               eg = torch.at("dbias").to_floats();
      for (size_t i = 0; i < s.size(); ++i) {
        EXPECT_NEAR(s[i], es[i], 1e-6 * (std::fabs(es[i]) + 1)) << i;
        EXPECT_NEAR(b[i], eb[i], biased_tolerance * (std::fabs(eb[i]) + 1)) << i;
      }
      for (size_t i = 0; i < g.size(); ++i)
        EXPECT_NEAR(g[i], eg[i], 1e-5 * (std::fabs(eg[i]) + 1)) << i;
    }
  }
}

TEST(Elementwise, BadShapesAreClearErrors) {
  Tensor out = Tensor::zeros({4, 3}, DType::F32);
  const Tensor x = Tensor::zeros({4, 2}, DType::F32);
  EXPECT_THROW(
      {
        try {
          ops::add_scaled(x, 1.0f, out);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("same number of elements"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  Tensor y = Tensor::zeros({4, 3}, DType::F32);
  EXPECT_THROW(ops::add_bias(y, Tensor::zeros({2}, DType::F32)), Error);
  Tensor sums = Tensor::zeros({3}, DType::BF16);
  EXPECT_THROW(ops::add_column_sums(y, sums), Error);
  Tensor ints[] = {Tensor::zeros({3}, DType::I32)};
  EXPECT_THROW(ops::scale(ints, 2.0f), Error);
}

}  // namespace
}  // namespace octet
