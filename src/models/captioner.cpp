// The image captioner, whole: construction, the vision encoder and projector (the prefix), the
// decoder over prefix and caption, the tied output layer's loss over the caption's tokens, their
// backward, and greedy decoding.
#include "octet/captioner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "models/gpt_parts.h"
#include "models/image_rows.h"
#include "models/precision_scope.h"
#include "modules/common.h"
#include "octet/ops/activation.h"
#include "octet/ops/embedding.h"

namespace octet {

using models_detail::HighPrecisionScope;
using models_detail::put_rows;
using models_detail::take_rows;
using models_detail::to_dtype;

namespace {

// The projector's activation: LLaVA-1.5's nn.GELU(), the exact (erf) form.
constexpr ops::ActivationKind kProjectorActivation = ops::ActivationKind::GeluErf;

ImageCaptioner::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<ImageCaptioner::Context*>(&base);
  OCTET_CHECK(ctx, "captioner: expected a context from ImageCaptioner::make_context()");
  return *ctx;
}

// Rows b * period + first + i, i in [0, count), of every sequence b in [0, B).
std::vector<int64_t> block_rows(int64_t B, int64_t period, int64_t first, int64_t count) {
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(B * count));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < count; ++i) rows.push_back(b * period + first + i);
  }
  return rows;
}

}  // namespace

ImageCaptioner::ImageCaptioner(const CaptionerConfig& config, uint64_t seed, ModelLayout layout,
                               bool recompute_activations)
    : VisionTextStack("captioner", config, seed, std::move(layout), recompute_activations,
                      "language_model.layers."),
      config_(config) {
  const CaptionerConfig& c = config;
  const int64_t Cv = c.vision_hidden, Ct = c.text_hidden;
  bool bridge = false;
  for (int chunk = 0; chunk < chunks(); ++chunk) bridge = bridge || is_bridge(chunk);
  if (bridge) {
    post_norm_.emplace(layer_norm_options(c, Cv, "vision_model.post_layernorm"));
    project_in_.emplace(linear_options(Cv, Ct, true, c.init_std, seed * 7919 + 11,
                                       "multi_modal_projector.linear_1"));
    project_out_.emplace(linear_options(Ct, Ct, true, c.init_std, seed * 7919 + 12,
                                        "multi_modal_projector.linear_2"));
  }
  if (bridge || has_last_) {
    token_embedding = modules_detail::make_parameter(
        "language_model.embed_tokens", {c.vocab_size, Ct}, c.init_std, seed * 7919 + 13);
  }
  if (bridge) {
    text_positions = modules_detail::make_parameter(
        "language_model.embed_positions", {c.decoder_seq_len(), Ct}, c.init_std, seed * 7919 + 14);
  }
  if (has_last_) final_norm_.emplace(layer_norm_options(c, Ct, "language_model.norm"));
}

int ImageCaptioner::bridge_stage() const {
  return static_cast<int>(config_.vision_layers / (num_layers_ / layout_.stages));
}

std::vector<Parameter*> ImageCaptioner::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  collect_chunk_vision(chunk, out);
  if (is_bridge(chunk)) {
    post_norm_->collect_parameters(out);
    project_in_->collect_parameters(out);
    project_out_->collect_parameters(out);
    out.push_back(&token_embedding);
    out.push_back(&text_positions);
  }
  for (size_t i = vision; i < stack.size(); ++i) stack[i].collect_parameters(out);
  if (is_last(chunk)) {
    final_norm_->collect_parameters(out);
    if (!is_bridge(chunk)) out.push_back(&token_embedding);  // the output layer's copy
  }
  return out;
}

void ImageCaptioner::collect_parameters(std::vector<Parameter*>& out) {
  // The whole model's order, each parameter once (one rank may hold the embedding's two uses).
  const size_t first = out.size();
  for (int chunk : chunks_in_stage_order()) {
    for (Parameter* p : chunk_parameters(chunk)) {
      if (std::find(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(), p) == out.end()) {
        out.push_back(p);
      }
    }
  }
}

