// T5, whole: construction, the one forward (shared embedding, the encoder's layers with their
// relative position bias and final norm, the decoder's layers with causal self-attention, their
// bias and cross-attention over the encoder's output, the final norm and the output layer's
// cross-entropy) and its backward, parameters.
#include "octet/t5.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

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

TransformerLayerOptions layer_options(const T5Config& c, int64_t index, uint64_t seed,
                                      bool recompute) {
  const bool decoder = index >= c.num_layers;
  TransformerLayerOptions o;
  o.checkpoint = recompute;
  o.hidden_size = c.hidden;
  o.ffn_hidden_size = c.ffn_hidden;  // each GEGLU half: FC1 is [wi_0 | wi_1]
  o.num_attention_heads = c.num_heads;
  o.kv_channels = c.kv_channels;
  o.layernorm_epsilon = c.layernorm_eps;
  o.hidden_dropout = c.dropout;
  o.attention_dropout = c.dropout;
  o.normalization = NormKind::RMSNorm;
  o.activation = ops::ActivationKind::GeGlu;
  o.bias = false;
  o.softmax_scale = 1.0f;  // T5 folds the 1/sqrt(d) into the query's initialization
  o.layer_type = decoder ? LayerType::Decoder : LayerType::Encoder;
  o.self_attn_mask_type = decoder ? AttnMaskType::PaddingCausal : AttnMaskType::Padding;
  o.enc_dec_attn_mask_type = AttnMaskType::Padding;
  // Fan-in scaling as T5's initialization (the query's extra 1/sqrt(d_kv) aside).
  o.init_std = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  o.output_init_std = 1.0f / std::sqrt(static_cast<float>(c.ffn_hidden));
  o.seed = seed * 1000 + static_cast<uint64_t>(index) + 1;
  o.name = decoder ? "decoder.layer." + std::to_string(index - c.num_layers)
                   : "encoder.layer." + std::to_string(index);
  return o;
}

NormOptions norm_options(const T5Config& c, std::string name) {
  NormOptions n;
  n.hidden = c.hidden;
  n.kind = NormKind::RMSNorm;
  n.eps = c.layernorm_eps;
  n.name = std::move(name);
  return n;
}

T5::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<T5::Context*>(&base);
  OCTET_CHECK(ctx, "t5: expected a context from T5::make_context()");
  return *ctx;
}

// Each score's bucket: [T, S] I32 for T queries and S keys.
Tensor relative_buckets(const T5Config& c, int64_t T, int64_t S, bool bidirectional) {
  Tensor buckets = Tensor::empty({T, S}, DType::I32);
  int32_t* b = buckets.data<int32_t>();
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      b[i * S + j] = static_cast<int32_t>(
          t5_relative_position_bucket(j - i, bidirectional, c.relative_attention_num_buckets,
                                      c.relative_attention_max_distance));
    }
  }
  return buckets;
}

// bias [H, T, S] F32 from table [buckets, H]; and the adjoint into table's gradient.
Tensor relative_bias(const Parameter& table, const Tensor& buckets) {
  const int64_t H = table.value.dim(1), T = buckets.dim(0), S = buckets.dim(1);
  Tensor bias = Tensor::empty({H, T, S}, DType::F32);
  const float* w = table.value.data<float>();
  const int32_t* b = buckets.data<int32_t>();
  float* out = bias.data<float>();
#pragma omp parallel for
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t ij = 0; ij < T * S; ++ij) out[h * T * S + ij] = w[b[ij] * H + h];
  }
  return bias;
}

void relative_bias_backward(const Tensor& dbias, const Tensor& buckets, Tensor& dtable) {
  const int64_t H = dtable.dim(1), TS = buckets.numel();
  const float* d = dbias.data<float>();
  const int32_t* b = buckets.data<int32_t>();
  float* g = dtable.data<float>();
#pragma omp parallel for
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t ij = 0; ij < TS; ++ij) g[b[ij] * H + h] += d[h * TS + ij];
  }
}

