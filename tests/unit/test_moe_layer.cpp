// The mixture-of-experts layer (MoELayer) and GPT with one in every layer: forward and every
// gradient against PyTorch in float64 (tests/reference/ops_moe.py, moe_layer), FP8 under every
// recipe near BF16, recomputation bit for bit, the load and the expert-bias update, the
// config's counts and errors, and a resumed training run equal to an uninterrupted one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "octet/model.h"
#include "octet/modules.h"
#include "octet/safetensors.h"
#include "octet/train.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using testing::error_of;
using testing::random_tensor;
using testing::relative_rms;
using testing::worst;

struct MoeCase {
  std::string label;
  ops::ActivationKind activation;
  ops::RouterScore score;
  bool normalize, shared, bias;
  float scaling, aux, z;
  double capacity_factor = 0.0;
  ops::DropPolicy drop_policy = ops::DropPolicy::Probs;
};

MoELayerOptions moe_options(const MoeCase& c, int64_t hidden, int64_t ffn) {
  MoELayerOptions o;
  o.hidden = hidden;
  o.num_experts = 4;
  o.ffn_hidden = ffn;
  o.shared_expert_ffn_hidden = c.shared ? ffn / 2 : 0;
  o.activation = c.activation;
  o.norm.hidden = hidden;
  o.norm.name = "moe.norm";
  o.router.topk = 2;
  o.router.score = c.score;
  o.router.normalize = c.normalize;
  o.router.scaling = c.scaling;
  o.router.aux_loss_coeff = c.aux;
  o.router.z_loss_coeff = c.z;
  o.enable_expert_bias = c.bias;
  o.capacity_factor = c.capacity_factor;
  o.drop_policy = c.drop_policy;
  o.seed = 3;
  o.name = "moe";
  return o;
}

void randomize(Module& m, uint32_t seed) {
  for (Parameter* p : m.parameters()) {
    p->value.copy_from(random_tensor(p->value.shape(), DType::F32, seed++, 0.0f, 0.3f));
  }
  m.on_parameters_updated();
}

const std::vector<MoeCase>& cases() {
  static const std::vector<MoeCase> all = {
      // Mixtral / Switch: softmax scores, the switch loss and the z-loss, a shared expert.
      {"softmax gelu shared aux z", ops::ActivationKind::GeluTanh, ops::RouterScore::Softmax, false,
       true, false, 1.0f, 0.01f, 0.001f},
      // DeepSeek-V3: sigmoid scores normalized and scaled, the expert bias steering the choice.
      {"sigmoid swiglu normalized bias", ops::ActivationKind::SwiGlu, ops::RouterScore::Sigmoid,
       true, false, true, 2.5f, 0.0f, 0.0f},
      // Token dropping: each expert computes at most 0.75 of an even share; the rest of its
      // pairs add nothing.
      {"softmax gelu capacity 0.75 by probs", ops::ActivationKind::GeluTanh,
       ops::RouterScore::Softmax, false, true, false, 1.0f, 0.01f, 0.0f, 0.75},
      {"sigmoid gelu capacity 0.5 by position", ops::ActivationKind::GeluTanh,
       ops::RouterScore::Sigmoid, true, false, false, 1.0f, 0.0f, 0.0f, 0.5,
       ops::DropPolicy::Position},
  };
  return all;
}