// Backward runs the decoder, the projector, then the encoder (ImageCaptioner::backward), the
// last stage first.
std::vector<Parameter*> ImageCaptioner::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  auto add = [&](const std::vector<Parameter*>& ps) {
    for (Parameter* p : ps) {
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
    }
  };
  const std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    const size_t vision = vision_layers_in(*chunk);
    if (is_last(*chunk)) add(final_norm_->parameters());
    for (size_t i = stack.size(); i-- > vision;) add(stack[i].parameters());
    if (is_bridge(*chunk)) {
      add({&token_embedding, &text_positions});
      add(project_out_->parameters());
      add(project_in_->parameters());
      add(post_norm_->parameters());
    }
    for (size_t i = vision; i-- > 0;) add(stack[i].parameters());
  }
  add_vision_embedding_in_backward_order(out);
  return out;
}

std::vector<pipeline::TiedParameters> ImageCaptioner::tied_parameters() {
  const int bridge = bridge_stage(), last = layout_.stages - 1;
  if (bridge == last) return {};
  pipeline::TiedParameters embedding;
  embedding.stages = {bridge, last};
  if (token_embedding.value.defined()) embedding.parameters = {&token_embedding};
  return {embedding};
}

void ImageCaptioner::on_parameters_updated() {
  TransformerStack::on_parameters_updated();
  vision_parameters_updated();
  if (project_in_) project_in_->on_parameters_updated();
  if (project_out_) project_out_->on_parameters_updated();
  output_cache_.invalidate();
}

std::unique_ptr<pipeline::StagedModel::Context> ImageCaptioner::make_context() const {
  return std::make_unique<Context>();
}

Shape ImageCaptioner::activation_shape(const pipeline::MicroBatch& batch) const {
  const int64_t B = pipeline::batch_tensor(batch, "pixels", "captioner").dim(0);
  return {B, config_.vision_seq_len(), config_.vision_hidden};
}

Shape ImageCaptioner::boundary_shape(const pipeline::MicroBatch& batch, int stage) const {
  // The stage's first layer is an encoder layer or the first decoder layer: the image tokens.
  if (stage <= bridge_stage()) return activation_shape(batch);
  const int64_t B = pipeline::batch_tensor(batch, "pixels", "captioner").dim(0);
  const int64_t T = pipeline::batch_tensor(batch, "text_ids", "captioner").dim(-1);
  return {B, config_.vision_seq_len() + T, config_.text_hidden};
}

Tensor ImageCaptioner::project(const Tensor& tokens, DType dtype, Context* ctx) {
  const int64_t T = config_.vision_seq_len(), C = config_.vision_hidden;
  const int64_t B = tokens.numel() / (T * C);
  Context scratch;
  Context& x_ctx = ctx ? *ctx : scratch;
  const Tensor features =
      post_norm_->forward(to_dtype(tokens, dtype).reshape({B * T, C}), x_ctx.post_norm);
  HighPrecisionScope scope;
  Tensor hidden = project_in_->forward(features, x_ctx.project_in);
  Tensor activated = Tensor::empty(hidden.shape(), hidden.dtype());
  ops::activation_forward(kProjectorActivation, hidden, nullptr, activated);
  if (ctx) ctx->projector_hidden = hidden;
  return to_dtype(project_out_->forward(activated, x_ctx.project_out), DType::F32);
}

Tensor ImageCaptioner::project_backward(const Tensor& dprefix, Context& ctx) {
  const int64_t B = ctx.batch, T = config_.vision_seq_len(), C = config_.vision_hidden;
  Tensor dfeatures;
  {
    HighPrecisionScope scope;
    const Tensor dactivated =
        project_out_->backward(to_dtype(dprefix, ctx.project_out.dtype), ctx.project_out);
    grads_ready(project_out_->parameters());
    Tensor dhidden = Tensor::empty(ctx.projector_hidden.shape(), ctx.projector_hidden.dtype());
    ops::activation_backward(kProjectorActivation, to_dtype(dactivated, dhidden.dtype()),
                             ctx.projector_hidden, nullptr, dhidden, nullptr);
    ctx.projector_hidden = Tensor();
    dfeatures = project_in_->backward(dhidden, ctx.project_in);
    grads_ready(project_in_->parameters());
  }
  // A frozen encoder (LLaVA's first stage: --freeze vision_model.) has no gradient to take.
  const std::vector<Parameter*> norm = post_norm_->parameters();
  if (vision_tower_frozen() && frozen(norm)) return Tensor();
  const Tensor dh = post_norm_->backward(dfeatures, ctx.post_norm).reshape({B, T, C});
  grads_ready(norm);
  return dh;
}

