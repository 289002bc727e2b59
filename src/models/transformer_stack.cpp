// TransformerStack: the layer stack a model part holds (pipeline stages, tensor shards), and the
// training interface's layout-only answers built on it.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "models/precision_scope.h"
#include "octet/fp4.h"
#include "octet/tensor_parallel.h"
#include "octet/trainable_model.h"

namespace octet {

using models_detail::HighPrecisionScope;

pipeline::MicroBatch context_parallel_split(const pipeline::MicroBatch& batch,
                                            const Communicator& group) {
  const int P = group.size(), r = group.rank();
  if (P == 1) return batch;
  pipeline::MicroBatch out;
  for (const auto& [name, t] : batch) {
    OCTET_CHECK(t.ndim() == 2 && t.dim(1) % (2 * P) == 0, "context parallelism: batch tensor '",
                name, "' expected [B,T] with T a multiple of 2 x CP = ", 2 * P, ", got ",
                shape_str(t.shape()));
    const int64_t B = t.dim(0), T = t.dim(1), c = T / (2 * P);
    const size_t unit = dtype_bytes(t.dtype());
    Tensor part = Tensor::empty({B, 2 * c}, t.dtype());
    for (int64_t b = 0; b < B; ++b) {
      for (int half = 0; half < 2; ++half) {
        std::memcpy(
            static_cast<char*>(part.raw()) + static_cast<size_t>(b * 2 * c + half * c) * unit,
            static_cast<const char*>(t.raw()) +
                static_cast<size_t>(b * T + context_parallel_chunk(r, P, half) * c) * unit,
            static_cast<size_t>(c) * unit);
      }
    }
    out.emplace(name, std::move(part));
  }
  return out;
}

TransformerStack::TransformerStack(std::string who, int64_t num_layers, ModelLayout layout,
                                   const std::function<TransformerLayerOptions(int64_t)>& layer)
    : who_(std::move(who)), num_layers_(num_layers), layout_(std::move(layout)) {
  const int stages = layout_.stages;
  OCTET_CHECK(stages >= 1 && num_layers % stages == 0, who_, ": num_layers (", num_layers,
              ") expected a multiple of the pipeline stages (", stages,
              ": ranks x chunks per rank)");
  OCTET_CHECK(!layout_.stage_of_chunk.empty(), who_, ": a rank must hold at least one chunk");
  const int64_t per_stage = num_layers / stages;
  for (int stage : layout_.stage_of_chunk) {
    OCTET_CHECK(stage >= 0 && stage < stages, who_, ": stage ", stage, " outside 0..", stages - 1);
    has_first_ = has_first_ || stage == 0;
    has_last_ = has_last_ || stage == stages - 1;
    std::vector<TransformerLayer> stack;
    stack.reserve(static_cast<size_t>(per_stage));
    const size_t chunk = layers_.size();
    Communicator* expert =
        chunk < layout_.chunk_expert.size() ? layout_.chunk_expert[chunk] : layout_.expert;
    Communicator* context =
        chunk < layout_.chunk_context.size() ? layout_.chunk_context[chunk] : layout_.context;
    for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
      TransformerLayerOptions options = layer(i);
      options.sequence_parallel = sequence_parallel();
      stack.emplace_back(options, layout_.tensor, expert);
      stack.back().self_attention.core_attention.set_context_parallel(context,
                                                                      layout_.cp_comm_type);
    }
    layers_.push_back(std::move(stack));
  }
}

void TransformerStack::check_whole(const char* what) const {
  OCTET_CHECK(layout_.stages == 1, who_, ": ", what, " needs the whole model; this rank holds ",
              chunks(), " of ", layout_.stages,
              " pipeline stages (run them through the pipeline executor)");
}

float TransformerStack::train_step(const pipeline::MicroBatch& batch, DType dtype,
                                   float grad_scale) {
  check_whole("train_step");
  std::unique_ptr<Context> ctx = make_context();
  forward(0, Tensor(), batch, dtype, grad_scale, *ctx);
  const float loss = ctx->loss;
  backward(0, Tensor(), *ctx);
  return loss;
}

float TransformerStack::evaluate(const pipeline::MicroBatch& batch, DType dtype) {
  check_whole("evaluate");
  float loss = 0.0f;
  evaluate(0, Tensor(), batch, dtype, &loss);
  return loss;
}

