// Checkpoint names: octet's module names <-> Hugging Face GPT-2's where the layer matches.
// GPT-2 keeps its linear weights as Conv1D [in, out]; octet's Linear is [out, in], so those
// four matrices are transposed on the way out and back.
#include <cctype>

#include "octet/model.h"

namespace octet {
namespace {

struct Rename {
  const char* ours;  // suffix after "transformer.h.{i}."
  const char* theirs;
  bool transpose;
};

constexpr Rename kLayerRenames[] = {
    {"self_attention.layernorm_qkv.norm.weight", "ln_1.weight", false},
    {"self_attention.layernorm_qkv.norm.bias", "ln_1.bias", false},
    {"self_attention.layernorm_qkv.weight", "attn.c_attn.weight", true},
    {"self_attention.layernorm_qkv.bias", "attn.c_attn.bias", false},
    {"self_attention.proj.weight", "attn.c_proj.weight", true},
    {"self_attention.proj.bias", "attn.c_proj.bias", false},
    {"layernorm_mlp.norm.weight", "ln_2.weight", false},
    {"layernorm_mlp.norm.bias", "ln_2.bias", false},
    {"layernorm_mlp.fc1.weight", "mlp.c_fc.weight", true},
    {"layernorm_mlp.fc1.bias", "mlp.c_fc.bias", false},
    {"layernorm_mlp.fc2.weight", "mlp.c_proj.weight", true},
    {"layernorm_mlp.fc2.bias", "mlp.c_proj.bias", false},
};

Tensor transposed(const Tensor& t) {
  check_dtype(t, DType::F32, "gpt2 names: transposed tensor");
  OCTET_CHECK(t.ndim() == 2, "gpt2 names: expected a matrix, got ", shape_str(t.shape()));
  const int64_t rows = t.dim(0), cols = t.dim(1);
  Tensor out = Tensor::empty({cols, rows}, DType::F32);
  const float* in = t.data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) o[c * rows + r] = in[r * cols + c];
  }
  return out;
}

// Splits "transformer.h.12.rest" into (prefix "transformer.h.12.", rest); false otherwise.
bool split_layer(const std::string& name, std::string& prefix, std::string& rest) {
  const std::string head = "transformer.h.";
  if (name.compare(0, head.size(), head) != 0) return false;
  size_t end = head.size();
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == head.size() || end >= name.size() || name[end] != '.') return false;
  prefix = name.substr(0, end + 1);
  rest = name.substr(end + 1);
  return true;
}

TensorMap rename(const TensorMap& in, bool to_hf) {
  TensorMap out;
  for (const auto& [name, tensor] : in) {
    std::string prefix, rest;
    std::string new_name = name;
    Tensor value = tensor;
    if (split_layer(name, prefix, rest)) {
      for (const Rename& r : kLayerRenames) {
        if (rest == (to_hf ? r.ours : r.theirs)) {
          new_name = prefix + (to_hf ? r.theirs : r.ours);
          if (r.transpose) value = transposed(tensor);
          break;
        }
      }
    }
    OCTET_CHECK(out.emplace(new_name, value).second, "gpt2 names: two tensors map to '", new_name,
                "'");
  }
  return out;
}

}  // namespace

TensorMap to_hf_gpt2_names(const TensorMap& ours) {
  return rename(ours, true);
}
TensorMap from_hf_gpt2_names(const TensorMap& theirs) {
  return rename(theirs, false);
}

}  // namespace octet