Tensor ImageCaptioner::decoder_input(const Tensor& prefix, const Tensor& ids, DType dtype) {
  const int64_t B = ids.dim(0), T = ids.dim(1), Tv = config_.vision_seq_len(), Td = Tv + T;
  const int64_t C = config_.text_hidden;
  Tensor text = Tensor::empty({B * T, C}, DType::F32);
  ops::embedding_forward(ids.reshape({B * T}), token_embedding.value, text);
  // [prefix of image b; caption b] for every b, then the positions 0 .. Td-1.
  Tensor x = Tensor::empty({B * Td, C}, DType::F32);
  const auto row_bytes = static_cast<size_t>(C) * sizeof(float);
  const auto* p = static_cast<const char*>(prefix.raw());
  const auto* t = static_cast<const char*>(text.raw());
  auto* out = static_cast<char*>(x.raw());
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(out + static_cast<size_t>(b * Td) * row_bytes,
                p + static_cast<size_t>(b * Tv) * row_bytes, static_cast<size_t>(Tv) * row_bytes);
    std::memcpy(out + static_cast<size_t>(b * Td + Tv) * row_bytes,
                t + static_cast<size_t>(b * T) * row_bytes, static_cast<size_t>(T) * row_bytes);
  }
  ops::position_embedding_forward(x, text_positions.value, Td);
  return to_dtype(x, dtype).reshape({B, Td, C});
}

Tensor ImageCaptioner::decoder_input_backward(const Tensor& dx_in, const Tensor& ids) {
  const int64_t B = ids.dim(0), T = ids.dim(1), Tv = config_.vision_seq_len(), Td = Tv + T;
  const Tensor dx = to_dtype(dx_in, DType::F32).reshape({B * Td, config_.text_hidden});
  ops::position_embedding_backward(dx, Td, text_positions.grad);
  ops::embedding_backward(ids.reshape({B * T}), take_rows(dx, block_rows(B, Td, Tv, T)),
                          token_embedding.grad);
  grads_ready({&token_embedding, &text_positions});
  return take_rows(dx, block_rows(B, Td, 0, Tv));
}