void check_ids(const Tensor& ids, const Tensor& lengths, const char* what, const char* lengths_what,
               int64_t vocab, int64_t max_len, const char* max_name) {
  check_dtype(ids, DType::I32, std::string("t5: ") + what);
  OCTET_CHECK(ids.ndim() == 2 && ids.dim(0) > 0 && ids.dim(1) > 0, "t5: ", what,
              " expected [B,L] with B, L > 0, got ", shape_str(ids.shape()));
  OCTET_CHECK(ids.dim(1) <= max_len, "t5: ", what, " length ", ids.dim(1), " exceeds ", max_name,
              " ", max_len);
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    OCTET_CHECK(id[i] >= 0 && id[i] < vocab, "t5: ", what, "[", i / ids.dim(1), ",", i % ids.dim(1),
                "] = ", id[i], " expected in [0, ", vocab, ")");
  }
  check_dtype(lengths, DType::I32, std::string("t5: ") + lengths_what);
  check_shape(lengths, {ids.dim(0)}, std::string("t5: ") + lengths_what, "B");
  for (int64_t b = 0; b < ids.dim(0); ++b) {
    const int32_t n = lengths.data<int32_t>()[b];
    OCTET_CHECK(n >= 1 && n <= ids.dim(1), "t5: ", lengths_what, "[", b, "] = ", n,
                " expected in [1, ", ids.dim(1), "]");
  }
}

}  // namespace

T5::T5(const T5Config& config, uint64_t seed, ModelLayout layout, bool recompute_activations)
    : TransformerStack(
          "t5", config.num_layers + config.decoder_layers(), std::move(layout),
          [&](int64_t i) { return layer_options(config, i, seed, recompute_activations); }),
      config_(config) {
  Communicator* tp = layout_.tensor;
  const int64_t V = config.vocab_size, C = config.hidden, H = config.num_heads;
  OCTET_CHECK(tp == nullptr || V >= tp->size(), "t5: vocabulary ", V,
              " smaller than TP=", tp ? tp->size() : 1);
  vocab_ = tp ? vocab_range(V, tp->rank(), tp->size()) : VocabRange{0, V};
  bool encoder = false, decoder = false, norm = false;
  for (int chunk = 0; chunk < chunks(); ++chunk) {
    const ChunkLayers held = chunk_layers(chunk);
    encoder = encoder || held.encoder > 0;
    decoder = decoder || held.decoder;
    norm = norm || held.norm;
  }
  // This rank's rows of a same-seed whole table.
  auto vocabulary_rows = [&](Parameter& p) {
    if (tp == nullptr) return;
    p.value = p.value.slice_rows(vocab_.begin, vocab_.end).clone();
    p.grad = Tensor::zeros(p.value.shape(), DType::F32);
    p.shard = TensorShard::vocabulary_rows({V, C});
  };
  // Every parameter from its own seed: each layout holds the same values.
  if (has_first_) {
    shared =
        modules_detail::make_parameter("shared.weight", {V, C}, config.init_std, seed * 7919 + 1);
    vocabulary_rows(shared);
  }
  const float bias_std = 1.0f / std::sqrt(static_cast<float>(C));
  if (encoder) {
    encoder_relative_bias = modules_detail::make_parameter(
        "encoder.relative_attention_bias.weight", {config.relative_attention_num_buckets, H},
        bias_std, seed * 7919 + 2);
  }
  if (decoder) {
    decoder_relative_bias = modules_detail::make_parameter(
        "decoder.relative_attention_bias.weight", {config.relative_attention_num_buckets, H},
        bias_std, seed * 7919 + 3);
  }
  // Applied to token shards under sequence parallelism: partial gradients.
  if (norm) {
    encoder_norm_.emplace(norm_options(config, "encoder.final_layer_norm"));
    for (Parameter* p : encoder_norm_->parameters())
      p->shard.sequence_parallel = sequence_parallel();
  }
  if (has_last_) {
    decoder_norm_.emplace(norm_options(config, "decoder.final_layer_norm"));
    for (Parameter* p : decoder_norm_->parameters())
      p->shard.sequence_parallel = sequence_parallel();
    lm_head = modules_detail::make_parameter("lm_head.weight", {V, C}, bias_std, seed * 7919 + 4);
    vocabulary_rows(lm_head);
  }
  // T5 folds attention's 1/sqrt(d_kv) into the query's initialization: the query rows of each
  // projection start 1/sqrt(d_kv) smaller than the keys' and values'.
  const float query_scale = 1.0f / std::sqrt(static_cast<float>(config.kv_channels));
  // Under TP each fused projection holds this rank's query rows first.
  const int64_t A = config.num_heads * config.kv_channels / (tp ? tp->size() : 1);
  auto scale_rows = [&](Parameter& w, int64_t rows) {
    float* v = w.value.data<float>();
    for (int64_t i = 0; i < rows * w.value.dim(1); ++i) v[i] *= query_scale;
  };
  for (int chunk = 0; chunk < chunks(); ++chunk) {
    for (TransformerLayer& layer : layers(chunk)) {
      scale_rows(layer.self_attention.layernorm_qkv->linear.weight, A);
      if (layer.inter_attention) {
        Parameter& query = layer.inter_attention->layernorm_query->linear.weight;
        scale_rows(query, query.value.dim(0));
      }
      layer.on_parameters_updated();
    }
  }
}

