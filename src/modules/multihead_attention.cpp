// DotProductAttention (the fused flash-attention kernels as a module) and
// MultiheadAttention: projections, the fused QKV split, QK-norm, RoPE, attention, output
// projection, each with its hand-written backward.
#include "octet/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "modules/common.h"
#include "modules/context_parallel.h"
#include "modules/tensor_columns.h"
#include "octet/ops/rope.h"

namespace octet {

using modules_detail::join_columns;
using modules_detail::split_columns;

DotProductAttention::DotProductAttention(const DotProductAttentionOptions& options)
    : options_(options) {
  if (options_.num_gqa_groups == 0) options_.num_gqa_groups = options_.num_attention_heads;
  const auto& o = options_;
  OCTET_CHECK(o.num_attention_heads > 0 && o.kv_channels > 0, o.name,
              ": num_attention_heads and kv_channels must be positive, got ", o.num_attention_heads,
              " and ", o.kv_channels);
  OCTET_CHECK(o.num_gqa_groups > 0 && o.num_attention_heads % o.num_gqa_groups == 0, o.name,
              ": num_gqa_groups must divide num_attention_heads=", o.num_attention_heads, ", got ",
              o.num_gqa_groups);
  OCTET_CHECK(o.attention_dropout >= 0.0f && o.attention_dropout < 1.0f, o.name,
              ": attention_dropout expected in [0, 1), got ", o.attention_dropout);
}

CpCommType parse_cp_comm_type(const std::string& name) {
  if (name == "p2p") return CpCommType::P2P;
  if (name == "a2a") return CpCommType::A2A;
  fail(detail::concat("--cp-comm-type expected p2p or a2a, got '", name, "'"));
}

void DotProductAttention::set_context_parallel(Communicator* group, CpCommType type) {
  const auto& o = options_;
  if (group != nullptr && group->size() > 1) {
    OCTET_CHECK(
        o.attn_mask_type == AttnMaskType::Causal || o.attn_mask_type == AttnMaskType::NoMask,
        o.name, ": context parallelism needs a causal mask or none");
    OCTET_CHECK(o.window_size.first < 0 && o.window_size.second < 0, o.name,
                ": context parallelism with a sliding window is not supported");
    OCTET_CHECK(o.attention_dropout == 0.0f, o.name,
                ": context parallelism needs attention_dropout 0 (got ", o.attention_dropout, ")");
    OCTET_CHECK(type != CpCommType::A2A || (o.num_attention_heads % group->size() == 0 &&
                                            o.num_gqa_groups % group->size() == 0),
                o.name, ": context parallelism (a2a) needs ", o.num_attention_heads, " query and ",
                o.num_gqa_groups, " key/value heads divisible by CP=", group->size(),
                " (use --cp-comm-type p2p)");
  }
  cp_ = group;
  cp_type_ = type;
}

bool DotProductAttention::context_parallel() const {
  return cp_ != nullptr && cp_->size() > 1;
}

namespace {

bool is_padding(AttnMaskType type) {
  return type == AttnMaskType::Padding || type == AttnMaskType::PaddingCausal;
}

bool is_causal(AttnMaskType type) {
  return type == AttnMaskType::Causal || type == AttnMaskType::PaddingCausal;
}

ops::AttentionOptions kernel_options(const DotProductAttentionOptions& o,
                                     const DotProductAttention::Context& ctx) {
  ops::AttentionOptions a;
  a.softmax_scale = o.softmax_scale;
  a.causal = is_causal(o.attn_mask_type);
  a.window_left = o.window_size.first;
  a.window_right = o.window_size.second;
  a.q_lengths = ctx.q_lengths.defined() ? &ctx.q_lengths : nullptr;
  a.kv_lengths = ctx.kv_lengths.defined() ? &ctx.kv_lengths : nullptr;
  a.bias = ctx.bias.defined() ? &ctx.bias : nullptr;
  a.dropout = o.attention_dropout;
  a.seed = o.seed;
  a.offset = ctx.rng_offset;
  return a;
}

}  // namespace

Tensor DotProductAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Context& ctx,
                                    const Tensor* q_lengths, const Tensor* kv_lengths,
                                    const Tensor* bias) {
  const auto& o = options_;
  OCTET_CHECK(q.ndim() == 4 && q.dim(2) == o.num_attention_heads && q.dim(3) == o.kv_channels,
              o.name, ": q expected [B,T,H,D] with H=", o.num_attention_heads,
              ", D=", o.kv_channels, ", got ", shape_str(q.shape()));
  OCTET_CHECK(k.ndim() == 4 && k.dim(0) == q.dim(0) && k.dim(2) == o.num_gqa_groups &&
                  k.dim(3) == o.kv_channels && v.shape() == k.shape(),
              o.name, ": k and v expected [B,S,Hkv,D]=[", q.dim(0), ",S,", o.num_gqa_groups, ",",
              o.kv_channels, "], got ", shape_str(k.shape()), " and ", shape_str(v.shape()));
  ctx = Context{};
  if (is_padding(o.attn_mask_type)) {
    OCTET_CHECK(q_lengths != nullptr || kv_lengths != nullptr, o.name,
                ": a padding mask needs q_lengths or kv_lengths");
    if (q_lengths) ctx.q_lengths = *q_lengths;
    if (kv_lengths) ctx.kv_lengths = *kv_lengths;
  }
  if (bias) {
    check_dtype(*bias, DType::F32, o.name + ": bias");
    check_shape(*bias, {q.dim(2), q.dim(1), k.dim(1)}, o.name + ": bias", "H,T,S");
    ctx.bias = *bias;
  }
  ctx.rng_offset = rng_offset_++;
  if (fp8_enabled()) {
    const auto* delayed = std::get_if<recipe::DelayedScaling>(&fp8_recipe());
    OCTET_CHECK(!(delayed && delayed->fp8_dpa && bias), o.name,
                ": FP8 attention (fp8_dpa) with an attention bias is not supported");
    OCTET_CHECK(!(delayed && delayed->fp8_dpa && context_parallel()), o.name,
                ": FP8 attention (fp8_dpa) under context parallelism is not supported");
    if (delayed && delayed->fp8_dpa) return forward_fp8(q, k, v, ctx);
  }
  if (context_parallel()) {
    OCTET_CHECK(!bias, o.name, ": an attention bias under context parallelism is not supported");
    ctx.dtype = q.dtype();
    return modules_detail::cp_attention_forward(q, k, v, kernel_options(o, ctx), *cp_, cp_type_,
                                                ctx);
  }
  Tensor out = Tensor::empty(q.shape(), q.dtype());
  // lse as hi + lo: the backward's probabilities then keep F32 accuracy at any score magnitude.
  ctx.lse = Tensor::empty({q.dim(0), q.dim(2), q.dim(1), 2}, DType::F32);
  ops::flash_attention_forward(q, k, v, kernel_options(o, ctx), out, ctx.lse);
  ctx.q = q;
  ctx.k = k;
  ctx.v = v;
  ctx.out = out;
  return out;
}