TEST(MoELayer, ForwardAndEveryGradientMatchTorch) {
  const int64_t n = 64, hidden = 32, ffn = 24;
  for (const MoeCase& c : cases()) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(c.label + " " + std::string(dtype_name(dtype)));
      MoELayer moe(moe_options(c, hidden, ffn));
      randomize(moe, 5);
      // The norm near the identity (a large bias would favour the same experts for every
      // token) and a router of small weights: every expert is chosen by some token.
      moe.norm.weight.value.copy_from(random_tensor({hidden}, DType::F32, 76, 1.0f, 0.1f));
      moe.norm.bias.value.copy_from(random_tensor({hidden}, DType::F32, 77, 0.0f, 0.1f));
      moe.router.weight.value.copy_from(
          random_tensor(moe.router.weight.value.shape(), DType::F32, 78, 0.0f, 0.05f));
      if (c.bias) moe.expert_bias.copy_from(Tensor::from_floats({4}, {0.01f, -0.02f, 0.03f, 0.0f}));
      const float loss_scale = 0.5f;
      moe.set_loss_scale(loss_scale);
      // Inputs of large magnitude: the norm brings them back.
      Tensor x = random_tensor({2, n / 2, hidden}, dtype, 14, 0.0f, 50.0f);
      Tensor dy = random_tensor({2, n / 2, hidden}, dtype, 15);
      MoELayer::Context ctx;
      Tensor y = moe.forward(x, ctx);
      EXPECT_EQ(y.shape(), x.shape());
      const Tensor experts = ctx.experts.clone();
      const int64_t dropped = ctx.dropped;
      // What a capacity dropped, by the op's rule (tested on its own in test_moe).
      Tensor dispatch = Tensor::empty({n, 2}, DType::I32), kept = Tensor::empty({4}, DType::I32);
      if (c.capacity_factor > 0) {
        ops::moe_capacity_drop(experts, ctx.probs, 4, ops::moe_capacity(n, 2, 4, c.capacity_factor),
                               c.drop_policy, dispatch, kept);
        EXPECT_GT(dropped, 0);
      } else {
        EXPECT_EQ(dropped, 0);
      }
      Tensor dx = moe.backward(dy, ctx);

      TensorMap in;
      for (Parameter* p : moe.parameters()) in[p->name.substr(4)] = p->value;
      in["x"] = x.reshape({n, hidden});
      in["dy"] = dy.reshape({n, hidden});
      in["experts"] = experts;
      if (c.capacity_factor > 0) in["dispatch"] = dispatch;
      const nlohmann::json args = {
          {"eps", 1e-5},
          {"experts", 4},
          {"topk", 2},
          {"activation", c.activation == ops::ActivationKind::SwiGlu ? "swiglu" : "gelu"},
          {"score", c.score == ops::RouterScore::Softmax ? "softmax" : "sigmoid"},
          {"normalize", c.normalize},
          {"scaling", c.scaling},
          {"aux_coeff", c.aux},
          {"z_coeff", c.z},
          {"loss_scale", loss_scale}};
      const TensorMap torch = testing::run_torch("moe_layer", in, args.dump());
      const double rtol = dtype == DType::F32 ? 2e-4 : 4e-2;
      auto check = [&](const std::string& name, const Tensor& got) {
        SCOPED_TRACE(name);
        const Tensor& want = torch.at(name);
        // An expert no token chose has zero gradients on both sides.
        const double atol =
            (dtype == DType::F32 ? 2e-5 : 3e-2) * std::max(testing::max_abs(want), 1e-30);
        EXPECT_LE(worst(got, want, atol, rtol), 1.0);
      };
      check("y", y.reshape({n, hidden}));
      check("x.grad", dx.reshape({n, hidden}));
      for (Parameter* p : moe.parameters()) check(p->name.substr(4) + ".grad", p->grad);
      // Every expert saw tokens: each group's GEMMs are exercised.
      const MoELayer::Load load = moe.take_load();
      for (double t : load.tokens) EXPECT_GT(t, 0.0);
      EXPECT_EQ(std::accumulate(load.tokens.begin(), load.tokens.end(), 0.0), 2.0 * n);
      EXPECT_EQ(load.dropped, static_cast<double>(dropped));
    }
  }
}

TEST(MoELayer, Fp8UnderEveryRecipeStaysNearBf16) {
  const int64_t n = 256, hidden = 128, ffn = 128;
  const MoeCase& c = cases()[0];
  MoELayer moe(moe_options(c, hidden, ffn));
  Tensor x = random_tensor({n, hidden}, DType::BF16, 21);
  Tensor dy = random_tensor({n, hidden}, DType::BF16, 22, 0.0f, 0.01f);
  auto step = [&](TensorMap& grads) {
    moe.zero_grad();
    MoELayer::Context ctx;
    Tensor y = moe.forward(x, ctx);
    Tensor dx = moe.backward(dy, ctx);
    for (Parameter* p : moe.parameters()) grads[p->name] = p->grad.clone();
    grads["y"] = y;
    grads["dx"] = dx;
  };
  TensorMap bf16;
  step(bf16);
  for (const auto& [name, r] : testing::fp8_recipes()) {
    SCOPED_TRACE(name);
    TensorMap fp8;
    fp8_autocast scope(true, r);
    if (name == "delayed") step(fp8);  // one step of amax history first
    step(fp8);
    for (const auto& [tensor, want] : bf16) {
      SCOPED_TRACE(tensor);
      EXPECT_LE(relative_rms(fp8.at(tensor), want), 0.15);
    }
    // The GEMMs did run in FP8: the output is not BF16's.
    EXPECT_GT(relative_rms(fp8.at("y"), bf16.at("y")), 1e-4);
  }
}