T5::ChunkLayers T5::chunk_layers(int chunk) const {
  const int64_t L = config_.num_layers, first = global_layer(chunk, 0);
  const int64_t end = first + num_layers_ / layout_.stages;
  ChunkLayers held;
  held.encoder = layers_before(chunk, L);
  held.decoder = end > L;
  held.norm = first <= L && L < end;
  return held;
}

std::vector<Parameter*> T5::chunk_parameters(int chunk) {
  const ChunkLayers held = chunk_layers(chunk);
  std::vector<TransformerLayer>& stack = layers(chunk);
  std::vector<Parameter*> out;
  if (is_first(chunk)) out.push_back(&shared);
  if (held.encoder > 0) out.push_back(&encoder_relative_bias);
  for (size_t i = 0; i < held.encoder; ++i) stack[i].collect_parameters(out);
  if (held.norm) encoder_norm_->collect_parameters(out);
  if (held.decoder) out.push_back(&decoder_relative_bias);
  for (size_t i = held.encoder; i < stack.size(); ++i) stack[i].collect_parameters(out);
  if (is_last(chunk)) {
    decoder_norm_->collect_parameters(out);
    out.push_back(&lm_head);
  }
  return out;
}

void T5::collect_parameters(std::vector<Parameter*>& out) {
  // The whole model's order, each parameter once (a bias table serves several chunks).
  const std::vector<int> chunks = chunks_in_stage_order();
  if (shared.value.defined()) out.push_back(&shared);
  if (encoder_relative_bias.value.defined()) out.push_back(&encoder_relative_bias);
  for (int chunk : chunks) {
    std::vector<TransformerLayer>& stack = layers(chunk);
    for (size_t i = 0; i < chunk_layers(chunk).encoder; ++i) stack[i].collect_parameters(out);
  }
  if (encoder_norm_) encoder_norm_->collect_parameters(out);
  if (decoder_relative_bias.value.defined()) out.push_back(&decoder_relative_bias);
  for (int chunk : chunks) {
    std::vector<TransformerLayer>& stack = layers(chunk);
    for (size_t i = chunk_layers(chunk).encoder; i < stack.size(); ++i) {
      stack[i].collect_parameters(out);
    }
  }
  if (decoder_norm_) decoder_norm_->collect_parameters(out);
  if (lm_head.value.defined()) out.push_back(&lm_head);
}

std::vector<Parameter*> T5::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  if (lm_head.value.defined()) out.push_back(&lm_head);
  if (decoder_norm_) {
    for (Parameter* p : decoder_norm_->parameters()) out.push_back(p);
  }
  const std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = stack.size(); i-- > chunk_layers(*chunk).encoder;) {
      for (Parameter* p : stack[i].parameters()) out.push_back(p);
    }
  }
  if (decoder_relative_bias.value.defined()) out.push_back(&decoder_relative_bias);
  if (encoder_norm_) {
    for (Parameter* p : encoder_norm_->parameters()) out.push_back(p);
  }
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = chunk_layers(*chunk).encoder; i-- > 0;) {
      for (Parameter* p : stack[i].parameters()) out.push_back(p);
    }
  }
  if (encoder_relative_bias.value.defined()) out.push_back(&encoder_relative_bias);
  if (shared.value.defined()) out.push_back(&shared);
  return out;
}

