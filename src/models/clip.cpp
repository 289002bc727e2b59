// CLIP, whole: construction, the two towers' forward (vision: patch embedding, class token and
// positions, pre-LayerNorm, encoder layers, the class token's LayerNorm; text: token and
// position embeddings, causal layers, the [EOS] row's LayerNorm), the projections, the
// symmetric contrastive loss and zero-shot classification, and their backward.
#include "octet/clip.h"

#include <algorithm>
#include <cmath>

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

pipeline::MicroBatch clip_micro_batch(const Tensor& pixels, const Tensor& labels,
                                      const Tensor& text_ids, const Tensor& text_lengths,
                                      const Tensor& class_ids, const Tensor& class_lengths) {
  return {{"pixels", pixels},       {"labels", labels},
          {"text_ids", text_ids},   {"text_lengths", text_lengths},
          {"class_ids", class_ids}, {"class_lengths", class_lengths}};
}

namespace {

// The largest similarity scale (CLIP clamps exp(logit_scale) at 100).
const float kMaxLogitScale = std::log(100.0f);

CLIP::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<CLIP::Context*>(&base);
  OCTET_CHECK(ctx, "clip: expected a context from CLIP::make_context()");
  return *ctx;
}

// Each row of x [N, D] F32 divided by its L2 norm (norms kept for the backward).
Tensor unit_rows(const Tensor& x, std::vector<double>* norms) {
  const int64_t N = x.dim(0), D = x.dim(1);
  Tensor out = Tensor::empty({N, D}, DType::F32);
  const float* in = x.data<float>();
  float* o = out.data<float>();
  if (norms) norms->assign(static_cast<size_t>(N), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    double sum = 0;
    for (int64_t k = 0; k < D; ++k) sum += double(in[i * D + k]) * in[i * D + k];
    const double norm = std::max(std::sqrt(sum), 1e-12);
    if (norms) (*norms)[static_cast<size_t>(i)] = norm;
    for (int64_t k = 0; k < D; ++k) o[i * D + k] = static_cast<float>(in[i * D + k] / norm);
  }
  return out;
}

// unit_rows' backward: du (the gradient at the unit rows u) -> dx = (du - u (u . du)) / norm.
Tensor unit_rows_backward(const std::vector<double>& du, const Tensor& u,
                          const std::vector<double>& norms) {
  const int64_t N = u.dim(0), D = u.dim(1);
  Tensor dx = Tensor::empty({N, D}, DType::F32);
  const float* uu = u.data<float>();
  float* d = dx.data<float>();
  for (int64_t i = 0; i < N; ++i) {
    double dot = 0;
    for (int64_t k = 0; k < D; ++k) dot += du[static_cast<size_t>(i * D + k)] * uu[i * D + k];
    for (int64_t k = 0; k < D; ++k) {
      d[i * D + k] = static_cast<float>((du[static_cast<size_t>(i * D + k)] - uu[i * D + k] * dot) /
                                        norms[static_cast<size_t>(i)]);
    }
  }
  return dx;
}

// The [EOS] row of each sequence of ids [N, T]: row n*T + lengths[n] - 1.
std::vector<int64_t> eos_rows(const Tensor& lengths, int64_t T) {
  const int32_t* l = lengths.data<int32_t>();
  std::vector<int64_t> rows(static_cast<size_t>(lengths.numel()));
  for (int64_t n = 0; n < lengths.numel(); ++n) rows[static_cast<size_t>(n)] = n * T + l[n] - 1;
  return rows;
}

// argmax over K classes of image . mean(class prompts) (unit features; M prompts per class).
std::vector<int64_t> nearest_class(const Tensor& images, const Tensor& prompts, int64_t M) {
  const int64_t B = images.dim(0), D = images.dim(1), K = prompts.dim(0) / M;
  std::vector<float> classes(static_cast<size_t>(K * D), 0.0f);
  const float* p = prompts.data<float>();
  for (int64_t r = 0; r < K * M; ++r) {
    for (int64_t k = 0; k < D; ++k) classes[static_cast<size_t>((r / M) * D + k)] += p[r * D + k];
  }
  Tensor mean = Tensor::from_floats({K, D}, classes);
  const Tensor unit = unit_rows(mean, nullptr);
  const float* u = unit.data<float>();
  const float* x = images.data<float>();
  std::vector<int64_t> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    double best = -1e300;
    for (int64_t k = 0; k < K; ++k) {
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += double(x[b * D + d]) * u[k * D + d];
      if (dot > best) best = dot, out[static_cast<size_t>(b)] = k;
    }
  }
  return out;
}

