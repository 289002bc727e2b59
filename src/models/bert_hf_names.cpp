// Checkpoint names: octet's BERT module names <-> Hugging Face's BertForPreTraining (post-LN) or
// MegatronBertForPreTraining (pre-LN). The embeddings, the pooler and the heads already carry
// Hugging Face's names; inside each layer the fused [query | key | value] projection is split
// into three tensors and the sub-modules renamed.
#include <array>
#include <cctype>
#include <map>
#include <span>

#include "octet/bert.h"

namespace octet {
namespace {

struct Rename {
  const char* ours;  // suffix after "bert.encoder.layer.{i}."
  const char* theirs;
};

// Post-LN: the MLP's input norm is LayerNorm(x + attention), BERT's attention.output.LayerNorm.
constexpr Rename kPostLnRenames[] = {
    {"self_attention.proj.weight", "attention.output.dense.weight"},
    {"self_attention.proj.bias", "attention.output.dense.bias"},
    {"layernorm_mlp.norm.weight", "attention.output.LayerNorm.weight"},
    {"layernorm_mlp.norm.bias", "attention.output.LayerNorm.bias"},
    {"layernorm_mlp.fc1.weight", "intermediate.dense.weight"},
    {"layernorm_mlp.fc1.bias", "intermediate.dense.bias"},
    {"layernorm_mlp.fc2.weight", "output.dense.weight"},
    {"layernorm_mlp.fc2.bias", "output.dense.bias"},
    {"layernorm.weight", "output.LayerNorm.weight"},
    {"layernorm.bias", "output.LayerNorm.bias"},
};

constexpr Rename kPreLnRenames[] = {
    {"self_attention.layernorm_qkv.norm.weight", "attention.ln.weight"},
    {"self_attention.layernorm_qkv.norm.bias", "attention.ln.bias"},
    {"self_attention.proj.weight", "attention.output.dense.weight"},
    {"self_attention.proj.bias", "attention.output.dense.bias"},
    {"layernorm_mlp.norm.weight", "ln.weight"},
    {"layernorm_mlp.norm.bias", "ln.bias"},
    {"layernorm_mlp.fc1.weight", "intermediate.dense.weight"},
    {"layernorm_mlp.fc1.bias", "intermediate.dense.bias"},
    {"layernorm_mlp.fc2.weight", "output.dense.weight"},
    {"layernorm_mlp.fc2.bias", "output.dense.bias"},
};

constexpr const char* kParts[] = {"query", "key", "value"};

// Splits "bert.encoder.layer.12.rest" into (prefix "bert.encoder.layer.12.", rest).
bool split_layer(const std::string& name, std::string& prefix, std::string& rest) {
  const std::string head = "bert.encoder.layer.";
  if (name.compare(0, head.size(), head) != 0) return false;
  size_t end = head.size();
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == head.size() || end >= name.size() || name[end] != '.') return false;
  prefix = name.substr(0, end + 1);
  rest = name.substr(end + 1);
  return true;
}

std::string qkv_name(bool post_layernorm) {
  return post_layernorm ? "self_attention.qkv" : "self_attention.layernorm_qkv";
}

}  // namespace

TensorMap Bert::to_checkpoint_names(const TensorMap& ours) const {
  const bool post = config_.post_layernorm;
  const std::string qkv = qkv_name(post);
  TensorMap out;
  for (const auto& [name, tensor] : ours) {
    std::string prefix, rest;
    if (!split_layer(name, prefix, rest)) {
      out[name] = tensor;
      continue;
    }
    if (rest == qkv + ".weight" || rest == qkv + ".bias") {
      // [q | k | v] rows, each hidden wide (BERT has no grouped queries).
      const bool weight = rest.back() == 't';
      const int64_t C = tensor.dim(0) / 3;
      for (int part = 0; part < 3; ++part) {
        out[prefix + "attention.self." + kParts[part] + (weight ? ".weight" : ".bias")] =
            tensor.slice_rows(part * C, (part + 1) * C).clone();
      }
      continue;
    }
    bool renamed = false;
    for (const Rename& r :
         post ? std::span<const Rename>(kPostLnRenames) : std::span<const Rename>(kPreLnRenames)) {
      if (rest == r.ours) {
        out[prefix + r.theirs] = tensor;
        renamed = true;
      }
    }
    OCTET_CHECK(renamed, "bert names: no Hugging Face name for '", name, "'");
  }
  return out;
}

TensorMap Bert::from_checkpoint_names(const TensorMap& theirs) const {
  const bool post = config_.post_layernorm;
  const std::string qkv = qkv_name(post);
  TensorMap out;
  // Fused projections gathered by layer: [query, key, value] of the weight and of the bias.
  std::map<std::string, std::array<Tensor, 6>> fused;
  for (const auto& [name, tensor] : theirs) {
    // Hugging Face ties the decoder to the word embedding and its bias to
    // cls.predictions.bias; position_ids is a buffer.
    if (name == "cls.predictions.decoder.weight" || name == "cls.predictions.decoder.bias" ||
        name == "bert.embeddings.position_ids") {
      continue;
    }
    std::string prefix, rest;
    if (!split_layer(name, prefix, rest)) {
      out[name] = tensor;
      continue;
    }
    bool renamed = false;
    for (int part = 0; part < 3 && !renamed; ++part) {
      for (int bias = 0; bias < 2; ++bias) {
        if (rest == std::string("attention.self.") + kParts[part] + (bias ? ".bias" : ".weight")) {
          fused[prefix][static_cast<size_t>(bias * 3 + part)] = tensor;
          renamed = true;
        }
      }
    }
    for (const Rename& r :
         post ? std::span<const Rename>(kPostLnRenames) : std::span<const Rename>(kPreLnRenames)) {
      if (rest == r.theirs) {
        out[prefix + r.ours] = tensor;
        renamed = true;
      }
    }
    OCTET_CHECK(renamed, "bert names: unknown tensor '", name, "' (expected Hugging Face's ",
                post ? "BertForPreTraining" : "MegatronBertForPreTraining", " names)");
  }
  for (const auto& [prefix, parts] : fused) {
    for (int bias = 0; bias < 2; ++bias) {
      std::vector<Tensor> pieces;
      for (int part = 0; part < 3; ++part) {
        const Tensor& piece = parts[static_cast<size_t>(bias * 3 + part)];
        OCTET_CHECK(piece.defined(), "bert names: '", prefix, "attention.self.", kParts[part],
                    bias ? ".bias" : ".weight", "' missing (query, key and value come together)");
        check_dtype(piece, DType::F32, prefix + "attention.self." + kParts[part]);
        OCTET_CHECK(pieces.empty() || piece.shape() == pieces[0].shape(),
                    "bert names: query, key and value of '", prefix, "' differ in shape");
        pieces.push_back(piece);
      }
      Shape shape = pieces[0].shape();
      const int64_t rows = shape[0];
      shape[0] = 3 * rows;
      Tensor whole = Tensor::empty(shape, DType::F32);
      for (int part = 0; part < 3; ++part) {
        whole.slice_rows(part * rows, (part + 1) * rows)
            .copy_from(pieces[static_cast<size_t>(part)]);
      }
      out[prefix + qkv + (bias ? ".bias" : ".weight")] = whole;
    }
  }
  return out;
}

}  // namespace octet