std::vector<pipeline::TiedParameters> T5::tied_parameters() {
  // Every group, also where this rank holds no copy: each stack's stages, when more than one.
  const int64_t per_stage = num_layers_ / layout_.stages, L = config_.num_layers;
  pipeline::TiedParameters encoder, decoder;
  for (int stage = 0; stage < layout_.stages; ++stage) {
    if (stage * per_stage < L) encoder.stages.push_back(stage);
    if ((stage + 1) * per_stage > L) decoder.stages.push_back(stage);
  }
  if (encoder_relative_bias.value.defined()) encoder.parameters = {&encoder_relative_bias};
  if (decoder_relative_bias.value.defined()) decoder.parameters = {&decoder_relative_bias};
  std::vector<pipeline::TiedParameters> out;
  for (pipeline::TiedParameters* group : {&encoder, &decoder}) {
    if (group->stages.size() > 1) out.push_back(std::move(*group));
  }
  return out;
}

std::vector<int64_t> T5::fp8_state_indices() {
  const std::vector<Fp8State*> states = fp8_states();
  if (layout_.stages == 1) return octet::fp8_state_indices(states.size());
  // An encoder layer's count, and a decoder layer's (cross-attention's more), from the layers
  // held: the whole model's index of layer g's first state follows from them.
  int64_t encoder = -1, decoder = -1, cross = 0;
  for (int chunk = 0; chunk < chunks(); ++chunk) {
    for (TransformerLayer& layer : layers(chunk)) {
      const auto count = static_cast<int64_t>(layer.fp8_states().size());
      if (!layer.inter_attention) {
        encoder = count;
        continue;
      }
      decoder = count;
      cross = static_cast<int64_t>(layer.inter_attention->fp8_states().size());
    }
  }
  if (encoder < 0) encoder = decoder - cross;
  const int64_t L = config_.num_layers;
  std::vector<int64_t> out;
  for (int chunk : chunks_in_stage_order()) {
    const std::vector<TransformerLayer>& stack = layers(chunk);
    for (size_t i = 0; i < stack.size(); ++i) {
      const int64_t g = global_layer(chunk, i);
      const int64_t first = g < L ? g * encoder : L * encoder + (g - L) * decoder;
      const int64_t count = g < L ? encoder : decoder;
      for (int64_t k = 0; k < count; ++k) out.push_back(first + k);
    }
  }
  OCTET_CHECK(out.size() == states.size(), "t5: ", states.size(), " FP8 states held, ", out.size(),
              " indexed");
  return out;
}

void T5::on_parameters_updated() {
  output_cache_.invalidate();
  TransformerStack::on_parameters_updated();
}

std::unique_ptr<pipeline::StagedModel::Context> T5::make_context() const {
  return std::make_unique<Context>();
}

Shape T5::activation_shape(const pipeline::MicroBatch& batch) const {
  const Tensor& enc = pipeline::batch_tensor(batch, "enc_ids", "t5");
  const Tensor& dec = pipeline::batch_tensor(batch, "dec_ids", "t5");
  const int64_t ranks = sequence_parallel() ? layout_.tensor->size() : 1;
  return {(enc.numel() + dec.numel()) / ranks, config_.hidden};
}

Tensor T5::pack(const Tensor& encoder, const Tensor& decoder) const {
  const int64_t C = config_.hidden, E = encoder.numel() / C, D = decoder.numel() / C;
  Tensor packed = Tensor::empty({E + D, C}, encoder.dtype());
  packed.slice_rows(0, E).copy_from(encoder.reshape({E, C}));
  packed.slice_rows(E, E + D).copy_from(decoder.reshape({D, C}));
  return packed;
}

std::pair<Tensor, Tensor> T5::unpack(const Tensor& packed, int64_t B, int64_t S, int64_t T) const {
  const int64_t C = config_.hidden;
  if (sequence_parallel()) {
    const int64_t E = B * S / layout_.tensor->size();
    return {packed.slice_rows(0, E).clone(), packed.slice_rows(E, packed.dim(0)).clone()};
  }
  return {packed.slice_rows(0, B * S).clone().reshape({B, S, C}),
          packed.slice_rows(B * S, B * (S + T)).clone().reshape({B, T, C})};
}