namespace {

Tensor as_rows(const Tensor& x) {  // [B,T,H,D] -> [B*T, H*D]
  return x.reshape({x.dim(0) * x.dim(1), x.dim(2) * x.dim(3)});
}

}  // namespace

Tensor DotProductAttention::forward_fp8(const Tensor& q, const Tensor& k, const Tensor& v,
                                        Context& ctx) {
  const auto& o = options_;
  fp8_.begin_forward(fp8_recipe());
  const auto format = std::get<recipe::DelayedScaling>(fp8_.recipe()).fp8_format;
  ctx.fp8 = true;
  ctx.q_shape = q.shape();
  ctx.kv_shape = k.shape();
  ctx.dtype = q.dtype();
  ctx.q8 = fp8_.input_quantizer(0).quantize(as_rows(q));
  ctx.k8 = fp8_.weight_quantizer(0).quantize(as_rows(k));
  ctx.v8 = fp8_.weight_quantizer(1).quantize(as_rows(v));
  if (fp8_stats_enabled()) {
    fp8_.record_stats(o.name, "q", as_rows(q), ctx.q8);
    fp8_.record_stats(o.name, "k", as_rows(k), ctx.k8);
    fp8_.record_stats(o.name, "v", as_rows(v), ctx.v8);
  }
  ops::AttentionOptions a = kernel_options(o, ctx);
  float p_amax = 0.0f;
  a.fp8.p_format = fp8_dtype(format, TensorRole::Input);
  a.fp8.p_scale = fp8_.input_scale(1);
  a.fp8.p_amax = &p_amax;
  Tensor out = Tensor::empty(q.shape(), DType::F32);
  ctx.lse = Tensor::empty({q.dim(0), q.dim(2), q.dim(1), 2}, DType::F32);
  ops::flash_attention_forward(ctx.q8.dequantize().reshape(q.shape()),
                               ctx.k8.dequantize().reshape(k.shape()),
                               ctx.v8.dequantize().reshape(k.shape()), a, out, ctx.lse);
  fp8_.record_input_amax(1, p_amax);
  ctx.out = q.dtype() == DType::F32 ? out : out.to(q.dtype());
  return ctx.out;
}

void DotProductAttention::backward_fp8(const Tensor& dout, Context& ctx, Tensor& dq, Tensor& dk,
                                       Tensor& dv) {
  const auto& o = options_;
  fp8_.begin_backward(fp8_.recipe());
  const auto format = std::get<recipe::DelayedScaling>(fp8_.recipe()).fp8_format;
  const Float8Tensor do8 = fp8_.grad_output_quantizer(1).quantize(as_rows(dout));
  if (fp8_stats_enabled()) fp8_.record_stats(o.name, "grad_output", as_rows(dout), do8);
  ops::AttentionOptions a = kernel_options(o, ctx);
  float ds_amax = 0.0f;
  a.fp8.p_format = fp8_dtype(format, TensorRole::Input);
  a.fp8.p_scale = fp8_.input_scale(1);
  a.fp8.ds_format = fp8_dtype(format, TensorRole::GradOutput);
  a.fp8.ds_scale = fp8_.grad_output_scale(0);
  a.fp8.ds_amax = &ds_amax;
  Tensor q = ctx.q8.dequantize().reshape(ctx.q_shape);
  Tensor k = ctx.k8.dequantize().reshape(ctx.kv_shape);
  Tensor v = ctx.v8.dequantize().reshape(ctx.kv_shape);
  Tensor out = ctx.out.dtype() == DType::F32 ? ctx.out : ctx.out.to(DType::F32);
  Tensor dq32 = Tensor::empty(ctx.q_shape, DType::F32);
  Tensor dk32 = Tensor::empty(ctx.kv_shape, DType::F32);
  Tensor dv32 = Tensor::empty(ctx.kv_shape, DType::F32);
  ops::flash_attention_backward(q, k, v, out, ctx.lse, do8.dequantize().reshape(ctx.q_shape), a,
                                dq32, dk32, dv32);
  fp8_.record_grad_output_amax(0, ds_amax);
  const bool f32 = ctx.dtype == DType::F32;
  dq = f32 ? dq32 : dq32.to(ctx.dtype);
  dk = f32 ? dk32 : dk32.to(ctx.dtype);
  dv = f32 ? dv32 : dv32.to(ctx.dtype);
  ctx = Context{};
}

void DotProductAttention::backward(const Tensor& dout, Context& ctx, Tensor& dq, Tensor& dk,
                                   Tensor& dv, Tensor* dbias) {
  OCTET_CHECK(ctx.out.defined(), options_.name, ": backward called without a forward context");
  if (ctx.fp8) {
    check_shape(dout, ctx.q_shape, options_.name + ": dout", "B,T,H,D");
    backward_fp8(dout, ctx, dq, dk, dv);
    return;
  }
  if (context_parallel()) {
    modules_detail::cp_attention_backward(dout, ctx, kernel_options(options_, ctx), *cp_, cp_type_,
                                          dq, dk, dv);
    ctx = Context{};
    return;
  }
  check_shape(dout, ctx.q.shape(), options_.name + ": dout", "B,T,H,D");
  dq = Tensor::empty(ctx.q.shape(), ctx.q.dtype());
  dk = Tensor::empty(ctx.k.shape(), ctx.k.dtype());
  dv = Tensor::empty(ctx.v.shape(), ctx.v.dtype());
  Tensor g = dout.dtype() == ctx.q.dtype() ? dout : dout.to(ctx.q.dtype());
  ops::AttentionOptions a = kernel_options(options_, ctx);
  if (ctx.bias.defined() && dbias) {
    *dbias = Tensor::empty(ctx.bias.shape(), DType::F32);
    a.dbias = dbias;
  }
  ops::flash_attention_backward(ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse, g, a, dq, dk, dv);
  ctx = Context{};
}

