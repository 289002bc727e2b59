// ViT, whole or as the part a rank holds (pipeline stages, tensor shards): construction, the
// one forward (patch embedding, class token and positions on the first stage; encoder layers;
// the class token's final norm, the head and cross-entropy on the last) and its backward,
// parameters and state dicts.
#include "octet/vit.h"

#include <algorithm>
#include <cstring>

#include "models/image_embedding.h"
#include "models/precision_scope.h"
#include "modules/common.h"
#include "octet/fp4.h"
#include "octet/mappings.h"
#include "octet/ops/loss.h"

namespace octet {

using models_detail::HighPrecisionScope;
using models_detail::put_rows;
using models_detail::strided_rows;
using models_detail::take_rows;

pipeline::MicroBatch vit_micro_batch(const Tensor& pixels, const Tensor& labels) {
  return {{"pixels", pixels}, {"labels", labels}};
}

namespace {

NormKind norm_kind(const ViTConfig& c) {
  return c.normalization == "rmsnorm" ? NormKind::RMSNorm : NormKind::LayerNorm;
}

TransformerLayerOptions layer_options(const ViTConfig& c, int64_t index, uint64_t seed,
                                      bool recompute) {
  TransformerLayerOptions o;
  o.checkpoint = recompute;
  o.hidden_size = c.hidden;
  o.ffn_hidden_size = c.ffn();
  o.num_attention_heads = c.num_heads;
  o.layernorm_epsilon = c.layernorm_eps;
  o.hidden_dropout = c.dropout;
  o.attention_dropout = c.dropout;
  o.normalization = norm_kind(c);
  o.activation = ops::parse_activation(c.activation);
  o.layer_type = LayerType::Encoder;
  o.self_attn_mask_type = AttnMaskType::NoMask;  // every patch sees every patch
  o.init_std = c.init_std;
  o.output_init_std = c.init_std;
  o.seed = seed * 1000 + static_cast<uint64_t>(index) + 1;
  o.name = "vit.encoder.layer." + std::to_string(index);
  return o;
}

ViT::Context& own_context(pipeline::StagedModel::Context& base) {
  auto* ctx = dynamic_cast<ViT::Context*>(&base);
  OCTET_CHECK(ctx, "vit: expected a context from ViT::make_context()");
  return *ctx;
}

}  // namespace

ViT::ViT(const ViTConfig& config, uint64_t seed, ModelLayout layout, bool recompute_activations)
    : TransformerStack(
          "vit", config.num_layers, std::move(layout),
          [&](int64_t i) { return layer_options(config, i, seed, recompute_activations); }),
      config_(config) {
  if (has_first_) {
    LinearOptions patch;
    patch.in_features = config.patch_dim();
    patch.out_features = config.hidden;
    patch.init_std = config.init_std;
    patch.seed = seed * 7919 + 11;
    patch.name = "vit.embeddings.patch_embeddings";
    patch_embed_.emplace(patch);
    cls_token = modules_detail::make_parameter("vit.embeddings.cls_token", {1, config.hidden},
                                               config.init_std, seed * 7919 + 12);
    pos_embed = modules_detail::make_parameter("vit.embeddings.position_embeddings",
                                               {config.seq_len(), config.hidden}, config.init_std,
                                               seed * 7919 + 13);
  }
  if (has_last_) {
    NormOptions norm;
    norm.hidden = config.hidden;
    norm.kind = norm_kind(config);
    norm.eps = config.layernorm_eps;
    norm.name = "vit.layernorm";
    final_norm_.emplace(norm);
    LinearOptions head;
    head.in_features = config.hidden;
    head.out_features = config.num_classes;
    head.init_std = config.init_std;
    head.seed = seed * 7919 + 14;
    head.name = "classifier";
    head_.emplace(head);
  }
}

std::vector<Parameter*> ViT::chunk_parameters(int chunk) {
  std::vector<Parameter*> out;
  if (is_first(chunk)) {
    patch_embed_->collect_parameters(out);
    out.push_back(&cls_token);
    out.push_back(&pos_embed);
  }
  for (TransformerLayer& layer : layers(chunk)) layer.collect_parameters(out);
  if (is_last(chunk)) {
    final_norm_->collect_parameters(out);
    head_->collect_parameters(out);
  }
  return out;
}

void ViT::collect_parameters(std::vector<Parameter*>& out) {
  for (int chunk : chunks_in_stage_order()) {
    for (Parameter* p : chunk_parameters(chunk)) out.push_back(p);
  }
}

std::vector<Parameter*> ViT::parameters_in_backward_order() {
  std::vector<Parameter*> out;
  if (has_last_) {
    for (Parameter* p : head_->parameters()) out.push_back(p);
    for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  }
  std::vector<int> chunks = chunks_in_stage_order();
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    std::vector<TransformerLayer>& stack = layers(*chunk);
    for (size_t i = stack.size(); i-- > 0;) {
      for (Parameter* p : stack[i].parameters()) out.push_back(p);
    }
  }
  if (has_first_) {
    for (Parameter* p : patch_embed_->parameters()) out.push_back(p);
    out.push_back(&cls_token);
    out.push_back(&pos_embed);
  }
  return out;
}

