// FP8 health over a run: the per-step stats (take_fp8_stats, in the modules) summarized per
// tensor for the closing table and the metrics file.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "octet/comm.h"
#include "octet/model.h"
#include "octet/train.h"

namespace octet {

void Fp8StatsSummary::add(const nlohmann::json& step_stats) {
  for (const auto& item : step_stats.items()) {
    const std::string& name = item.key();
    const nlohmann::json& s = item.value();
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
