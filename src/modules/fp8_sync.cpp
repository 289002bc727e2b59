// FP8 state across ranks: the delayed-scaling amax reduction (TransformerEngine does it in its
// module layer, reduce_and_update_fp8_tensors) and the FP8 health stats each Fp8State keeps,
// taken per step and merged over a group.
#include <cstring>

#include "octet/modules.h"

namespace octet {

void reduce_fp8_amax(const std::vector<Fp8State*>& states, Communicator& group) {
  if (group.size() == 1) return;
  std::vector<FP8Meta*> metas;
  for (Fp8State* state : states) {
    for (FP8Meta* meta : {&state->mutable_forward_meta(), &state->mutable_backward_meta()}) {
      if (meta->num_tensors() > 0 && meta->history_len() > 0) metas.push_back(meta);
    }
  }
  std::vector<float> amax;
  for (FP8Meta* meta : metas) {
    for (int i = 0; i < meta->num_tensors(); ++i) amax.push_back(meta->amax_history(0, i));
  }
  if (amax.empty()) return;
  Tensor buffer = Tensor::from_floats({static_cast<int64_t>(amax.size())}, amax);
  group.all_reduce(buffer, ReduceOp::Max);  // NaN anywhere stays NaN everywhere
  const float* reduced = buffer.data<float>();
  for (FP8Meta* meta : metas) {
    for (int i = 0; i < meta->num_tensors(); ++i) meta->record_amax(i, *reduced++);
  }
}

nlohmann::json take_fp8_stats(const std::vector<Fp8State*>& states) {
  nlohmann::json out = nlohmann::json::object();
  for (Fp8State* state : states) {
    for (const auto& [name, s] : state->stats()) {
      out[name] = {{"amax", s.amax},
                   {"scale", s.scale},
                   {"underflow", s.underflow},
                   {"saturated", s.saturated}};
    }
    state->clear_stats();
  }
  return out;
}

nlohmann::json gather_fp8_stats(const nlohmann::json& mine, Communicator& group) {
  if (group.size() == 1) return mine;
  // Each rank's JSON text in one row, padded with NULs to the longest.
  const std::string text = mine.dump();
  const auto longest =
      static_cast<int64_t>(group.all_reduce(static_cast<double>(text.size()), ReduceOp::Max));
  Tensor row = Tensor::zeros({1, longest}, DType::U8);
  std::memcpy(row.raw(), text.data(), text.size());
  const Tensor rows = group.all_gather(row);
  nlohmann::json merged = nlohmann::json::object();
  for (int r = 0; r < group.size(); ++r) {
    const char* begin = static_cast<const char*>(rows.raw()) + r * longest;
    merged.update(nlohmann::json::parse(std::string(begin, strnlen(begin, longest))));
  }
  return merged;
}

}  // namespace octet