// Cross-entropy towards the diagonal of logits = scale * sim [B,B], along each row (columns =
// false) or each column: the summed losses, and the softmax of each line into p.
double softmax_lines(const std::vector<double>& sim, int64_t B, double scale, bool columns,
                     std::vector<double>& p) {
  double loss = 0;
  for (int64_t line = 0; line < B; ++line) {
    auto at = [&](int64_t k) { return static_cast<size_t>(columns ? k * B + line : line * B + k); };
    double top = -1e300, sum = 0;
    for (int64_t k = 0; k < B; ++k) top = std::max(top, scale * sim[at(k)]);
    for (int64_t k = 0; k < B; ++k) {
      p[at(k)] = std::exp(scale * sim[at(k)] - top);
      sum += p[at(k)];
    }
    for (int64_t k = 0; k < B; ++k) p[at(k)] /= sum;
    loss += top + std::log(sum) - scale * sim[at(line)];
  }
  return loss;
}

int64_t prompts_per_class(const Tensor& class_ids, int64_t num_classes) {
  OCTET_CHECK(class_ids.ndim() == 2 && class_ids.dim(0) > 0 && class_ids.dim(0) % num_classes == 0,
              "clip: class_ids expected [K*M, T] (M prompts for each of num_classes = ",
              num_classes, " classes), got ", shape_str(class_ids.shape()));
  return class_ids.dim(0) / num_classes;
}

}  // namespace

CLIP::CLIP(const CLIPConfig& config, uint64_t seed, ModelLayout layout, bool recompute_activations)
    : VisionTextStack("clip", config, seed, std::move(layout), recompute_activations,
                      "text_model.encoder.layers."),
      config_(config) {
  const CLIPConfig& c = config;
  const int64_t Cv = c.vision_hidden, Ct = c.text_hidden;
  // Every parameter from its own seed: each layout holds the same values.
  if (has_first_) {
    token_embedding = modules_detail::make_parameter(
        "text_model.embeddings.token_embedding", {c.vocab_size, Ct}, c.init_std, seed * 7919 + 5);
    text_positions =
        modules_detail::make_parameter("text_model.embeddings.position_embedding",
                                       {c.max_text_len, Ct}, c.init_std, seed * 7919 + 6);
  }
  if (has_last_) {
    post_norm_.emplace(layer_norm_options(c, Cv, "vision_model.post_layernorm"));
    visual_projection_.emplace(
        linear_options(Cv, c.embed_dim, false, c.init_std, seed * 7919 + 4, "visual_projection"));
    final_norm_.emplace(layer_norm_options(c, Ct, "text_model.final_layer_norm"));
    text_projection_.emplace(
        linear_options(Ct, c.embed_dim, false, c.init_std, seed * 7919 + 7, "text_projection"));
    logit_scale = modules_detail::make_parameter("logit_scale", {1}, 0.0f, 0);
    logit_scale.value.data<float>()[0] = c.logit_scale_init;
  }
}

std::vector<Parameter*> CLIP::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  collect_chunk_vision(chunk, out);
  if (is_last(chunk)) {
    post_norm_->collect_parameters(out);
    visual_projection_->collect_parameters(out);
  }
  if (is_first(chunk)) {
    out.push_back(&token_embedding);
    out.push_back(&text_positions);
  }
  for (size_t i = vision; i < stack.size(); ++i) stack[i].collect_parameters(out);
  if (is_last(chunk)) {
    final_norm_->collect_parameters(out);
    text_projection_->collect_parameters(out);
    out.push_back(&logit_scale);
  }
  return out;
}

void CLIP::collect_parameters(std::vector<Parameter*>& out) {
  // The whole model's order: the image side, then the text side.
  collect_vision_parameters(out);
  if (has_last_) {
    post_norm_->collect_parameters(out);
    visual_projection_->collect_parameters(out);
  }
  if (has_first_) {
    out.push_back(&token_embedding);
    out.push_back(&text_positions);
  }
  for (int chunk : chunks_in_stage_order()) {
    std::vector<TransformerLayer>& stack = layers(chunk);
    for (size_t i = vision_layers_in(chunk); i < stack.size(); ++i)
      stack[i].collect_parameters(out);
  }
  if (has_last_) {
    final_norm_->collect_parameters(out);
    text_projection_->collect_parameters(out);
    out.push_back(&logit_scale);
  }
}