// ---------------------------------------------------------------------------------------------

namespace {

int64_t resolved_kv_channels(const MultiheadAttentionOptions& o) {
  OCTET_CHECK(o.hidden_size > 0 && o.num_attention_heads > 0, o.name,
              ": hidden_size and num_attention_heads must be positive, got ", o.hidden_size,
              " and ", o.num_attention_heads);
  if (o.kv_channels > 0) return o.kv_channels;
  OCTET_CHECK(o.hidden_size % o.num_attention_heads == 0, o.name, ": hidden_size ", o.hidden_size,
              " is not divisible by num_attention_heads ", o.num_attention_heads,
              "; set kv_channels");
  return o.hidden_size / o.num_attention_heads;
}

}  // namespace

DotProductAttentionOptions MultiheadAttention::core_options(const MultiheadAttentionOptions& o) {
  DotProductAttentionOptions c;
  c.num_attention_heads = o.num_attention_heads;
  c.kv_channels = resolved_kv_channels(o);
  c.num_gqa_groups = o.num_gqa_groups;
  c.attn_mask_type = o.attn_mask_type;
  c.window_size = o.window_size;
  c.attention_dropout = o.attention_dropout;
  c.softmax_scale = o.softmax_scale;
  c.seed = o.seed * 8 + 7;
  c.name = o.name + ".core_attention";
  return c;
}

namespace {

LinearOptions linear_options(const MultiheadAttentionOptions& o, const std::string& part,
                             int64_t in, int64_t out, float init_std, uint64_t seed) {
  LinearOptions l;
  l.in_features = in;
  l.out_features = out;
  l.bias = o.bias;
  l.init_std = init_std;
  l.params_dtype = o.params_dtype;
  l.seed = o.seed * 8 + seed;
  l.name = o.name + "." + part;
  return l;
}

LayerNormLinearOptions layernorm_linear_options(const MultiheadAttentionOptions& o,
                                                const LinearOptions& linear) {
  LayerNormLinearOptions l;
  l.linear = linear;
  l.norm.hidden = linear.in_features;
  l.norm.kind = o.normalization;
  l.norm.eps = o.layernorm_epsilon;
  l.norm.zero_centered_gamma = o.zero_centered_gamma;
  l.norm.name = linear.name + ".norm";
  return l;
}

NormOptions qk_norm_options(const MultiheadAttentionOptions& o, const char* part) {
  NormOptions n;
  n.hidden = resolved_kv_channels(o);
  n.kind = o.qk_norm_type;
  n.eps = o.qk_norm_eps;
  n.name = o.name + "." + part;
  return n;
}

}  // namespace

LinearOptions MultiheadAttention::proj_options(const MultiheadAttentionOptions& o) {
  LinearOptions l = linear_options(o, "proj", o.num_attention_heads * resolved_kv_channels(o),
                                   o.hidden_size, o.output_init_std, 4);
  l.return_bias = o.return_bias;
  l.parallel_mode = ParallelMode::Row;  // under a tensor-parallel group
  l.sequence_parallel = o.sequence_parallel;
  return l;
}

LayerNormLinearOptions MultiheadAttention::qkv_options(const MultiheadAttentionOptions& o) {
  const int64_t heads = o.num_attention_heads, d = resolved_kv_channels(o);
  const int64_t kv_heads = o.num_gqa_groups > 0 ? o.num_gqa_groups : heads;
  LayerNormLinearOptions l = layernorm_linear_options(
      o, linear_options(o, o.input_layernorm ? "layernorm_qkv" : "qkv", o.hidden_size,
                        (heads + 2 * kv_heads) * d, o.init_std, 1));
  // Under a tensor-parallel group: rank r holds the r-th 1/TP of the q, k and v heads.
  l.linear.parallel_mode = ParallelMode::Column;
  l.linear.sequence_parallel = o.sequence_parallel;
  l.linear.output_blocks = {heads * d, kv_heads * d, kv_heads * d};
  return l;
}