std::pair<int64_t, int64_t> TransformerStack::take_eval_counts() {
  return {std::exchange(eval_correct_, 0), std::exchange(eval_seen_, 0)};
}

std::vector<TransformerLayer>& TransformerStack::layers() {
  check_whole("layers()");
  return layers_.front();
}

int64_t TransformerStack::global_layer(int chunk, size_t i) const {
  const int64_t per_stage = num_layers_ / layout_.stages;
  return stage_of_chunk(chunk) * per_stage + static_cast<int64_t>(i);
}

size_t TransformerStack::layers_before(int chunk, int64_t border) const {
  const int64_t per_stage = num_layers_ / layout_.stages;
  return static_cast<size_t>(std::clamp<int64_t>(border - global_layer(chunk, 0), 0, per_stage));
}

Tensor TransformerStack::gather(const Parameter& p, const Tensor& local) {
  return layout_.tensor ? gather_shards(p, local, *layout_.tensor) : local;
}

Tensor TransformerStack::shard(const Parameter& p, const Tensor& whole) const {
  if (layout_.tensor) return shard_of(p, whole, *layout_.tensor);
  check_shape(whole, p.value.shape(), "checkpoint: tensor '" + p.name + "'");
  check_dtype(whole, DType::F32, "checkpoint: tensor '" + p.name + "'");
  return whole;
}

std::vector<Parameter*> TransformerStack::counted_in_norm(
    const std::vector<Parameter*>& candidates) const {
  return layout_.tensor ? counted_once(candidates, *layout_.tensor) : candidates;
}

std::vector<Fp8State*> TransformerStack::fp8_states() {
  std::vector<Fp8State*> out;
  for (int chunk : chunks_in_stage_order()) {
    for (TransformerLayer& layer : layers(chunk)) {
      for (Fp8State* s : layer.fp8_states()) out.push_back(s);
    }
  }
  return out;
}

std::vector<int64_t> TransformerStack::fp8_state_indices() {
  const size_t states = fp8_states().size();
  return layout_.stages == 1 ? octet::fp8_state_indices(states)
                             : octet::fp8_state_indices(*this, states, num_layers_);
}

namespace {

std::string expert_bias_name(const MoELayer& moe) {
  return moe.options().name + ".router.expert_bias";
}

}  // namespace

std::vector<TrainableModel::MoELayerRef> TransformerStack::moe_layers() {
  std::vector<MoELayerRef> out;
  for (int chunk : chunks_in_stage_order()) {
    std::vector<TransformerLayer>& stack = layers(chunk);
    for (size_t i = 0; i < stack.size(); ++i) {
      if (stack[i].moe) out.push_back({global_layer(chunk, i), &*stack[i].moe});
    }
  }
  return out;
}

TensorMap TransformerStack::state_dict() {
  TensorMap out;
  for (Parameter* p : parameters()) out[p->name] = gather(*p, p->value);
  for (const MoELayerRef& ref : moe_layers()) {
    const MoELayer& moe = *ref.moe;
    if (moe.options().enable_expert_bias) out[expert_bias_name(moe)] = moe.expert_bias.clone();
  }
  return out;
}

void TransformerStack::load_state_dict(const TensorMap& tensors) {
  std::vector<Parameter*> params = parameters();
  for (Parameter* p : params) {
    auto it = tensors.find(p->name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", p->name,
                "' (does the checkpoint match this model config?)");
    p->value.copy_from(shard(*p, it->second));
  }
  size_t buffers = 0;
  for (const MoELayerRef& ref : moe_layers()) {
    MoELayer* moe = ref.moe;
    if (!moe->options().enable_expert_bias) continue;
    const std::string name = expert_bias_name(*moe);
    auto it = tensors.find(name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", name,
                "' (the expert bias of --moe-router-enable-expert-bias)");
    check_shape(it->second, moe->expert_bias.shape(), "checkpoint: tensor '" + name + "'", "E");
    check_dtype(it->second, DType::F32, "checkpoint: tensor '" + name + "'");
    moe->expert_bias.copy_from(it->second);
    ++buffers;
  }
  // Another stage's tensors (or another expert rank's experts) are expected in a whole-model
  // map; the whole model has no others.
  OCTET_CHECK(
      layout_.stages > 1 || layout_.expert != nullptr || tensors.size() == params.size() + buffers,
      "checkpoint: holds ", tensors.size(), " tensors, the model has ", params.size() + buffers,
      " (parameters and buffers)");
  on_parameters_updated();
}

