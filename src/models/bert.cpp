// BERT, whole or as the part a rank holds (pipeline stages, tensor shards): construction, the one
// forward (word, position and token-type embeddings on the first stage; encoder layers with the
// padding mask; the MLM and NSP heads and their losses on the last) and its backward,
// parameters and state dicts.
#include "octet/bert.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "models/gpt_parts.h"
#include "models/precision_scope.h"
#include "modules/common.h"
#include "octet/fp4.h"
#include "octet/mappings.h"
#include "octet/ops/activation.h"
#include "octet/ops/embedding.h"
#include "octet/ops/loss.h"

namespace octet {

using models_detail::HighPrecisionScope;
using models_detail::to_dtype;

namespace {

TransformerLayerOptions layer_options(const BertConfig& c, int64_t index, uint64_t seed,
                                      bool recompute) {
  TransformerLayerOptions o;
  o.checkpoint = recompute;
  o.hidden_size = c.hidden;
  o.ffn_hidden_size = c.ffn();
  o.num_attention_heads = c.num_heads;
  o.layernorm_epsilon = c.layernorm_eps;
  o.hidden_dropout = c.dropout;
  o.attention_dropout = c.dropout;
  o.normalization = NormKind::LayerNorm;
  o.activation = ops::parse_activation(c.activation);
  o.layer_type = LayerType::Encoder;
  o.self_attn_mask_type = AttnMaskType::Padding;  // every token sees every non-padding token
  // Post-LN (the original): the attention reads x itself, LayerNorm(x + attention) is both the
  // MLP's input and its residual, and the output LayerNorm closes the layer.
  o.output_layernorm = c.post_layernorm;
  o.apply_residual_connection_post_layernorm = c.post_layernorm;
  o.init_std = c.init_std;
  o.output_init_std = c.init_std;
  o.seed = seed * 1000 + static_cast<uint64_t>(index) + 1;
  o.name = "bert.encoder.layer." + std::to_string(index);
  return o;
}

NormOptions norm_options(const BertConfig& c, std::string name) {
  NormOptions n;
  n.hidden = c.hidden;
  n.kind = NormKind::LayerNorm;
  n.eps = c.layernorm_eps;
  n.name = std::move(name);
  return n;
}

LinearOptions dense_options(int64_t in, int64_t out, float init_std, uint64_t seed,
                            std::string name) {
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.init_std = init_std;
  o.seed = seed;
  o.name = std::move(name);
  return o;
}

Bert::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<Bert::Context*>(&base);
  OCTET_CHECK(ctx, "bert: expected a context from Bert::make_context()");
  return *ctx;
}

// rows [N, C] (any dtype), picked: [rows.size(), C]; and the adjoint into a zeroed [N, C] F32.
Tensor take_rows(const Tensor& x, const std::vector<int32_t>& rows) {
  const int64_t C = x.dim(-1), M = static_cast<int64_t>(rows.size());
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(x.dtype());
  Tensor out = Tensor::empty({M, C}, x.dtype());
  const auto* src = static_cast<const char*>(x.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < M; ++i) {
    std::memcpy(dst + i * row_bytes, src + rows[static_cast<size_t>(i)] * row_bytes, row_bytes);
  }
  return out;
}

void add_rows(const Tensor& y, const std::vector<int32_t>& rows, Tensor& out) {
  const Tensor y32 = y.dtype() == DType::F32 ? y : y.to(DType::F32);
  const int64_t C = y32.dim(-1);
  const float* src = y32.data<float>();
  float* dst = out.data<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    float* row = dst + rows[i] * C;
    for (int64_t k = 0; k < C; ++k) row[k] += src[static_cast<int64_t>(i) * C + k];
  }
}

}  // namespace