// Backward runs the text tower, then the vision tower (CLIP::backward).
std::vector<Parameter*> CLIP::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  auto add = [&](const std::vector<Parameter*>& ps) {
    out.insert(out.end(), ps.begin(), ps.end());
  };
  if (has_last_) {
    add({&logit_scale});
    add(text_projection_->parameters());
    add(final_norm_->parameters());
  }
  const std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = stack.size(); i-- > vision_layers_in(*chunk);) add(stack[i].parameters());
  }
  if (has_first_) add({&token_embedding, &text_positions});
  if (has_last_) {
    add(visual_projection_->parameters());
    add(post_norm_->parameters());
  }
  add_vision_parameters_in_backward_order(out);
  return out;
}

void CLIP::on_parameters_updated() {
  TransformerStack::on_parameters_updated();
  vision_parameters_updated();
  if (visual_projection_) visual_projection_->on_parameters_updated();
  if (text_projection_) text_projection_->on_parameters_updated();
}

std::unique_ptr<pipeline::StagedModel::Context> CLIP::make_context() const {
  return std::make_unique<Context>();
}

Shape CLIP::activation_shape(const pipeline::MicroBatch& batch) const {
  const int64_t B = pipeline::batch_tensor(batch, "pixels", "clip").dim(0);
  const int64_t text = pipeline::batch_tensor(batch, "text_ids", "clip").numel();
  const auto classes = batch.find("class_ids");
  const int64_t prompts = classes == batch.end() ? 0 : classes->second.numel();
  return {B * config_.vision_seq_len() * config_.vision_hidden +
          (text + prompts) * config_.text_hidden};
}

Tensor CLIP::pack(const Tensor& vision, const Tensor& text, const Tensor& classes,
                  int64_t class_elements) const {
  const int64_t V = vision.numel(), T = text.numel();
  Tensor packed = Tensor::zeros({V + T + class_elements}, vision.dtype());
  packed.slice_rows(0, V).copy_from(vision.reshape({V}));
  packed.slice_rows(V, V + T).copy_from(text.reshape({T}));
  if (classes.defined())
    packed.slice_rows(V + T, V + T + class_elements).copy_from(classes.reshape({class_elements}));
  return packed;
}

void CLIP::unpack(const Tensor& packed, int64_t B, int64_t T, const Tensor* class_ids,
                  Tensor& vision, Tensor& text, Tensor* classes) const {
  const int64_t Tv = config_.vision_seq_len(), Cv = config_.vision_hidden, Ct = config_.text_hidden;
  const int64_t V = B * Tv * Cv, X = B * T * Ct;
  vision = packed.slice_rows(0, V).clone().reshape({B, Tv, Cv});
  text = packed.slice_rows(V, V + X).clone().reshape({B, T, Ct});
  if (classes) {
    const int64_t K = class_ids->numel() * Ct;
    *classes = packed.slice_rows(V + X, V + X + K)
                   .clone()
                   .reshape({class_ids->dim(0), class_ids->dim(1), Ct});
  }
}

void CLIP::check_text(const Tensor& ids, const Tensor& lengths, const char* what) const {
  const CLIPConfig& c = config_;
  check_dtype(ids, DType::I32, std::string("clip: ") + what + " ids");
  check_dtype(lengths, DType::I32, std::string("clip: ") + what + " lengths");
  OCTET_CHECK(ids.ndim() == 2 && ids.dim(0) > 0 && ids.dim(1) >= 1 && ids.dim(1) <= c.max_text_len,
              "clip: ", what, " ids expected [N, T] with T in [1, max_text_len = ", c.max_text_len,
              "], got ", shape_str(ids.shape()));
  check_shape(lengths, {ids.dim(0)}, std::string("clip: ") + what + " lengths", "N");
  const int64_t N = ids.dim(0), T = ids.dim(1);
  for (int64_t n = 0; n < N; ++n) {
    const int32_t l = lengths.data<int32_t>()[n];
    OCTET_CHECK(l >= 1 && l <= T, "clip: ", what, " length ", l, " of sequence ", n,
                " expected in [1, ", T, "]");
  }
  const int32_t* id = ids.data<int32_t>();
  for (int64_t k = 0; k < N * T; ++k) {
    OCTET_CHECK(id[k] >= 0 && id[k] < c.vocab_size, "clip: token id ", id[k],
                " expected in [0, vocab_size = ", c.vocab_size, ")");
  }
}