namespace {

// The options, checked for what tensor-parallel attention supports, and the core attention
// on this rank's heads.
DotProductAttentionOptions local_core_options(const MultiheadAttentionOptions& o,
                                              Communicator* tp) {
  DotProductAttentionOptions c = MultiheadAttention::core_options(o);
  if (tp == nullptr) return c;
  OCTET_CHECK(!o.qk_norm && o.attention_dropout == 0.0f, o.name,
              ": tensor-parallel attention does not support QK-norm or attention dropout yet");
  const int64_t size = tp->size(),
                kv_heads = c.num_gqa_groups > 0 ? c.num_gqa_groups : c.num_attention_heads;
  OCTET_CHECK(c.num_attention_heads % size == 0 && kv_heads % size == 0, o.name, ": ",
              c.num_attention_heads, " query heads and ", kv_heads,
              " kv heads must both be divisible by TP=", size);
  c.num_attention_heads /= size;
  c.num_gqa_groups = kv_heads / size;
  return c;
}

}  // namespace

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& options, Communicator* tp)
    : core_attention(local_core_options(options, tp)),
      proj(proj_options(options), tp),
      options_(options),
      tp_size_(tp ? tp->size() : 1),
      tp_rank_(tp ? tp->rank() : 0) {
  heads_ = core_attention.options().num_attention_heads;
  kv_heads_ = core_attention.options().num_gqa_groups;
  head_dim_ = resolved_kv_channels(options);
  const int64_t c = options.hidden_size;
  const float std = options.init_std;
  if (options.attention_type == AttentionType::Self) {
    LayerNormLinearOptions l = qkv_options(options);
    if (options.input_layernorm) {
      layernorm_qkv.emplace(l, tp);
    } else {
      qkv.emplace(l.linear, tp);
    }
  } else {
    // Under a tensor-parallel group: rank r holds the r-th 1/TP of the query heads, and of the
    // key and value heads (the encoder's output is whole on every rank, or its token rows
    // gathered under sequence parallelism).
    const int64_t whole_kv =
        options.num_gqa_groups > 0 ? options.num_gqa_groups : options.num_attention_heads;
    LinearOptions l = linear_options(options, options.input_layernorm ? "layernorm_query" : "query",
                                     c, options.num_attention_heads * head_dim_, std, 2);
    l.parallel_mode = ParallelMode::Column;
    l.sequence_parallel = options.sequence_parallel;
    if (options.input_layernorm) {
      layernorm_query.emplace(layernorm_linear_options(options, l), tp);
    } else {
      query.emplace(l, tp);
    }
    LinearOptions kv = linear_options(options, "key_value", c, 2 * whole_kv * head_dim_, std, 3);
    kv.parallel_mode = ParallelMode::Column;
    kv.sequence_parallel = options.sequence_parallel;
    kv.output_blocks = {whole_kv * head_dim_, whole_kv * head_dim_};
    key_value.emplace(kv, tp);
  }
  if (options.qk_norm) {
    q_norm.emplace(qk_norm_options(options, "q_norm"));
    k_norm.emplace(qk_norm_options(options, "k_norm"));
  }
  if (options.rope) {
    int64_t rotary = options.rotary_dim > 0
                         ? options.rotary_dim
                         : static_cast<int64_t>(head_dim_ * options.rotary_percent) / 2 * 2;
    OCTET_CHECK(rotary >= 2 && rotary % 2 == 0 && rotary <= head_dim_, options.name,
                ": rotary dimension expected even and in [2, kv_channels=", head_dim_, "], got ",
                rotary);
    options_.rotary_dim = rotary;
  }
}

void MultiheadAttention::collect_parameters(std::vector<Parameter*>& out) {
  if (layernorm_qkv) layernorm_qkv->collect_parameters(out);
  if (qkv) qkv->collect_parameters(out);
  if (layernorm_query) layernorm_query->collect_parameters(out);
  if (query) query->collect_parameters(out);
  if (key_value) key_value->collect_parameters(out);
  if (q_norm) q_norm->collect_parameters(out);
  if (k_norm) k_norm->collect_parameters(out);
  proj.collect_parameters(out);
}

void MultiheadAttention::on_parameters_updated() {
  if (layernorm_qkv) layernorm_qkv->on_parameters_updated();
  if (qkv) qkv->on_parameters_updated();
  if (layernorm_query) layernorm_query->on_parameters_updated();
  if (query) query->on_parameters_updated();
  if (key_value) key_value->on_parameters_updated();
  proj.on_parameters_updated();
}

std::vector<Fp8State*> MultiheadAttention::fp8_states() {
  std::vector<Fp8State*> out;
  if (layernorm_qkv) out.push_back(&layernorm_qkv->linear.fp8_state());
  if (qkv) out.push_back(&qkv->fp8_state());
  if (layernorm_query) out.push_back(&layernorm_query->linear.fp8_state());
  if (query) out.push_back(&query->fp8_state());
  if (key_value) out.push_back(&key_value->fp8_state());
  out.push_back(&proj.fp8_state());
  out.push_back(&core_attention.fp8_state());
  return out;
}

const Tensor* MultiheadAttention::output_bias() const {
  return options_.bias && options_.return_bias ? &proj.bias.value : nullptr;
}

namespace {

ops::RopeOptions rope_options(const MultiheadAttentionOptions& o) {
  ops::RopeOptions r;
  r.rotary_dim = o.rotary_dim;
  r.theta = o.rope_theta;
  r.layout = o.rotary_interleaved ? ops::RopeLayout::Interleaved : ops::RopeLayout::RotateHalf;
  return r;
}

// RoPE in place over x [B,T,heads,D] at the tokens' positions in the whole sequence: under
// context parallelism x holds chunks r and 2CP-1-r, each rotated from its own first position.
void rotate(Tensor& x, const ops::RopeOptions& options, const Communicator* cp, bool backward) {
  const auto apply = [backward](Tensor& part, const ops::RopeOptions& at) {
    if (backward) {
      ops::rope_backward(part, at);
    } else {
      ops::rope_forward(part, at);
    }
  };
  if (cp == nullptr || cp->size() == 1) {
    apply(x, options);
    return;
  }
  const int64_t B = x.dim(0), c = x.dim(1) / 2;
  Tensor halves = x.reshape({B * 2, c, x.dim(2), x.dim(3)});
  for (int64_t b = 0; b < B; ++b) {
    for (int half = 0; half < 2; ++half) {
      Tensor part = halves.slice_rows(2 * b + half, 2 * b + half + 1);
      ops::RopeOptions at = options;
      at.position_offset = modules_detail::cp_chunk(cp->rank(), cp->size(), half) * c;
      apply(part, at);
    }
  }
}

// The norm over D of every head: x [B,T,heads,D] seen as [B*T*heads, D].
Tensor norm_heads(Norm& norm, const Tensor& x, Norm::Context& ctx) {
  return norm.forward(x.reshape({x.numel() / x.dim(3), x.dim(3)}), ctx).reshape(x.shape());
}

Tensor norm_heads_backward(Norm& norm, const Tensor& dy, Norm::Context& ctx) {
  return norm.backward(dy.reshape({dy.numel() / dy.dim(3), dy.dim(3)}), ctx).reshape(dy.shape());
}

}  // namespace

void MultiheadAttention::split_qkv(const Tensor& fused, Context& ctx, Tensor& q, Tensor& k,
                                   Tensor& v) {
  const int64_t batch = ctx.x_shape[0], seq = ctx.x_shape[1];
  q = Tensor::empty({batch, seq, heads_, head_dim_}, fused.dtype());
  k = Tensor::empty({batch, seq, kv_heads_, head_dim_}, fused.dtype());
  v = Tensor::empty({batch, seq, kv_heads_, head_dim_}, fused.dtype());
  split_columns(fused, {&q, &k, &v});
  position_qk(ctx, q, k);
}

