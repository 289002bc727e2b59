// Checkpoint names: octet's T5 module names <-> Hugging Face's T5ForConditionalGeneration
// (v1.1). Inside each layer the fused projections are split ([q | k | v] of self-attention,
// [k | v] of cross-attention, [wi_0 | wi_1] of the gated FFN) and the sub-modules renamed; the
// relative position tables live in each stack's first block.
#include <cctype>
#include <map>
#include <vector>

#include "octet/t5.h"

namespace octet {
namespace {

// One of our tensors: its name after "{stack}.layer.{i}." and the pieces it is cut into (in
// row order, equal parts).
struct Rename {
  const char* ours;
  std::vector<const char*> theirs;
};

const std::vector<Rename>& encoder_renames() {
  static const std::vector<Rename> renames = {
      {"self_attention.layernorm_qkv.norm.weight", {"layer.0.layer_norm.weight"}},
      {"self_attention.layernorm_qkv.weight",
       {"layer.0.SelfAttention.q.weight", "layer.0.SelfAttention.k.weight",
        "layer.0.SelfAttention.v.weight"}},
      {"self_attention.proj.weight", {"layer.0.SelfAttention.o.weight"}},
      {"layernorm_mlp.norm.weight", {"layer.1.layer_norm.weight"}},
      {"layernorm_mlp.fc1.weight",
       {"layer.1.DenseReluDense.wi_0.weight", "layer.1.DenseReluDense.wi_1.weight"}},
      {"layernorm_mlp.fc2.weight", {"layer.1.DenseReluDense.wo.weight"}},
  };
  return renames;
}

const std::vector<Rename>& decoder_renames() {
  static const std::vector<Rename> renames = {
      {"self_attention.layernorm_qkv.norm.weight", {"layer.0.layer_norm.weight"}},
      {"self_attention.layernorm_qkv.weight",
       {"layer.0.SelfAttention.q.weight", "layer.0.SelfAttention.k.weight",
        "layer.0.SelfAttention.v.weight"}},
      {"self_attention.proj.weight", {"layer.0.SelfAttention.o.weight"}},
      {"inter_attention.layernorm_query.norm.weight", {"layer.1.layer_norm.weight"}},
      {"inter_attention.layernorm_query.weight", {"layer.1.EncDecAttention.q.weight"}},
      {"inter_attention.key_value.weight",
       {"layer.1.EncDecAttention.k.weight", "layer.1.EncDecAttention.v.weight"}},
      {"inter_attention.proj.weight", {"layer.1.EncDecAttention.o.weight"}},
      {"layernorm_mlp.norm.weight", {"layer.2.layer_norm.weight"}},
      {"layernorm_mlp.fc1.weight",
       {"layer.2.DenseReluDense.wi_0.weight", "layer.2.DenseReluDense.wi_1.weight"}},
      {"layernorm_mlp.fc2.weight", {"layer.2.DenseReluDense.wo.weight"}},
  };
  return renames;
}

// "encoder.layer.3.rest" -> ("encoder", 3, "rest"); false for other names. `word` is "layer"
// (ours) or "block" (theirs).
bool split_layer(const std::string& name, const std::string& word, std::string& stack,
                 int64_t& index, std::string& rest) {
  for (const std::string s : {"encoder", "decoder"}) {
    const std::string head = s + "." + word + ".";
    if (name.compare(0, head.size(), head) != 0) continue;
    size_t end = head.size();
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end == head.size() || end >= name.size() || name[end] != '.') return false;
    stack = s;
    index = std::stoll(name.substr(head.size(), end - head.size()));
    rest = name.substr(end + 1);
    return true;
  }
  return false;
}

const char* kEncoderBias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
const char* kDecoderBias = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";

}  // namespace

