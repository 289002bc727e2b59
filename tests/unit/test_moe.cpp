// Mixture-of-experts routing: the router (softmax and sigmoid scores, top-k with and without
// DeepSeek-V3's expert bias, normalization, scaling, the auxiliary and z losses) and the token
// permutation, forward and backward: the CPU path against the reference on every ISA path and
// both against PyTorch 1.13 in float64 (tests/reference/ops_moe.py), with logits and tokens of
// large and tiny magnitude; the choice against the rule; bad arguments are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "octet/ops/moe.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using ops::RouterOptions;
using ops::RouterScore;
using testing::available_isas;
using testing::random_tensor;
using testing::worst;

struct RouterOut {
  Tensor scores, probs, experts, counts, dlogits;
  ops::RouterLosses losses;
};

template <typename Forward, typename Backward>
RouterOut route(const Tensor& logits, const Tensor& dprobs, const RouterOptions& o, Forward forward,
                Backward backward) {
  const int64_t N = logits.dim(0), E = logits.dim(1), k = o.topk;
  RouterOut r{Tensor::empty({N, E}, DType::F32), Tensor::empty({N, k}, DType::F32),
              Tensor::empty({N, k}, DType::I32), Tensor::empty({E}, DType::I32),
              Tensor::empty({N, E}, DType::F32), {}};
  r.losses = forward(logits, o, r.scores, r.probs, r.experts, r.counts);
  backward(dprobs, logits, r.scores, r.experts, r.counts, o, r.dlogits);
  return r;
}

RouterOut route_reference(const Tensor& logits, const Tensor& dprobs, const RouterOptions& o) {
  return route(logits, dprobs, o, ops::reference::router_forward, ops::reference::router_backward);
}
RouterOut route_fast(const Tensor& logits, const Tensor& dprobs, const RouterOptions& o) {
  return route(logits, dprobs, o, ops::router_forward, ops::router_backward);
}

struct RouterCase {
  const char* name;
  int64_t N, E, k;
  RouterScore score;
  bool normalize;
  float scaling;
  bool bias;
  float aux, z;
  float logit_scale = 1.0f;
};

void PrintTo(const RouterCase& c, std::ostream* os) {
  *os << c.name;
}

class Router : public ::testing::TestWithParam<RouterCase> {};