void MultiheadAttention::position_qk(Context& ctx, Tensor& q, Tensor& k) {
  const auto& o = options_;
  if (o.qk_norm && o.qk_norm_before_rope) {
    q = norm_heads(*q_norm, q, ctx.q_norm);
    k = norm_heads(*k_norm, k, ctx.k_norm);
  }
  if (o.rope) {
    // q and k are fresh tensors: rotated in place
    rotate(q, rope_options(o), core_attention.context_parallel_group(), false);
    rotate(k, rope_options(o), core_attention.context_parallel_group(), false);
  }
  if (o.qk_norm && !o.qk_norm_before_rope) {
    q = norm_heads(*q_norm, q, ctx.q_norm);
    k = norm_heads(*k_norm, k, ctx.k_norm);
  }
}

std::pair<int64_t, int64_t> MultiheadAttention::batch_and_seq(const Tensor& x,
                                                              int64_t seq_len) const {
  const auto& o = options_;
  if (!(proj.parallel() && proj.whole_options().sequence_parallel)) {
    OCTET_CHECK(x.ndim() == 3 && x.dim(2) == o.hidden_size, o.name,
                ": input expected [B,T,C] with C=", o.hidden_size, ", got ", shape_str(x.shape()));
    return {x.dim(0), x.dim(1)};
  }
  OCTET_CHECK(seq_len > 0, o.name, ": sequence parallelism needs seq_len (T)");
  const int64_t rows = x.rows() * tp_size_;
  OCTET_CHECK(x.ndim() == 2 && x.cols() == o.hidden_size && rows % seq_len == 0, o.name,
              ": input expected this rank's token rows [B*T/TP, C] with T=", seq_len,
              ", TP=", tp_size_, ", C=", o.hidden_size, ", got ", shape_str(x.shape()));
  return {rows / seq_len, seq_len};
}

Tensor MultiheadAttention::forward(const Tensor& x, Context& ctx, const Tensor* encoder_output,
                                   const Tensor* q_lengths, const Tensor* kv_lengths,
                                   int64_t seq_len, const Tensor* bias) {
  const auto& o = options_;
  const auto [batch, seq] = batch_and_seq(x, seq_len);
  ctx = Context{};
  ctx.x_shape = {batch, seq, o.hidden_size};
  ctx.input_shape = x.shape();
  Tensor q, k, v;
  if (o.attention_type == AttentionType::Self) {
    Tensor fused =
        layernorm_qkv ? layernorm_qkv->forward(x, ctx.layernorm_input) : qkv->forward(x, ctx.input);
    split_qkv(fused, ctx, q, k, v);
  } else {
    OCTET_CHECK(encoder_output != nullptr, o.name, ": cross-attention needs encoder_output");
    const Tensor& e = *encoder_output;
    // Its sequences' length S: whole [B,S,C], or this rank's token rows [B*S/TP, C] under
    // sequence parallelism.
    const bool sp = proj.parallel() && proj.whole_options().sequence_parallel;
    const int64_t rows = e.ndim() == 2 ? e.rows() * tp_size_ : 0;
    OCTET_CHECK(e.dtype() == x.dtype() &&
                    (sp ? e.ndim() == 2 && e.cols() == o.hidden_size && rows % batch == 0
                        : e.ndim() == 3 && e.dim(0) == batch && e.dim(2) == o.hidden_size),
                o.name, ": encoder_output expected ",
                sp ? "this rank's token rows [B*S/TP, C]" : "[B,S,C]", " with B=", batch,
                ", C=", o.hidden_size, " in ", dtype_name(x.dtype()), ", got ",
                shape_str(e.shape()), " ", dtype_name(e.dtype()));
    const int64_t S = sp ? rows / batch : e.dim(1);
    ctx.encoder_shape = {batch, S, o.hidden_size};
    q = (layernorm_query ? layernorm_query->forward(x, ctx.layernorm_input)
                         : query->forward(x, ctx.input))
            .reshape({batch, seq, heads_, head_dim_});
    Tensor fused = key_value->forward(e, ctx.key_value);
    k = Tensor::empty({batch, S, kv_heads_, head_dim_}, x.dtype());
    v = Tensor::empty({batch, S, kv_heads_, head_dim_}, x.dtype());
    split_columns(fused.reshape({batch * S, 2 * kv_heads_ * head_dim_}), {&k, &v});
    position_qk(ctx, q, k);
  }
  // Under tensor parallelism this rank's heads are rows [rank * heads_, ...) of the bias.
  Tensor head_bias;
  if (bias) {
    check_dtype(*bias, DType::F32, o.name + ": bias");
    OCTET_CHECK(bias->ndim() == 3 && bias->dim(0) == o.num_attention_heads, o.name,
                ": bias expected [H,T,S] with H=", o.num_attention_heads, ", got ",
                shape_str(bias->shape()));
    const int64_t first = heads_ == o.num_attention_heads ? 0 : tp_rank_ * heads_;
    head_bias = heads_ == o.num_attention_heads ? *bias : bias->slice_rows(first, first + heads_);
  }
  Tensor out =
      core_attention.forward(q, k, v, ctx.core, q_lengths, kv_lengths, bias ? &head_bias : nullptr);
  // (FP8 attention keeps q, k and v in FP8 itself: nothing to replay.)
  if (o.attention_type == AttentionType::Self && !ctx.core.fp8 && qkv_projection_can_replay(ctx)) {
    // The projection kept its FP8 input (a third of q, k and v's bytes, and needed for the
    // weight gradient anyway): backward recomputes q, k, v from it instead.
    ctx.replay_qkv = true;
    ctx.core.q = ctx.core.k = ctx.core.v = Tensor();
    ctx.q_norm = ctx.k_norm = Norm::Context{};
  }
  // A row-parallel projection returns [rows, C]: x's shape (its token rows under SP).
  Shape out_shape = x.shape();
  out_shape.back() = o.hidden_size;
  return proj.forward(out.reshape({batch, seq, heads_ * head_dim_}), ctx.proj).reshape(out_shape);
}