Bert::Bert(const BertConfig& config, uint64_t seed, ModelLayout layout, bool recompute_activations)
    : TransformerStack(
          "bert", config.num_layers, std::move(layout),
          [&](int64_t i) { return layer_options(config, i, seed, recompute_activations); }),
      config_(config) {
  Communicator* tp = layout_.tensor;
  const int64_t V = config.vocab_size, C = config.hidden;
  OCTET_CHECK(tp == nullptr || V >= tp->size(), "bert: vocabulary ", V,
              " smaller than TP=", tp ? tp->size() : 1);
  vocab_ = tp ? vocab_range(V, tp->rank(), tp->size()) : VocabRange{0, V};
  const bool sp = sequence_parallel();
  if (has_first_ || has_last_) {
    word_embeddings = modules_detail::make_parameter("bert.embeddings.word_embeddings.weight",
                                                     {V, C}, config.init_std, seed * 7919 + 1);
    if (tp) {
      // This rank's rows of the same-seed whole table.
      word_embeddings.value = word_embeddings.value.slice_rows(vocab_.begin, vocab_.end).clone();
      word_embeddings.grad = Tensor::zeros(word_embeddings.value.shape(), DType::F32);
      word_embeddings.shard = TensorShard::vocabulary_rows({V, C});
    }
  }
  if (has_first_) {
    position_embeddings =
        modules_detail::make_parameter("bert.embeddings.position_embeddings.weight",
                                       {config.max_seq_len, C}, config.init_std, seed * 7919 + 2);
    token_type_embeddings = modules_detail::make_parameter(
        "bert.embeddings.token_type_embeddings.weight", {config.type_vocab_size, C},
        config.init_std, seed * 7919 + 3);
    // Applied to token shards under sequence parallelism: partial gradients.
    position_embeddings.shard.sequence_parallel = sp;
    token_type_embeddings.shard.sequence_parallel = sp;
    if (config.post_layernorm) {
      embedding_norm_.emplace(norm_options(config, "bert.embeddings.LayerNorm"));
      for (Parameter* p : embedding_norm_->parameters()) p->shard.sequence_parallel = sp;
    }
  }
  if (has_last_) {
    if (!config.post_layernorm) {
      final_norm_.emplace(norm_options(config, "bert.encoder.ln"));
      for (Parameter* p : final_norm_->parameters()) p->shard.sequence_parallel = sp;
    }
    mlm_dense_.emplace(
        dense_options(C, C, config.init_std, seed * 7919 + 4, "cls.predictions.transform.dense"));
    mlm_norm_.emplace(norm_options(config, "cls.predictions.transform.LayerNorm"));
    mlm_bias = modules_detail::constant_parameter("cls.predictions.bias", {V}, 0.0f);
    if (tp) {
      mlm_bias.value = mlm_bias.value.slice_rows(vocab_.begin, vocab_.end).clone();
      mlm_bias.grad = Tensor::zeros(mlm_bias.value.shape(), DType::F32);
      mlm_bias.shard = TensorShard::vocabulary_rows({V});
    }
    pooler_.emplace(dense_options(C, C, config.init_std, seed * 7919 + 5, "bert.pooler.dense"));
    nsp_.emplace(dense_options(C, 2, config.init_std, seed * 7919 + 6, "cls.seq_relationship"));
  }
}

std::vector<Parameter*> Bert::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  if (is_first(chunk)) {
    out.push_back(&word_embeddings);
    out.push_back(&position_embeddings);
    out.push_back(&token_type_embeddings);
    if (embedding_norm_) embedding_norm_->collect_parameters(out);
  }
  for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  if (is_last(chunk)) {
    if (!is_first(chunk)) out.push_back(&word_embeddings);
    if (final_norm_) final_norm_->collect_parameters(out);
    pooler_->collect_parameters(out);
    mlm_dense_->collect_parameters(out);
    mlm_norm_->collect_parameters(out);
    out.push_back(&mlm_bias);
    nsp_->collect_parameters(out);
  }
  return out;
}

void Bert::collect_parameters(std::vector<Parameter*>& out) {
  // The whole model's order, the word embedding once.
  if (word_embeddings.value.defined()) out.push_back(&word_embeddings);
  if (has_first_) {
    out.push_back(&position_embeddings);
    out.push_back(&token_type_embeddings);
    if (embedding_norm_) embedding_norm_->collect_parameters(out);
  }
  for (int chunk : chunks_in_stage_order()) {
    for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  }
  if (has_last_) {
    if (final_norm_) final_norm_->collect_parameters(out);
    pooler_->collect_parameters(out);
    mlm_dense_->collect_parameters(out);
    mlm_norm_->collect_parameters(out);
    out.push_back(&mlm_bias);
    nsp_->collect_parameters(out);
  }
}

