// Tensor-parallel blocks: LayerNormMLP and self-attention split across the tensor group,
// Megatron's column -> local compute -> row pattern, with sequence parallelism around it.
#include <cstring>

#include "octet/tensor_parallel.h"

namespace octet {

namespace {

// parts[i] (allocated, [N, widths[i]] as numel / N) <- consecutive columns of fused [N, W].
void split_columns(const Tensor& fused, const std::vector<Tensor*>& parts) {
  const int64_t rows = fused.rows(), cols = fused.cols();
  const size_t element = dtype_bytes(fused.dtype());
  const auto* src = static_cast<const unsigned char*>(fused.raw());
  int64_t begin = 0;
  for (Tensor* part : parts) {
    const int64_t width = part->numel() / rows;
    auto* dst = static_cast<unsigned char*>(part->raw());
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * width * element, src + (r * cols + begin) * element, width * element);
    }
    begin += width;
  }
}

// The inverse: [N, sum of widths] from parts seen as [N, width].
Tensor join_columns(const std::vector<const Tensor*>& parts, int64_t rows) {
  int64_t cols = 0;
  for (const Tensor* part : parts) cols += part->numel() / rows;
  const DType dtype = parts.front()->dtype();
  const size_t element = dtype_bytes(dtype);
  Tensor fused = Tensor::empty({rows, cols}, dtype);
  auto* dst = static_cast<unsigned char*>(fused.raw());
  int64_t begin = 0;
  for (const Tensor* part : parts) {
    const int64_t width = part->numel() / rows;
    const auto* src = static_cast<const unsigned char*>(part->raw());
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + (r * cols + begin) * element, src + r * width * element, width * element);
    }
    begin += width;
  }
  return fused;
}

void copy_norm(Norm& to, Norm& from) {
  to.weight.value.copy_from(from.weight.value);
  if (to.options().kind == NormKind::LayerNorm) to.bias.value.copy_from(from.bias.value);
}

void add_norm_parameters(Norm& norm, std::vector<Parameter*>& out) {
  out.push_back(&norm.weight);
  if (norm.options().kind == NormKind::LayerNorm) out.push_back(&norm.bias);
}

// LayerNormMLP's FC1 / FC2 options (the same seeds and names), split by the parallel layers.
ParallelLinearOptions mlp_fc(const LayerNormMLPOptions& o, bool first, bool sequence_parallel) {
  ParallelLinearOptions p;
  LinearOptions& l = p.linear;
  const bool gated = ops::is_gated(o.activation);
  l.in_features = first ? o.hidden : o.ffn_hidden;
  l.out_features = first ? (gated ? 2 * o.ffn_hidden : o.ffn_hidden) : o.hidden;
  l.bias = o.bias;
  l.return_bias = first;  // FC1's bias is added inside the activation kernel
  l.init_std = first ? o.init_std : o.output_init_std;
  l.seed = o.seed * 2 + (first ? 1 : 2);
  l.name = o.name + (first ? ".fc1" : ".fc2");
  l.parallel_mode = first ? ParallelMode::Column : ParallelMode::Row;
  l.sequence_parallel = sequence_parallel;
  if (first && gated) p.output_blocks = {o.ffn_hidden, o.ffn_hidden};  // [a | b]
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

NormOptions attention_norm(const MultiheadAttentionOptions& o) {
  NormOptions n;
  n.hidden = o.hidden_size;
  n.kind = o.normalization;
  n.eps = o.layernorm_epsilon;
  n.zero_centered_gamma = o.zero_centered_gamma;
  n.name = o.name + ".layernorm_qkv.norm";
  return n;
}

// MultiheadAttention's linear options (seed o.seed * 8 + part), split by the parallel layers.
ParallelLinearOptions attention_linear(const MultiheadAttentionOptions& o, bool qkv,
                                       bool sequence_parallel) {
  const int64_t heads = o.num_attention_heads, kv_heads = kv_heads_of(o), d = head_dim_of(o);
  ParallelLinearOptions p;
  LinearOptions& l = p.linear;
  l.in_features = qkv ? o.hidden_size : heads * d;
  l.out_features = qkv ? (heads + 2 * kv_heads) * d : o.hidden_size;
  l.bias = o.bias;
  l.return_bias = qkv ? false : o.return_bias;
  l.init_std = qkv ? o.init_std : o.output_init_std;
  l.params_dtype = o.params_dtype;
  l.seed = o.seed * 8 + (qkv ? 1 : 4);
  l.name = o.name + (qkv ? ".layernorm_qkv" : ".proj");
  l.parallel_mode = qkv ? ParallelMode::Column : ParallelMode::Row;
  l.sequence_parallel = sequence_parallel;
  if (qkv) p.output_blocks = {heads * d, kv_heads * d, kv_heads * d};  // [q | k | v]
  return p;
}

DotProductAttentionOptions local_core(const MultiheadAttentionOptions& o, Communicator& tp) {
  DotProductAttentionOptions c;
  c.num_attention_heads = o.num_attention_heads / tp.size();
  c.kv_channels = head_dim_of(o);
  c.num_gqa_groups = kv_heads_of(o) / tp.size();
  c.attn_mask_type = o.attn_mask_type;
  c.window_size = o.window_size;
  c.softmax_scale = o.softmax_scale;
  c.seed = o.seed * 8 + 7;
  c.name = o.name + ".core_attention";
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TensorParallelLayerNormMLP.

TensorParallelLayerNormMLP::TensorParallelLayerNormMLP(const LayerNormMLPOptions& options,
                                                       bool sequence_parallel, Communicator& tp)
    : norm(options.norm),
      fc1(mlp_fc(options, true, sequence_parallel), tp),
      fc2(mlp_fc(options, false, sequence_parallel), tp),
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
  OCTET_CHECK(!fp8_enabled(), options_.name, ": tensor-parallel MLP does not run FP8 yet");
  ctx = Context{};
  const Tensor h = fc1.forward(norm.forward(x.reshape({x.rows(), x.cols()}), ctx.norm), ctx.fc1);
  ctx.fc1_output = h;
  Tensor a = Tensor::empty({h.rows(), options_.ffn_hidden / tp_->size()}, h.dtype());
  ops::activation_forward(options_.activation, h, options_.bias ? &fc1.linear.bias.value : nullptr,
                          a);
  return fc2.forward(a, ctx.fc2);
}

Tensor TensorParallelLayerNormMLP::backward(const Tensor& dy, Context& ctx) {
  OCTET_CHECK(ctx.fc1_output.defined(), options_.name, ": backward called without a forward");
  const Tensor da = fc2.backward(dy, ctx.fc2);
  const Tensor& h = ctx.fc1_output;
  Tensor dh = Tensor::empty(h.shape(), h.dtype());
  if (options_.bias) {
    Tensor dbias = Tensor::empty({h.cols()}, DType::F32);
    ops::activation_backward(options_.activation, da, h, &fc1.linear.bias.value, dh, &dbias);
    float* grad = fc1.linear.bias.grad.data<float>();
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
    : norm(attention_norm(checked_attention(options, tp))),
      qkv(attention_linear(options, true, sequence_parallel), tp),
      core_attention(local_core(options, tp)),
      proj(attention_linear(options, false, sequence_parallel), tp),
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
  OCTET_CHECK(!fp8_enabled(), options_.name, ": tensor-parallel attention does not run FP8 yet");
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
