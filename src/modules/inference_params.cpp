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
  const Shape shape = is_paged ? Shape{num_blocks, block_size, kv_heads, head_dim}
                               : Shape{max_batch_size, max_sequence_length, kv_heads, head_dim};
  OCTET_CHECK(!fp8_kv || is_paged, "InferenceParams: an FP8 cache must be paged");
  const DType stored = fp8_kv ? DType::E4M3 : dtype;
  if (!kv.key.defined()) {
    kv.key = Tensor::zeros(shape, stored);
    kv.value = Tensor::zeros(shape, stored);
    if (fp8_kv) {
      kv.key_scale = Tensor::zeros({num_blocks, block_size, kv_heads}, DType::F32);
      kv.value_scale = Tensor::zeros({num_blocks, block_size, kv_heads}, DType::F32);
    }
  }
  OCTET_CHECK(kv.key.shape() == shape && kv.key.dtype() == stored, "InferenceParams: layer ",
              layer_number, " cache is ", shape_str(kv.key.shape()), " ",
              dtype_name(kv.key.dtype()), ", asked for ", shape_str(shape), " ", dtype_name(stored),
              " (call generation with one compute dtype per cache)");
  return kv;
}

InferenceParams InferenceParams::paged(int64_t blocks, int64_t tokens_per_block,
                                       int64_t max_length) {
  OCTET_CHECK(blocks > 0 && tokens_per_block > 0,
              "InferenceParams: num_blocks and block_size must be positive, got ", blocks, " and ",
              tokens_per_block);
  InferenceParams params(1, max_length);
  params.is_paged = true;
  params.num_blocks = blocks;
  params.block_size = tokens_per_block;
  return params;
}

void InferenceParams::set_paged_batch(PagedBatch b) {
  OCTET_CHECK(is_paged, "InferenceParams: set_paged_batch on a contiguous cache");
  const int64_t sequences = b.sequences();
  OCTET_CHECK(sequences > 0, "InferenceParams: a paged batch needs at least one sequence");
  OCTET_CHECK(static_cast<int64_t>(b.row_offsets.size()) == sequences + 1 &&
                  static_cast<int64_t>(b.block_tables.size()) == sequences && b.row_offsets[0] == 0,
              "InferenceParams: a paged batch of ", sequences, " sequences expects ", sequences + 1,
              " row offsets from 0 and ", sequences, " block tables, got ", b.row_offsets.size(),
              " and ", b.block_tables.size());
  for (int64_t s = 0; s < sequences; ++s) {
    const size_t i = static_cast<size_t>(s);
    const int64_t rows = b.row_offsets[i + 1] - b.row_offsets[i];
    const int64_t length = b.cached_lengths[i] + rows;
    OCTET_CHECK(rows > 0 && b.cached_lengths[i] >= 0, "InferenceParams: sequence ", s, " has ",
                rows, " new tokens after ", b.cached_lengths[i], " cached (expected > 0, >= 0)");
    OCTET_CHECK(length <= max_sequence_length, "InferenceParams: sequence ", s, " reaches ", length,
                " tokens, over max_sequence_length ", max_sequence_length);
    const int64_t needed = (length + block_size - 1) / block_size;
    OCTET_CHECK(static_cast<int64_t>(b.block_tables[i].size()) >= needed,
                "InferenceParams: sequence ", s, " of ", length, " tokens needs ", needed,
                " blocks, its table has ", b.block_tables[i].size());
    for (const int32_t block : b.block_tables[i]) {
      OCTET_CHECK(block >= 0 && block < num_blocks, "InferenceParams: sequence ", s, " block ",
                  block, " outside [0, ", num_blocks, ")");
    }
  }
  batch = std::move(b);
}

size_t InferenceParams::bytes() const {
  size_t total = 0;
  for (const KeyValue& kv : key_value_memory) {
    if (kv.key.defined()) total += kv.key.nbytes() + kv.value.nbytes();
    if (kv.key_scale.defined()) total += kv.key_scale.nbytes() + kv.value_scale.nbytes();
  }
  return total;
}

}  // namespace octet