// A TransformerLayer with a mixture of experts, recomputed in backward (activation
// checkpointing), gives the kept layer's output and gradients bit for bit, and counts each
// micro-batch's load once.
TEST(MoELayer, RecomputedLayerEqualsTheKeptOne) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    TransformerLayerOptions o;
    o.hidden_size = 32;
    o.ffn_hidden_size = 64;
    o.num_attention_heads = 4;
    o.hidden_dropout = 0.0f;
    o.attention_dropout = 0.0f;
    o.moe = moe_options(cases()[0], 32, 24);
    o.seed = 9;
    TransformerLayer kept(o);
    o.checkpoint = true;
    TransformerLayer recomputed(o);
    ASSERT_TRUE(kept.moe && !kept.layernorm_mlp);
    Tensor x = random_tensor({2, 8, 32}, dtype, 31);
    Tensor dy = random_tensor({2, 8, 32}, dtype, 32);
    TransformerLayer::Context a, b;
    Tensor ya = kept.forward(x, a), yb = recomputed.forward(x, b);
    EXPECT_EQ(ya.to_floats(), yb.to_floats());
    Tensor dxa = kept.backward(dy, a), dxb = recomputed.backward(dy, b);
    EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
    std::vector<Parameter*> pa = kept.parameters(), pb = recomputed.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(pa[i]->grad.to_floats(), pb[i]->grad.to_floats()) << pa[i]->name;
    }
    EXPECT_EQ(kept.moe->take_load().tokens, recomputed.moe->take_load().tokens);
    EXPECT_EQ(recomputed.moe->take_load().micro_batches, 0);
  }
}

TEST(MoELayer, LoadCountsTrainingBackwardsAndTheBiasMovesTowardTheMean) {
  const MoeCase& c = cases()[1];
  MoELayer moe(moe_options(c, 32, 24));
  Tensor x = random_tensor({16, 32}, DType::F32, 41);
  MoELayer::Context ctx;
  moe.forward(x, ctx);  // evaluation: no backward, no load
  EXPECT_EQ(moe.take_load().micro_batches, 0);
  for (int i = 0; i < 2; ++i) {
    moe.forward(x, ctx);
    moe.backward(random_tensor({16, 32}, DType::F32, 42), ctx);
  }
  const MoELayer::Load load = moe.take_load();
  EXPECT_EQ(load.micro_batches, 2);
  EXPECT_EQ(std::accumulate(load.tokens.begin(), load.tokens.end(), 0.0), 2.0 * 16 * 2);
  EXPECT_EQ(moe.take_load().micro_batches, 0);  // taken

  // DeepSeek-V3's rule: +rate below the mean load, -rate above it, nothing at it.
  moe.update_expert_bias({10, 2, 4, 4});
  EXPECT_EQ(moe.expert_bias.to_floats(), (std::vector<float>{-1e-3f, 1e-3f, 1e-3f, 1e-3f}));
  moe.update_expert_bias({5, 5, 5, 5});
  EXPECT_EQ(moe.expert_bias.to_floats(), (std::vector<float>{-1e-3f, 1e-3f, 1e-3f, 1e-3f}));
  // Without enable_expert_bias the bias stays zero and steers nothing.
  MoELayer plain(moe_options(cases()[0], 32, 24));
  plain.update_expert_bias({10, 2, 4, 4});
  EXPECT_EQ(plain.expert_bias.to_floats(), std::vector<float>(4, 0.0f));
}

TEST(MoELayer, BadOptionsAndInputsAreClearErrors) {
  MoELayerOptions o = moe_options(cases()[0], 32, 24);
  o.router.topk = 5;
  EXPECT_NE(
      error_of([&] { MoELayer m(o); }).find("moe_router_topk expected in [1, num_experts = 4]"),
      std::string::npos);
  o = moe_options(cases()[0], 32, 24);
  o.num_experts = 0;
  EXPECT_NE(error_of([&] { MoELayer m(o); }).find("num_experts expected >= 1"), std::string::npos);
  MoELayer moe(moe_options(cases()[0], 32, 24));
  MoELayer::Context ctx;
  EXPECT_NE(error_of([&] {
              moe.forward(Tensor::zeros({4, 31}, DType::F32), ctx);
            }).find("input expected [..., C] with C=32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              moe.backward(Tensor::zeros({4, 32}, DType::F32), ctx);
            }).find("backward called without a forward context"),
            std::string::npos);
}

nlohmann::json moe_config() {
  return {{"name", "moe-test"},
          {"vocab_size", 512},
          {"max_seq_len", 16},
          {"num_layers", 2},
          {"hidden", 32},
          {"num_heads", 4},
          {"num_experts", 4},
          {"moe_ffn_hidden", 48},
          {"moe_shared_expert_ffn_hidden", 32},
          {"moe_router_topk", 2},
          {"moe_aux_loss_coeff", 0.01},
          {"moe_router_enable_expert_bias", true},
          {"moe_router_bias_update_rate", 0.01}};
}