std::vector<Parameter*> Bert::heads_in_backward_order() {
  std::vector<Parameter*> out;
  for (Linear* head : {&*nsp_, &*pooler_}) {
    for (Parameter* p : head->parameters()) out.push_back(p);
  }
  out.push_back(&mlm_bias);
  for (Parameter* p : mlm_norm_->parameters()) out.push_back(p);
  for (Parameter* p : mlm_dense_->parameters()) out.push_back(p);
  if (final_norm_) {
    for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Parameter*> Bert::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  if (has_last_) out = heads_in_backward_order();
  std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = stack.size(); i-- > 0;) {
      for (Parameter* p : stack[i].parameters()) out.push_back(p);
    }
  }
  if (has_first_) {
    if (embedding_norm_) {
      for (Parameter* p : embedding_norm_->parameters()) out.push_back(p);
    }
    out.push_back(&position_embeddings);
    out.push_back(&token_type_embeddings);
  }
  if (word_embeddings.value.defined()) out.push_back(&word_embeddings);
  return out;
}

void Bert::on_parameters_updated() {
  output_cache_.invalidate();
  TransformerStack::on_parameters_updated();
  for (std::optional<Linear>* linear : {&mlm_dense_, &pooler_, &nsp_}) {
    if (*linear) (*linear)->on_parameters_updated();
  }
}

std::vector<pipeline::TiedParameters> Bert::tied_parameters() {
  pipeline::TiedParameters embedding;
  embedding.stages = {0};
  if (layout_.stages > 1) embedding.stages.push_back(layout_.stages - 1);
  if (word_embeddings.value.defined()) embedding.parameters = {&word_embeddings};
  return {embedding};
}

std::unique_ptr<pipeline::StagedModel::Context> Bert::make_context() const {
  return std::make_unique<Context>();
}

Shape Bert::activation_shape(const pipeline::MicroBatch& batch) const {
  const Tensor& ids = pipeline::batch_tensor(batch, "ids", "bert");
  if (sequence_parallel()) return {ids.numel() / layout_.tensor->size(), config_.hidden};
  return {ids.dim(0), ids.dim(1), config_.hidden};
}

Tensor Bert::embed(const Tensor& ids, const Tensor& token_types, DType dtype, Context* ctx) {
  Communicator* tp = layout_.tensor;
  const int64_t T = ids.dim(1), N = ids.numel(), C = config_.hidden;
  Tensor x;
  if (tp == nullptr) {
    x = Tensor::empty({N, C}, DType::F32);
    ops::embedding_forward(ids.reshape({N}), word_embeddings.value, x);
  } else {
    Tensor partial = Tensor::empty({N, C}, DType::F32);
    ops::embedding_part_forward(ids.reshape({N}), word_embeddings.value, vocab_.begin,
                                config_.vocab_size, partial);
    x = sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(partial, *tp)
                            : reduce_from_tensor_parallel_region(partial, *tp);
  }
  // x's rows are tokens first_row.. of the whole [B*T].
  const int64_t first_row = sequence_parallel() ? tp->rank() * x.rows() : 0;
  ops::position_embedding_forward(x, position_embeddings.value, T, first_row);
  const int32_t* types = token_types.data<int32_t>();
  const float* table = token_type_embeddings.value.data<float>();
  float* xs = x.data<float>();
#pragma omp parallel for
  for (int64_t r = 0; r < x.rows(); ++r) {
    const float* row = table + types[first_row + r] * C;
    for (int64_t k = 0; k < C; ++k) xs[r * C + k] += row[k];
  }
  if (embedding_norm_) {
    Norm::Context scratch;
    x = embedding_norm_->forward(x, ctx ? ctx->embedding_norm : scratch);
  }
  return to_dtype(x, dtype);
}