bool MultiheadAttention::qkv_projection_can_replay(const Context& ctx) const {
  return layernorm_qkv ? layernorm_qkv->linear.can_replay(ctx.layernorm_input.linear)
                       : qkv->can_replay(ctx.input);
}

namespace {

// k or v [B,T,Hkv,D] -> cache [B_max, max_T, Hkv, D] rows [offset, offset + T) of sequences
// [0, B).
void append_to_cache(const Tensor& x, Tensor& cache, int64_t offset) {
  const int64_t batch = x.dim(0), seq = x.dim(1), max_seq = cache.dim(1);
  const size_t row_bytes = static_cast<size_t>(x.dim(2) * x.dim(3)) * dtype_bytes(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(cache.raw());
  for (int64_t b = 0; b < batch; ++b) {
    std::memcpy(dst + (b * max_seq + offset) * row_bytes, src + b * seq * row_bytes,
                static_cast<size_t>(seq) * row_bytes);
  }
}

// The first `length` positions of sequence b of a cache, as [1, length, Hkv, D] (contiguous).
Tensor cached_prefix(const Tensor& cache, int64_t b, int64_t length) {
  const int64_t max_seq = cache.dim(1), kv_heads = cache.dim(2), head_dim = cache.dim(3);
  return cache.slice_rows(b, b + 1)
      .reshape({max_seq, kv_heads, head_dim})
      .slice_rows(0, length)
      .reshape({1, length, kv_heads, head_dim});
}

// Rows [begin, end) of x [1, N, heads, D] as [1, end - begin, heads, D] (a view).
Tensor token_rows(const Tensor& x, int64_t begin, int64_t end) {
  const int64_t heads = x.dim(2), head_dim = x.dim(3);
  return x.reshape({x.dim(1), heads, head_dim})
      .slice_rows(begin, end)
      .reshape({1, end - begin, heads, head_dim});
}

// Paged cache: the new rows of sequence s written to their blocks' slots; into an FP8 pool
// (scales given) each (token, head) row of D values quantized with its own scale.
void append_to_pages(const Tensor& x, Tensor& pool, Tensor* scales,
                     const InferenceParams::PagedBatch& batch, int64_t s) {
  const size_t i = static_cast<size_t>(s);
  const int64_t block_size = pool.dim(1), begin = batch.row_offsets[i];
  const int64_t rows = batch.row_offsets[i + 1] - begin, cached = batch.cached_lengths[i];
  const int64_t heads = x.dim(2), head_dim = x.dim(3);
  const std::vector<int32_t>& table = batch.block_tables[i];
  if (scales != nullptr) {
    const std::vector<float> values =
        x.reshape({x.dim(1), heads, head_dim}).slice_rows(begin, begin + rows).to_floats();
    auto* codes = static_cast<uint8_t*>(pool.raw());
    float* scale = scales->data<float>();
    const float max = fp8_max(DType::E4M3);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t p = cached + t;
      const int64_t slot = table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const float* v = values.data() + (t * heads + h) * head_dim;
        float amax = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(v[d]));
        const float scale_inv = amax > 0.0f && std::isfinite(amax) ? amax / max : 1.0f;
        scale[slot * heads + h] = scale_inv;
        uint8_t* out = codes + (slot * heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          out[d] = float_to_fp8(v[d] / scale_inv, DType::E4M3, /*saturate=*/true);
        }
      }
    }
    return;
  }
  const size_t row_bytes = static_cast<size_t>(heads * head_dim) * dtype_bytes(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(pool.raw());
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t p = cached + t;
    const int64_t slot = table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
    std::memcpy(dst + slot * row_bytes, src + (begin + t) * row_bytes, row_bytes);
  }
}

// Paged cache: the first `length` positions of sequence s gathered as [1, length, Hkv, D] in
// dtype (an FP8 pool dequantized with its scales).
Tensor gather_pages(const Tensor& pool, const Tensor* scales, const std::vector<int32_t>& table,
                    int64_t length, DType dtype) {
  const int64_t block_size = pool.dim(1), kv_heads = pool.dim(2), head_dim = pool.dim(3);
  if (scales != nullptr) {
    Tensor out = Tensor::empty({1, length, kv_heads, head_dim}, DType::F32);
    const auto* codes = static_cast<const uint8_t*>(pool.raw());
    const float* scale = scales->data<float>();
    for (int64_t p = 0; p < length; ++p) {
      const int64_t slot = table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        dequantize_fp8(codes + (slot * kv_heads + h) * head_dim, static_cast<size_t>(head_dim),
                       DType::E4M3, scale[slot * kv_heads + h],
                       out.data<float>() + (p * kv_heads + h) * head_dim);
      }
    }
    return dtype == DType::F32 ? out : out.to(dtype);
  }
  Tensor out = Tensor::empty({1, length, kv_heads, head_dim}, pool.dtype());
  const size_t row_bytes = static_cast<size_t>(kv_heads * head_dim) * dtype_bytes(pool.dtype());
  const auto* src = static_cast<const unsigned char*>(pool.raw());
  auto* dst = static_cast<unsigned char*>(out.raw());
  for (int64_t p = 0; p < length; p += block_size) {
    const int64_t n = std::min(block_size, length - p);
    std::memcpy(dst + p * row_bytes,
                src + table[static_cast<size_t>(p / block_size)] * block_size * row_bytes,
                static_cast<size_t>(n) * row_bytes);
  }
  return out;
}

}  // namespace

