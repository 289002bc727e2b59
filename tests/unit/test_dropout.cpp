// Philox and bias + dropout + residual: known-answer vectors, fast against reference on every
// ISA, PyTorch on the same mask, keep rate, determinism, fused against unfused.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "octet/cpu_features.h"
#include "octet/ops/dropout.h"
#include "octet/rng.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::max_abs;
using octet::testing::random_tensor;
using octet::testing::relative_rms;
using octet::testing::worst;

TEST(Philox, KnownAnswerVectors) {
  // Random123's kat_vectors for philox4x32_10.
  EXPECT_EQ(philox4x32(0, 0, 0),
            (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32(~uint64_t{0}, ~uint64_t{0}, ~uint64_t{0}),
            (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32(0x299f31d0a4093822ull, 0x85a308d3243f6a88ull, 0x0370734413198a2eull),
            (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

struct Inputs {
  Tensor x, bias, residual, dout;
};

Inputs make_inputs(int64_t rows, int64_t cols, DType dtype) {
  return {random_tensor({rows, cols}, dtype, 1), random_tensor({cols}, DType::F32, 2),
          random_tensor({rows, cols}, dtype, 3), random_tensor({rows, cols}, dtype, 4)};
}

TEST(BiasDropoutAdd, FastMatchesReferenceAndTorch) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {65, 384}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::to_string(rows) + "x" +
                   std::to_string(cols));
      Inputs in = make_inputs(rows, cols, dtype);
      ops::DropoutParams d{0.3f, 1234, 77};
      Tensor ref_out = Tensor::empty({rows, cols}, dtype),
             ref_dx = Tensor::empty({rows, cols}, dtype);
      Tensor ref_dbias = Tensor::empty({cols}, DType::F32);
      ops::reference::bias_dropout_add_forward(in.x, &in.bias, in.residual, d, ref_out);
      ops::reference::bias_dropout_add_backward(in.dout, d, ref_dx, &ref_dbias);
      // F32: one rounding per operation in F32 versus FP64; BF16: one final BF16 rounding.
      const bool bf16 = dtype == DType::BF16;
      const double atol = bf16 ? 1e-2 : 1e-6, rtol = bf16 ? 1.0 / 128 : 1e-6;
      for (Isa isa : available_isas()) {
        SCOPED_TRACE(isa_name(isa));
        Isa original = active_isa();
        set_active_isa(isa);
        Tensor out = Tensor::empty({rows, cols}, dtype), dx = Tensor::empty({rows, cols}, dtype);
        Tensor dbias = Tensor::empty({cols}, DType::F32);
        ops::bias_dropout_add_forward(in.x, &in.bias, in.residual, d, out);
        ops::bias_dropout_add_backward(in.dout, d, dx, &dbias);
        set_active_isa(original);
        EXPECT_LE(worst(out, ref_out, atol, rtol), 1.0);
        EXPECT_LE(worst(dx, ref_dx, atol, rtol), 1.0);
        EXPECT_LE(worst(dbias, ref_dbias, 1e-5 * rows, 1e-5), 1.0);
      }
      Tensor mask = Tensor::empty({rows, cols}, DType::F32);
      for (int64_t i = 0; i < mask.numel(); ++i) {
        mask.data<float>()[i] = philox_uniform(d.seed, d.offset, i) >= d.probability ? 1.0f : 0.0f;
      }
      TensorMap torch = octet::testing::run_torch("bias_dropout_add",
                                                  {{"x", in.x},
                                                   {"bias", in.bias},
                                                   {"residual", in.residual},
                                                   {"mask", mask},
                                                   {"dout", in.dout}},
                                                  "{\"p\": 0.3}");
      EXPECT_LE(worst(ref_out, torch.at("out"), atol, rtol), 1.0);
      EXPECT_LE(worst(ref_dx, torch.at("dx"), atol, rtol), 1.0);
      EXPECT_LE(worst(ref_dbias, torch.at("dbias"), bf16 ? 1e-2 * rows : 1e-5, 1e-5), 1.0);
    }
  }
}

TEST(BiasDropoutAdd, KeepRateDeterminismAndFreshOffsets) {
  const int64_t rows = 1000, cols = 1000;
  Tensor x = Tensor::empty({rows, cols}, DType::F32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = 1.0f;
  Tensor zero = Tensor::zeros({rows, cols}, DType::F32);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    ops::DropoutParams d{p, 42, 0};
    Tensor a = Tensor::empty({rows, cols}, DType::F32), b = Tensor::empty({rows, cols}, DType::F32);
    ops::bias_dropout_add_forward(x, nullptr, zero, d, a);
    ops::bias_dropout_add_forward(x, nullptr, zero, d, b);
    EXPECT_EQ(a.to_floats(), b.to_floats());  // same (seed, offset): same mask
    int64_t kept = 0;
    for (float v : a.to_floats()) {
      kept += v != 0.0f;
      if (v != 0.0f) {
        EXPECT_FLOAT_EQ(v, 1.0f / (1.0f - p));
      }
    }
    double rate = double(kept) / x.numel();
    double sigma = std::sqrt(p * (1 - p) / x.numel());
    EXPECT_NEAR(rate, 1.0 - p, 6 * sigma) << "p=" << p;  // 6 sigma: a false alarm is ~1e-9
    d.offset = (x.numel() + 3) / 4;                      // the next call's stream
    ops::bias_dropout_add_forward(x, nullptr, zero, d, b);
    int64_t same = 0;
    std::vector<float> av = a.to_floats(), bv = b.to_floats();
    for (size_t i = 0; i < av.size(); ++i) same += (av[i] != 0) == (bv[i] != 0);
    // Independent masks agree on a fraction p^2 + (1-p)^2 of elements.
    EXPECT_NEAR(double(same) / x.numel(), p * p + (1 - p) * (1 - p), 0.01);
  }
}

TEST(BiasDropoutAdd, FusedEqualsUnfusedAndBadInput) {
  Inputs in = make_inputs(9, 40, DType::F32);
  ops::DropoutParams d{0.25f, 7, 3};
  Tensor fused = Tensor::empty({9, 40}, DType::F32);
  ops::bias_dropout_add_forward(in.x, &in.bias, in.residual, d, fused);
  // Unfused: h = x + bias; dropped = dropout(h); out = residual + dropped, as three passes.
  Tensor h = Tensor::empty({9, 40}, DType::F32), zero = Tensor::zeros({9, 40}, DType::F32);
  ops::bias_dropout_add_forward(in.x, &in.bias, zero, ops::DropoutParams{}, h);
  Tensor dropped = Tensor::empty({9, 40}, DType::F32);
  ops::bias_dropout_add_forward(h, nullptr, zero, d, dropped);
  Tensor unfused = Tensor::empty({9, 40}, DType::F32);
  ops::bias_dropout_add_forward(dropped, nullptr, in.residual, ops::DropoutParams{}, unfused);
  EXPECT_LE(worst(fused, unfused, 1e-6, 1e-6), 1.0);

  Tensor out = Tensor::empty({9, 40}, DType::F32);
  EXPECT_THROW(ops::bias_dropout_add_forward(in.x, &in.bias, in.residual,
                                             ops::DropoutParams{1.0f, 0, 0}, out),
               Error);
  Tensor short_residual = Tensor::zeros({8, 40}, DType::F32);
  EXPECT_THROW(ops::bias_dropout_add_forward(in.x, &in.bias, short_residual, d, out), Error);
}

}  // namespace
}  // namespace octet