void Bert::embed_backward(const Tensor& dx_in, Context& ctx) {
  Communicator* tp = layout_.tensor;
  const int64_t T = ctx.ids.dim(1), N = ctx.ids.numel(), C = config_.hidden;
  Tensor dx = to_dtype(dx_in, DType::F32).reshape({dx_in.numel() / C, C});
  if (embedding_norm_) dx = embedding_norm_->backward(dx, ctx.embedding_norm);
  // Under SP this rank's token rows give partial gradients (summed over the group later).
  const int64_t first_row = sequence_parallel() ? tp->rank() * dx.rows() : 0;
  ops::position_embedding_backward(dx, T, position_embeddings.grad, first_row);
  const int32_t* types = ctx.token_types.data<int32_t>();
  float* dtable = token_type_embeddings.grad.data<float>();
  const float* d = dx.data<float>();
  for (int64_t r = 0; r < dx.rows(); ++r) {
    float* row = dtable + types[first_row + r] * C;
    for (int64_t k = 0; k < C; ++k) row[k] += d[r * C + k];
  }
  if (tp == nullptr) {
    ops::embedding_backward(ctx.ids.reshape({N}), dx, word_embeddings.grad);
    return;
  }
  const Tensor dwhole = sequence_parallel()
                            ? reduce_scatter_to_sequence_parallel_region_backward(dx, *tp)
                            : reduce_from_tensor_parallel_region_backward(dx, *tp);
  ops::embedding_part_backward(ctx.ids.reshape({N}), dwhole, vocab_.begin, config_.vocab_size,
                               word_embeddings.grad);
}