void ViT::on_parameters_updated() {
  TransformerStack::on_parameters_updated();
  if (patch_embed_) patch_embed_->on_parameters_updated();
  if (head_) head_->on_parameters_updated();
}

std::unique_ptr<pipeline::StagedModel::Context> ViT::make_context() const {
  return std::make_unique<Context>();
}

Shape ViT::activation_shape(const pipeline::MicroBatch& batch) const {
  const int64_t B = pipeline::batch_tensor(batch, "pixels", "vit").dim(0), T = config_.seq_len();
  if (sequence_parallel()) return {B * T / layout_.tensor->size(), config_.hidden};
  return {B, T, config_.hidden};
}

Tensor ViT::embed(const Tensor& pixels, DType dtype, Linear::Context& patch_ctx) {
  const ViTConfig& c = config_;
  return models_detail::embed_images(pixels, c.channels, c.image_size, c.patch_size, *patch_embed_,
                                     cls_token, pos_embed, dtype, patch_ctx);
}

void ViT::embed_backward(const Tensor& dx, int64_t batch, Linear::Context& patch_ctx) {
  models_detail::embed_images_backward(dx, batch, *patch_embed_, cls_token, pos_embed, patch_ctx);
}

float ViT::head_loss(const Tensor& h, const Tensor& labels, int64_t batch, DType dtype,
                     float grad_scale, Context* ctx, bool count) {
  Communicator* tp = layout_.tensor;
  const int64_t T = config_.seq_len(), C = config_.hidden, K = config_.num_classes;
  check_dtype(labels, DType::I32, "vit: labels");
  check_shape(labels, {batch}, "vit: labels", "B");
  const Tensor rows = h.reshape({h.numel() / C, C});
  // Every rank's class tokens: the whole [B*T, C] under sequence parallelism.
  const Tensor whole = sequence_parallel() ? gather_from_sequence_parallel_region(rows, *tp) : rows;
  const Tensor cls = take_rows(whole, strided_rows(0, T, batch));
  HighPrecisionScope scope;
  Norm::Context norm_scratch;
  Linear::Context head_scratch;
  const Tensor normed = final_norm_->forward(cls, ctx ? ctx->final_norm : norm_scratch);
  const Tensor out = head_->forward(normed, ctx ? ctx->head : head_scratch);
  Tensor logits = out.dtype() == DType::F32 ? out.clone() : out.to(DType::F32);
  if (count && (tp == nullptr || tp->rank() == 0)) {
    const float* l = logits.data<float>();
    const int32_t* y = labels.data<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = l + b * K;
      eval_correct_ += (std::max_element(row, row + K) - row) == y[b];
    }
    eval_seen_ += batch;
  }
  Tensor losses = Tensor::empty({batch}, DType::F32);
  ops::CrossEntropyOptions options;
  options.grad_scale = grad_scale / static_cast<float>(batch);
  ops::cross_entropy_forward_backward(logits, labels, losses, ctx ? &logits : nullptr, options);
  double sum = 0;
  for (float l : losses.to_floats()) sum += l;
  if (ctx) {
    const Tensor dlogits = dtype == DType::F32 ? logits : logits.to(dtype);
    const Tensor dnormed = head_->backward(dlogits, ctx->head);
    ctx->dclass = final_norm_->backward(dnormed, ctx->final_norm);
    ctx->batch = batch;
  }
  return static_cast<float>(sum / static_cast<double>(batch));
}