Tensor T5::embed(const Tensor& ids, DType dtype) {
  Communicator* tp = layout_.tensor;
  const int64_t N = ids.numel(), C = config_.hidden;
  Tensor x = Tensor::empty({N, C}, DType::F32);
  if (tp == nullptr) {
    ops::embedding_forward(ids.reshape({N}), shared.value, x);
    return to_dtype(x, dtype).reshape({ids.dim(0), ids.dim(1), C});
  }
  // Each rank looks up its vocabulary rows; the sum over the group is the embedding.
  ops::embedding_part_forward(ids.reshape({N}), shared.value, vocab_.begin, config_.vocab_size, x);
  if (sequence_parallel())
    return to_dtype(reduce_scatter_to_sequence_parallel_region(x, *tp), dtype);
  return to_dtype(reduce_from_tensor_parallel_region(x, *tp), dtype)
      .reshape({ids.dim(0), ids.dim(1), C});
}

void T5::embed_backward(const Tensor& ids, const Tensor& dx_in) {
  Communicator* tp = layout_.tensor;
  const int64_t N = ids.numel(), C = config_.hidden;
  const Tensor dx = to_dtype(dx_in, DType::F32).reshape({dx_in.numel() / C, C});
  if (tp == nullptr) {
    ops::embedding_backward(ids.reshape({N}), dx, shared.grad);
    return;
  }
  const Tensor dwhole = sequence_parallel()
                            ? reduce_scatter_to_sequence_parallel_region_backward(dx, *tp)
                            : reduce_from_tensor_parallel_region_backward(dx, *tp);
  ops::embedding_part_backward(ids.reshape({N}), dwhole, vocab_.begin, config_.vocab_size,
                               shared.grad);
}