Tensor MultiheadAttention::forward_inference(const Tensor& x, InferenceParams& params,
                                             int64_t layer_number) {
  const auto& o = options_;
  OCTET_CHECK(o.attention_type == AttentionType::Self, o.name,
              ": the KV cache serves self-attention only");
  OCTET_CHECK(o.attn_mask_type == AttnMaskType::Causal || o.attn_mask_type == AttnMaskType::NoMask,
              o.name, ": KV-cache inference expects a causal or no mask, got a padding mask");
  OCTET_CHECK(x.ndim() == 3 && x.dim(2) == o.hidden_size && x.dim(1) > 0, o.name,
              ": input expected [B,T,C] with C=", o.hidden_size, ", got ", shape_str(x.shape()));
  OCTET_CHECK(!proj.parallel(), o.name, ": KV-cache inference runs without tensor parallelism");
  const int64_t batch = x.dim(0), seq = x.dim(1), offset = params.sequence_len_offset;
  const bool paged = params.is_paged;
  OCTET_CHECK(!paged || (batch == 1 && params.batch.sequences() > 0 &&
                         params.batch.row_offsets.back() == seq),
              o.name, ": a paged forward expects [1, N, C] packed rows, N = ",
              paged && params.batch.sequences() > 0 ? params.batch.row_offsets.back() : 0,
              " (the batch's rows), got ", shape_str(x.shape()));
  OCTET_CHECK(paged || batch <= params.max_batch_size, o.name, ": batch ", batch,
              " exceeds the cache's max_batch_size ", params.max_batch_size);
  OCTET_CHECK(paged || offset + seq <= params.max_sequence_length, o.name, ": ", offset,
              " cached + ", seq, " new tokens exceed the cache's max_sequence_length ",
              params.max_sequence_length);
  Tensor fused;
  if (layernorm_qkv) {
    LayerNormLinear::Context scratch;
    fused = layernorm_qkv->forward(x, scratch);
  } else {
    Linear::Context scratch;
    fused = qkv->forward(x, scratch);
  }
  Tensor q = Tensor::empty({batch, seq, heads_, head_dim_}, x.dtype());
  Tensor k = Tensor::empty({batch, seq, kv_heads_, head_dim_}, x.dtype());
  Tensor v = Tensor::empty({batch, seq, kv_heads_, head_dim_}, x.dtype());
  split_columns(fused, {&q, &k, &v});
  Norm::Context scratch_norm;
  if (o.qk_norm && o.qk_norm_before_rope) {
    q = norm_heads(*q_norm, q, scratch_norm);
    k = norm_heads(*k_norm, k, scratch_norm);
  }
  if (o.rope && !paged) {
    ops::RopeOptions rope = rope_options(o);
    rope.position_offset = offset;
    ops::rope_forward(q, rope);
    ops::rope_forward(k, rope);
  } else if (o.rope) {
    // Each packed sequence from its own position.
    const InferenceParams::PagedBatch& pb = params.batch;
    for (int64_t s = 0; s < pb.sequences(); ++s) {
      const size_t i = static_cast<size_t>(s);
      ops::RopeOptions rope = rope_options(o);
      rope.position_offset = pb.cached_lengths[i];
      Tensor q_s = token_rows(q, pb.row_offsets[i], pb.row_offsets[i + 1]);
      Tensor k_s = token_rows(k, pb.row_offsets[i], pb.row_offsets[i + 1]);
      ops::rope_forward(q_s, rope);
      ops::rope_forward(k_s, rope);
    }
  }
  if (o.qk_norm && !o.qk_norm_before_rope) {
    q = norm_heads(*q_norm, q, scratch_norm);
    k = norm_heads(*k_norm, k, scratch_norm);
  }
  InferenceParams::KeyValue& cache =
      params.key_value(layer_number, kv_heads_, head_dim_, x.dtype());
  const DotProductAttentionOptions& core = core_attention.options();
  ops::AttentionOptions a;
  a.softmax_scale = core.softmax_scale;
  a.causal = core.attn_mask_type == AttnMaskType::Causal;
  a.window_left = core.window_size.first;
  a.window_right = core.window_size.second;
  Tensor out = Tensor::empty({batch, seq, heads_, head_dim_}, x.dtype());
  if (paged) {
    // Each sequence's new rows written to its blocks, then its queries over its whole prefix
    // (bottom-right aligned: new query t on key cached + t).
    // Sequences with one new token (decoding) go to the paged decode kernel together, which
    // reads the pages in place; prefill chunks gather their pages for the flash kernel.
    const InferenceParams::PagedBatch& pb = params.batch;
    const bool fp8_kv = params.fp8_kv;
    std::vector<int64_t> decoding;
    int64_t widest = 0;
    for (int64_t s = 0; s < pb.sequences(); ++s) {
      const size_t i = static_cast<size_t>(s);
      append_to_pages(k, cache.key, fp8_kv ? &cache.key_scale : nullptr, pb, s);
      append_to_pages(v, cache.value, fp8_kv ? &cache.value_scale : nullptr, pb, s);
      if (pb.row_offsets[i + 1] - pb.row_offsets[i] == 1) {
        decoding.push_back(s);
        widest = std::max<int64_t>(widest, static_cast<int64_t>(pb.block_tables[i].size()));
      }
    }
    if (!decoding.empty()) {
      const int64_t n = static_cast<int64_t>(decoding.size());
      const bool all = n == pb.sequences();  // the packed rows are the decode rows
      Tensor q_rows = all ? q.reshape({n, heads_, head_dim_})
                          : Tensor::empty({n, heads_, head_dim_}, x.dtype());
      Tensor out_rows = all ? out.reshape({n, heads_, head_dim_})
                            : Tensor::empty({n, heads_, head_dim_}, x.dtype());
      Tensor tables = Tensor::zeros({n, widest}, DType::I32);
      Tensor lengths = Tensor::empty({n}, DType::I32);
      const size_t row_bytes = static_cast<size_t>(heads_ * head_dim_) * dtype_bytes(x.dtype());
      for (int64_t r = 0; r < n; ++r) {
        const size_t i = static_cast<size_t>(decoding[static_cast<size_t>(r)]);
        const std::vector<int32_t>& table = pb.block_tables[i];
        std::copy(table.begin(), table.end(), tables.data<int32_t>() + r * widest);
        lengths.data<int32_t>()[r] = static_cast<int32_t>(pb.cached_lengths[i] + 1);
        if (!all) {
          std::memcpy(static_cast<char*>(q_rows.raw()) + r * row_bytes,
                      static_cast<const char*>(q.raw()) + pb.row_offsets[i] * row_bytes, row_bytes);
        }
      }
      if (fp8_kv) {
        ops::paged_attention_decode(q_rows, cache.key, cache.value, tables, lengths, a, out_rows,
                                    &cache.key_scale, &cache.value_scale);
      } else {
        ops::paged_attention_decode(q_rows, cache.key, cache.value, tables, lengths, a, out_rows);
      }
      for (int64_t r = 0; r < n && !all; ++r) {
        const size_t i = static_cast<size_t>(decoding[static_cast<size_t>(r)]);
        std::memcpy(static_cast<char*>(out.raw()) + pb.row_offsets[i] * row_bytes,
                    static_cast<const char*>(out_rows.raw()) + r * row_bytes, row_bytes);
      }
    }
    for (int64_t s = 0; s < pb.sequences(); ++s) {
      const size_t i = static_cast<size_t>(s);
      const int64_t begin = pb.row_offsets[i], end = pb.row_offsets[i + 1];
      if (end - begin == 1) continue;  // decoded above
      const int64_t keys = pb.cached_lengths[i] + end - begin;
      Tensor out_s = token_rows(out, begin, end);
      Tensor lse = Tensor::empty({1, heads_, end - begin}, DType::F32);
      ops::flash_attention_forward(token_rows(q, begin, end),
                                   gather_pages(cache.key, fp8_kv ? &cache.key_scale : nullptr,
                                                pb.block_tables[i], keys, x.dtype()),
                                   gather_pages(cache.value, fp8_kv ? &cache.value_scale : nullptr,
                                                pb.block_tables[i], keys, x.dtype()),
                                   a, out_s, lse);
    }
  } else {
    append_to_cache(k, cache.key, offset);
    append_to_cache(v, cache.value, offset);
    // Each sequence's queries over its cached prefix; the mask's bottom-right alignment puts
    // new query i on key offset + i.
    const int64_t keys = offset + seq;
    Tensor lse = Tensor::empty({1, heads_, seq}, DType::F32);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor out_b = out.slice_rows(b, b + 1);
      ops::flash_attention_forward(q.slice_rows(b, b + 1), cached_prefix(cache.key, b, keys),
                                   cached_prefix(cache.value, b, keys), a, out_b, lse);
    }
  }
  Linear::Context scratch_proj;
  return proj.forward(out.reshape({batch, seq, heads_ * head_dim_}), scratch_proj);
}

