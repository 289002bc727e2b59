// DotProductAttention, MultiheadAttention, TransformerLayer and GroupedLinear: forward and
// backward (inputs and every parameter) against PyTorch 1.13 in float64; FP8 delayed scaling
// against explicitly quantized GEMM inputs with the scales the recipe prescribes; activation
// recomputation bit for bit; dropout determinism; attention memory linear in T.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>

#include "modules/tensor_columns.h"
#include "octet/modules.h"
#include "octet/ops/attention.h"
#include "test_util.h"  // also reports the instruction-set paths run
#include "torch_reference.h"

namespace octet {
namespace {

Tensor random_tensor(Shape shape, DType dtype, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(rng);
  return dtype == DType::F32 ? t : t.to(dtype);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.to_floats()) m = std::max(m, std::fabs(double(v)));
  return m;
}

float amax(const Tensor& t) {
  return static_cast<float>(max_abs(t));
}

// Largest |a - b| as a fraction of the reference's largest magnitude: sums of mixed signs
// make element-wise relative error meaningless, the tensor's scale is the natural unit.
double scaled_error(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  if (x.size() != y.size()) return 1e9;
  double error = 0;
  for (size_t i = 0; i < x.size(); ++i) error = std::max(error, std::fabs(double(x[i]) - y[i]));
  return error / std::max(max_abs(b), 1e-30);
}

double relative_rms(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  double error = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    error += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    norm += double(y[i]) * y[i];
  }
  return std::sqrt(error / norm);
}

void randomize(Module& m, uint32_t seed, float stddev = 0.3f) {
  for (Parameter* p : m.parameters()) {
    Tensor r = random_tensor(p->value.shape(), DType::F32, seed++, stddev);
    p->value.copy_from(r);
  }
  m.on_parameters_updated();
}

void copy_parameters(Module& from, Module& to) {
  std::vector<Parameter*> a = from.parameters(), b = to.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) b[i]->value.copy_from(a[i]->value);
  to.on_parameters_updated();
}

TensorMap parameter_map(Module& m, const std::string& strip_prefix) {
  TensorMap out;
  for (Parameter* p : m.parameters()) out[p->name.substr(strip_prefix.size())] = p->value;
  return out;
}

// F32: every GEMM and reduction accumulates in F32 over at most a few hundred terms, and a
// layer chains about ten of them: errors stay below 1e-5 of each tensor's scale.
constexpr double kF32Tolerance = 2e-5;

void expect_close(const Tensor& actual, const TensorMap& torch, const std::string& name,
                  double tolerance) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(torch.count(name)) << "reference has no " << name;
  EXPECT_LE(scaled_error(actual, torch.at(name)), tolerance);
}

void expect_grads(Module& m, const std::string& strip_prefix, const TensorMap& torch,
                  double tolerance) {
  for (Parameter* p : m.parameters()) {
    expect_close(p->grad, torch, p->name.substr(strip_prefix.size()) + ".grad", tolerance);
  }
}