Tensor T5::run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                       DType dtype, float grad_scale, Context* ctx, float* loss, bool count) {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "t5: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const Tensor& enc_ids = pipeline::batch_tensor(batch, "enc_ids", "t5");
  const Tensor& enc_lengths = pipeline::batch_tensor(batch, "enc_lengths", "t5");
  const Tensor& dec_ids = pipeline::batch_tensor(batch, "dec_ids", "t5");
  const Tensor& dec_lengths = pipeline::batch_tensor(batch, "dec_lengths", "t5");
  const Tensor& targets = pipeline::batch_tensor(batch, "targets", "t5");
  check_ids(enc_ids, enc_lengths, "enc_ids", "enc_lengths", config_.vocab_size, config_.max_seq_len,
            "max_seq_len");
  check_ids(dec_ids, dec_lengths, "dec_ids", "dec_lengths", config_.vocab_size,
            config_.max_target_len, "max_target_len");
  OCTET_CHECK(dec_ids.dim(0) == enc_ids.dim(0), "t5: dec_ids hold ", dec_ids.dim(0),
              " sequences, enc_ids ", enc_ids.dim(0));
  check_dtype(targets, DType::I32, "t5: targets");
  check_shape(targets, dec_ids.shape(), "t5: targets", "B,T");
  const int64_t B = enc_ids.dim(0), S = enc_ids.dim(1), T = dec_ids.dim(1), C = config_.hidden;
  const ChunkLayers held = chunk_layers(chunk);
  std::vector<TransformerLayer>& stack = layers(chunk);
  Context scratch;
  Context& c = ctx ? *ctx : scratch;
  c.enc_ids = enc_ids;
  c.dec_ids = dec_ids;
  c.enc_lengths = enc_lengths;
  c.dec_lengths = dec_lengths;
  c.layers.assign(stack.size(), TransformerLayer::Context{});
  // Under sequence parallelism the layers see this rank's token rows and their lengths S, T.
  const int64_t enc_seq = sequence_parallel() ? S : 0, dec_seq = sequence_parallel() ? T : 0;
  // h: the encoder's stream (its hidden state, or the normed output past the final norm); y:
  // the decoder's. The first stage embeds both; later ones receive them packed.
  Tensor h, y;
  if (is_first(chunk)) {
    h = embed(enc_ids, dtype);
    y = embed(dec_ids, dtype);
  } else {
    const Shape boundary = activation_shape(batch);
    check_shape(input, boundary, "t5: input of chunk " + std::to_string(chunk),
                "B*S+B*T (/TP under SP),C");
    check_dtype(input, dtype, "t5: input of chunk " + std::to_string(chunk));
    std::tie(h, y) = unpack(input, B, S, T);
  }
  if (held.encoder > 0) {
    c.enc_buckets = relative_buckets(config_, S, S, /*bidirectional=*/true);
    const Tensor enc_bias = relative_bias(encoder_relative_bias, c.enc_buckets);
    for (size_t i = 0; i < held.encoder; ++i) {
      TransformerLayer::Context layer_scratch;
      HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
      h = stack[i].forward(h, ctx ? c.layers[i] : layer_scratch, nullptr, &enc_lengths, nullptr,
                           enc_seq, &enc_bias);
    }
  }
  if (held.norm) {
    h = encoder_norm_->forward(h, c.encoder_norm);
  }
  if (held.decoder) {
    // Causal self-attention, cross-attention over the encoder's output.
    c.enc_out = h;
    c.dec_buckets = relative_buckets(config_, T, T, /*bidirectional=*/false);
    const Tensor dec_bias = relative_bias(decoder_relative_bias, c.dec_buckets);
    for (size_t i = held.encoder; i < stack.size(); ++i) {
      TransformerLayer::Context layer_scratch;
      HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
      y = stack[i].forward(y, ctx ? c.layers[i] : layer_scratch, &c.enc_out, &dec_lengths,
                           &enc_lengths, dec_seq, &dec_bias);
    }
  }
  if (!is_last(chunk)) return pack(h, y);
  Tensor hidden = decoder_norm_->forward(y, c.decoder_norm).reshape({-1, C});
  // The output layer sees every token: gathered from the token shards under SP.
  Communicator* tp = layout_.tensor;
  if (sequence_parallel()) hidden = gather_from_sequence_parallel_region(hidden, *tp);
  const Tensor flat_targets = targets.reshape({B * T});
  HighPrecisionScope scope;
  if (count) {
    const std::vector<int64_t> predicted =
        gpt_parts::vocab_argmax(hidden, lm_head, dtype, output_cache_, vocab_, tp);
    const int32_t* t = flat_targets.data<int32_t>();
    if (tp == nullptr || tp->rank() == 0) {
      for (int64_t r = 0; r < B * T; ++r) {
        if (t[r] == -100) continue;
        eval_correct_ += predicted[static_cast<size_t>(r)] == t[r];
        ++eval_seen_;
      }
    }
  }
  if (tp == nullptr) {
    *loss = gpt_parts::tied_output_loss(hidden, flat_targets, lm_head, dtype, grad_scale,
                                        ctx ? &c.dhidden : nullptr, output_cache_);
    return Tensor();
  }
  *loss = gpt_parts::tied_output_loss(
      copy_to_tensor_parallel_region(hidden, *tp), flat_targets, lm_head, dtype, grad_scale,
      ctx ? &c.dhidden : nullptr, output_cache_,
      [&](Tensor& logits, const Tensor& target_chunk, Tensor& losses, bool backward, float scale) {
        vocab_parallel_cross_entropy(logits, target_chunk, vocab_, losses, backward, scale, *tp);
      },
      // Rank 0's shard is the widest: every rank cuts the same chunks (collective per chunk).
      vocab_range(config_.vocab_size, 0, tp->size()).size());
  if (ctx) {
    // Each rank's part of the gradient comes from its vocabulary rows: summed over the group,
    // then this rank's token rows under SP.
    c.dhidden = copy_to_tensor_parallel_region_backward(c.dhidden, *tp);
    if (sequence_parallel()) c.dhidden = scatter_to_sequence_parallel_region(c.dhidden, *tp);
  }
  return Tensor();
}

Tensor T5::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                   float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, batch, dtype, grad_scale, &ctx, &ctx.loss, false);
}

Tensor T5::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                    float* loss) {
  return run_forward(chunk, input, batch, dtype, 1.0f, nullptr, loss, true);
}