Tensor ViT::run_forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch,
                        DType dtype, float grad_scale, Context* ctx, float* loss) {
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "vit: compute dtype expected f32 or bf16, got ", dtype_name(dtype));
  const Tensor& pixels = pipeline::batch_tensor(batch, "pixels", "vit");
  check_dtype(pixels, DType::F32, "vit: pixels");
  OCTET_CHECK(pixels.ndim() == 2 && pixels.dim(1) == config_.pixels(), "vit: pixels expected [B, ",
              config_.pixels(), "] (", config_.channels, "x", config_.image_size, "x",
              config_.image_size, " images), got ", shape_str(pixels.shape()));
  const int64_t B = pixels.dim(0), T = config_.seq_len();
  OCTET_CHECK(B > 0, "vit: an empty micro-batch");
  OCTET_CHECK(!sequence_parallel() || (B * T) % layout_.tensor->size() == 0,
              "vit: sequence parallelism needs B*T (", B * T,
              ") divisible by TP=", sequence_parallel() ? layout_.tensor->size() : 1);
  const Shape boundary = activation_shape(batch);
  if (ctx) ctx->batch = B;
  Tensor h;
  if (is_first(chunk)) {
    Linear::Context patch_scratch;
    Tensor x = embed(pixels, dtype, ctx ? ctx->patch : patch_scratch);
    if (sequence_parallel()) x = scatter_to_sequence_parallel_region(x, *layout_.tensor);
    h = (dtype == DType::F32 ? x : x.to(dtype)).reshape(boundary);
  } else {
    h = checked_input(chunk, input, boundary, dtype);
  }
  h = forward_layers(chunk, h, ctx ? &ctx->layers : nullptr, sequence_parallel() ? T : 0);
  if (!is_last(chunk)) return h;
  *loss = head_loss(h, pipeline::batch_tensor(batch, "labels", "vit"), B, dtype, grad_scale, ctx,
                    /*count=*/ctx == nullptr);
  return Tensor();
}

Tensor ViT::forward(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                    float grad_scale, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  return run_forward(chunk, input, batch, dtype, grad_scale, &ctx, &ctx.loss);
}

Tensor ViT::evaluate(int chunk, const Tensor& input, const pipeline::MicroBatch& batch, DType dtype,
                     float* loss) {
  return run_forward(chunk, input, batch, dtype, 1.0f, nullptr, loss);
}

Tensor ViT::backward(int chunk, const Tensor& doutput, StagedModel::Context& base) {
  Context& ctx = own_context(base);
  Communicator* tp = layout_.tensor;
  const int64_t B = ctx.batch, T = config_.seq_len(), C = config_.hidden;
  const Shape boundary = sequence_parallel() ? Shape{B * T / tp->size(), C} : Shape{B, T, C};
  Tensor dx;
  if (is_last(chunk)) {
    OCTET_CHECK(ctx.dclass.defined(), "vit: backward of the last stage before its forward");
    // Only the class tokens reach the head; each rank keeps its rows of the gradient (the
    // head ran whole on every rank).
    Tensor dwhole = put_rows(ctx.dclass, B * T, strided_rows(0, T, B));
    ctx.dclass = Tensor();
    if (sequence_parallel()) dwhole = scatter_to_sequence_parallel_region(dwhole, *tp);
    dx = dwhole.reshape(boundary);
    std::vector<Parameter*> ready = head_->parameters();
    for (Parameter* p : final_norm_->parameters()) ready.push_back(p);
    grads_ready(ready);
  } else {
    dx = doutput;
  }
  dx = backward_layers(chunk, dx, ctx.layers);
  if (!is_first(chunk)) {
    ctx = Context{};
    return dx;
  }
  Tensor dx32 = dx.dtype() == DType::F32 ? dx : dx.to(DType::F32);
  dx32 = dx32.reshape({dx32.numel() / C, C});
  if (sequence_parallel()) dx32 = scatter_to_sequence_parallel_region_backward(dx32, *tp);
  embed_backward(dx32, B, ctx.patch);
  std::vector<Parameter*> ready = patch_embed_->parameters();
  ready.push_back(&cls_token);
  ready.push_back(&pos_embed);
  grads_ready(ready);
  ctx = Context{};
  return Tensor();
}

Tensor ViT::logits(const Tensor& pixels, DType dtype) {
  check_whole("logits");
  OCTET_CHECK(layout_.tensor == nullptr, "vit: logits() runs without tensor parallelism");
  const int64_t B = pixels.dim(0);
  Linear::Context patch;
  Tensor h = embed(pixels, dtype, patch);
  h = (dtype == DType::F32 ? h : h.to(dtype)).reshape({B, config_.seq_len(), config_.hidden});
  h = forward_layers(0, h, nullptr, 0);
  const Tensor cls = take_rows(h.reshape({h.numel() / config_.hidden, config_.hidden}),
                               strided_rows(0, config_.seq_len(), B));
  HighPrecisionScope scope;
  Norm::Context norm;
  Linear::Context head;
  const Tensor out = head_->forward(final_norm_->forward(cls, norm), head);
  return out.dtype() == DType::F32 ? out : out.to(DType::F32);
}

}  // namespace octet