Tensor CLIP::text_embed(const Tensor& ids, DType dtype) {
  const int64_t N = ids.dim(0), T = ids.dim(1), C = config_.text_hidden;
  Tensor x = Tensor::empty({N * T, C}, DType::F32);
  ops::embedding_forward(ids.reshape({N * T}), token_embedding.value, x);
  ops::position_embedding_forward(x, text_positions.value, T);
  return to_dtype(x, dtype).reshape({N, T, C});
}

Tensor CLIP::pool_image(const Tensor& tokens, Norm::Context& ctx) {
  const int64_t T = config_.vision_seq_len(), C = config_.vision_hidden,
                B = tokens.numel() / (T * C);
  return post_norm_->forward(
      take_rows(tokens.reshape({B * T, C}), models_detail::strided_rows(0, T, B)), ctx);
}

Tensor CLIP::pool_text(const Tensor& tokens, const Tensor& lengths, Norm::Context& ctx) {
  // The final LayerNorm acts on each row alone: normalizing the pooled rows only is the same.
  const int64_t N = tokens.dim(0), T = tokens.dim(1), C = config_.text_hidden;
  return final_norm_->forward(take_rows(tokens.reshape({N * T, C}), eos_rows(lengths, T)), ctx);
}

Tensor CLIP::image_features(const Tensor& pixels, DType dtype) {
  const Tensor tokens = vision_encode(pixels, dtype, nullptr, nullptr);
  Norm::Context norm;
  const Tensor pooled = pool_image(tokens, norm);
  HighPrecisionScope scope;
  Linear::Context proj;
  return unit_rows(to_dtype(visual_projection_->forward(pooled, proj), DType::F32), nullptr);
}

Tensor CLIP::text_features(const Tensor& ids, const Tensor& lengths, DType dtype) {
  check_whole("text_features");
  check_text(ids, lengths, "text");
  const Tensor tokens = layers_forward(0, text_embed(ids, dtype), ids.dim(1), first_text_layer(),
                                       layers(0).size(), nullptr);
  Norm::Context norm;
  const Tensor pooled = pool_text(tokens, lengths, norm);
  HighPrecisionScope scope;
  Linear::Context proj;
  return unit_rows(to_dtype(text_projection_->forward(pooled, proj), DType::F32), nullptr);
}

std::vector<int64_t> CLIP::zero_shot(const Tensor& pixels, const Tensor& class_ids,
                                     const Tensor& class_lengths, DType dtype) {
  const int64_t M = prompts_per_class(class_ids, config_.num_classes);
  const Tensor images = image_features(pixels, dtype);
  return nearest_class(images, text_features(class_ids, class_lengths, dtype), M);
}

