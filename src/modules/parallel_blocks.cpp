// Tensor-parallel blocks: LayerNormMLP and self-attention split across the tensor group,
// Megatron's column -> local compute -> row pattern, with sequence parallelism around it.
#include "modules/tensor_columns.h"
#include "octet/tensor_parallel.h"

namespace octet {

namespace {

using modules_detail::join_columns;
using modules_detail::split_columns;

void copy_norm(Norm& to, Norm& from) {
  to.weight.value.copy_from(from.weight.value);
  if (to.options().kind == NormKind::LayerNorm) to.bias.value.copy_from(from.bias.value);
}

void add_norm_parameters(Norm& norm, std::vector<Parameter*>& out) {
  out.push_back(&norm.weight);
  if (norm.options().kind == NormKind::LayerNorm) out.push_back(&norm.bias);
}

// LayerNormMLP's FC1 / FC2 options (the same seeds and names), split by the parallel layers.
LinearOptions mlp_fc(const LayerNormMLPOptions& o, bool first, bool sequence_parallel) {
  LinearOptions p = LayerNormMLP::fc_options(o, first);
  p.parallel_mode = first ? ParallelMode::Column : ParallelMode::Row;
  p.sequence_parallel = sequence_parallel;
  if (first && ops::is_gated(o.activation)) p.output_blocks = {o.ffn_hidden, o.ffn_hidden};
  return p;
}

int64_t kv_heads_of(const MultiheadAttentionOptions& o) {
  return o.num_gqa_groups > 0 ? o.num_gqa_groups : o.num_attention_heads;
}
int64_t head_dim_of(const MultiheadAttentionOptions& o) {
  OCTET_CHECK(o.num_attention_heads > 0, o.name, ": num_attention_heads must be positive");
  return o.kv_channels > 0 ? o.kv_channels : o.hidden_size / o.num_attention_heads;
}

// MultiheadAttention's options checked for what the parallel block supports.
const MultiheadAttentionOptions& checked_attention(const MultiheadAttentionOptions& o,
                                                   Communicator& tp) {
  OCTET_CHECK(o.attention_type == AttentionType::Self && o.input_layernorm, o.name,
              ": tensor-parallel attention expects self-attention with input_layernorm");
  OCTET_CHECK(
      !o.rope && !o.qk_norm && o.attention_dropout == 0.0f, o.name,
      ": tensor-parallel attention does not support RoPE, QK-norm or attention dropout yet");
  OCTET_CHECK(o.attn_mask_type == AttnMaskType::Causal || o.attn_mask_type == AttnMaskType::NoMask,
              o.name, ": tensor-parallel attention supports causal or no mask");
  const int64_t size = tp.size();
  OCTET_CHECK(o.num_attention_heads % size == 0 && kv_heads_of(o) % size == 0, o.name, ": ",
              o.num_attention_heads, " query heads and ", kv_heads_of(o),
              " kv heads must both be divisible by TP=", size);
  return o;
}

// MultiheadAttention's QKV (with its norm) and projection options (the same seeds and
// names), split by the parallel layers; QKV's [q | k | v] blocks split per rank by heads.
LinearOptions attention_linear(const MultiheadAttentionOptions& o, bool qkv,
                               bool sequence_parallel) {
  LinearOptions p =
      qkv ? MultiheadAttention::qkv_options(o).linear : MultiheadAttention::proj_options(o);
  p.parallel_mode = qkv ? ParallelMode::Column : ParallelMode::Row;
  p.sequence_parallel = sequence_parallel;
  if (qkv) {
    const int64_t d = head_dim_of(o);
    p.output_blocks = {o.num_attention_heads * d, kv_heads_of(o) * d, kv_heads_of(o) * d};
  }
  return p;
}

// The core attention on this rank's heads.
DotProductAttentionOptions local_core(const MultiheadAttentionOptions& o, Communicator& tp) {
  DotProductAttentionOptions c = MultiheadAttention::core_options(o);
  c.num_attention_heads /= tp.size();
  c.num_gqa_groups = kv_heads_of(o) / tp.size();
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TensorParallelLayerNormMLP.

TensorParallelLayerNormMLP::TensorParallelLayerNormMLP(const LayerNormMLPOptions& options,
                                                       bool sequence_parallel, Communicator& tp)
    : norm(options.norm),
      fc1(mlp_fc(options, true, sequence_parallel), &tp),
      fc2(mlp_fc(options, false, sequence_parallel), &tp),
      options_(options),
      sequence_parallel_(sequence_parallel),
      tp_(&tp) {
  OCTET_CHECK(options.norm.hidden == options.hidden, options.name, ": norm hidden (",
              options.norm.hidden, ") must equal hidden (", options.hidden, ")");
}

void TensorParallelLayerNormMLP::load_full(LayerNormMLP& full) {
  copy_norm(norm, full.norm);
  fc1.load_full(full.fc1.weight.value, options_.bias ? &full.fc1.bias.value : nullptr);
  fc2.load_full(full.fc2.weight.value, options_.bias ? &full.fc2.bias.value : nullptr);
}

void TensorParallelLayerNormMLP::collect_parameters(std::vector<Parameter*>& out) {
  norm.collect_parameters(out);
  fc1.collect_parameters(out);
  fc2.collect_parameters(out);
}

void TensorParallelLayerNormMLP::on_parameters_updated() {
  fc1.on_parameters_updated();
  fc2.on_parameters_updated();
}

std::vector<Parameter*> TensorParallelLayerNormMLP::sequence_parallel_parameters() {
  std::vector<Parameter*> out;
  if (!sequence_parallel_) return out;
  add_norm_parameters(norm, out);
  for (Parameter* p : fc2.sequence_parallel_parameters()) out.push_back(p);
  return out;
}

Tensor TensorParallelLayerNormMLP::forward(const Tensor& x, Context& ctx) {
  ctx = Context{};
  const Tensor h = fc1.forward(norm.forward(x.reshape({x.rows(), x.cols()}), ctx.norm), ctx.fc1);
  ctx.fc1_output = h;
  Tensor a = Tensor::empty({h.rows(), options_.ffn_hidden / tp_->size()}, h.dtype());
  ops::activation_forward(options_.activation, h, options_.bias ? &fc1.bias.value : nullptr, a);
  return fc2.forward(a, ctx.fc2);
}

Tensor TensorParallelLayerNormMLP::backward(const Tensor& dy, Context& ctx) {
  OCTET_CHECK(ctx.fc1_output.defined(), options_.name, ": backward called without a forward");
  const Tensor da = fc2.backward(dy, ctx.fc2);
  const Tensor& h = ctx.fc1_output;
  Tensor dh = Tensor::empty(h.shape(), h.dtype());
  if (options_.bias) {
    Tensor dbias = Tensor::empty({h.cols()}, DType::F32);
    ops::activation_backward(options_.activation, da, h, &fc1.bias.value, dh, &dbias);
    float* grad = fc1.bias.grad.data<float>();
    const float* add = dbias.data<float>();
    for (int64_t i = 0; i < h.cols(); ++i) grad[i] += add[i];
  } else {
    ops::activation_backward(options_.activation, da, h, nullptr, dh, nullptr);
  }
  const Tensor dx = norm.backward(fc1.backward(dh, ctx.fc1), ctx.norm);
  ctx = Context{};
  return dx;
}

// ---------------------------------------------------------------------------------------------
// TensorParallelSelfAttention.

TensorParallelSelfAttention::TensorParallelSelfAttention(const MultiheadAttentionOptions& options,
                                                         bool sequence_parallel, Communicator& tp)
    : norm(MultiheadAttention::qkv_options(checked_attention(options, tp)).norm),
      qkv(attention_linear(options, true, sequence_parallel), &tp),
      core_attention(local_core(options, tp)),
      proj(attention_linear(options, false, sequence_parallel), &tp),
      options_(options),
      sequence_parallel_(sequence_parallel),
      tp_(&tp),
      local_heads_(options.num_attention_heads / tp.size()),
      local_kv_heads_(kv_heads_of(options) / tp.size()),
      head_dim_(head_dim_of(options)) {}

void TensorParallelSelfAttention::load_full(MultiheadAttention& full) {
  OCTET_CHECK(full.layernorm_qkv.has_value(), options_.name,
              ": load_full expects a MultiheadAttention with input_layernorm");
  copy_norm(norm, full.layernorm_qkv->norm);
  const Linear& l = full.layernorm_qkv->linear;
  qkv.load_full(l.weight.value, options_.bias ? &l.bias.value : nullptr);
  proj.load_full(full.proj.weight.value, options_.bias ? &full.proj.bias.value : nullptr);
}

void TensorParallelSelfAttention::collect_parameters(std::vector<Parameter*>& out) {
  norm.collect_parameters(out);
  qkv.collect_parameters(out);
  proj.collect_parameters(out);
}

void TensorParallelSelfAttention::on_parameters_updated() {
  qkv.on_parameters_updated();
  proj.on_parameters_updated();
}

std::vector<Parameter*> TensorParallelSelfAttention::sequence_parallel_parameters() {
  std::vector<Parameter*> out;
  if (!sequence_parallel_) return out;
  add_norm_parameters(norm, out);
  for (Parameter* p : proj.sequence_parallel_parameters()) out.push_back(p);
  return out;
}

Tensor TensorParallelSelfAttention::forward(const Tensor& x, int64_t batch, int64_t seq,
                                            Context& ctx) {
  const int64_t shards = sequence_parallel_ ? tp_->size() : 1;
  OCTET_CHECK(x.cols() == options_.hidden_size && x.rows() * shards == batch * seq, options_.name,
              ": input expected [B*T/", shards, ", C]=[", batch * seq / shards, ",",
              options_.hidden_size, "], got ", shape_str(x.shape()));
  ctx = Context{};
  ctx.batch = batch;
  ctx.seq = seq;
  const Tensor fused =
      qkv.forward(norm.forward(x.reshape({x.rows(), x.cols()}), ctx.norm), ctx.qkv);
  Tensor q = Tensor::empty({batch, seq, local_heads_, head_dim_}, fused.dtype());
  Tensor k = Tensor::empty({batch, seq, local_kv_heads_, head_dim_}, fused.dtype());
  Tensor v = Tensor::empty({batch, seq, local_kv_heads_, head_dim_}, fused.dtype());
  split_columns(fused, {&q, &k, &v});
  const Tensor out = core_attention.forward(q, k, v, ctx.core);
  return proj.forward(out.reshape({batch * seq, local_heads_ * head_dim_}), ctx.proj);
}

Tensor TensorParallelSelfAttention::backward(const Tensor& dy, Context& ctx) {
  OCTET_CHECK(ctx.batch > 0, options_.name, ": backward called without a forward");
  const int64_t batch = ctx.batch, seq = ctx.seq;
  const Tensor d_out = proj.backward(dy, ctx.proj).reshape({batch, seq, local_heads_, head_dim_});
  Tensor dq, dk, dv;
  core_attention.backward(d_out, ctx.core, dq, dk, dv);
  const Tensor dfused = join_columns({&dq, &dk, &dv}, batch * seq);
  const Tensor dx = norm.backward(qkv.backward(dfused, ctx.qkv), ctx.norm);
  ctx = Context{};
  return dx;
}

}  // namespace octet