TEST_P(Router, FastEqualsReferenceAndBothMatchTorch) {
  const RouterCase& c = GetParam();
  const Tensor logits = random_tensor({c.N, c.E}, DType::F32, 11, 0.0f, c.logit_scale);
  const Tensor dprobs = random_tensor({c.N, c.k}, DType::F32, 12);
  const Tensor bias = random_tensor({c.E}, DType::F32, 13, 0.0f, 0.05f);
  RouterOptions o;
  o.topk = c.k;
  o.score = c.score;
  o.normalize = c.normalize;
  o.scaling = c.scaling;
  o.expert_bias = c.bias ? &bias : nullptr;
  o.aux_loss_coeff = c.aux;
  o.z_loss_coeff = c.z;
  const RouterOut ref = route_reference(logits, dprobs, o);
  // The fast path routes each token as the reference does, in parallel: bit for bit.
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(isa_name(isa));
    const Isa saved = active_isa();
    set_active_isa(isa);
    const RouterOut fast = route_fast(logits, dprobs, o);
    set_active_isa(saved);
    EXPECT_EQ(fast.experts.to_floats(), ref.experts.to_floats());
    EXPECT_EQ(fast.counts.to_floats(), ref.counts.to_floats());
    EXPECT_EQ(fast.probs.to_floats(), ref.probs.to_floats());
    EXPECT_EQ(fast.dlogits.to_floats(), ref.dlogits.to_floats());
    EXPECT_EQ(fast.losses.aux, ref.losses.aux);
    EXPECT_EQ(fast.losses.z, ref.losses.z);
  }
  // Each token's experts are distinct, their keys descending, and no expert left out has a
  // larger key than the last chosen one.
  const float* s = ref.scores.data<float>();
  const int32_t* e = ref.experts.data<int32_t>();
  int64_t routed = 0;
  for (int64_t n = 0; n < c.N; ++n) {
    auto key = [&](int64_t x) { return s[n * c.E + x] + (c.bias ? bias.data<float>()[x] : 0.0f); };
    std::vector<bool> chosen(static_cast<size_t>(c.E), false);
    for (int64_t j = 0; j < c.k; ++j) {
      const int32_t x = e[n * c.k + j];
      ASSERT_FALSE(chosen[static_cast<size_t>(x)]) << "token " << n << " chose " << x << " twice";
      chosen[static_cast<size_t>(x)] = true;
      if (j > 0) {
        EXPECT_GE(key(e[n * c.k + j - 1]), key(x));
      }
    }
    for (int64_t x = 0; x < c.E; ++x) {
      if (!chosen[static_cast<size_t>(x)]) {
        EXPECT_LE(key(x), key(e[n * c.k + c.k - 1]));
      }
    }
  }
  for (float count : ref.counts.to_floats()) routed += static_cast<int64_t>(count);
  EXPECT_EQ(routed, c.N * c.k);

  TensorMap inputs{{"logits", logits}, {"dprobs", dprobs}};
  if (c.bias) inputs.emplace("expert_bias", bias);
  const std::string args = std::string("{\"topk\": ") + std::to_string(c.k) + ", \"score\": \"" +
                           (c.score == RouterScore::Softmax ? "softmax" : "sigmoid") +
                           "\", \"normalize\": " + (c.normalize ? "true" : "false") +
                           ", \"scaling\": " + std::to_string(c.scaling) +
                           ", \"aux_coeff\": " + std::to_string(c.aux) +
                           ", \"z_coeff\": " + std::to_string(c.z) + "}";
  const TensorMap torch = testing::run_torch("moe_router", inputs, args);
  EXPECT_EQ(ref.experts.to_floats(), torch.at("experts").to_floats());
  EXPECT_EQ(ref.counts.to_floats(), torch.at("counts").to_floats());
  // Scores and probabilities: F32 roundings of FP64 values (a few ulps through normalization).
  EXPECT_LE(worst(ref.scores, torch.at("scores"), 1e-30, 1e-6), 1.0);
  EXPECT_LE(worst(ref.probs, torch.at("probs"), 1e-30, 1e-6), 1.0);
  // dlogits: FP64 sums of F32-rounded scores, rounded once; relative to the largest gradient.
  const double scale = std::max(testing::max_abs(torch.at("dlogits")), 1e-30);
  EXPECT_LE(worst(ref.dlogits, torch.at("dlogits"), 1e-5 * scale, 1e-5), 1.0);
  EXPECT_NEAR(ref.losses.aux, torch.at("aux").to_floats()[0],
              1e-6 * std::max(1e-30, std::fabs(ref.losses.aux)));
  EXPECT_NEAR(ref.losses.z, torch.at("z").to_floats()[0],
              1e-6 * std::max(1e-30, std::fabs(ref.losses.z)));
  std::printf("[ measured ] %s: aux %.6g z %.6g, dlogits worst %.3g of tolerance\n", c.name,
              ref.losses.aux, ref.losses.z,
              worst(ref.dlogits, torch.at("dlogits"), 1e-5 * scale, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Router,
    ::testing::Values(
        RouterCase{"softmax_top2", 37, 8, 2, RouterScore::Softmax, false, 1.0f, false, 0, 0},
        // Megatron's default (top-k of the logits, then softmax over the k): normalized softmax.
        RouterCase{"softmax_top2_normalized_aux_z", 64, 8, 2, RouterScore::Softmax, true, 1.0f,
                   false, 1e-2f, 1e-3f},
        RouterCase{"softmax_top1_switch", 29, 16, 1, RouterScore::Softmax, false, 1.0f, false,
                   1e-2f, 0},
        // DeepSeek-V3: sigmoid scores, the bias in the choice, normalized, scaled by 2.5.
        RouterCase{"sigmoid_top8_bias_deepseek", 33, 64, 8, RouterScore::Sigmoid, true, 2.5f, true,
                   1e-3f, 0},
        RouterCase{"sigmoid_top4_aux_z", 21, 12, 4, RouterScore::Sigmoid, false, 1.0f, false, 1e-2f,
                   1e-3f},
        RouterCase{"large_logits", 17, 8, 2, RouterScore::Softmax, true, 1.0f, false, 1e-2f, 1e-3f,
                   300.0f},
        RouterCase{"tiny_logits", 17, 8, 2, RouterScore::Sigmoid, true, 1.0f, true, 1e-2f, 1e-3f,
                   1e-4f},
        RouterCase{"every_expert", 9, 4, 4, RouterScore::Softmax, true, 1.0f, false, 1e-2f, 0}),
    [](const ::testing::TestParamInfo<RouterCase>& param) {
      return std::string(param.param.name);
    });

// The bias moves the choice, never the weights: with a large bias toward expert 3 every token
// picks it, with its own score as weight.
TEST(Router, ExpertBiasChoosesButDoesNotWeigh) {
  const int64_t N = 10, E = 6;
  const Tensor logits = random_tensor({N, E}, DType::F32, 5);
  Tensor bias = Tensor::zeros({E}, DType::F32);
  bias.data<float>()[3] = 10.0f;
  RouterOptions o;
  o.topk = 2;
  o.expert_bias = &bias;
  const RouterOut r = route_fast(logits, Tensor::zeros({N, 2}, DType::F32), o);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(r.experts.data<int32_t>()[n * 2], 3);
    EXPECT_EQ(r.probs.data<float>()[n * 2], r.scores.data<float>()[n * E + 3]);
  }
  EXPECT_EQ(r.counts.data<int32_t>()[3], N);
}