Tensor CLIP::run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                         DType dtype, float grad_scale, Context* ctx, float* loss, bool count) {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "clip: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const Tensor& pixels = pipeline::batch_tensor(batch, "pixels", "clip");
  const Tensor& text_ids = pipeline::batch_tensor(batch, "text_ids", "clip");
  const Tensor& text_lengths = pipeline::batch_tensor(batch, "text_lengths", "clip");
  OCTET_CHECK(text_ids.ndim() == 2 && pixels.ndim() == 2 && text_ids.dim(0) == pixels.dim(0),
              "clip: text_ids expected one caption per image (", pixels.dim(0), " images), got ",
              shape_str(text_ids.shape()));
  check_text(text_ids, text_lengths, "text");
  const int64_t B = pixels.dim(0), T = text_ids.dim(1), D = config_.embed_dim;
  const int64_t Tv = config_.vision_seq_len();
  // Evaluation's class prompts (zero-shot accuracy) run through the text layers beside the
  // captions.
  const Tensor* class_ids = nullptr;
  const Tensor* class_lengths = nullptr;
  int64_t M = 0;
  if (count) {
    class_ids = &pipeline::batch_tensor(batch, "class_ids", "clip");
    class_lengths = &pipeline::batch_tensor(batch, "class_lengths", "clip");
    M = prompts_per_class(*class_ids, config_.num_classes);
    check_text(*class_ids, *class_lengths, "class prompt");
  }
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  Context scratch;
  Context& c = ctx ? *ctx : scratch;
  c.layers.assign(stack.size(), TransformerLayer::Context{});
  c.batch = B;
  c.text_ids = text_ids;
  c.text_lengths = text_lengths;
  const auto class_slot = batch.find("class_ids");
  c.class_elements =
      class_slot == batch.end() ? 0 : class_slot->second.numel() * config_.text_hidden;
  // The three token streams: images [B,Tv,Cv], captions [B,T,Ct], class prompts [K*M,Tc,Ct].
  Tensor image_tokens, text_tokens, class_tokens;
  if (is_first(chunk)) {
    image_tokens = vision_embed(pixels, dtype, ctx ? &c.vision : nullptr);
    text_tokens = text_embed(text_ids, dtype);
    if (count) class_tokens = text_embed(*class_ids, dtype);
  } else {
    check_shape(input, activation_shape(batch), "clip: input of chunk " + std::to_string(chunk),
                "B*Tv*Cv+(B*T+K*M*Tc)*Ct");
    check_dtype(input, dtype, "clip: input of chunk " + std::to_string(chunk));
    unpack(input, B, T, class_ids, image_tokens, text_tokens, count ? &class_tokens : nullptr);
  }
  std::vector<TransformerLayer::Context>* contexts = ctx ? &c.layers : nullptr;
  if (vision > 0) image_tokens = layers_forward(chunk, image_tokens, Tv, 0, vision, contexts);
  if (vision < stack.size()) {
    text_tokens = layers_forward(chunk, text_tokens, T, vision, stack.size(), contexts);
    if (count) {
      class_tokens =
          layers_forward(chunk, class_tokens, class_ids->dim(1), vision, stack.size(), nullptr);
    }
  }
  if (!is_last(chunk)) return pack(image_tokens, text_tokens, class_tokens, c.class_elements);
  const Tensor pooled_image = pool_image(image_tokens, c.post_norm);
  const Tensor pooled_text = pool_text(text_tokens, text_lengths, c.final_norm);
  Tensor image, text;
  {
    HighPrecisionScope scope;
    image = to_dtype(visual_projection_->forward(pooled_image, c.visual_projection), DType::F32);
    text = to_dtype(text_projection_->forward(pooled_text, c.text_projection), DType::F32);
  }
  std::vector<double> image_norms, text_norms;
  const Tensor u_image = unit_rows(image, &image_norms);
  const Tensor u_text = unit_rows(text, &text_norms);
  const float* ui = u_image.data<float>();
  const float* ut = u_text.data<float>();
  const float log_scale = logit_scale.value.data<float>()[0];
  const bool clamped = log_scale > kMaxLogitScale;
  const double scale = std::exp(static_cast<double>(std::min(log_scale, kMaxLogitScale)));
  // sim[i][j]: caption i against image j; logits per caption = scale * sim, per image its
  // transpose.
  std::vector<double> sim(static_cast<size_t>(B * B));
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t j = 0; j < B; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < D; ++k) dot += double(ut[i * D + k]) * ui[j * D + k];
      sim[static_cast<size_t>(i * B + j)] = dot;
    }
  }
  // Softmax over each row (captions -> images) and each column (images -> captions).
  std::vector<double> row_p(sim.size()), col_p(sim.size());
  const double loss_text = softmax_lines(sim, B, scale, /*columns=*/false, row_p);
  const double loss_image = softmax_lines(sim, B, scale, /*columns=*/true, col_p);
  *loss = static_cast<float>(0.5 * (loss_text + loss_image) / static_cast<double>(B));
  if (count) {
    const Tensor& labels = pipeline::batch_tensor(batch, "labels", "clip");
    check_dtype(labels, DType::I32, "clip: labels");
    check_shape(labels, {B}, "clip: labels", "B");
    const int32_t* y = labels.data<int32_t>();
    Norm::Context norm;
    Linear::Context projection;
    const Tensor pooled = pool_text(class_tokens, *class_lengths, norm);
    Tensor prompts;
    {
      HighPrecisionScope scope;
      prompts =
          unit_rows(to_dtype(text_projection_->forward(pooled, projection), DType::F32), nullptr);
    }
    const std::vector<int64_t> predicted = nearest_class(u_image, prompts, M);
    for (int64_t b = 0; b < B; ++b) eval_correct_ += predicted[static_cast<size_t>(b)] == y[b];
    eval_seen_ += B;
  }
  if (!ctx) return Tensor();
  // d loss / d (scale * sim) = 0.5 / B * ((row softmax - I) + (column softmax - I)).
  const double g = 0.5 / static_cast<double>(B) * grad_scale;
  std::vector<double> du_text(static_cast<size_t>(B * D), 0.0), du_image(du_text.size(), 0.0);
  double dscale = 0;
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t j = 0; j < B; ++j) {
      const size_t ij = static_cast<size_t>(i * B + j);
      const double dz = g * (row_p[ij] + col_p[ij] - (i == j ? 2.0 : 0.0));
      dscale += dz * sim[ij];
      const double dsim = dz * scale;
      for (int64_t k = 0; k < D; ++k) {
        du_text[static_cast<size_t>(i * D + k)] += dsim * ui[j * D + k];
        du_image[static_cast<size_t>(j * D + k)] += dsim * ut[i * D + k];
      }
    }
  }
  // d loss / d logit_scale = dscale * scale (none where clamped).
  if (!clamped) logit_scale.grad.data<float>()[0] += static_cast<float>(dscale * scale);
  c.dimage = unit_rows_backward(du_image, u_image, image_norms);
  c.dtext = unit_rows_backward(du_text, u_text, text_norms);
  return Tensor();
}