TensorMap T5::to_checkpoint_names(const TensorMap& ours) const {
  TensorMap out;
  for (const auto& [name, tensor] : ours) {
    std::string stack, rest;
    int64_t index = 0;
    if (name == "encoder.relative_attention_bias.weight") {
      out[kEncoderBias] = tensor;
      continue;
    }
    if (name == "decoder.relative_attention_bias.weight") {
      out[kDecoderBias] = tensor;
      continue;
    }
    if (!split_layer(name, "layer", stack, index, rest)) {
      out[name] = tensor;  // shared, final norms, lm_head: the same names
      continue;
    }
    bool renamed = false;
    for (const Rename& r : stack == "encoder" ? encoder_renames() : decoder_renames()) {
      if (rest != r.ours) continue;
      const int64_t parts = static_cast<int64_t>(r.theirs.size());
      const int64_t rows = tensor.dim(0) / parts;
      for (int64_t k = 0; k < parts; ++k) {
        out[stack + ".block." + std::to_string(index) + "." + r.theirs[static_cast<size_t>(k)]] =
            parts == 1 ? tensor : tensor.slice_rows(k * rows, (k + 1) * rows).clone();
      }
      renamed = true;
    }
    OCTET_CHECK(renamed, "t5 names: no Hugging Face name for '", name, "'");
  }
  return out;
}

TensorMap T5::from_checkpoint_names(const TensorMap& theirs) const {
  TensorMap out;
  // Pieces of our fused tensors by their name: [piece index] -> tensor.
  std::map<std::string, std::vector<Tensor>> pieces;
  for (const auto& [name, tensor] : theirs) {
    // Hugging Face ties both stacks' embed_tokens to shared.
    if (name == "encoder.embed_tokens.weight" || name == "decoder.embed_tokens.weight") continue;
    if (name == kEncoderBias) {
      out["encoder.relative_attention_bias.weight"] = tensor;
      continue;
    }
    if (name == kDecoderBias) {
      out["decoder.relative_attention_bias.weight"] = tensor;
      continue;
    }
    std::string stack, rest;
    int64_t index = 0;
    if (!split_layer(name, "block", stack, index, rest)) {
      OCTET_CHECK(name == "shared.weight" || name == "lm_head.weight" ||
                      name == "encoder.final_layer_norm.weight" ||
                      name == "decoder.final_layer_norm.weight",
                  "t5 names: unknown tensor '", name,
                  "' (expected Hugging Face's T5ForConditionalGeneration v1.1 names)");
      out[name] = tensor;
      continue;
    }
    bool renamed = false;
    for (const Rename& r : stack == "encoder" ? encoder_renames() : decoder_renames()) {
      for (size_t k = 0; k < r.theirs.size(); ++k) {
        if (rest != r.theirs[k]) continue;
        std::vector<Tensor>& parts =
            pieces[stack + ".layer." + std::to_string(index) + "." + r.ours];
        parts.resize(r.theirs.size());
        parts[k] = tensor;
        renamed = true;
      }
    }
    OCTET_CHECK(renamed, "t5 names: unknown tensor '", name,
                "' (expected Hugging Face's T5ForConditionalGeneration v1.1 names)");
  }
  for (const auto& [name, parts] : pieces) {
    if (parts.size() == 1) {
      out[name] = parts[0];
      continue;
    }
    int64_t rows = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      OCTET_CHECK(parts[k].defined(), "t5 names: a piece of '", name, "' is missing (",
                  parts.size(), " pieces come together)");
      check_dtype(parts[k], DType::F32, "t5 names: " + name);
      OCTET_CHECK(parts[k].ndim() == 2 && parts[k].dim(1) == parts[0].dim(1),
                  "t5 names: the "
                  "pieces of '",
                  name, "' differ in shape");
      rows += parts[k].dim(0);
    }
    Tensor whole = Tensor::empty({rows, parts[0].dim(1)}, DType::F32);
    int64_t row = 0;
    for (const Tensor& part : parts) {
      whole.slice_rows(row, row + part.dim(0)).copy_from(part);
      row += part.dim(0);
    }
    out[name] = whole;
  }
  return out;
}

}  // namespace octet
