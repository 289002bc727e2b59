// InferenceParams: the per-layer key/value buffers of KV-cache decoding, allocated lazily by
// the first forward that reaches each layer.
#include "octet/modules.h"

namespace octet {

InferenceParams::InferenceParams(int64_t max_batch, int64_t max_length)
    : max_batch_size(max_batch), max_sequence_length(max_length) {
  OCTET_CHECK(max_batch > 0 && max_length > 0,
              "InferenceParams: max_batch_size and max_sequence_length must be positive, got ",
              max_batch, " and ", max_length);
}

InferenceParams::KeyValue& InferenceParams::key_value(int64_t layer_number, int64_t kv_heads,
                                                      int64_t head_dim, DType dtype) {
  OCTET_CHECK(layer_number >= 0, "InferenceParams: layer_number must be >= 0, got ", layer_number);
  OCTET_CHECK(dtype == DType::F32 || dtype == DType::BF16,
              "InferenceParams: cache dtype expected f32 or bf16, got ", dtype_name(dtype));
  if (static_cast<int64_t>(key_value_memory.size()) <= layer_number) {
    key_value_memory.resize(static_cast<size_t>(layer_number + 1));
  }
  KeyValue& kv = key_value_memory[static_cast<size_t>(layer_number)];
  const Shape shape = {max_batch_size, max_sequence_length, kv_heads, head_dim};
  if (!kv.key.defined()) {
    kv.key = Tensor::zeros(shape, dtype);
    kv.value = Tensor::zeros(shape, dtype);
  }
  OCTET_CHECK(kv.key.shape() == shape && kv.key.dtype() == dtype, "InferenceParams: layer ",
              layer_number, " cache is ", shape_str(kv.key.shape()), " ",
              dtype_name(kv.key.dtype()), ", asked for ", shape_str(shape), " ", dtype_name(dtype),
              " (call generation with one compute dtype per cache)");
  return kv;
}

size_t InferenceParams::bytes() const {
  size_t total = 0;
  for (const KeyValue& kv : key_value_memory) {
    if (kv.key.defined()) total += kv.key.nbytes() + kv.value.nbytes();
  }
  return total;
}

}  // namespace octet