Tensor CLIP::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, batch, dtype, grad_scale, &ctx, &ctx.loss, false);
}

Tensor CLIP::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                      DType dtype, float* loss) {
  return run_forward(chunk, input, batch, dtype, 1.0f, nullptr, loss, true);
}

Tensor CLIP::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  OCTET_CHECK(
      ctx.text_ids.defined() && (!is_last(chunk) || (ctx.dimage.defined() && ctx.dtext.defined())),
      "clip: backward of chunk ", chunk, " before its forward");
  const int64_t B = ctx.batch, T = ctx.text_ids.dim(1), Ct = config_.text_hidden;
  const int64_t Tv = config_.vision_seq_len(), Cv = config_.vision_hidden;
  std::vector<TransformerLayer>& stack = layers(chunk);
  const size_t vision = vision_layers_in(chunk);
  // The gradients of the two streams at this chunk's output: the text side first, as the whole
  // model always ran them.
  Tensor dimages, dtext;
  if (is_last(chunk)) {
    grads_ready({&logit_scale});
    Tensor dpooled;
    {
      HighPrecisionScope scope;
      dpooled = text_projection_->backward(to_dtype(ctx.dtext, ctx.text_projection.dtype),
                                           ctx.text_projection);
    }
    grads_ready(text_projection_->parameters());
    const Tensor deos = final_norm_->backward(dpooled, ctx.final_norm);
    grads_ready(final_norm_->parameters());
    dtext = put_rows(deos, B * T, eos_rows(ctx.text_lengths, T)).reshape({B, T, Ct});
  } else {
    unpack(doutput, B, T, nullptr, dimages, dtext, nullptr);
  }
  if (vision < stack.size())
    dtext = layers_backward(chunk, dtext, T, vision, stack.size(), ctx.layers);
  if (is_first(chunk)) {
    const Tensor dx = to_dtype(dtext, DType::F32).reshape({B * T, Ct});
    ops::embedding_backward(ctx.text_ids.reshape({B * T}), dx, token_embedding.grad);
    ops::position_embedding_backward(dx, T, text_positions.grad);
    grads_ready({&token_embedding, &text_positions});
  }
  if (is_last(chunk)) {
    Tensor dpooled;
    {
      HighPrecisionScope scope;
      dpooled = visual_projection_->backward(to_dtype(ctx.dimage, ctx.visual_projection.dtype),
                                             ctx.visual_projection);
    }
    grads_ready(visual_projection_->parameters());
    // A frozen image encoder (--freeze vision_model.) has no gradient to take.
    const std::vector<Parameter*> norm = post_norm_->parameters();
    if (vision_tower_frozen() && frozen(norm)) {
      ctx = Context{};
      return Tensor();
    }
    const Tensor dcls = post_norm_->backward(dpooled, ctx.post_norm);
    grads_ready(norm);
    dimages = put_rows(dcls, B * Tv, models_detail::strided_rows(0, Tv, B)).reshape({B, Tv, Cv});
  }
  if (vision > 0) dimages = layers_backward(chunk, dimages, Tv, 0, vision, ctx.layers);
  Tensor result;
  if (is_first(chunk)) {
    vision_embed_backward(dimages, ctx.vision);
  } else {
    result = pack(dimages, dtext, Tensor(), ctx.class_elements);
  }
  ctx = Context{};
  return result;
}

}  // namespace octet