float Bert::heads_loss(const Tensor& h_in, const pipeline::MicroBatch& batch, DType dtype,
                       float grad_scale, Context* ctx, bool count) {
  Communicator* tp = layout_.tensor;
  const Tensor& targets = pipeline::batch_tensor(batch, "targets", "bert");
  const Tensor& nsp_labels = pipeline::batch_tensor(batch, "nsp_labels", "bert");
  const int64_t B = targets.dim(0), T = targets.dim(1), C = config_.hidden;
  HighPrecisionScope scope;
  Tensor h = h_in.reshape({h_in.numel() / C, C});
  Norm::Context final_scratch;
  if (final_norm_) h = final_norm_->forward(h, ctx ? ctx->final_norm : final_scratch);
  // Every rank's tokens: the whole [B*T, C] under sequence parallelism. The heads run whole on
  // every rank, so their gradients are whole too (each rank keeps its rows in backward).
  const Tensor whole = sequence_parallel() ? gather_from_sequence_parallel_region(h, *tp) : h;

  // The masked-language-model head over the masked rows only.
  std::vector<int32_t> rows;
  std::vector<int32_t> mlm_targets;
  const int32_t* t = targets.data<int32_t>();
  for (int64_t r = 0; r < B * T; ++r) {
    if (t[r] == -100) continue;
    OCTET_CHECK(t[r] >= 0 && t[r] < config_.vocab_size, "bert: target ", t[r], " at row ", r,
                " expected in [0, ", config_.vocab_size, ") or -100");
    rows.push_back(static_cast<int32_t>(r));
    mlm_targets.push_back(t[r]);
  }
  OCTET_CHECK(!rows.empty(), "bert: the micro-batch's targets hold no masked token (all -100)");
  const int64_t M = static_cast<int64_t>(rows.size());
  Tensor target_rows = Tensor::empty({M}, DType::I32);
  std::memcpy(target_rows.raw(), mlm_targets.data(), mlm_targets.size() * sizeof(int32_t));
  Linear::Context dense_scratch;
  Norm::Context norm_scratch;
  const Tensor pre =
      mlm_dense_->forward(take_rows(whole, rows), ctx ? ctx->mlm_dense : dense_scratch);
  const ops::ActivationKind act = ops::parse_activation(config_.activation);
  Tensor activated = Tensor::empty(pre.shape(), pre.dtype());
  ops::activation_forward(act, pre, nullptr, activated);
  const Tensor transformed = mlm_norm_->forward(activated, ctx ? ctx->mlm_norm : norm_scratch);
  if (count) {
    // Predictions: each row's argmax over the whole vocabulary (under TP: over the group).
    const std::vector<int64_t> predicted = gpt_parts::vocab_argmax(
        transformed, word_embeddings, dtype, output_cache_, vocab_, tp, &mlm_bias);
    if (tp == nullptr || tp->rank() == 0) {
      for (int64_t i = 0; i < M; ++i) {
        eval_correct_ += predicted[static_cast<size_t>(i)] == mlm_targets[static_cast<size_t>(i)];
      }
      eval_seen_ += M;
    }
  }
  const Tensor logits_input = tp ? copy_to_tensor_parallel_region(transformed, *tp) : transformed;
  Tensor dtransformed;
  float mlm_loss = 0.0f;
  if (tp == nullptr) {
    mlm_loss =
        gpt_parts::tied_output_loss(logits_input, target_rows, word_embeddings, dtype, grad_scale,
                                    ctx ? &dtransformed : nullptr, output_cache_, {}, 0, &mlm_bias);
  } else {
    mlm_loss = gpt_parts::tied_output_loss(
        logits_input, target_rows, word_embeddings, dtype, grad_scale,
        ctx ? &dtransformed : nullptr, output_cache_,
        [&](Tensor& logits, const Tensor& target_chunk, Tensor& losses, bool backward,
            float scale) {
          vocab_parallel_cross_entropy(logits, target_chunk, vocab_, losses, backward, scale, *tp);
        },
        // Rank 0's shard is the widest: every rank cuts the same chunks (collective per chunk).
        vocab_range(config_.vocab_size, 0, tp->size()).size(), &mlm_bias);
    // Each rank's part of the gradient comes from its vocabulary rows: summed over the group.
    if (ctx) dtransformed = copy_to_tensor_parallel_region_backward(dtransformed, *tp);
  }

  // The next-sentence head: the pooler (dense and tanh) over [CLS], then two classes, in F32.
  check_shape(nsp_labels, {B}, "bert: nsp_labels", "B");
  std::vector<int32_t> cls_rows(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) cls_rows[static_cast<size_t>(b)] = static_cast<int32_t>(b * T);
  Linear::Context pooler_scratch, nsp_scratch;
  Tensor pooled = to_dtype(pooler_->forward(to_dtype(take_rows(whole, cls_rows), DType::F32),
                                            ctx ? ctx->pooler : pooler_scratch),
                           DType::F32)
                      .clone();
  float* pooled_values = pooled.data<float>();
  for (int64_t i = 0; i < pooled.numel(); ++i) pooled_values[i] = std::tanh(pooled_values[i]);
  Tensor nsp_logits = to_dtype(nsp_->forward(pooled, ctx ? ctx->nsp : nsp_scratch), DType::F32);
  nsp_logits = nsp_logits.clone();
  Tensor losses = Tensor::empty({B}, DType::F32);
  ops::CrossEntropyOptions options;
  options.grad_scale = grad_scale / static_cast<float>(B);
  ops::cross_entropy_forward_backward(nsp_logits, nsp_labels, losses, ctx ? &nsp_logits : nullptr,
                                      options);
  double nsp_sum = 0;
  for (float l : losses.to_floats()) nsp_sum += l;
  const float nsp_loss = static_cast<float>(nsp_sum / static_cast<double>(B));
  last_losses_ = {mlm_loss, nsp_loss};
  if (ctx) {
    // The gradient at the (final-normed) hidden states: whole, then this rank's rows.
    Tensor dpooled = nsp_->backward(nsp_logits, ctx->nsp);
    const float* y = pooled.data<float>();
    float* d = dpooled.data<float>();
    for (int64_t i = 0; i < pooled.numel(); ++i) d[i] *= 1.0f - y[i] * y[i];
    const Tensor dcls = pooler_->backward(dpooled, ctx->pooler);
    Tensor dactivated = mlm_norm_->backward(dtransformed, ctx->mlm_norm);
    Tensor dpre = Tensor::empty(pre.shape(), pre.dtype());
    ops::activation_backward(act, dactivated, pre, nullptr, dpre, nullptr);
    const Tensor drows = mlm_dense_->backward(dpre, ctx->mlm_dense);
    Tensor dwhole = Tensor::zeros({B * T, C}, DType::F32);
    add_rows(drows, rows, dwhole);
    add_rows(dcls, cls_rows, dwhole);
    if (sequence_parallel()) dwhole = scatter_to_sequence_parallel_region(dwhole, *tp);
    Tensor dh = to_dtype(dwhole, h.dtype());
    if (final_norm_) dh = final_norm_->backward(dh, ctx->final_norm);
    ctx->dhidden = to_dtype(dh, dtype);
  }
  return mlm_loss + nsp_loss;
}