// A JSON object for the reference's arguments.
class Args {
 public:
  Args& set(const std::string& key, const std::string& value) {
    return raw(key, "\"" + value + "\"");
  }
  Args& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
  Args& set(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  Args& set(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  Args& set(const std::string& key, double value) {
    std::ostringstream s;
    s.precision(17);
    s << value;
    return raw(key, s.str());
  }
  Args& raw(const std::string& key, const std::string& json) {
    fields_[key] = json;
    return *this;
  }
  std::string str() const {
    std::string out = "{";
    for (const auto& [key, value] : fields_) {
      if (out.size() > 1) out += ", ";
      out += "\"" + key + "\": " + value;
    }
    return out + "}";
  }

 private:
  std::map<std::string, std::string> fields_;
};

const char* mask_name(AttnMaskType type) {
  switch (type) {
    case AttnMaskType::NoMask:
      return "no_mask";
    case AttnMaskType::Causal:
      return "causal";
    case AttnMaskType::Padding:
      return "padding";
    case AttnMaskType::PaddingCausal:
      return "padding_causal";
  }
  return "";
}

const char* norm_name(NormKind kind) {
  return kind == NormKind::LayerNorm ? "layernorm" : "rmsnorm";
}

Tensor lengths_tensor(std::vector<int32_t> values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::I32);
  for (size_t i = 0; i < values.size(); ++i) t.data<int32_t>()[i] = values[i];
  return t;
}

// ---------------------------------------------------------------------------------------------

TEST(DotProductAttention, MasksAndGqaMatchTorch) {
  struct Case {
    AttnMaskType mask;
    int64_t S;
    std::pair<int64_t, int64_t> window;
  };
  const Case cases[] = {{AttnMaskType::NoMask, 9, {-1, -1}},
                        {AttnMaskType::Causal, 7, {-1, -1}},
                        {AttnMaskType::Causal, 7, {2, 0}},  // sliding window of 3 keys
                        {AttnMaskType::Padding, 9, {-1, -1}},
                        {AttnMaskType::PaddingCausal, 7, {-1, -1}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(mask_name(c.mask)) + " window " + std::to_string(c.window.first));
    DotProductAttentionOptions o;
    o.num_attention_heads = 6;
    o.num_gqa_groups = 2;
    o.kv_channels = 8;
    o.attn_mask_type = c.mask;
    o.window_size = c.window;
    DotProductAttention attention(o);
    Tensor q = random_tensor({2, 7, 6, 8}, DType::F32, 1);
    Tensor k = random_tensor({2, c.S, 2, 8}, DType::F32, 2);
    Tensor v = random_tensor({2, c.S, 2, 8}, DType::F32, 3);
    Tensor dy = random_tensor({2, 7, 6, 8}, DType::F32, 4);
    Tensor q_lengths = lengths_tensor({7, 4}), kv_lengths = lengths_tensor({int32_t(c.S), 5});
    const bool padding = c.mask == AttnMaskType::Padding || c.mask == AttnMaskType::PaddingCausal;
    DotProductAttention::Context ctx;
    Tensor y = attention.forward(q, k, v, ctx, padding ? &q_lengths : nullptr,
                                 padding ? &kv_lengths : nullptr);
    EXPECT_TRUE(ctx.lse.defined());
    Tensor dq, dk, dv;
    attention.backward(dy, ctx, dq, dk, dv);
    TensorMap in{{"q", q}, {"k", k}, {"v", v}, {"dy", dy}};
    if (padding) {
      in["q_lengths"] = q_lengths;
      in["kv_lengths"] = kv_lengths;
    }
    Args args;
    args.set("mask", mask_name(c.mask))
        .raw("window",
             "[" + std::to_string(c.window.first) + ", " + std::to_string(c.window.second) + "]");
    TensorMap torch = testing::run_torch("dot_product_attention", in, args.str());
    expect_close(y, torch, "y", kF32Tolerance);
    expect_close(dq, torch, "q.grad", kF32Tolerance);
    expect_close(dk, torch, "k.grad", kF32Tolerance);
    expect_close(dv, torch, "v.grad", kF32Tolerance);
  }
}

TEST(DotProductAttention, PaddingMaskNeedsLengths) {
  DotProductAttentionOptions o;
  o.num_attention_heads = 2;
  o.kv_channels = 4;
  o.attn_mask_type = AttnMaskType::Padding;
  DotProductAttention attention(o);
  Tensor q = random_tensor({1, 3, 2, 4}, DType::F32, 1);
  DotProductAttention::Context ctx;
  EXPECT_THROW(attention.forward(q, q, q, ctx), Error);
  Tensor bad = random_tensor({1, 3, 3, 4}, DType::F32, 1);
  EXPECT_THROW(attention.forward(bad, q, q, ctx), Error);
}

// ---------------------------------------------------------------------------------------------

MultiheadAttentionOptions mha_options() {
  MultiheadAttentionOptions o;
  o.hidden_size = 48;
  o.num_attention_heads = 6;
  o.num_gqa_groups = 2;
  o.name = "attn";
  return o;
}

Args mha_args(const MultiheadAttentionOptions& o) {
  Args a;
  a.set("heads", o.num_attention_heads)
      .set("gqa_groups", o.num_gqa_groups ? o.num_gqa_groups : o.num_attention_heads)
      .set("kv_channels", o.kv_channels ? o.kv_channels : o.hidden_size / o.num_attention_heads)
      .set("norm", norm_name(o.normalization))
      .set("eps", double(o.layernorm_epsilon))
      .set("mask", mask_name(o.attn_mask_type))
      .set("rope", o.rope)
      .set("rotary_dim", o.rotary_dim)
      .set("qk_norm", o.qk_norm)
      .set("qk_norm_type", norm_name(o.qk_norm_type))
      .set("qk_norm_eps", double(o.qk_norm_eps))
      .set("qk_norm_before_rope", o.qk_norm_before_rope)
      .set("cross", o.attention_type == AttentionType::Cross);
  return a;
}

TEST(MultiheadAttention, SelfAttentionMatchesTorch) {
  struct Case {
    std::string name;
    bool input_layernorm;
    NormKind norm;
    bool rope;
    int64_t rotary_dim;
    bool qk_norm, qk_norm_before_rope;
    int64_t gqa;
  };
  const Case cases[] = {
      {"layernorm_plain", true, NormKind::LayerNorm, false, 0, false, false, 6},
      {"rmsnorm_partial_rope_qknorm", true, NormKind::RMSNorm, true, 4, true, false, 2},
      {"no_norm_rope_qknorm_first", false, NormKind::LayerNorm, true, 8, true, true, 2},
      {"gqa_one_kv_head_rope", true, NormKind::LayerNorm, true, 8, false, false, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    MultiheadAttentionOptions o = mha_options();
    o.input_layernorm = c.input_layernorm;
    o.normalization = c.norm;
    o.rope = c.rope;
    o.rotary_dim = c.rotary_dim;
    o.qk_norm = c.qk_norm;
    o.qk_norm_before_rope = c.qk_norm_before_rope;
    o.num_gqa_groups = c.gqa;
    MultiheadAttention attention(o);
    randomize(attention, 5);
    Tensor x = random_tensor({2, 7, 48}, DType::F32, 6);
    Tensor dy = random_tensor({2, 7, 48}, DType::F32, 7);
    MultiheadAttention::Context ctx;
    Tensor y = attention.forward(x, ctx);
    EXPECT_EQ(y.shape(), (Shape{2, 7, 48}));
    Tensor dx = attention.backward(dy, ctx);
    TensorMap in = parameter_map(attention, "attn.");
    in["x"] = x;
    in["dy"] = dy;
    TensorMap torch = testing::run_torch("multihead_attention", in, mha_args(o).str());
    expect_close(y, torch, "y", kF32Tolerance);
    expect_close(dx, torch, "x.grad", kF32Tolerance);
    expect_grads(attention, "attn.", torch, kF32Tolerance);
  }
}

TEST(MultiheadAttention, RotaryPercentSetsRotaryDim) {
  MultiheadAttentionOptions o = mha_options();
  o.rope = true;
  o.rotary_percent = 0.5f;  // D = 8 -> 4 rotated channels
  MultiheadAttention a(o);
  EXPECT_EQ(a.options().rotary_dim, 4);
  o.rotary_percent = 0.2f;  // 1.6 channels: nothing even to rotate
  EXPECT_THROW(MultiheadAttention{o}, Error);
}

TEST(MultiheadAttention, CrossAttentionMatchesTorch) {
  for (bool return_bias : {false, true}) {
    SCOPED_TRACE(return_bias ? "return_bias" : "bias in the GEMM");
    MultiheadAttentionOptions o = mha_options();
    o.attention_type = AttentionType::Cross;
    o.attn_mask_type = AttnMaskType::NoMask;
    o.input_layernorm = true;
    o.return_bias = return_bias;
    MultiheadAttention attention(o);
    randomize(attention, 8);
    Tensor x = random_tensor({2, 7, 48}, DType::F32, 9);
    Tensor encoder = random_tensor({2, 5, 48}, DType::F32, 10);
    Tensor dy = random_tensor({2, 7, 48}, DType::F32, 11);
    MultiheadAttention::Context ctx;
    Tensor y = attention.forward(x, ctx, &encoder);
    Tensor d_encoder;
    Tensor dx = attention.backward(dy, ctx, &d_encoder);
    TensorMap in = parameter_map(attention, "attn.");
    in["x"] = x;
    in["encoder_output"] = encoder;
    in["dy"] = dy;
    TensorMap torch = testing::run_torch("multihead_attention", in, mha_args(o).str());
    if (return_bias) {
      // The caller adds the bias (and owns its gradient): y + bias is the full output.
      ASSERT_NE(attention.output_bias(), nullptr);
      Tensor full = y.clone();
      const float* b = attention.output_bias()->data<float>();
      for (int64_t i = 0; i < full.numel(); ++i) full.data<float>()[i] += b[i % 48];
      expect_close(full, torch, "y", kF32Tolerance);
      EXPECT_EQ(max_abs(attention.proj.bias.grad), 0.0);
    } else {
      EXPECT_EQ(attention.output_bias(), nullptr);
      expect_close(y, torch, "y", kF32Tolerance);
      expect_close(attention.proj.bias.grad, torch, "proj.bias.grad", kF32Tolerance);
    }
    expect_close(dx, torch, "x.grad", kF32Tolerance);
    expect_close(d_encoder, torch, "encoder_output.grad", kF32Tolerance);
    for (Parameter* p : attention.parameters()) {
      if (p == &attention.proj.bias) continue;
      expect_close(p->grad, torch, p->name.substr(5) + ".grad", kF32Tolerance);
    }
  }
}

// ---------------------------------------------------------------------------------------------

TransformerLayerOptions layer_options() {
  TransformerLayerOptions o;
  o.hidden_size = 48;
  o.ffn_hidden_size = 80;
  o.num_attention_heads = 6;
  o.num_gqa_groups = 2;
  o.hidden_dropout = 0.0f;
  o.attention_dropout = 0.0f;
  o.name = "layer";
  return o;
}

Args layer_args(const TransformerLayerOptions& o) {
  Args a;
  const int64_t heads = o.num_attention_heads;
  a.set("heads", heads)
      .set("gqa_groups", o.num_gqa_groups ? o.num_gqa_groups : heads)
      .set("kv_channels", o.kv_channels ? o.kv_channels : o.hidden_size / heads)
      .set("norm", norm_name(o.normalization))
      .set("eps", double(o.layernorm_epsilon))
      .set("zero_centered_gamma", o.zero_centered_gamma)
      .set("activation", std::string(ops::activation_name(o.activation)))
      .set("mask", mask_name(o.self_attn_mask_type))
      .set("cross_mask", mask_name(o.enc_dec_attn_mask_type))
      .raw("window", "[" + std::to_string(o.window_size.first) + ", " +
                         std::to_string(o.window_size.second) + "]")
      .set("rope", o.rope)
      .set("rotary_dim", o.rotary_dim ? o.rotary_dim : o.hidden_size / heads)
      .set("qk_norm", o.qk_norm)
      .set("qk_norm_type", norm_name(o.qk_norm_type))
      .set("qk_norm_eps", double(o.qk_norm_eps))
      .set("qk_norm_before_rope", o.qk_norm_before_rope)
      .set("post_layernorm_residual", o.apply_residual_connection_post_layernorm)
      .set("output_layernorm", o.output_layernorm)
      .set("parallel_attention_mlp", o.parallel_attention_mlp);
  return a;
}

struct LayerRun {
  Tensor y, dx, d_encoder;
};

// forward + backward of `layer` and of the PyTorch reference on the same inputs.
LayerRun run_layer(TransformerLayer& layer, const Tensor& x, const Tensor& dy,
                   const Tensor* encoder, const Tensor* lengths, TensorMap& torch) {
  LayerRun r;
  TransformerLayer::Context ctx;
  r.y = layer.forward(x, ctx, encoder, lengths);
  r.dx = layer.backward(dy, ctx, encoder ? &r.d_encoder : nullptr);
  TensorMap in = parameter_map(layer, "layer.");
  in["x"] = x;
  in["dy"] = dy;
  if (encoder) in["encoder_output"] = *encoder;
  if (lengths) in["lengths"] = *lengths;
  torch = testing::run_torch("transformer_layer", in, layer_args(layer.options()).str());
  return r;
}

TEST(TransformerLayer, EncoderVariantsMatchTorch) {
  struct Case {
    std::string name;
    std::function<void(TransformerLayerOptions&)> configure;
  };
  const std::vector<Case> cases = {
      {"pre_norm_gelu", [](TransformerLayerOptions&) {}},
      {"rmsnorm_swiglu_rope_qknorm",
       [](TransformerLayerOptions& o) {
         o.normalization = NormKind::RMSNorm;
         o.activation = ops::ActivationKind::SwiGlu;
         o.rope = true;
         o.qk_norm = true;
         o.qk_norm_before_rope = true;
         o.zero_centered_gamma = true;
       }},
      {"post_norm_bert",
       [](TransformerLayerOptions& o) {
         o.output_layernorm = true;
         o.apply_residual_connection_post_layernorm = true;
         o.self_attn_mask_type = AttnMaskType::NoMask;
         o.num_gqa_groups = 6;
       }},
      {"output_layernorm_only",
       [](TransformerLayerOptions& o) {
         o.output_layernorm = true;
         o.self_attn_mask_type = AttnMaskType::NoMask;
       }},
      {"post_layernorm_residual",
       [](TransformerLayerOptions& o) { o.apply_residual_connection_post_layernorm = true; }},
      {"parallel_attention_mlp_rope",
       [](TransformerLayerOptions& o) {
         o.parallel_attention_mlp = true;
         o.rope = true;
         o.rotary_dim = 4;
       }},
      {"sliding_window_no_bias",
       [](TransformerLayerOptions& o) {
         o.window_size = {3, 0};
         o.bias = false;
       }},
      {"padding_causal",
       [](TransformerLayerOptions& o) { o.self_attn_mask_type = AttnMaskType::PaddingCausal; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TransformerLayerOptions o = layer_options();
    c.configure(o);
    TransformerLayer layer(o);
    randomize(layer, 20);
    Tensor x = random_tensor({2, 7, 48}, DType::F32, 21);
    Tensor dy = random_tensor({2, 7, 48}, DType::F32, 22);
    Tensor lengths = lengths_tensor({7, 5});
    const bool padding = o.self_attn_mask_type == AttnMaskType::PaddingCausal;
    TensorMap torch;
    LayerRun r = run_layer(layer, x, dy, nullptr, padding ? &lengths : nullptr, torch);
    expect_close(r.y, torch, "y", kF32Tolerance);
    expect_close(r.dx, torch, "x.grad", kF32Tolerance);
    expect_grads(layer, "layer.", torch, kF32Tolerance);
  }
}

TEST(TransformerLayer, DecoderMatchesTorch) {
  for (bool post : {false, true}) {
    SCOPED_TRACE(post ? "post-layernorm residuals" : "pre-norm");
    TransformerLayerOptions o = layer_options();
    o.layer_type = LayerType::Decoder;
    o.apply_residual_connection_post_layernorm = post;
    o.rope = true;
    TransformerLayer layer(o);
    ASSERT_TRUE(layer.inter_attention.has_value());
    randomize(layer, 30);
    Tensor x = random_tensor({2, 7, 48}, DType::F32, 31);
    Tensor encoder = random_tensor({2, 5, 48}, DType::F32, 32);
    Tensor dy = random_tensor({2, 7, 48}, DType::F32, 33);
    TensorMap torch;
    LayerRun r = run_layer(layer, x, dy, &encoder, nullptr, torch);
    expect_close(r.y, torch, "y", kF32Tolerance);
    expect_close(r.dx, torch, "x.grad", kF32Tolerance);
    expect_close(r.d_encoder, torch, "encoder_output.grad", kF32Tolerance);
    expect_grads(layer, "layer.", torch, kF32Tolerance);
  }
  TransformerLayerOptions o = layer_options();
  o.layer_type = LayerType::Decoder;
  TransformerLayer layer(o);
  TransformerLayer::Context ctx;
  EXPECT_THROW(layer.forward(random_tensor({1, 3, 48}, DType::F32, 1), ctx), Error);
}

// BF16: every activation is rounded to BF16 (relative 2^-9) and the GEMMs read BF16 weights;
// over the ~10 chained ops of a layer the errors reach a fraction of a percent of each
// tensor's scale (measured: 0.4% for y, 0.7% for dx, <= 0.6% RMS for parameter gradients).
TEST(TransformerLayer, Bf16MatchesTorchLoosely) {
  TransformerLayerOptions o = layer_options();
  o.normalization = NormKind::RMSNorm;
  o.activation = ops::ActivationKind::SwiGlu;
  o.rope = true;
  o.qk_norm = true;
  TransformerLayer layer(o);
  randomize(layer, 40);
  Tensor x = random_tensor({2, 7, 48}, DType::BF16, 41);
  Tensor dy = random_tensor({2, 7, 48}, DType::BF16, 42);
  TensorMap torch;
  LayerRun r = run_layer(layer, x, dy, nullptr, nullptr, torch);
  EXPECT_EQ(r.y.dtype(), DType::BF16);
  EXPECT_EQ(r.dx.dtype(), DType::BF16);
  expect_close(r.y, torch, "y", 2e-2);
  expect_close(r.dx, torch, "x.grad", 3e-2);
  for (Parameter* p : layer.parameters()) {
    SCOPED_TRACE(p->name);
    EXPECT_LT(relative_rms(p->grad, torch.at(p->name.substr(6) + ".grad")), 2e-2);
  }
}

// ---------------------------------------------------------------------------------------------

Tensor fake_quantize(const Tensor& x, DType format, float scale) {
  Float8Tensor q = Quantizer::fixed(format, scale).quantize(x.reshape({x.rows(), x.cols()}));
  return q.dequantize();
}

// y = Q(x) Q(W)^T (+ bias), both quantized with the given scales, in FP64.
Tensor quantized_linear(const Tensor& x, float x_scale, const Tensor& weight, float w_scale,
                        const Tensor* bias, DType format = DType::E4M3) {
  Tensor xq = fake_quantize(x, format, x_scale);
  Tensor wq = fake_quantize(weight, DType::E4M3, w_scale);
  Tensor y = Tensor::empty({xq.rows(), wq.rows()}, DType::F32);
  gemm_reference(xq, wq, y, false, true, 1.0f, 0.0f, Epilogue{bias, Activation::None});
  return y;
}

// The scale delayed scaling gives after the amaxes `history` (oldest first): fp8_max over the
// largest of the last `window`, 1 before any step.
float delayed_scale(const std::vector<float>& history, size_t window, float fp8_max_value) {
  if (history.empty()) return 1.0f;
  float m = 0;
  for (size_t i = history.size() > window ? history.size() - window : 0; i < history.size(); ++i) {
    m = std::max(m, history[i]);
  }
  return fp8_max_value / m;
}

// FP8 attention (DelayedScaling::fp8_dpa): each step, q, k, v are quantized with the delayed
// scales of their amax histories (forward meta 0, 1, 3), P with the scale of its amax (meta 2,
// amax 1), dO with backward meta 1 (E5M2) and dS with backward meta 0; the module's output and
// gradients equal the kernels run on those FP8 values, bit for bit. Only FP8 q, k, v are kept.
TEST(DotProductAttention, Fp8DpaQuantizesWithItsDelayedScales) {
  DotProductAttentionOptions o;
  o.num_attention_heads = 4;
  o.num_gqa_groups = 2;
  o.kv_channels = 16;
  DotProductAttention attention(o);
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 2;
  recipe.fp8_dpa = true;
  std::vector<float> q_amax, k_amax, v_amax, do_amax, ds_amax;
  auto fake_quantize = [](const Tensor& x, DType format, float scale) {
    const Tensor rows = x.reshape({x.dim(0) * x.dim(1), x.dim(2) * x.dim(3)});
    return Quantizer::fixed(format, scale).quantize(rows).dequantize().reshape(x.shape());
  };
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float magnitude = step == 1 ? 8.0f : 1.0f;  // moves the delayed scales
    Tensor q = random_tensor({2, 20, 4, 16}, DType::BF16, 200 + step, magnitude);
    Tensor k = random_tensor({2, 20, 2, 16}, DType::BF16, 210 + step);
    Tensor v = random_tensor({2, 20, 2, 16}, DType::BF16, 220 + step, 0.5f);
    Tensor dy = random_tensor({2, 20, 4, 16}, DType::BF16, 230 + step, 0.01f);
    DotProductAttention::Context ctx;
    Tensor y;
    {
      fp8_autocast scope(true, recipe);
      y = attention.forward(q, k, v, ctx);
    }
    EXPECT_TRUE(ctx.fp8);
    EXPECT_FALSE(ctx.q.defined() || ctx.k.defined() || ctx.v.defined());
    EXPECT_EQ(ctx.q8.data.dtype(), DType::E4M3);
    EXPECT_EQ(y.dtype(), DType::BF16);
    const FP8Meta& fwd = attention.fp8_state().forward_meta();
    EXPECT_FLOAT_EQ(fwd.scale(0), delayed_scale(q_amax, 2, 448.0f));
    EXPECT_FLOAT_EQ(fwd.scale(1), delayed_scale(k_amax, 2, 448.0f));
    EXPECT_FLOAT_EQ(fwd.scale(3), delayed_scale(v_amax, 2, 448.0f));
    EXPECT_FLOAT_EQ(fwd.scale(2), step == 0 ? 1.0f : 448.0f);  // P's amax is 1
    q_amax.push_back(amax(q));
    k_amax.push_back(amax(k));
    v_amax.push_back(amax(v));
    EXPECT_FLOAT_EQ(fwd.amax_history(0, 0), q_amax.back());
    EXPECT_FLOAT_EQ(fwd.amax_history(0, 2), 1.0f);

    ops::AttentionOptions a;
    a.causal = true;
    a.fp8.p_scale = fwd.scale(2);
    Tensor q8 = fake_quantize(q, DType::E4M3, fwd.scale(0));
    Tensor k8 = fake_quantize(k, DType::E4M3, fwd.scale(1));
    Tensor v8 = fake_quantize(v, DType::E4M3, fwd.scale(3));
    Tensor expected = Tensor::empty(q.shape(), DType::F32);
    Tensor lse = Tensor::empty({2, 4, 20, 2}, DType::F32);
    ops::flash_attention_forward(q8, k8, v8, a, expected, lse);
    EXPECT_EQ(y.to_floats(), expected.to(DType::BF16).to_floats());

    Tensor dq, dk, dv;
    attention.backward(dy, ctx, dq, dk, dv);
    const FP8Meta& bwd = attention.fp8_state().backward_meta();
    EXPECT_FLOAT_EQ(bwd.scale(1), delayed_scale(do_amax, 2, 57344.0f));
    EXPECT_FLOAT_EQ(bwd.scale(0), delayed_scale(ds_amax, 2, 57344.0f));
    do_amax.push_back(amax(dy));
    EXPECT_FLOAT_EQ(bwd.amax_history(0, 1), do_amax.back());
    a.fp8.ds_scale = bwd.scale(0);
    a.fp8.ds_format = DType::E5M2;
    float measured_ds = 0;
    a.fp8.ds_amax = &measured_ds;
    Tensor eq = Tensor::empty(q.shape(), DType::F32), ek = Tensor::empty(k.shape(), DType::F32),
           ev = Tensor::empty(v.shape(), DType::F32);
    ops::flash_attention_backward(q8, k8, v8, expected.to(DType::BF16).to(DType::F32), lse,
                                  fake_quantize(dy, DType::E5M2, bwd.scale(1)), a, eq, ek, ev);
    ds_amax.push_back(measured_ds);
    EXPECT_GT(measured_ds, 0.0f);
    EXPECT_FLOAT_EQ(bwd.amax_history(0, 0), measured_ds);
    EXPECT_EQ(dq.to_floats(), eq.to(DType::BF16).to_floats());
    EXPECT_EQ(dk.to_floats(), ek.to(DType::BF16).to_floats());
    EXPECT_EQ(dv.to_floats(), ev.to(DType::BF16).to_floats());
  }
}

// fp8_dpa is DelayedScaling's: without it, or outside fp8_autocast, attention stays exact.
TEST(DotProductAttention, Fp8WithoutDpaKeepsAttentionExact) {
  DotProductAttentionOptions o;
  o.num_attention_heads = 2;
  o.kv_channels = 8;
  DotProductAttention attention(o);
  Tensor q = random_tensor({1, 6, 2, 8}, DType::F32, 1);
  DotProductAttention::Context plain, autocast;
  Tensor y0 = attention.forward(q, q, q, plain);
  Tensor y1;
  {
    fp8_autocast scope(true, recipe::DelayedScaling{});
    y1 = attention.forward(q, q, q, autocast);
  }
  EXPECT_FALSE(autocast.fp8);
  EXPECT_EQ(y0.to_floats(), y1.to_floats());
}

TEST(TransformerLayer, Fp8DelayedScalingMatchesQuantizedReference) {
  TransformerLayerOptions o = layer_options();
  o.num_gqa_groups = 6;
  o.self_attn_mask_type = AttnMaskType::Causal;
  TransformerLayer layer(o);
  randomize(layer, 50, 0.2f);
  TransformerLayer plain(o);  // the same weights in F32, no FP8
  recipe::DelayedScaling recipe;
  recipe.fp8_format = recipe::Format::HYBRID;
  recipe.amax_history_len = 3;
  LayerNormLinear& qkv = *layer.self_attention.layernorm_qkv;
  Linear& proj = layer.self_attention.proj;
  Linear& fc1 = layer.layernorm_mlp->fc1;
  Linear& fc2 = layer.layernorm_mlp->fc2;
  std::vector<float> qkv_input_amax, qkv_weight_amax, fc2_grad_amax;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    copy_parameters(layer, plain);
    Tensor x = random_tensor({2, 7, 48}, DType::F32, 60 + step);
    Tensor dy = random_tensor({2, 7, 48}, DType::F32, 70 + step, 0.01f);
    TransformerLayer::Context ctx;
    Tensor y;
    {
      fp8_autocast scope(true, recipe);
      y = layer.forward(x, ctx);
    }
    // The scales this step used come from the amaxes of the earlier steps (window of 3).
    const FP8Meta& qkv_meta = qkv.linear.fp8_state().forward_meta();
    EXPECT_FLOAT_EQ(qkv_meta.scale(0), delayed_scale(qkv_input_amax, 3, 448.0f));
    EXPECT_FLOAT_EQ(qkv_meta.scale(1), delayed_scale(qkv_weight_amax, 3, 448.0f));
    Norm::Context norm_ctx;
    Tensor ln1 = qkv.norm.forward(x, norm_ctx);
    qkv_input_amax.push_back(amax(ln1));
    qkv_weight_amax.push_back(amax(qkv.linear.weight.value));
    EXPECT_FLOAT_EQ(qkv_meta.amax_history(0, 0), qkv_input_amax.back());  // this step's, row 0
    EXPECT_FLOAT_EQ(qkv_meta.amax_history(0, 1), qkv_weight_amax.back());

    // Each GEMM, fed the inputs the layer produced, against Q(input) Q(W)^T + b in FP64 with
    // the scales its FP8 state holds: equal to FP32 rounding.
    const int64_t N = 14;
    auto input_scale = [](Linear& l) { return l.fp8_state().forward_meta().scale(0); };
    auto weight_scale = [](Linear& l) { return l.fp8_state().forward_meta().scale(1); };
    // FP8 keeps neither q, k, v nor the activation: backward recomputes them bit for bit (q, k,
    // v from the projection's kept FP8 input, the activation from FC1's output).
    const auto& core = ctx.self_attention.core;
    EXPECT_TRUE(ctx.self_attention.replay_qkv);
    EXPECT_FALSE(core.q.defined() || core.k.defined() || core.v.defined());
    EXPECT_FALSE(ctx.mlp.activation.defined());
    Tensor fused = qkv.linear.replay_forward(ctx.self_attention.layernorm_input.linear);
    Tensor expected_qkv = quantized_linear(ln1, input_scale(qkv.linear), qkv.linear.weight.value,
                                           weight_scale(qkv.linear), &qkv.linear.bias.value);
    EXPECT_LE(scaled_error(fused, expected_qkv), 1e-5);
    Tensor attention_out = core.out.reshape({N, 48});
    Tensor projected = quantized_linear(attention_out, input_scale(proj), proj.weight.value,
                                        weight_scale(proj), &proj.bias.value);
    Tensor h1 = ctx.mlp.input.reshape({N, 48});
    EXPECT_LE(scaled_error(h1, modules_detail::add(projected, x.reshape({N, 48}))), 1e-5);
    Norm::Context norm2_ctx;
    Tensor ln2 = layer.layernorm_mlp->norm.forward(h1, norm2_ctx);
    Tensor expected_fc1 =
        quantized_linear(ln2, input_scale(fc1), fc1.weight.value, weight_scale(fc1), nullptr);
    EXPECT_LE(scaled_error(ctx.mlp.fc1_output.reshape({N, 80}), expected_fc1), 1e-5);
    Tensor activation = Tensor::empty({N, 80}, DType::F32);
    ops::activation_forward(o.activation, ctx.mlp.fc1_output.reshape({N, 80}), &fc1.bias.value,
                            activation);
    Tensor expected_y =
        modules_detail::add(quantized_linear(activation, input_scale(fc2), fc2.weight.value,
                                             weight_scale(fc2), &fc2.bias.value),
                            h1);
    EXPECT_LE(scaled_error(y.reshape({N, 48}), expected_y), 1e-5);

    // Backward: FC2's weight gradient is Q_e5m2(dy)^T Q_e4m3(activation) (HYBRID), with the
    // gradient scale from the earlier steps' amax(dy).
    layer.zero_grad();
    Tensor dx = layer.backward(dy, ctx);
    const float grad_scale = fc2.fp8_state().backward_meta().scale(0);
    EXPECT_FLOAT_EQ(grad_scale, delayed_scale(fc2_grad_amax, 3, 57344.0f));
    fc2_grad_amax.push_back(amax(dy));
    EXPECT_FLOAT_EQ(fc2.fp8_state().backward_meta().amax_history(0, 0), fc2_grad_amax.back());
    Tensor dyq = fake_quantize(dy, DType::E5M2, grad_scale);
    Tensor aq = fake_quantize(activation, DType::E4M3, input_scale(fc2));
    Tensor expected_dw = Tensor::empty({48, 80}, DType::F32);
    gemm_reference(dyq, aq, expected_dw, true, false);
    EXPECT_LE(scaled_error(fc2.weight.grad, expected_dw), 1e-5);

    // The whole layer in FP8 stays near the F32 layer, but is not it.
    TransformerLayer::Context plain_ctx;
    Tensor y_plain = plain.forward(x, plain_ctx);
    Tensor dx_plain = plain.backward(dy, plain_ctx);
    // E4M3 rounds each GEMM input by up to 2^-4 relative, E5M2 gradients by up to 2^-3, and
    // delayed scales let a value that outgrew the window's amax saturate; chained through the
    // layer that is ~3% RMS (measured 2.7-3.9% forward, 2.7-3.7% input gradient).
    EXPECT_GT(scaled_error(y, y_plain), 1e-3);  // it really ran in FP8
    EXPECT_LT(relative_rms(y, y_plain), 0.06);
    EXPECT_LT(relative_rms(dx, dx_plain), 0.08);

    // An SGD step, so the weight amaxes (and next step's weight scales) move.
    for (Parameter* p : layer.parameters()) {
      float* v = p->value.data<float>();
      const float* g = p->grad.data<float>();
      for (int64_t i = 0; i < p->value.numel(); ++i) v[i] -= 0.5f * g[i];
    }
    layer.on_parameters_updated();
  }
  EXPECT_NE(qkv_weight_amax.front(), qkv_weight_amax.back());
}

// ---------------------------------------------------------------------------------------------

TEST(TransformerLayer, CheckpointEqualsNoCheckpointBitwise) {
  for (int mode = 0; mode < 3; ++mode) {  // bf16, fp8, fp8 with FP8 attention
    const bool fp8 = mode > 0;
    recipe::DelayedScaling fp8_recipe;
    fp8_recipe.fp8_dpa = mode == 2;
    SCOPED_TRACE(mode == 0 ? "bf16" : mode == 1 ? "fp8" : "fp8 + fp8_dpa");
    TransformerLayerOptions o = layer_options();
    o.layer_type = LayerType::Decoder;
    o.hidden_dropout = 0.1f;
    o.attention_dropout = 0.2f;
    o.rope = true;
    o.qk_norm = true;
    o.seed = 7;
    TransformerLayer plain(o);
    o.checkpoint = true;
    TransformerLayer recomputed(o);
    randomize(plain, 80);
    copy_parameters(plain, recomputed);
    for (int step = 0; step < 3; ++step) {
      Tensor x = random_tensor({2, 8, 48}, DType::BF16, 90 + step);
      Tensor encoder = random_tensor({2, 6, 48}, DType::BF16, 95 + step);
      Tensor dy = random_tensor({2, 8, 48}, DType::BF16, 100 + step);
      TransformerLayer::Context a, b;
      Tensor ya, yb;
      {
        fp8_autocast scope(fp8, fp8_recipe);
        ya = plain.forward(x, a, &encoder);
        yb = recomputed.forward(x, b, &encoder);
      }
      EXPECT_TRUE(b.recompute);
      EXPECT_FALSE(b.self_attention.core.q.defined());  // nothing but the inputs was kept
      EXPECT_FALSE(b.mlp.activation.defined());
      Tensor da, db;
      Tensor dxa = plain.backward(dy, a, &da);
      Tensor dxb = recomputed.backward(dy, b, &db);
      EXPECT_EQ(ya.to_floats(), yb.to_floats());
      EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
      EXPECT_EQ(da.to_floats(), db.to_floats());
      std::vector<Parameter*> pa = plain.parameters(), pb = recomputed.parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_EQ(pa[i]->grad.to_floats(), pb[i]->grad.to_floats()) << pa[i]->name;
      }
    }
  }
}

// Pipeline schedules run a later micro-batch's forward before an earlier one's backward: the
// recomputation must quantize with the scales its own forward used (not those the later
// forward moved to) and leave the live amax histories alone. Micro-batch 1 is 16x larger, so
// its forward changes the delayed scales a lot.
TEST(TransformerLayer, CheckpointReplaysItsForwardsFp8ScalesAcrossMicroBatches) {
  for (const bool dpa : {false, true}) {
    SCOPED_TRACE(dpa ? "fp8_dpa" : "fp8");
    recipe::DelayedScaling fp8_recipe;
    fp8_recipe.fp8_dpa = dpa;
    TransformerLayerOptions o = layer_options();
    o.seed = 3;
    TransformerLayer plain(o);
    o.checkpoint = true;
    TransformerLayer recomputed(o);
    randomize(plain, 81);
    copy_parameters(plain, recomputed);
    for (int step = 0; step < 3; ++step) {
      Tensor x[2], dy[2];
      for (int m = 0; m < 2; ++m) {
        std::vector<float> v =
            random_tensor({2, 8, 48}, DType::F32, 110 + 2 * step + m).to_floats();
        for (float& e : v) e *= m == 1 ? 16.0f : 1.0f;
        x[m] = Tensor::from_floats({2, 8, 48}, v).to(DType::BF16);
        dy[m] = random_tensor({2, 8, 48}, DType::BF16, 120 + 2 * step + m);
      }
      TransformerLayer::Context a[2], b[2];
      Tensor ya[2], yb[2];
      for (int m = 0; m < 2; ++m) {
        fp8_autocast scope(true, fp8_recipe);
        ya[m] = plain.forward(x[m], a[m]);
        yb[m] = recomputed.forward(x[m], b[m]);
      }
      for (int m = 0; m < 2; ++m) {
        SCOPED_TRACE("step " + std::to_string(step) + ", micro-batch " + std::to_string(m));
        Tensor dxa = plain.backward(dy[m], a[m]);
        Tensor dxb = recomputed.backward(dy[m], b[m]);
        EXPECT_EQ(ya[m].to_floats(), yb[m].to_floats());
        EXPECT_EQ(dxa.to_floats(), dxb.to_floats());
      }
      std::vector<Parameter*> pa = plain.parameters(), pb = recomputed.parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_EQ(pa[i]->grad.to_floats(), pb[i]->grad.to_floats()) << pa[i]->name;
      }
      const std::vector<Fp8State*> sa = plain.fp8_states(), sb = recomputed.fp8_states();
      for (size_t i = 0; i < sa.size(); ++i) {
        EXPECT_EQ(sa[i]->forward_meta().amax_history_data(),
                  sb[i]->forward_meta().amax_history_data());
        EXPECT_EQ(sa[i]->forward_meta().scales(), sb[i]->forward_meta().scales());
      }
    }
  }
}