TEST(Router, BadArgumentsAreClearErrors) {
  const Tensor logits = random_tensor({4, 8}, DType::F32, 1);
  auto error = [&](const RouterOptions& o, const Tensor& in) {
    return testing::error_of([&] { route_fast(in, Tensor::zeros({4, o.topk}, DType::F32), o); });
  };
  RouterOptions o;
  o.topk = 9;
  EXPECT_NE(error(o, logits).find("topk expected in [1, E = 8], got 9"), std::string::npos);
  o.topk = 2;
  EXPECT_NE(error(o, logits.to(DType::BF16)).find("router_forward: logits"), std::string::npos);
  const Tensor short_bias = Tensor::zeros({7}, DType::F32);
  o.expert_bias = &short_bias;
  EXPECT_NE(error(o, logits).find("expert_bias"), std::string::npos);
  o.expert_bias = nullptr;
  o.scaling = 0.0f;
  EXPECT_NE(error(o, logits).find("scaling expected > 0"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Permutation: tokens grouped by expert, each expert's rows run through a stand-in (the rows
// times a fixed weight matrix of the same shape), then weighted by the probabilities back into
// token order.

struct PermuteOut {
  Tensor permuted, row_map, out, dtokens, dprobs;
};

template <bool Reference>
PermuteOut permute_round_trip(const Tensor& tokens, const Tensor& experts, int64_t E,
                              const Tensor& probs, const Tensor& y_weights, const Tensor& dout) {
  const int64_t N = tokens.dim(0), C = tokens.dim(1), k = experts.dim(1);
  const DType dtype = tokens.dtype();
  PermuteOut r{Tensor::empty({N * k, C}, dtype), Tensor::empty({N, k}, DType::I32),
               Tensor::empty({N, C}, dtype), Tensor::empty({N, C}, dtype),
               Tensor::empty({N, k}, DType::F32)};
  auto permute = Reference ? ops::reference::moe_permute : ops::moe_permute;
  auto unpermute = Reference ? ops::reference::moe_unpermute : ops::moe_unpermute;
  auto unpermute_backward =
      Reference ? ops::reference::moe_unpermute_backward : ops::moe_unpermute_backward;
  auto permute_backward =
      Reference ? ops::reference::moe_permute_backward : ops::moe_permute_backward;
  permute(tokens, experts, E, r.permuted, r.row_map);
  // The stand-in expert: y = permuted * w elementwise, dpermuted = dy * w.
  const std::vector<float> p = r.permuted.to_floats(), w = y_weights.to_floats();
  std::vector<float> y(p.size());
  for (size_t i = 0; i < p.size(); ++i) y[i] = p[i] * w[i];
  const Tensor y_tensor = Tensor::from_floats({N * k, C}, y).to(dtype);
  unpermute(y_tensor, r.row_map, probs, r.out);
  Tensor dy = Tensor::empty({N * k, C}, dtype);
  unpermute_backward(dout, y_tensor, r.row_map, probs, dy, r.dprobs);
  std::vector<float> dpermuted = dy.to_floats();
  for (size_t i = 0; i < dpermuted.size(); ++i) dpermuted[i] *= w[i];
  permute_backward(Tensor::from_floats({N * k, C}, dpermuted).to(dtype), r.row_map, r.dtokens);
  return r;
}

Tensor random_experts(int64_t N, int64_t k, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor experts = Tensor::empty({N, k}, DType::I32);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) all[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < k; ++j)
      experts.data<int32_t>()[n * k + j] = all[static_cast<size_t>(j)];
  }
  return experts;
}

struct PermuteCase {
  const char* name;
  int64_t N, C, E, k;
  DType dtype;
  float magnitude = 1.0f;
};

void PrintTo(const PermuteCase& c, std::ostream* os) {
  *os << c.name;
}

class Permute : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(Permute, FastMatchesReferenceAndTorch) {
  const PermuteCase& c = GetParam();
  const Tensor tokens = random_tensor({c.N, c.C}, c.dtype, 1, 0.0f, c.magnitude);
  const Tensor experts = random_experts(c.N, c.k, c.E, 2);
  const Tensor probs = random_tensor({c.N, c.k}, DType::F32, 3);
  const Tensor y_weights = random_tensor({c.N * c.k, c.C}, DType::F32, 4);
  const Tensor dout = random_tensor({c.N, c.C}, c.dtype, 5, 0.0f, c.magnitude);
  const PermuteOut ref = permute_round_trip<true>(tokens, experts, c.E, probs, y_weights, dout);
  // Rows grouped by expert, each expert's in token order.
  const int32_t* e = experts.data<int32_t>();
  const int32_t* map = ref.row_map.data<int32_t>();
  for (int64_t a = 0; a < c.N * c.k; ++a) {
    for (int64_t b = 0; b < c.N * c.k; ++b) {
      if (e[a] < e[b] || (e[a] == e[b] && a < b)) {
        EXPECT_LT(map[a], map[b]);
      }
    }
  }
  // F32 sums of k terms beside FP64 ones; BF16 outputs round once more.
  const double rtol = c.dtype == DType::F32 ? 1e-5 : 8e-3;
  const double atol = rtol * c.magnitude * c.magnitude;
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(isa_name(isa));
    const Isa saved = active_isa();
    set_active_isa(isa);
    const PermuteOut fast = permute_round_trip<false>(tokens, experts, c.E, probs, y_weights, dout);
    set_active_isa(saved);
    EXPECT_EQ(fast.row_map.to_floats(), ref.row_map.to_floats());
    EXPECT_EQ(fast.permuted.to_floats(), ref.permuted.to_floats());
    EXPECT_LE(worst(fast.out, ref.out, atol * c.k, rtol), 1.0);
    EXPECT_LE(worst(fast.dtokens, ref.dtokens, atol * c.k, rtol), 1.0);
    EXPECT_LE(worst(fast.dprobs, ref.dprobs, atol * c.C, rtol), 1.0);
  }
  const TensorMap torch = testing::run_torch("moe_permute",
                                             {{"tokens", tokens},
                                              {"experts", experts},
                                              {"probs", probs},
                                              {"y_weights", y_weights},
                                              {"dout", dout}},
                                             "{}");
  EXPECT_EQ(ref.row_map.to_floats(), torch.at("row_map").to_floats());
  EXPECT_EQ(ref.permuted.to_floats(), torch.at("permuted").to_floats());
  // The stand-in expert's output is rounded to the dtype before the reference weighs it.
  const double torch_rtol = c.dtype == DType::F32 ? 1e-5 : 2e-2;
  const double torch_atol = torch_rtol * c.magnitude * c.magnitude;
  EXPECT_LE(worst(ref.out, torch.at("out"), torch_atol * c.k, torch_rtol), 1.0);
  EXPECT_LE(worst(ref.dtokens, torch.at("dtokens"), torch_atol * c.k, torch_rtol), 1.0);
  EXPECT_LE(worst(ref.dprobs, torch.at("dprobs"), torch_atol * c.C, torch_rtol), 1.0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Permute,
    ::testing::Values(PermuteCase{"f32_top2", 23, 40, 8, 2, DType::F32},
                      PermuteCase{"bf16_top2", 31, 64, 8, 2, DType::BF16},
                      PermuteCase{"f32_top6_wide", 13, 300, 16, 6, DType::F32},
                      PermuteCase{"f32_large", 11, 48, 4, 2, DType::F32, 1e15f},
                      PermuteCase{"f32_tiny", 11, 48, 4, 2, DType::F32, 1e-15f},
                      PermuteCase{"bf16_top1", 19, 33, 5, 1, DType::BF16}),
    [](const ::testing::TestParamInfo<PermuteCase>& param) {
      return std::string(param.param.name);
    });

TEST(Permute, BadArgumentsAreClearErrors) {
  const Tensor tokens = random_tensor({4, 8}, DType::F32, 1);
  Tensor experts = random_experts(4, 2, 4, 2);
  Tensor permuted = Tensor::empty({8, 8}, DType::F32), map = Tensor::empty({4, 2}, DType::I32);
  experts.data<int32_t>()[5] = 4;
  EXPECT_NE(testing::error_of([&] {
              ops::moe_permute(tokens, experts, 4, permuted, map);
            }).find("expert 4 of entry 5 expected in [0, 4)"),
            std::string::npos);
  Tensor bad_map = Tensor::zeros({4, 2}, DType::I32);
  Tensor out = Tensor::empty({4, 8}, DType::F32);
  EXPECT_NE(testing::error_of([&] {
              ops::moe_unpermute(permuted, bad_map, Tensor::zeros({4, 2}, DType::F32), out);
            }).find("row_map expected a permutation"),
            std::string::npos);
  experts = random_experts(4, 2, 4, 2);
  Tensor short_permuted = Tensor::empty({7, 8}, DType::F32);
  EXPECT_NE(testing::error_of([&] {
              ops::moe_permute(tokens, experts, 4, short_permuted, map);
            }).find("moe_permute: permuted"),
            std::string::npos);
}

// Token dropping by hand: 5 tokens, top-2 over 3 experts, capacity 2. Expert 0 is chosen by
// tokens 0, 1, 2 and 4 (probs .5 .6 .6 .9): by probability it keeps token 4 and, of the equal
// .6s, token 1; by position tokens 0 and 1. Expert 1 (tokens 0, 3) keeps both; expert 2 (tokens
// 1, 2, 3, 4 with .4 .4 .7 .1) keeps 3 and 1 by probability, 1 and 2 by position.
TEST(CapacityDrop, KeepsExactlyThePairsTheRuleSays) {
  Tensor experts = Tensor::empty({5, 2}, DType::I32);
  const int32_t chosen[] = {0, 1, 0, 2, 2, 0, 1, 2, 0, 2};
  for (int i = 0; i < 10; ++i) experts.data<int32_t>()[i] = chosen[i];
  const Tensor probs =
      Tensor::from_floats({5, 2}, {0.5f, 0.5f, 0.6f, 0.4f, 0.4f, 0.6f, 0.3f, 0.7f, 0.9f, 0.1f});
  const std::vector<float> by_probs = {3, 1, 0, 2, 3, 3, 1, 2, 0, 3};
  const std::vector<float> by_position = {0, 1, 0, 2, 2, 3, 1, 3, 3, 3};
  for (auto policy : {ops::DropPolicy::Probs, ops::DropPolicy::Position}) {
    const bool probs_policy = policy == ops::DropPolicy::Probs;
    SCOPED_TRACE(probs_policy ? "probs" : "position");
    for (bool fast : {true, false}) {
      Tensor dispatch = Tensor::empty({5, 2}, DType::I32), kept = Tensor::empty({3}, DType::I32);
      (fast ? ops::moe_capacity_drop : ops::reference::moe_capacity_drop)(experts, probs, 3, 2,
                                                                          policy, dispatch, kept);
      EXPECT_EQ(dispatch.to_floats(), probs_policy ? by_probs : by_position);
      EXPECT_EQ(kept.to_floats(), (std::vector<float>{2, 2, 2}));
    }
  }
  EXPECT_EQ(ops::moe_capacity(6, 2, 3, 0.5), 2);  // ceil(12 / 3 * 0.5)
  EXPECT_EQ(ops::moe_capacity(5, 2, 3, 1.0), 4);
}

// Large random cases with many equal probabilities: the fast path keeps what the reference
// keeps, every expert at most its capacity, and no pair it could keep is dropped.
TEST(CapacityDrop, FastEqualsReferenceOnRandomRoutesWithTies) {
  const int64_t N = 300, k = 3, E = 7;
  for (int64_t capacity : {0, 1, 40, 128, 900}) {
    for (auto policy : {ops::DropPolicy::Probs, ops::DropPolicy::Position}) {
      SCOPED_TRACE(std::to_string(capacity));
      const Tensor experts = random_experts(N, k, E, static_cast<uint32_t>(capacity) + 3);
      Tensor probs = Tensor::empty({N, k}, DType::F32);
      for (int64_t i = 0; i < N * k; ++i) probs.data<float>()[i] = float((i * 7919) % 5) / 4.0f;
      Tensor d1 = Tensor::empty({N, k}, DType::I32), d2 = Tensor::empty({N, k}, DType::I32);
      Tensor k1 = Tensor::empty({E}, DType::I32), k2 = Tensor::empty({E}, DType::I32);
      ops::moe_capacity_drop(experts, probs, E, capacity, policy, d1, k1);
      ops::reference::moe_capacity_drop(experts, probs, E, capacity, policy, d2, k2);
      EXPECT_EQ(d1.to_floats(), d2.to_floats());
      EXPECT_EQ(k1.to_floats(), k2.to_floats());
      std::vector<int64_t> routed(E, 0), kept(E, 0);
      for (int64_t i = 0; i < N * k; ++i) {
        ++routed[static_cast<size_t>(experts.data<int32_t>()[i])];
        const int32_t d = d1.data<int32_t>()[i];
        ASSERT_TRUE(d == experts.data<int32_t>()[i] || d == E);
        if (d < E) ++kept[static_cast<size_t>(d)];
      }
      for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ(kept[static_cast<size_t>(e)], std::min(routed[static_cast<size_t>(e)], capacity));
        EXPECT_EQ(k1.data<int32_t>()[e], kept[static_cast<size_t>(e)]);
      }
    }
  }
  Tensor dispatch = Tensor::empty({N, k}, DType::I32), kept = Tensor::empty({E}, DType::I32);
  EXPECT_NE(testing::error_of([&] {
              ops::moe_capacity_drop(random_experts(N, k, E, 1), Tensor::zeros({N, k}, DType::F32),
                                     E, -1, ops::DropPolicy::Probs, dispatch, kept);
            }).find("capacity expected >= 0"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              ops::moe_capacity(10, 2, 4, 0.0);
            }).find("capacity_factor expected > 0"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
