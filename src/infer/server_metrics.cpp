// /metrics in Prometheus' text format (version 0.0.4): each family with its HELP and TYPE.
#include "infer/server_metrics.h"

#include <cstdio>
#include <tuple>

namespace octet::serving {
namespace {

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", value);
  return text;
}

}  // namespace

Histogram::Histogram() : counts_(std::size(kBounds) + 1, 0) {}

void Histogram::observe(double seconds) {
  size_t bucket = 0;
  while (bucket < std::size(kBounds) && seconds > kBounds[bucket]) ++bucket;
  std::lock_guard lock(mutex_);
  ++counts_[bucket];
  sum_ += seconds;
}

void Histogram::write(std::string& out, const std::string& name, const char* help) const {
  std::lock_guard lock(mutex_);
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    const std::string bound = i < std::size(kBounds) ? number_text(kBounds[i]) : "+Inf";
    out += name + "_bucket{le=\"" + bound + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum " + number_text(sum_) + "\n";
  out += name + "_count " + std::to_string(cumulative) + "\n";
}

std::string prometheus_text(const Metrics& metrics, const EngineStats& stats) {
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto sample = [&](const std::string& name, double value) {
    out += name + " " + number_text(value) + "\n";
  };
  family("octet_requests_total", "counter",
         "Completion requests answered, by outcome (rejected: 503 busy or draining; cancelled: "
         "the client left mid-stream).");
  for (size_t i = 0; i < std::size(kOutcomeNames); ++i) {
    sample(std::string("octet_requests_total{status=\"") + kOutcomeNames[i] + "\"}",
           static_cast<double>(metrics.requests[i].load()));
  }
  family("octet_completions_total", "counter", "Completion choices finished, by finish reason.");
  for (size_t i = 0; i < std::size(kFinishReasons); ++i) {
    sample(std::string("octet_completions_total{finish_reason=\"") +
               finish_reason_name(kFinishReasons[i]) + "\"}",
           static_cast<double>(metrics.choices_finished[i].load()));
  }
  const std::pair<const char*, double> counters[] = {
      {"octet_prompt_tokens_total", static_cast<double>(stats.prompt_tokens)},
      {"octet_generation_tokens_total", static_cast<double>(stats.generation_tokens)},
      {"octet_preemptions_total", static_cast<double>(stats.preemptions)},
      {"octet_prefix_cache_hit_tokens_total", static_cast<double>(stats.prefix_cache_hit_tokens)}};
  const char* counter_help[] = {"Prompt tokens the engine took in.", "Tokens generated.",
                                "Sequences preempted for want of KV blocks (recomputed later).",
                                "Prompt tokens not recomputed thanks to the prefix cache."};
  for (size_t i = 0; i < std::size(counters); ++i) {
    family(counters[i].first, "counter", counter_help[i]);
    sample(counters[i].first, counters[i].second);
  }
  const double utilization =
      stats.num_blocks > 0 ? static_cast<double>(stats.blocks_in_use) / stats.num_blocks : 0.0;
  const std::tuple<const char*, double, const char*> gauges[] = {
      {"octet_requests_running", double(stats.running), "Sequences in the running batch."},
      {"octet_requests_waiting", double(stats.waiting), "Sequences waiting to be scheduled."},
      {"octet_kv_blocks_in_use", double(stats.blocks_in_use), "KV blocks held by sequences."},
      {"octet_kv_blocks_cached", double(stats.cached_blocks),
       "Free KV blocks still keeping a prefix for reuse."},
      {"octet_kv_blocks_total", double(stats.num_blocks), "KV blocks in the cache."},
      {"octet_kv_cache_utilization", utilization, "Fraction of the KV blocks in use (0..1)."},
      {"octet_kv_block_fill_ratio", stats.kv_utilization,
       "KV tokens held / tokens the blocks in use could hold."}};
  for (const auto& [name, value, help] : gauges) {
    family(name, "gauge", help);
    sample(name, value);
  }
  metrics.time_to_first_token.write(out, "octet_time_to_first_token_seconds",
                                    "From a request's arrival to its first token.");
  metrics.inter_token_latency.write(out, "octet_inter_token_latency_seconds",
                                    "Between consecutive tokens of a completion.");
  metrics.request_latency.write(out, "octet_request_latency_seconds",
                                "From arrival to the whole answer (non-streaming requests).");
  return out;
}

}  // namespace octet::serving