TEST(TransformerLayer, DropoutIsDeterministicGivenTheSeed) {
  TransformerLayerOptions o = layer_options();
  o.hidden_dropout = 0.2f;
  o.attention_dropout = 0.3f;
  o.seed = 11;
  TransformerLayer a(o), b(o);
  o.seed = 12;
  TransformerLayer other_seed(o);
  o.hidden_dropout = o.attention_dropout = 0.0f;
  TransformerLayer no_dropout(o);
  randomize(a, 110);
  copy_parameters(a, b);
  copy_parameters(a, other_seed);
  copy_parameters(a, no_dropout);
  Tensor x = random_tensor({2, 7, 48}, DType::F32, 111);
  Tensor dy = random_tensor({2, 7, 48}, DType::F32, 112);
  TransformerLayer::Context ca, cb, cc, cd;
  Tensor ya = a.forward(x, ca), yb = b.forward(x, cb);
  Tensor yc = other_seed.forward(x, cc), yd = no_dropout.forward(x, cd);
  EXPECT_EQ(ya.to_floats(), yb.to_floats());
  EXPECT_NE(ya.to_floats(), yc.to_floats());
  EXPECT_NE(ya.to_floats(), yd.to_floats());
  EXPECT_EQ(a.backward(dy, ca).to_floats(), b.backward(dy, cb).to_floats());
  // The next step draws fresh masks.
  TransformerLayer::Context next;
  EXPECT_NE(a.forward(x, next).to_floats(), ya.to_floats());
}

