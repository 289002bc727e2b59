// What `octet serve` counts for /metrics, in Prometheus' text format: request outcomes and
// finish reasons (counted by the server), latency histograms (observed from the engine's
// callbacks), and the engine's own counters and gauges (EngineStats).
#pragma once

#include <atomic>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "octet/engine.h"

namespace octet::serving {

// A Prometheus histogram of seconds, buckets 5 ms .. 30 s.
class Histogram {
 public:
  Histogram();
  void observe(double seconds);
  // "# HELP", "# TYPE", then NAME_bucket{le=..} (cumulative), NAME_sum and NAME_count.
  void write(std::string& out, const std::string& name, const char* help) const;

 private:
  static constexpr double kBounds[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
                                       0.75,  1.0,  2.5,   5.0,  7.5,   10,  20,   30};
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, the last one past every bound
  double sum_ = 0;
};

// How a completion request ended (octet_requests_total{status=..}).
enum class Outcome { Ok, BadRequest, Rejected, Cancelled, Error };
inline constexpr const char* kOutcomeNames[] = {"ok", "bad_request", "rejected", "cancelled",
                                                "error"};
// FinishReason's values in order (octet_completions_total{finish_reason=..}).
inline constexpr FinishReason kFinishReasons[] = {FinishReason::Length, FinishReason::Stop,
                                                  FinishReason::Cancelled, FinishReason::Error};

// Shared by the server and every request's state (an engine callback may outlive the server).
struct Metrics {
  std::atomic<uint64_t> requests[std::size(kOutcomeNames)] = {};
  std::atomic<uint64_t> choices_finished[std::size(kFinishReasons)] = {};
  Histogram time_to_first_token, inter_token_latency, request_latency;

  void count(Outcome outcome) { ++requests[static_cast<size_t>(outcome)]; }
  void finished(FinishReason reason) { ++choices_finished[static_cast<size_t>(reason)]; }
};

// The /metrics page.
std::string prometheus_text(const Metrics& metrics, const EngineStats& stats);

}  // namespace octet::serving