Tensor MultiheadAttention::backward(const Tensor& dy, Context& ctx, Tensor* d_encoder_output,
                                    Tensor* dbias) {
  const auto& o = options_;
  OCTET_CHECK(!ctx.x_shape.empty(), o.name, ": backward called without a forward context");
  const int64_t batch = ctx.x_shape[0], seq = ctx.x_shape[1];
  Tensor d_out = proj.backward(dy, ctx.proj).reshape({batch, seq, heads_, head_dim_});
  if (ctx.replay_qkv) {
    Tensor fused = layernorm_qkv ? layernorm_qkv->linear.replay_forward(ctx.layernorm_input.linear)
                                 : qkv->replay_forward(ctx.input);
    split_qkv(fused, ctx, ctx.core.q, ctx.core.k, ctx.core.v);
  }
  Tensor dq, dk, dv, dhead_bias;
  const bool has_bias = ctx.core.bias.defined();
  core_attention.backward(d_out, ctx.core, dq, dk, dv, has_bias && dbias ? &dhead_bias : nullptr);
  if (has_bias && dbias) {
    check_dtype(*dbias, DType::F32, o.name + ": dbias");
    OCTET_CHECK(dbias->ndim() == 3 && dbias->dim(0) == o.num_attention_heads &&
                    dbias->numel() / o.num_attention_heads == dhead_bias.numel() / heads_,
                o.name, ": dbias expected [H,T,S] with H=", o.num_attention_heads, ", got ",
                shape_str(dbias->shape()));
    const int64_t first = heads_ == o.num_attention_heads ? 0 : tp_rank_ * heads_;
    float* acc = dbias->data<float>() + first * (dbias->numel() / o.num_attention_heads);
    const float* add = dhead_bias.data<float>();
    for (int64_t i = 0; i < dhead_bias.numel(); ++i) acc[i] += add[i];
  }
  if (o.qk_norm && !o.qk_norm_before_rope) {
    dq = norm_heads_backward(*q_norm, dq, ctx.q_norm);
    dk = norm_heads_backward(*k_norm, dk, ctx.k_norm);
  }
  if (o.rope) {
    rotate(dq, rope_options(o), core_attention.context_parallel_group(), true);
    rotate(dk, rope_options(o), core_attention.context_parallel_group(), true);
  }
  if (o.qk_norm && o.qk_norm_before_rope) {
    dq = norm_heads_backward(*q_norm, dq, ctx.q_norm);
    dk = norm_heads_backward(*k_norm, dk, ctx.k_norm);
  }
  Tensor dx;
  if (o.attention_type == AttentionType::Self) {
    Tensor dfused = join_columns({&dq, &dk, &dv}, batch * seq)
                        .reshape({batch, seq, (heads_ + 2 * kv_heads_) * head_dim_});
    dx = (layernorm_qkv ? layernorm_qkv->backward(dfused, ctx.layernorm_input)
                        : qkv->backward(dfused, ctx.input))
             .reshape(ctx.input_shape);
  } else {
    OCTET_CHECK(d_encoder_output != nullptr, o.name,
                ": cross-attention backward needs d_encoder_output");
    Tensor dquery = dq.reshape({batch, seq, heads_ * head_dim_});
    dx = layernorm_query ? layernorm_query->backward(dquery, ctx.layernorm_input)
                         : query->backward(dquery, ctx.input);
    const Shape& e = ctx.encoder_shape;
    const bool sp = proj.parallel() && proj.whole_options().sequence_parallel;
    Tensor dfused = join_columns({&dk, &dv}, e[0] * e[1]);
    if (!sp) dfused = dfused.reshape({e[0], e[1], 2 * kv_heads_ * head_dim_});
    *d_encoder_output = key_value->backward(dfused, ctx.key_value);
  }
  ctx = Context{};
  return dx;
}

}  // namespace octet