Tensor Bert::run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                         DType dtype, float grad_scale, Context* ctx, float* loss) {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "bert: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const Tensor& ids = pipeline::batch_tensor(batch, "ids", "bert");
  const Tensor& token_types = pipeline::batch_tensor(batch, "token_types", "bert");
  const Tensor& lengths = pipeline::batch_tensor(batch, "lengths", "bert");
  check_dtype(ids, DType::I32, "bert: ids");
  OCTET_CHECK(ids.ndim() == 2 && ids.dim(0) > 0 && ids.dim(1) > 0,
              "bert: ids expected [B,T] with B, T > 0, got ", shape_str(ids.shape()));
  const int64_t B = ids.dim(0), T = ids.dim(1);
  OCTET_CHECK(T <= config_.max_seq_len, "bert: sequence length ", T, " exceeds max_seq_len ",
              config_.max_seq_len);
  check_dtype(token_types, DType::I32, "bert: token_types");
  check_shape(token_types, ids.shape(), "bert: token_types", "B,T");
  check_dtype(lengths, DType::I32, "bert: lengths");
  check_shape(lengths, {B}, "bert: lengths", "B");
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = lengths.data<int32_t>()[b];
    OCTET_CHECK(n >= 1 && n <= T, "bert: lengths[", b, "] = ", n, " expected in [1, ", T, "]");
  }
  if (is_first(chunk)) {
    const int32_t* id = ids.data<int32_t>();
    const int32_t* type = token_types.data<int32_t>();
    for (int64_t i = 0; i < B * T; ++i) {
      OCTET_CHECK(id[i] >= 0 && id[i] < config_.vocab_size, "bert: ids[", i / T, ",", i % T,
                  "] = ", id[i], " expected in [0, ", config_.vocab_size, ")");
      OCTET_CHECK(type[i] >= 0 && type[i] < config_.type_vocab_size, "bert: token_types[", i / T,
                  ",", i % T, "] = ", type[i], " expected in [0, ", config_.type_vocab_size, ")");
    }
  }
  if (is_last(chunk)) {
    const Tensor& targets = pipeline::batch_tensor(batch, "targets", "bert");
    const Tensor& nsp = pipeline::batch_tensor(batch, "nsp_labels", "bert");
    check_dtype(targets, DType::I32, "bert: targets");
    check_shape(targets, ids.shape(), "bert: targets", "B,T");
    check_dtype(nsp, DType::I32, "bert: nsp_labels");
  }
  OCTET_CHECK(!sequence_parallel() || (B * T) % layout_.tensor->size() == 0,
              "bert: sequence parallelism needs B*T (", B * T,
              ") divisible by TP=", sequence_parallel() ? layout_.tensor->size() : 1);
  const Shape boundary = activation_shape(batch);
  if (ctx) {
    ctx->ids = ids;
    ctx->token_types = token_types;
    ctx->lengths = lengths;
  }
  Tensor h;
  if (is_first(chunk)) {
    HighPrecisionScope scope;
    h = embed(ids, token_types, dtype, ctx).reshape(boundary);
  } else {
    h = checked_input(chunk, input, boundary, dtype);
  }
  h = forward_layers(chunk, h, ctx ? &ctx->layers : nullptr, sequence_parallel() ? T : 0, &lengths);
  if (!is_last(chunk)) return h;
  *loss = heads_loss(h, batch, dtype, grad_scale, ctx, /*count=*/ctx == nullptr);
  return Tensor();
}

Tensor Bert::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, batch, dtype, grad_scale, &ctx, &ctx.loss);
}

Tensor Bert::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                      DType dtype, float* loss) {
  return run_forward(chunk, input, batch, dtype, 1.0f, nullptr, loss);
}

Tensor Bert::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  Tensor dx;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.dhidden.defined(), "bert: backward of the last stage before its forward");
    dx = ctx.dhidden.reshape(sequence_parallel()
                                 ? Shape{ctx.ids.numel() / layout_.tensor->size(), config_.hidden}
                                 : Shape{ctx.ids.dim(0), ctx.ids.dim(1), config_.hidden});
    ctx.dhidden = Tensor();
    grads_ready(heads_in_backward_order());
  } else {
    dx = doutput;
  }
  dx = backward_layers(chunk, dx, ctx.layers);
  if (!is_first(chunk)) {
    ctx = Context{};
    return dx;
  }
  {
    HighPrecisionScope scope;
    embed_backward(dx, ctx);
  }
  std::vector<Parameter*> ready;
  if (embedding_norm_) ready = embedding_norm_->parameters();
  ready.push_back(&position_embeddings);
  ready.push_back(&token_type_embeddings);
  ready.push_back(&word_embeddings);
  grads_ready(ready);
  ctx = Context{};
  return Tensor();
}

}  // namespace octet
