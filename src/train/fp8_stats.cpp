// FP8 state of a GPT in training: the list of its Fp8States and their checkpoint indices at
// any layout, the amax reduction across ranks, and FP8 health (the stats every Fp8State
// measured in a step, the metrics line's "fp8" object, summarized over the run).
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "octet/comm.h"
#include "octet/model.h"
#include "octet/train.h"

namespace octet {

std::vector<Fp8State*> fp8_states(TrainableModel& model) {
  return model.fp8_states();
}

void reduce_fp8_amax(TrainableModel& model, Communicator& group) {
  reduce_fp8_amax(fp8_states(model), group);
}

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

nlohmann::json take_fp8_stats(TrainableModel& model) {
  return take_fp8_stats(fp8_states(model));
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

void Fp8StatsSummary::add(const nlohmann::json& step_stats) {
  for (const auto& [name, s] : step_stats.items()) {
    auto it = std::find_if(entries_.begin(), entries_.end(),
                           [&](const Entry& e) { return e.name == name; });
    const double amax = s.at("amax"), scale = s.at("scale");
    const double underflow = s.at("underflow"), saturated = s.at("saturated");
    if (it == entries_.end()) {
      entries_.push_back({name, amax, scale, scale, underflow, saturated, 1});
      continue;
    }
    it->max_amax = std::max(it->max_amax, amax);
    it->min_scale = std::min(it->min_scale, scale);
    it->max_scale = std::max(it->max_scale, scale);
    it->underflow_sum += underflow;
    it->max_saturated = std::max(it->max_saturated, saturated);
    ++it->steps;
  }
}

nlohmann::json Fp8StatsSummary::to_json() const {
  nlohmann::json out = nlohmann::json::object();
  for (const Entry& e : entries_) {
    out[e.name] = {{"max_amax", e.max_amax},
                   {"min_scale", e.min_scale},
                   {"max_scale", e.max_scale},
                   {"mean_underflow", e.underflow_sum / static_cast<double>(e.steps)},
                   {"max_saturated", e.max_saturated},
                   {"steps", e.steps}};
  }
  return out;
}

std::string Fp8StatsSummary::table() const {
  size_t width = 6;
  for (const Entry& e : entries_) width = std::max(width, e.name.size());
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-*s %11s %11s %11s %12s %13s\n", static_cast<int>(width),
                "tensor", "max amax", "min scale", "max scale", "underflow %", "saturated %");
  out += line;
  for (const Entry& e : entries_) {
    std::snprintf(line, sizeof line, "%-*s %11.4g %11.4g %11.4g %12.4f %13.4f\n",
                  static_cast<int>(width), e.name.c_str(), e.max_amax, e.min_scale, e.max_scale,
                  100.0 * e.underflow_sum / static_cast<double>(e.steps), 100.0 * e.max_saturated);
    out += line;
  }
  return out;
}

}  // namespace octet