// The attention context holds q, k, v, out and the log-sum-exp: O(T), never T x T. With H = 8
// heads of D = 4, a T x T score matrix would dominate at T = 256 (8 * 256^2 * 4 bytes = 2 MiB
// against ~1 MiB of O(T) activations) and make the peak grow ~6x from T = 64; linear is at most 4x
// (measured 3.0x).
TEST(TransformerLayer, PeakMemoryIsLinearInSequenceLength) {
  TransformerLayerOptions o = layer_options();
  o.hidden_size = 32;
  o.ffn_hidden_size = 64;
  o.num_attention_heads = 8;
  o.num_gqa_groups = 8;
  TransformerLayer layer(o);
  auto peak_extra = [&](int64_t T) {
    Tensor x = random_tensor({1, T, 32}, DType::F32, 120);
    Tensor dy = random_tensor({1, T, 32}, DType::F32, 121);
    reset_peak_memory();
    const int64_t before = memory_stats().current_bytes;
    TransformerLayer::Context ctx;
    Tensor y = layer.forward(x, ctx);
    Tensor dx = layer.backward(dy, ctx);
    return memory_stats().peak_bytes - before;
  };
  const int64_t small = peak_extra(64), large = peak_extra(256);
  ASSERT_GT(small, 0);
  const double ratio = static_cast<double>(large) / static_cast<double>(small);
  EXPECT_LT(ratio, 4.5) << small << " bytes at T=64, " << large << " at T=256";
  EXPECT_LT(large, 8 * 256 * 256 * 4) << "the peak is as large as one T x T score matrix";
}