void TransformerStack::set_high_precision_layers(int64_t first, int64_t last) {
  OCTET_CHECK(first >= 0 && last >= 0 && first + last <= num_layers_, who_,
              ": layers kept in high precision (first ", first, ", last ", last,
              ") expected >= 0 and at most num_layers=", num_layers_, " together");
  high_precision_first_ = first;
  high_precision_last_ = last;
}

bool TransformerStack::is_high_precision_layer(int64_t layer) const {
  return layer < high_precision_first_ || layer >= num_layers_ - high_precision_last_;
}

const Tensor& TransformerStack::checked_input(int chunk, const Tensor& input, const Shape& boundary,
                                              DType dtype) const {
  const std::string what = who_ + ": input of chunk " + std::to_string(chunk);
  check_shape(input, boundary, what, sequence_parallel() ? "B*T/TP,C" : "B,T,C");
  check_dtype(input, dtype, what);
  return input;
}

Tensor TransformerStack::forward_layers(int chunk, Tensor h,
                                        std::vector<TransformerLayer::Context>* contexts,
                                        int64_t seq_len, const Tensor* lengths, float loss_scale) {
  std::vector<TransformerLayer>& stack = layers(chunk);
  if (contexts) contexts->assign(stack.size(), TransformerLayer::Context{});
  for (size_t i = 0; i < stack.size(); ++i) {
    TransformerLayer::Context scratch;
    if (stack[i].moe) stack[i].moe->set_loss_scale(loss_scale);
    HighPrecisionScope scope(is_high_precision_layer(global_layer(chunk, i)));
    h = stack[i].forward(h, contexts ? (*contexts)[i] : scratch, nullptr, lengths, nullptr,
                         seq_len);
  }
  return h;
}

Tensor TransformerStack::backward_layers(int chunk, Tensor dx,
                                         std::vector<TransformerLayer::Context>& contexts) {
  std::vector<TransformerLayer>& stack = layers(chunk);
  OCTET_CHECK(contexts.size() == stack.size(), who_, ": backward of chunk ", chunk,
              " before its forward");
  for (size_t i = stack.size(); i-- > 0;) {
    HighPrecisionScope scope(is_high_precision_layer(global_layer(chunk, i)));
    dx = stack[i].backward(dx, contexts[i]);
    contexts[i] = TransformerLayer::Context{};
    grads_ready(stack[i].parameters());
  }
  return dx;
}

void TransformerStack::on_parameters_updated() {
  for (std::vector<TransformerLayer>& chunk : layers_) {
    for (TransformerLayer& layer : chunk) layer.on_parameters_updated();
  }
}

std::vector<int64_t> fp8_state_indices(size_t states) {
  std::vector<int64_t> out(states);
  for (size_t i = 0; i < states; ++i) out[i] = static_cast<int64_t>(i);
  return out;
}

std::vector<int64_t> fp8_state_indices(const pipeline::StagedModel& part, size_t states,
                                       int64_t num_layers) {
  const int64_t per_stage = num_layers / part.stages();
  const int64_t layers_held = per_stage * part.chunks();
  OCTET_CHECK(layers_held > 0 && static_cast<int64_t>(states) % layers_held == 0,
              "fp8 states: ", states, " states over ", layers_held,
              " layers held: expected the same number per layer");
  const int64_t per_layer = static_cast<int64_t>(states) / layers_held;
  // The part lists its chunks in stage order, each chunk's layers in order.
  const std::vector<int> chunks = part.chunks_in_stage_order();
  std::vector<int64_t> out(states);
  for (int64_t i = 0; i < static_cast<int64_t>(states); ++i) {
    const int64_t local_layer = i / per_layer;
    const int stage = part.stage_of_chunk(chunks[static_cast<size_t>(local_layer / per_stage)]);
    const int64_t layer = stage * per_stage + local_layer % per_stage;
    out[static_cast<size_t>(i)] = layer * per_layer + i % per_layer;
  }
  return out;
}

}  // namespace octet