TEST(GptMoe, ParameterCountsFollowTheConfig) {
  const GPTConfig config = GPTConfig::from_json(moe_config());
  GPT model(config, 7);
  int64_t total = 0;
  for (Parameter* p : model.parameters()) total += p->value.numel();
  EXPECT_EQ(total, config.num_parameters());
  // A token meets the router, 2 of the 4 experts and the shared expert.
  const int64_t expert = 32 * 48 * 2 + 48 + 32;  // FC1 and FC2 with their biases
  EXPECT_EQ(config.num_parameters() - config.num_active_parameters(), 2 * 2 * expert);
  EXPECT_EQ(model.moe_layers().size(), 2u);
  // The state holds each layer's expert bias beside the parameters, and loads back.
  const TensorMap state = model.state_dict();
  EXPECT_EQ(state.size(), model.parameters().size() + 2);
  ASSERT_TRUE(state.count("transformer.h.1.moe.router.expert_bias"));
  GPT other(config, 8);
  other.load_state_dict(state);
  testing::expect_same_tensors(other.state_dict(), state);
  TensorMap missing = state;
  missing.erase("transformer.h.0.moe.router.expert_bias");
  EXPECT_NE(error_of([&] {
              other.load_state_dict(missing);
            }).find("missing tensor 'transformer.h.0.moe.router.expert_bias'"),
            std::string::npos);
}

TEST(GptMoe, BadConfigsAreClearErrors) {
  testing::expect_config_errors<GPTConfig>(
      moe_config(),
      {{"moe_router_topk", 5, "moe_router_topk expected in [1, num_experts = 4]"},
       {"num_experts", -1, "num_experts expected in [0, 4096]"},
       {"moe_router_score_function", "relu", "expected softmax or sigmoid"},
       {"moe_aux_loss_coeff", -0.1, "moe_aux_loss_coeff (-0.1"},
       {"moe_router_bias_update_rate", -1, "moe_router_bias_update_rate expected >= 0"},
       {"moe_ffn_hidden", -4, "moe_ffn_hidden (-4) and moe_shared_expert_ffn_hidden"}});
}

// Training: a run saved at iteration 3 and resumed to 6 gives the uninterrupted losses exactly
// (the expert biases travel in the checkpoint); FP8 trains; --moe-* flags override the config
// and are refused on a dense one.
TEST(GptMoe, ResumeWithExpertBiasEqualsUninterrupted) {
  testing::TrainerFixture fixture(moe_config());
  TrainOptions o = fixture.options("bf16");
  o.eval_iters = 0;
  o.lr_warmup_iters = 100;
  o.train_iters = 6;
  const TrainResult whole = train_gpt(o);
  ASSERT_EQ(whole.losses.size(), 6u);
  TrainOptions first = o;
  first.train_iters = 3;
  first.save = fixture.path("ckpt");
  train_gpt(first);
  const TensorMap saved = load_safetensors(first.save + "/model.safetensors");
  ASSERT_TRUE(saved.count("transformer.h.0.moe.router.expert_bias"));
  // Three updates of 0.01 each: every entry moved by a multiple of 0.01, some of them.
  const std::vector<float> bias = saved.at("transformer.h.0.moe.router.expert_bias").to_floats();
  EXPECT_TRUE(std::any_of(bias.begin(), bias.end(), [](float b) { return b != 0.0f; }));
  TrainOptions second = o;
  second.load = first.save;
  const TrainResult tail = train_gpt(second);
  ASSERT_EQ(tail.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(tail.losses[i], whole.losses[3 + i]) << i;

  TrainOptions fp8 = fixture.options("fp8");
  fp8.train_iters = 3;
  fp8.moe_router_topk = 1;
  for (float loss : train_gpt(fp8).losses) EXPECT_TRUE(std::isfinite(loss));

  testing::TrainerFixture dense({{"name", "dense"},
                                 {"vocab_size", 512},
                                 {"max_seq_len", 16},
                                 {"num_layers", 2},
                                 {"hidden", 32},
                                 {"num_heads", 4}});
  TrainOptions flags = dense.options("bf16");
  flags.moe_aux_loss_coeff = 0.01f;
  EXPECT_NE(error_of([&] { train_gpt(flags); }).find("--moe-* flags need a mixture-of-experts"),
            std::string::npos);
  TrainOptions topk = fixture.options("bf16");
  topk.moe_router_topk = 9;
  EXPECT_NE(error_of([&] { train_gpt(topk); }).find("moe_router_topk expected in [1"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