Tensor ImageCaptioner::run_forward(int chunk, const Tensor& input,
                                   const pipeline::MicroBatch& batch, DType dtype, float grad_scale,
                                   Context* ctx, float* loss, bool count) {
  const CaptionerConfig& c = config_;
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "captioner: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const Tensor& pixels = pipeline::batch_tensor(batch, "pixels", "captioner");
  const Tensor& ids = pipeline::batch_tensor(batch, "text_ids", "captioner");
  const Tensor& lengths = pipeline::batch_tensor(batch, "text_lengths", "captioner");
  check_dtype(ids, DType::I32, "captioner: text_ids");
  OCTET_CHECK(ids.ndim() == 2 && pixels.ndim() == 2 && ids.dim(0) == pixels.dim(0) &&
                  ids.dim(1) >= 2 && ids.dim(1) <= c.max_text_len,
              "captioner: text_ids expected [B, T] with one caption per image (", pixels.dim(0),
              " images) and T in [2, max_text_len = ", c.max_text_len, "], got ",
              shape_str(ids.shape()));
  const int64_t B = ids.dim(0), T = ids.dim(1), Tv = c.vision_seq_len(), Td = Tv + T;
  check_dtype(lengths, DType::I32, "captioner: text_lengths");
  check_shape(lengths, {B}, "captioner: text_lengths", "B");
  const int32_t* id = ids.data<int32_t>();
  const int32_t* len = lengths.data<int32_t>();
  for (int64_t k = 0; k < B * T; ++k) {
    OCTET_CHECK(id[k] >= 0 && id[k] < c.vocab_size, "captioner: token id ", id[k],
                " expected in [0, vocab_size = ", c.vocab_size, ")");
  }
  for (int64_t b = 0; b < B; ++b) {
    OCTET_CHECK(len[b] >= 2 && len[b] <= T, "captioner: text length ", len[b], " of caption ", b,
                " expected in [2, ", T, "] ([SOS] ... [EOS])");
    OCTET_CHECK(id[b * T] == c.sos_id, "captioner: caption ", b, " expected to start with [SOS] (",
                c.sos_id, "), got ", id[b * T]);
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  Context scratch;
  Context& x = ctx ? *ctx : scratch;
  x.layers.assign(stack.size(), TransformerLayer::Context{});
  x.batch = B;
  x.text_ids = ids;
  std::vector<TransformerLayer::Context>* contexts = ctx ? &x.layers : nullptr;
  Tensor h;
  if (is_first(chunk)) {
    h = vision_embed(pixels, dtype, ctx ? &x.vision : nullptr);
  } else {
    const std::string what = "captioner: input of chunk " + std::to_string(chunk);
    check_shape(input, boundary_shape(batch, stage_of_chunk(chunk)), what,
                is_bridge(chunk) ? "B,Tv,Cv" : "B,Tv+T,Ct");
    check_dtype(input, dtype, what);
    h = input;
  }
  if (vision > 0) h = layers_forward(chunk, h, Tv, 0, vision, contexts);
  if (is_bridge(chunk)) h = decoder_input(project(h, dtype, ctx), ids, dtype);
  if (vision < stack.size()) h = layers_forward(chunk, h, Td, vision, stack.size(), contexts);
  if (!is_last(chunk)) return h;
  const Tensor hidden = final_norm_->forward(h.reshape({B * Td, c.text_hidden}), x.final_norm);
  *loss = caption_loss(hidden, ids, lengths, dtype, grad_scale, ctx, count);
  return Tensor();
}

float ImageCaptioner::caption_loss(const Tensor& hidden, const Tensor& ids, const Tensor& lengths,
                                   DType dtype, float grad_scale, Context* ctx, bool count) {
  const CaptionerConfig& c = config_;
  const int64_t B = ids.dim(0), T = ids.dim(1), Tv = c.vision_seq_len(), Td = Tv + T;
  const int32_t* id = ids.data<int32_t>();
  const int32_t* len = lengths.data<int32_t>();  // checked by run_forward
  // Targets: caption b's token j + 1 after its rows up to j (the words and the [EOS]).
  std::vector<int32_t> target(static_cast<size_t>(B * (T - 1)));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j + 1 < T; ++j) {
      target[static_cast<size_t>(b * (T - 1) + j)] = j + 1 < len[b] ? id[b * T + j + 1] : -100;
    }
  }
  Tensor targets = Tensor::empty({B * (T - 1)}, DType::I32);
  std::memcpy(targets.raw(), target.data(), target.size() * sizeof(int32_t));
  // The output layer over the rows that predict a caption token.
  const std::vector<int64_t> rows = block_rows(B, Td, Tv, T - 1);
  const Tensor predicting = take_rows(hidden, rows);
  HighPrecisionScope scope;
  if (count) {
    const std::vector<int64_t> predicted = gpt_parts::vocab_argmax(
        predicting, token_embedding, dtype, output_cache_, {0, c.vocab_size}, nullptr);
    for (size_t r = 0; r < target.size(); ++r) {
      if (target[r] == -100) continue;
      eval_correct_ += predicted[r] == target[r];
      ++eval_seen_;
    }
  }
  Tensor dpredicting;
  const float loss =
      gpt_parts::tied_output_loss(predicting, targets, token_embedding, dtype, grad_scale,
                                  ctx ? &dpredicting : nullptr, output_cache_);
  if (ctx) ctx->dhidden = put_rows(dpredicting, B * Td, rows).reshape({B, Td, c.text_hidden});
  return loss;
}

