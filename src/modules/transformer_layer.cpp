// TransformerLayer: self-attention, cross-attention (decoder layers) and the MLP, each joined
// to its residual by bias_dropout_add, in TransformerEngine's arrangement of pre-norm,
// post-norm (output_layernorm) and post-layernorm residuals. With `checkpoint` only the
// inputs are kept and backward replays the forward with the same FP8 scales and dropout masks.
#include <utility>

#include "modules/common.h"
#include "modules/tensor_columns.h"
#include "octet/ops/dropout.h"
#include "octet/ops/elementwise.h"

namespace octet {

using modules_detail::add;

MultiheadAttentionOptions TransformerLayer::attention_options(const TransformerLayerOptions& o,
                                                              bool cross) {
  MultiheadAttentionOptions a;
  a.hidden_size = o.hidden_size;
  a.num_attention_heads = o.num_attention_heads;
  a.kv_channels = o.kv_channels;
  a.num_gqa_groups = o.num_gqa_groups;
  a.attention_dropout = o.attention_dropout;
  a.layernorm_epsilon = o.layernorm_epsilon;
  a.normalization = o.normalization;
  a.zero_centered_gamma = o.zero_centered_gamma;
  // Post-norm layers normalize the output instead of the self-attention input.
  a.input_layernorm = cross || !o.output_layernorm;
  a.attention_type = cross ? AttentionType::Cross : AttentionType::Self;
  a.attn_mask_type = cross ? o.enc_dec_attn_mask_type : o.self_attn_mask_type;
  a.window_size = cross ? std::pair<int64_t, int64_t>{-1, -1} : o.window_size;
  a.softmax_scale = o.softmax_scale;
  a.bias = o.bias;
  a.return_bias = true;  // the bias is added in bias_dropout_add
  a.rope = o.rope && !cross;
  a.rope_theta = o.rope_theta;
  a.rotary_percent = o.rotary_percent;
  a.rotary_dim = o.rotary_dim;
  a.rotary_interleaved = o.rotary_interleaved;
  a.qk_norm = o.qk_norm;
  a.qk_norm_type = o.qk_norm_type;
  a.qk_norm_eps = o.qk_norm_eps;
  a.qk_norm_before_rope = o.qk_norm_before_rope;
  a.sequence_parallel = o.sequence_parallel;
  a.init_std = o.init_std;
  a.output_init_std = o.output_init_std;
  a.params_dtype = o.params_dtype;
  a.seed = o.seed * 4 + (cross ? 2 : 1);
  a.name = o.name + (cross ? ".inter_attention" : ".self_attention");
  return a;
}

LayerNormMLPOptions TransformerLayer::mlp_options(const TransformerLayerOptions& o) {
  LayerNormMLPOptions m;
  m.hidden = o.hidden_size;
  m.ffn_hidden = o.ffn_hidden_size;
  m.activation = o.activation;
  m.norm.hidden = o.hidden_size;
  m.norm.kind = o.normalization;
  m.norm.eps = o.layernorm_epsilon;
  m.norm.zero_centered_gamma = o.zero_centered_gamma;
  m.norm.name = o.name + ".layernorm_mlp.norm";
  m.bias = o.bias;
  m.checkpoint = false;  // the layer's own checkpoint covers the MLP
  m.sequence_parallel = o.sequence_parallel;
  m.init_std = o.init_std;
  m.output_init_std = o.output_init_std;
  m.seed = o.seed * 4 + 3;
  m.name = o.name + ".layernorm_mlp";
  return m;
}

MoELayerOptions TransformerLayer::moe_options(const TransformerLayerOptions& o) {
  MoELayerOptions m = o.moe;
  m.hidden = o.hidden_size;
  m.activation = o.activation;
  m.norm.hidden = o.hidden_size;
  m.norm.kind = o.normalization;
  m.norm.eps = o.layernorm_epsilon;
  m.norm.zero_centered_gamma = o.zero_centered_gamma;
  m.norm.name = o.name + ".moe.norm";
  m.bias = o.bias;
  m.init_std = o.init_std;
  m.output_init_std = o.output_init_std;
  m.seed = o.seed * 4 + 3;
  m.name = o.name + ".moe";
  m.sequence_parallel = o.sequence_parallel;
  return m;
}

namespace {

const TransformerLayerOptions& checked(const TransformerLayerOptions& o, Communicator* tp) {
  OCTET_CHECK(tp == nullptr || o.hidden_dropout == 0.0f, o.name,
              ": hidden dropout under tensor parallelism is not supported yet, got ",
              o.hidden_dropout);
  OCTET_CHECK(o.hidden_size > 0 && o.ffn_hidden_size > 0, o.name,
              ": hidden_size and ffn_hidden_size must be positive, got ", o.hidden_size, " and ",
              o.ffn_hidden_size);
  OCTET_CHECK(o.hidden_dropout >= 0.0f && o.hidden_dropout < 1.0f, o.name,
              ": hidden_dropout expected in [0, 1), got ", o.hidden_dropout);
  OCTET_CHECK(!o.parallel_attention_mlp || o.layer_type == LayerType::Encoder, o.name,
              ": parallel_attention_mlp needs an encoder layer");
  OCTET_CHECK(!o.parallel_attention_mlp || !o.apply_residual_connection_post_layernorm, o.name,
              ": parallel_attention_mlp does not combine with post-layernorm residuals");
  return o;
}

}  // namespace

TransformerLayer::TransformerLayer(const TransformerLayerOptions& options, Communicator* tp,
                                   Communicator* ep)
    : self_attention(attention_options(checked(options, tp), false), tp), options_(options) {
  if (options.moe.num_experts > 0) {
    moe.emplace(moe_options(options), tp, ep);
  } else {
    layernorm_mlp.emplace(mlp_options(options), tp);
  }
  if (options.layer_type == LayerType::Decoder)
    inter_attention.emplace(attention_options(options, true), tp);
  if (options.output_layernorm) {
    NormOptions n;
    n.hidden = options.hidden_size;
    n.kind = options.normalization;
    n.eps = options.layernorm_epsilon;
    n.zero_centered_gamma = options.zero_centered_gamma;
    n.name = options.name + ".layernorm";
    layernorm.emplace(n);
    for (Parameter* p : layernorm->parameters()) {
      p->shard.sequence_parallel = tp != nullptr && options.sequence_parallel;
    }
  }
}

void TransformerLayer::set_overlap_gather(bool on) {
  if (self_attention.layernorm_qkv) self_attention.layernorm_qkv->linear.set_overlap_gather(on);
  if (self_attention.qkv) self_attention.qkv->set_overlap_gather(on);
  if (layernorm_mlp) layernorm_mlp->fc1.set_overlap_gather(on);
}

Norm& TransformerLayer::mlp_norm() {
  return moe ? moe->norm : layernorm_mlp->norm;
}

Tensor TransformerLayer::mlp_forward(const Tensor& x, Context& ctx) {
  return moe ? moe->forward(x, ctx.moe) : layernorm_mlp->forward(x, ctx.mlp);
}

Tensor TransformerLayer::mlp_backward(const Tensor& dy, Context& ctx) {
  return moe ? moe->backward(dy, ctx.moe) : layernorm_mlp->backward(dy, ctx.mlp);
}

void TransformerLayer::collect_parameters(std::vector<Parameter*>& out) {
  self_attention.collect_parameters(out);
  if (inter_attention) inter_attention->collect_parameters(out);
  if (moe) {
    moe->collect_parameters(out);
  } else {
    layernorm_mlp->collect_parameters(out);
  }
  if (layernorm) layernorm->collect_parameters(out);
}

void TransformerLayer::on_parameters_updated() {
  self_attention.on_parameters_updated();
  if (inter_attention) inter_attention->on_parameters_updated();
  if (moe) {
    moe->on_parameters_updated();
  } else {
    layernorm_mlp->on_parameters_updated();
  }
}

std::vector<Fp8State*> TransformerLayer::fp8_states() {
  std::vector<Fp8State*> states = self_attention.fp8_states();
  if (inter_attention) {
    for (Fp8State* s : inter_attention->fp8_states()) states.push_back(s);
  }
  if (moe) {
    for (Fp8State* s : moe->fp8_states()) states.push_back(s);
  } else {
    states.push_back(&layernorm_mlp->fc1.fp8_state());
    states.push_back(&layernorm_mlp->fc2.fp8_state());
  }
  return states;
}

void TransformerLayer::run_forward(const Tensor& x, const Tensor* encoder_output, Context& ctx,
                                   Tensor& out) {
  const auto& o = options_;
  const bool post = o.apply_residual_connection_post_layernorm;
  const Tensor* lengths = ctx.lengths.defined() ? &ctx.lengths : nullptr;
  const Tensor* encoder_lengths = ctx.encoder_lengths.defined() ? &ctx.encoder_lengths : nullptr;
  // residual + dropout(branch + bias), each call with fresh dropout offsets.
  auto bias_dropout_add = [&](const Tensor& branch, const Tensor* bias, const Tensor& residual,
                              uint64_t& offset) {
    offset = dropout_offset_;
    dropout_offset_ += static_cast<uint64_t>((branch.numel() + 3) / 4);
    const Shape flat = {branch.rows(), branch.cols()};
    Tensor sum = Tensor::empty(branch.shape(), branch.dtype());
    Tensor sum_flat = sum.reshape(flat);
    ops::bias_dropout_add_forward(branch.reshape(flat), bias, residual.reshape(flat),
                                  {o.hidden_dropout, o.seed, offset}, sum_flat);
    return sum;
  };

  Tensor attention =
      self_attention.forward(x, ctx.self_attention, nullptr, lengths, lengths, ctx.seq_len,
                             ctx.self_bias.defined() ? &ctx.self_bias : nullptr);
  Tensor residual = x;
  if (post && !o.output_layernorm) {
    residual = self_attention.layernorm_qkv->norm.forward(x, ctx.self_residual_norm);
  }
  Tensor h = bias_dropout_add(attention, self_attention.output_bias(), residual,
                              ctx.attention_dropout_offset);
  if (o.parallel_attention_mlp) {
    Tensor mlp = mlp_forward(x, ctx);
    out = bias_dropout_add(mlp, nullptr, h, ctx.mlp_dropout_offset);
  } else {
    if (inter_attention) {
      Tensor cross = inter_attention->forward(h, ctx.inter_attention, encoder_output, lengths,
                                              encoder_lengths, ctx.seq_len);
      residual =
          post ? inter_attention->layernorm_query->norm.forward(h, ctx.inter_residual_norm) : h;
      h = bias_dropout_add(cross, inter_attention->output_bias(), residual,
                           ctx.inter_dropout_offset);
    }
    // FC2's bias is added in its GEMM epilogue (LayerNormMLP has no return_bias).
    Tensor mlp = mlp_forward(h, ctx);
    residual = post ? mlp_norm().forward(h, ctx.mlp_residual_norm) : h;
    out = bias_dropout_add(mlp, nullptr, residual, ctx.mlp_dropout_offset);
  }
  if (layernorm) out = layernorm->forward(out, ctx.output_norm);
}

Tensor TransformerLayer::forward(const Tensor& x, Context& ctx, const Tensor* encoder_output,
                                 const Tensor* lengths, const Tensor* encoder_lengths,
                                 int64_t seq_len, const Tensor* self_bias) {
  const auto& o = options_;
  // Under sequence parallelism the attention checks x's token rows against seq_len.
  OCTET_CHECK(seq_len > 0 || (x.ndim() == 3 && x.dim(2) == o.hidden_size), o.name,
              ": input expected [B,T,C] with C=", o.hidden_size, ", got ", shape_str(x.shape()));
  OCTET_CHECK(o.layer_type == LayerType::Encoder || encoder_output != nullptr, o.name,
              ": a decoder layer needs encoder_output");
  ctx = Context{};
  ctx.seq_len = seq_len;
  if (lengths) ctx.lengths = *lengths;
  if (encoder_lengths) ctx.encoder_lengths = *encoder_lengths;
  if (self_bias) ctx.self_bias = *self_bias;
  if (fp8_enabled()) ctx.fp8_recipe = fp8_recipe();
  ctx.dropout_offset = dropout_offset_;
  ctx.self_attention_rng = self_attention.core_attention.rng_offset();
  if (inter_attention) ctx.inter_attention_rng = inter_attention->core_attention.rng_offset();
  Tensor out;
  run_forward(x, inter_attention ? encoder_output : nullptr, ctx, out);
  if (o.checkpoint) {
    Context kept;
    kept.input = x;
    if (inter_attention) kept.encoder_output = *encoder_output;
    kept.lengths = ctx.lengths;
    kept.encoder_lengths = ctx.encoder_lengths;
    kept.self_bias = ctx.self_bias;
    kept.fp8_recipe = ctx.fp8_recipe;
    kept.dropout_offset = ctx.dropout_offset;
    kept.seq_len = ctx.seq_len;
    kept.self_attention_rng = ctx.self_attention_rng;
    kept.inter_attention_rng = ctx.inter_attention_rng;
    kept.recompute = true;
    if (kept.fp8_recipe) {
      for (Fp8State* state : fp8_states()) {
        kept.fp8_forward_metas.push_back(state->forward_meta());
      }
    }
    ctx = std::move(kept);
  }
  return out;
}

Tensor TransformerLayer::forward_inference(const Tensor& x, InferenceParams& params,
                                           int64_t layer_number) {
  const auto& o = options_;
  OCTET_CHECK(x.ndim() == 3 && x.dim(2) == o.hidden_size, o.name,
              ": input expected [B,T,C] with C=", o.hidden_size, ", got ", shape_str(x.shape()));
  OCTET_CHECK(o.layer_type == LayerType::Encoder, o.name,
              ": KV-cache inference supports encoder (self-attention only) layers");
  const bool post = o.apply_residual_connection_post_layernorm;
  // residual + branch + bias: run_forward's bias_dropout_add without dropout.
  auto bias_add = [](const Tensor& branch, const Tensor* bias, const Tensor& residual) {
    const Shape flat = {branch.rows(), branch.cols()};
    Tensor sum = Tensor::empty(branch.shape(), branch.dtype());
    Tensor sum_flat = sum.reshape(flat);
    ops::bias_dropout_add_forward(branch.reshape(flat), bias, residual.reshape(flat),
                                  ops::DropoutParams{}, sum_flat);
    return sum;
  };
  Norm::Context scratch_norm;
  Context scratch;  // the MLP's
  Tensor attention = self_attention.forward_inference(x, params, layer_number);
  Tensor residual = x;
  if (post && !o.output_layernorm) {
    residual = self_attention.layernorm_qkv->norm.forward(x, scratch_norm);
  }
  Tensor h = bias_add(attention, self_attention.output_bias(), residual);
  Tensor out;
  if (o.parallel_attention_mlp) {
    out = bias_add(mlp_forward(x, scratch), nullptr, h);
  } else {
    Tensor mlp = mlp_forward(h, scratch);
    residual = post ? mlp_norm().forward(h, scratch_norm) : h;
    out = bias_add(mlp, nullptr, residual);
  }
  if (layernorm) out = layernorm->forward(out, scratch_norm);
  return out;
}

Tensor TransformerLayer::backward(const Tensor& dy, Context& ctx, Tensor* d_encoder_output,
                                  Tensor* dself_bias) {
  const auto& o = options_;
  const bool post = o.apply_residual_connection_post_layernorm;
  if (ctx.recompute) {
    // Replay the forward as it ran: its FP8 recipe with the scales frozen, its dropout
    // offsets; then put the counters back where later forwards left them.
    const uint64_t dropout_now = dropout_offset_;
    const uint64_t self_rng_now = self_attention.core_attention.rng_offset();
    const uint64_t inter_rng_now =
        inter_attention ? inter_attention->core_attention.rng_offset() : 0;
    dropout_offset_ = ctx.dropout_offset;
    self_attention.core_attention.set_rng_offset(ctx.self_attention_rng);
    if (inter_attention) inter_attention->core_attention.set_rng_offset(ctx.inter_attention_rng);
    const std::vector<Fp8State*> states = ctx.fp8_recipe ? fp8_states() : std::vector<Fp8State*>{};
    std::vector<FP8Meta> live;
    for (size_t k = 0; k < states.size(); ++k) {
      live.push_back(
          std::exchange(states[k]->mutable_forward_meta(), std::move(ctx.fp8_forward_metas.at(k))));
      states[k]->set_recomputing(true);
    }
    {
      fp8_autocast scope(ctx.fp8_recipe.has_value(),
                         ctx.fp8_recipe.value_or(recipe::DelayedScaling{}));
      Tensor input = ctx.input, encoder_output = ctx.encoder_output, unused;
      run_forward(input, inter_attention ? &encoder_output : nullptr, ctx, unused);
    }
    for (size_t k = 0; k < states.size(); ++k) {
      states[k]->mutable_forward_meta() = std::move(live[k]);
      states[k]->set_recomputing(false);
    }
    dropout_offset_ = dropout_now;
    self_attention.core_attention.set_rng_offset(self_rng_now);
    if (inter_attention) inter_attention->core_attention.set_rng_offset(inter_rng_now);
  }
  // The branch's gradient through dropout (and the fused bias's gradient into `bias`).
  auto bias_dropout_add_backward = [&](const Tensor& dout, uint64_t offset, Parameter* bias) {
    const Shape flat = {dout.rows(), dout.cols()};
    Tensor dbranch = Tensor::empty(dout.shape(), dout.dtype());
    Tensor dbranch_flat = dbranch.reshape(flat);
    Tensor dbias = bias ? Tensor::empty({dout.cols()}, DType::F32) : Tensor();
    ops::bias_dropout_add_backward(dout.reshape(flat), {o.hidden_dropout, o.seed, offset},
                                   dbranch_flat, bias ? &dbias : nullptr);
    if (bias) ops::add_scaled(dbias, 1.0f, bias->grad);
    return dbranch;
  };
  auto bias_of = [&](MultiheadAttention& attention) {
    return attention.output_bias() ? &attention.proj.bias : nullptr;
  };

  Tensor d = layernorm ? layernorm->backward(dy, ctx.output_norm) : dy;
  Tensor dh;  // gradient of the self-attention block's output h
  Tensor dx;
  if (o.parallel_attention_mlp) {
    Tensor dmlp = bias_dropout_add_backward(d, ctx.mlp_dropout_offset, nullptr);
    Tensor dx_mlp = mlp_backward(dmlp, ctx);
    dh = d;
    dx = dx_mlp;
  } else {
    Tensor dmlp = bias_dropout_add_backward(d, ctx.mlp_dropout_offset, nullptr);
    dh = mlp_backward(dmlp, ctx);
    dh = add(dh, post ? mlp_norm().backward(d, ctx.mlp_residual_norm) : d);
    if (inter_attention) {
      Tensor dcross =
          bias_dropout_add_backward(dh, ctx.inter_dropout_offset, bias_of(*inter_attention));
      Tensor d_encoder;
      Tensor dh_in = inter_attention->backward(dcross, ctx.inter_attention, &d_encoder);
      if (d_encoder_output) *d_encoder_output = d_encoder;
      dh = add(
          dh_in,
          post ? inter_attention->layernorm_query->norm.backward(dh, ctx.inter_residual_norm) : dh);
    }
  }
  Tensor dattention =
      bias_dropout_add_backward(dh, ctx.attention_dropout_offset, bias_of(self_attention));
  Tensor dx_attention =
      self_attention.backward(dattention, ctx.self_attention, nullptr, dself_bias);
  dx = dx.defined() ? add(dx, dx_attention) : dx_attention;
  if (post && !o.output_layernorm) {
    dx = add(dx, self_attention.layernorm_qkv->norm.backward(dh, ctx.self_residual_norm));
  } else {
    dx = add(dx, dh);
  }
  ctx = Context{};
  return dx;
}

}  // namespace octet