Tensor T5::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  OCTET_CHECK(ctx.enc_ids.defined() && (!is_last(chunk) || ctx.dhidden.defined()),
              "t5: backward of chunk ", chunk, " before its forward");
  const int64_t C = config_.hidden, H = config_.num_heads;
  const int64_t B = ctx.dec_ids.dim(0), S = ctx.enc_ids.dim(1), T = ctx.dec_ids.dim(1);
  const ChunkLayers held = chunk_layers(chunk);
  std::vector<TransformerLayer>& stack = layers(chunk);
  Communicator* tp = layout_.tensor;
  const bool sp = sequence_parallel();
  // Activations: [B,T,C], or this rank's token rows [B*T/TP, C] under SP.
  auto shaped = [&](const Tensor& x, int64_t L_) {
    return sp ? x.reshape({-1, C}) : x.reshape({B, L_, C});
  };
  // Under TP each rank's heads gave their part of a bias's gradient: summed over the group.
  auto bias_backward = [&](Tensor& dbias, const Tensor& buckets, Parameter& table) {
    if (tp == nullptr) return relative_bias_backward(dbias, buckets, table.grad);
    Tensor part = Tensor::zeros(table.grad.shape(), DType::F32);
    relative_bias_backward(dbias, buckets, part);
    tp->all_reduce(part);
    float* g = table.grad.data<float>();
    const float* add = part.data<float>();
    for (int64_t k = 0; k < part.numel(); ++k) g[k] += add[k];
  };
  // dh, dy: the gradients of the two streams at this chunk's output (see run_forward).
  Tensor dh, dy;
  if (is_last(chunk)) {
    dy = decoder_norm_->backward(shaped(ctx.dhidden, T), ctx.decoder_norm);
    ctx.dhidden = Tensor();
    grads_ready({&lm_head});
    grads_ready(decoder_norm_->parameters());
  } else {
    std::tie(dh, dy) = unpack(doutput, B, S, T);
  }
  if (held.decoder) {
    // The encoder output's gradient: what later stages sent, plus each decoder layer's, in F32.
    Tensor denc = Tensor::zeros(ctx.enc_out.shape(), DType::F32);
    float* acc = denc.data<float>();
    auto accumulate = [&](const Tensor& d) {
      const Tensor d32 = to_dtype(d, DType::F32);
      const float* add = d32.data<float>();
      for (int64_t k = 0; k < denc.numel(); ++k) acc[k] += add[k];
    };
    if (dh.defined()) accumulate(dh);
    Tensor ddec_bias = Tensor::zeros({H, T, T}, DType::F32);
    for (size_t i = stack.size(); i-- > held.encoder;) {
      Tensor d_encoder_output;
      HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
      dy = stack[i].backward(dy, ctx.layers[i], &d_encoder_output, &ddec_bias);
      ctx.layers[i] = TransformerLayer::Context{};
      accumulate(d_encoder_output);
      grads_ready(stack[i].parameters());
    }
    bias_backward(ddec_bias, ctx.dec_buckets, decoder_relative_bias);
    grads_ready({&decoder_relative_bias});
    dh = to_dtype(denc, ctx.enc_out.dtype());
  }
  if (held.norm) {
    dh = encoder_norm_->backward(shaped(dh, S), ctx.encoder_norm);
    grads_ready(encoder_norm_->parameters());
  }
  if (held.encoder > 0) {
    Tensor denc_bias = Tensor::zeros({H, S, S}, DType::F32);
    dh = shaped(dh, S);
    for (size_t i = held.encoder; i-- > 0;) {
      HighPrecisionScope precision(is_high_precision_layer(global_layer(chunk, i)));
      dh = stack[i].backward(dh, ctx.layers[i], nullptr, &denc_bias);
      ctx.layers[i] = TransformerLayer::Context{};
      grads_ready(stack[i].parameters());
    }
    bias_backward(denc_bias, ctx.enc_buckets, encoder_relative_bias);
    grads_ready({&encoder_relative_bias});
  }
  if (!is_first(chunk)) {
    ctx = Context{};
    return pack(dh, dy);
  }
  // Both embeddings into the shared table: the decoder's first, as the whole model always
  // accumulated them.
  embed_backward(ctx.dec_ids, dy);
  embed_backward(ctx.enc_ids, dh);
  grads_ready({&shared});
  ctx = Context{};
  return Tensor();
}

}  // namespace octet
