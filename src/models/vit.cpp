// ViT, whole or as the part a rank holds (pipeline stages, tensor shards): construction, the
// one forward (patch embedding, class token and positions on the first stage; encoder layers;
// the class token's final norm, the head and cross-entropy on the last) and its backward,
// parameters and state dicts.
#include "octet/vit.h"

#include <algorithm>
#include <cstring>

#include "models/precision_scope.h"
#include "modules/common.h"
#include "octet/fp4.h"
#include "octet/mappings.h"
#include "octet/ops/loss.h"

namespace octet {

using models_detail::HighPrecisionScope;

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

// Rows first, first + stride, ... (count of them) of x [N, C] (any dtype) -> [count, C]; and
// the adjoint: y's rows into those rows of a zeroed [rows, C].
Tensor take_rows(const Tensor& x, int64_t first, int64_t stride, int64_t count) {
  const int64_t C = x.dim(-1);
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(x.dtype());
  Tensor out = Tensor::empty({count, C}, x.dtype());
  const auto* src = static_cast<const char*>(x.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * row_bytes, src + (first + i * stride) * row_bytes, row_bytes);
  }
  return out;
}

Tensor put_rows(const Tensor& y, int64_t rows, int64_t first, int64_t stride) {
  const int64_t C = y.dim(-1);
  const size_t row_bytes = static_cast<size_t>(C) * dtype_bytes(y.dtype());
  Tensor out = Tensor::zeros({rows, C}, y.dtype());
  const auto* src = static_cast<const char*>(y.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < y.dim(0); ++i) {
    std::memcpy(dst + (first + i * stride) * row_bytes, src + i * row_bytes, row_bytes);
  }
  return out;
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
  const int64_t B = pixels.dim(0), N = c.num_patches(), T = c.seq_len(), C = c.hidden;
  const int64_t P = c.patch_size, S = c.image_size, per_row = S / P, D = c.patch_dim();
  // patches [B*N, C_in*P*P]: patch (py, px) holds pixel (ch, py*P + i, px*P + j) at
  // ch*P*P + i*P + j (a convolution's weight layout [hidden, C_in, P, P], flattened).
  Tensor patches = Tensor::empty({B * N, D}, DType::F32);
  const float* image = pixels.data<float>();
  float* out = patches.data<float>();
#pragma omp parallel for
  for (int64_t bn = 0; bn < B * N; ++bn) {
    const int64_t b = bn / N, n = bn % N, py = n / per_row, px = n % per_row;
    float* row = out + bn * D;
    for (int64_t ch = 0; ch < c.channels; ++ch) {
      const float* plane = image + (b * c.channels + ch) * S * S;
      for (int64_t i = 0; i < P; ++i) {
        std::memcpy(row + (ch * P + i) * P, plane + (py * P + i) * S + px * P,
                    static_cast<size_t>(P) * sizeof(float));
      }
    }
  }
  Tensor embedded;
  {
    HighPrecisionScope scope;
    embedded = patch_embed_->forward(dtype == DType::F32 ? patches : patches.to(dtype), patch_ctx);
  }
  const Tensor y = embedded.dtype() == DType::F32 ? embedded : embedded.to(DType::F32);
  Tensor x = Tensor::empty({B * T, C}, DType::F32);
  const float* cls = cls_token.value.data<float>();
  const float* pos = pos_embed.value.data<float>();
  const float* patch_rows = y.data<float>();
  float* xs = x.data<float>();
#pragma omp parallel for
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    const float* from = t == 0 ? cls : patch_rows + (b * N + t - 1) * C;
    for (int64_t k = 0; k < C; ++k) xs[bt * C + k] = from[k] + pos[t * C + k];
  }
  return x;
}

void ViT::embed_backward(const Tensor& dx, int64_t batch, Linear::Context& patch_ctx) {
  const int64_t N = config_.num_patches(), T = config_.seq_len(), C = config_.hidden;
  const float* d = dx.data<float>();
  float* dcls = cls_token.grad.data<float>();
  float* dpos = pos_embed.grad.data<float>();
  Tensor dpatch = Tensor::empty({batch * N, C}, DType::F32);
  float* dp = dpatch.data<float>();
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = d + (b * T + t) * C;
      for (int64_t k = 0; k < C; ++k) dpos[t * C + k] += row[k];
      if (t == 0) {
        for (int64_t k = 0; k < C; ++k) dcls[k] += row[k];
      } else {
        std::memcpy(dp + (b * N + t - 1) * C, row, static_cast<size_t>(C) * sizeof(float));
      }
    }
  }
  HighPrecisionScope scope;
  patch_embed_->backward(patch_ctx.dtype == DType::F32 ? dpatch : dpatch.to(patch_ctx.dtype),
                         patch_ctx);
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
  const Tensor cls = take_rows(whole, 0, T, batch);
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
    Tensor dwhole = put_rows(ctx.dclass, B * T, 0, T);
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
  const Tensor cls =
      take_rows(h.reshape({h.numel() / config_.hidden, config_.hidden}), 0, config_.seq_len(), B);
  HighPrecisionScope scope;
  Norm::Context norm;
  Linear::Context head;
  const Tensor out = head_->forward(final_norm_->forward(cls, norm), head);
  return out.dtype() == DType::F32 ? out : out.to(DType::F32);
}

}  // namespace octet