Tensor ImageCaptioner::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                               DType dtype, float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, batch, dtype, grad_scale, &ctx, &ctx.loss, false);
}

Tensor ImageCaptioner::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                                DType dtype, float* loss) {
  return run_forward(chunk, input, batch, dtype, 1.0f, nullptr, loss, true);
}

Tensor ImageCaptioner::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  OCTET_CHECK(ctx.text_ids.defined(), "captioner: backward before its forward");
  const int64_t T = ctx.text_ids.dim(1), Tv = config_.vision_seq_len(), Td = Tv + T;
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  Tensor dh = doutput;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.dhidden.defined(), "captioner: backward before its forward");
    dh = final_norm_->backward(ctx.dhidden, ctx.final_norm);
    ctx.dhidden = Tensor();
    grads_ready(final_norm_->parameters());
  }
  if (vision < stack.size()) dh = layers_backward(chunk, dh, Td, vision, stack.size(), ctx.layers);
  if (is_bridge(chunk)) {
    dh = project_backward(decoder_input_backward(dh, ctx.text_ids), ctx);
    if (!dh.defined()) {  // the whole encoder frozen: nothing more to compute
      ctx = Context{};
      return Tensor();
    }
  }
  if (vision > 0) dh = layers_backward(chunk, dh, Tv, 0, vision, ctx.layers);
  if (is_first(chunk)) {
    vision_embed_backward(dh, ctx.vision);
    dh = Tensor();
  }
  ctx = Context{};
  return dh;
}

std::vector<std::vector<int32_t>> ImageCaptioner::generate(const Tensor& pixels, DType dtype) {
  const CaptionerConfig& c = config_;
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "captioner: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  check_whole("generate");
  const Tensor prefix = project(vision_encode(pixels, dtype, nullptr, nullptr), dtype, nullptr);
  const int64_t N = pixels.dim(0), Tv = c.vision_seq_len(), C = c.text_hidden;
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(N), {static_cast<int32_t>(c.sos_id)});
  std::vector<bool> done(static_cast<size_t>(N), false);
  // Each step runs the decoder over the whole prefix and caption so far: captions are short.
  for (int64_t T = 1; T < c.max_text_len; ++T) {
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    Tensor ids = Tensor::empty({N, T}, DType::I32);
    int32_t* id = ids.data<int32_t>();
    for (int64_t n = 0; n < N; ++n) {
      const std::vector<int32_t>& caption = out[static_cast<size_t>(n)];
      for (int64_t t = 0; t < T; ++t) {
        // A finished caption is held at its [EOS] (its rows are not read again).
        id[n * T + t] = t < static_cast<int64_t>(caption.size()) ? caption[static_cast<size_t>(t)]
                                                                 : static_cast<int32_t>(c.eos_id);
      }
    }
    const Tensor h = layers_forward(0, decoder_input(prefix, ids, dtype), Tv + T,
                                    first_text_layer(), layers(0).size(), nullptr);
    Norm::Context norm;
    const Tensor hidden = final_norm_->forward(h.reshape({N * (Tv + T), C}), norm);
    const Tensor last = take_rows(hidden, block_rows(N, Tv + T, Tv + T - 1, 1));
    HighPrecisionScope scope;
    const std::vector<int64_t> predicted = gpt_parts::vocab_argmax(
        last, token_embedding, dtype, output_cache_, {0, c.vocab_size}, nullptr);
    for (int64_t n = 0; n < N; ++n) {
      if (done[static_cast<size_t>(n)]) continue;
      const auto next = static_cast<int32_t>(predicted[static_cast<size_t>(n)]);
      out[static_cast<size_t>(n)].push_back(next);
      done[static_cast<size_t>(n)] = next == c.eos_id;
    }
  }
  return out;
}

}  // namespace octet