// ---------------------------------------------------------------------------------------------

TEST(GroupedLinear, EqualsSeparateLinearsAndTorch) {
  const std::vector<int64_t> splits = {5, 0, 9, 3};
  GroupedLinearOptions o;
  o.num_gemms = 4;
  o.in_features = 24;
  o.out_features = 40;
  o.name = "experts";
  GroupedLinear grouped(o);
  randomize(grouped, 130);
  std::vector<std::unique_ptr<Linear>> linears;
  for (int i = 0; i < 4; ++i) {
    LinearOptions l;
    l.in_features = 24;
    l.out_features = 40;
    l.name = "expert" + std::to_string(i);
    linears.push_back(std::make_unique<Linear>(l));
    linears[i]->weight.value.copy_from(grouped.weights[i].value);
    linears[i]->bias.value.copy_from(grouped.biases[i].value);
    linears[i]->on_parameters_updated();
  }
  for (bool fp8 : {false, true}) {
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE(std::string(fp8 ? "fp8" : "f32") + " step " + std::to_string(step));
      Tensor x = random_tensor({17, 24}, DType::F32, 131 + step, 1.0f + step);
      Tensor dy = random_tensor({17, 40}, DType::F32, 133 + step);
      grouped.zero_grad();
      GroupedLinear::Context ctx;
      Tensor y, dx;
      {
        fp8_autocast scope(fp8, recipe::DelayedScaling{});
        y = grouped.forward(x, splits, ctx);
      }
      dx = grouped.backward(dy, ctx);
      int64_t begin = 0;
      for (int i = 0; i < 4; ++i) {
        const int64_t end = begin + splits[i];
        if (end == begin) {
          EXPECT_EQ(max_abs(grouped.weights[i].grad), 0.0);
          EXPECT_EQ(max_abs(grouped.biases[i].grad), 0.0);
          continue;
        }
        linears[i]->zero_grad();
        Linear::Context lctx;
        Tensor yi;
        {
          fp8_autocast scope(fp8, recipe::DelayedScaling{});
          yi = linears[i]->forward(x.slice_rows(begin, end).clone(), lctx);
        }
        Tensor dxi = linears[i]->backward(dy.slice_rows(begin, end).clone(), lctx);
        EXPECT_EQ(y.slice_rows(begin, end).to_floats(), yi.to_floats()) << "group " << i;
        EXPECT_EQ(dx.slice_rows(begin, end).to_floats(), dxi.to_floats()) << "group " << i;
        EXPECT_EQ(grouped.weights[i].grad.to_floats(), linears[i]->weight.grad.to_floats());
        EXPECT_EQ(grouped.biases[i].grad.to_floats(), linears[i]->bias.grad.to_floats());
        if (fp8) {
          EXPECT_EQ(grouped.fp8_state().forward_meta().scale(2 * i),
                    linears[i]->fp8_state().forward_meta().scale(0));
        }
        begin = end;
      }
      if (!fp8) {
        TensorMap in = parameter_map(grouped, "experts.");
        in["x"] = x;
        in["dy"] = dy;
        TensorMap torch = testing::run_torch("grouped_linear", in, "{\"m_splits\": [5, 0, 9, 3]}");
        expect_close(y, torch, "y", kF32Tolerance);
        expect_close(dx, torch, "x.grad", kF32Tolerance);
        expect_grads(grouped, "experts.", torch, kF32Tolerance);
      }
    }
  }
  GroupedLinear::Context ctx;
  EXPECT_THROW(grouped.forward(random_tensor({16, 24}, DType::F32, 1), splits, ctx), Error);
  EXPECT_THROW(grouped.forward(random_tensor({17, 24}, DType::F32, 1), {17, 0}, ctx), Error);
}

}  // namespace
}  // namespace octet
