// TensorParallelGPT's shards: how each parameter is split, gathering whole-model tensors for
// checkpoints and slicing them back at any tensor-parallel size.
#include <algorithm>
#include <cstring>

#include "octet/model_tensor_parallel.h"

namespace octet {

void TensorParallelGPT::register_specs() {
  for (Parameter* p : parameters()) {
    ShardSpec replicated;
    replicated.full_shape = p->value.shape();
    specs_[p->name] = replicated;
  }
  if (wte.value.defined()) {
    ShardSpec& table = specs_[wte.name];
    table.kind = ShardSpec::Kind::Rows;
    table.full_shape = {config_.vocab_size, config_.hidden};
    table.vocabulary = true;
  }
  auto column = [&](Linear& layer) {
    const LinearOptions& l = layer.whole_options();
    ShardSpec s;
    s.kind = ShardSpec::Kind::Rows;
    s.blocks = l.output_blocks;
    s.full_shape = {l.out_features, l.in_features};
    specs_[layer.weight.name] = s;
    if (l.bias) {
      s.full_shape = {l.out_features};
      specs_[layer.bias.name] = s;
    }
  };
  auto row = [&](Linear& layer) {
    const LinearOptions& l = layer.whole_options();
    ShardSpec s;
    s.kind = ShardSpec::Kind::Columns;
    s.full_shape = {l.out_features, l.in_features};
    specs_[layer.weight.name] = s;
  };
  for (Stack& stack : layers_) {
    for (auto& layer : stack) {
      column(layer->attention.qkv);
      row(layer->attention.proj);
      column(layer->mlp.fc1);
      row(layer->mlp.fc2);
    }
  }
}

const ShardSpec& TensorParallelGPT::spec(const Parameter& p) const {
  auto it = specs_.find(p.name);
  OCTET_CHECK(it != specs_.end(), "tensor-parallel gpt: no parameter '", p.name, "'");
  return it->second;
}

// Per rank of the group: the (begin, count) ranges of the whole dimension (0 for Rows, 1 for
// Columns) that the rank's shard holds, in the shard's order.
std::vector<std::vector<std::pair<int64_t, int64_t>>> TensorParallelGPT::segments(
    const ShardSpec& spec) const {
  const int size = tp_->size();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> out(static_cast<size_t>(size));
  for (int q = 0; q < size; ++q) {
    auto& ranges = out[static_cast<size_t>(q)];
    if (spec.kind == ShardSpec::Kind::Columns) {
      const int64_t width = spec.full_shape[1] / size;
      ranges.emplace_back(q * width, width);
    } else if (spec.vocabulary) {
      const VocabRange range = vocab_range(spec.full_shape[0], q, size);
      ranges.emplace_back(range.begin, range.size());
    } else {
      std::vector<int64_t> blocks = spec.blocks;
      if (blocks.empty()) blocks.push_back(spec.full_shape[0]);
      int64_t begin = 0;
      for (int64_t width : blocks) {
        ranges.emplace_back(begin + q * (width / size), width / size);
        begin += width;
      }
    }
  }
  return out;
}

namespace {

int64_t inner_of(const Shape& shape) {
  int64_t inner = 1;
  for (size_t i = 1; i < shape.size(); ++i) inner *= shape[i];
  return inner;
}

}  // namespace

Tensor TensorParallelGPT::gather(const Parameter& p, const Tensor& local) {
  const ShardSpec& s = spec(p);
  check_shape(local, p.value.shape(), "tensor-parallel gpt: gather of '" + p.name + "'");
  check_dtype(local, DType::F32, "tensor-parallel gpt: gather of '" + p.name + "'");
  if (s.kind == ShardSpec::Kind::Replicated) return local;
  const auto ranges = segments(s);
  const int size = tp_->size();
  const bool rows = s.kind == ShardSpec::Kind::Rows;
  const int64_t inner = inner_of(s.full_shape), height = s.full_shape[0];
  // Equal-sized buffers for the all-gather (vocabulary shards may differ by a row).
  int64_t largest = 0;
  for (const auto& r : ranges) {
    int64_t count = 0;
    for (const auto& [begin, n] : r) count += n;
    largest = std::max(largest, rows ? count * inner : count * height);
  }
  Tensor buffer = Tensor::zeros({largest}, DType::F32);
  std::memcpy(buffer.raw(), local.raw(), static_cast<size_t>(local.numel()) * 4);
  const Tensor all = tp_->all_gather(buffer);
  Tensor full = Tensor::empty(s.full_shape, DType::F32);
  float* out = full.data<float>();
  for (int q = 0; q < size; ++q) {
    const float* src = all.data<float>() + q * largest;
    if (rows) {
      for (const auto& [begin, n] : ranges[static_cast<size_t>(q)]) {
        std::memcpy(out + begin * inner, src, static_cast<size_t>(n * inner) * 4);
        src += n * inner;
      }
    } else {
      const auto [begin, width] = ranges[static_cast<size_t>(q)].front();
      for (int64_t r = 0; r < height; ++r) {
        std::memcpy(out + r * inner + begin, src + r * width, static_cast<size_t>(width) * 4);
      }
    }
  }
  return full;
}

Tensor TensorParallelGPT::shard(const Parameter& p, const Tensor& full) const {
  const ShardSpec& s = spec(p);
  check_shape(full, s.full_shape, "tensor-parallel gpt: whole tensor '" + p.name + "'");
  check_dtype(full, DType::F32, "tensor-parallel gpt: whole tensor '" + p.name + "'");
  if (s.kind == ShardSpec::Kind::Replicated) return full.clone();
  const auto ranges = segments(s)[static_cast<size_t>(tp_->rank())];
  Tensor local = Tensor::empty(p.value.shape(), DType::F32);
  float* out = local.data<float>();
  const float* src = full.data<float>();
  const int64_t inner = inner_of(s.full_shape), height = s.full_shape[0];
  if (s.kind == ShardSpec::Kind::Rows) {
    for (const auto& [begin, n] : ranges) {
      std::memcpy(out, src + begin * inner, static_cast<size_t>(n * inner) * 4);
      out += n * inner;
    }
  } else {
    const auto [begin, width] = ranges.front();
    for (int64_t r = 0; r < height; ++r) {
      std::memcpy(out + r * width, src + r * inner + begin, static_cast<size_t>(width) * 4);
    }
  }
  return local;
}

TensorMap TensorParallelGPT::state_dict() {
  TensorMap out;
  for (Parameter* p : parameters()) out[p->name] = gather(*p, p->value);
  return out;
}

void TensorParallelGPT::load_state_dict(const TensorMap& tensors) {
  std::vector<Parameter*> params = parameters();
  for (Parameter* p : params) {
    auto it = tensors.find(p->name);
    OCTET_CHECK(it != tensors.end(), "checkpoint: missing tensor '", p->name,
                "' (does the checkpoint match this model config?)");
    p->value.copy_from(shard(*p, it->second));
  }
  // A pipeline stage takes its part of a whole-model map; the whole model takes all of it.
  OCTET_CHECK(stages_ > 1 || tensors.size() == params.size(), "checkpoint: holds ", tensors.size(),
              " tensors, the model has ", params.size(), " parameters");
  on_parameters_updated();
}

}  // namespace octet
