// A measured pipeline step against the simulator: the executor's timings give the measured
// bubble and the costs to simulate, so the two bubbles can be held side by side.
#include <algorithm>
#include <cmath>

#include "octet/error.h"
#include "octet/pipeline.h"

namespace octet::pipeline {

namespace {

double median(std::vector<double> values) {
  OCTET_CHECK(!values.empty(), "pipeline: median of no values");
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace

Costs executed_costs(const Schedule& schedule, double forward_seconds, double backward_seconds,
                     double latency_seconds) {
  OCTET_CHECK(schedule.chunk_work > 0, "pipeline: chunk_work expected > 0, got ",
              schedule.chunk_work);
  Costs costs;
  costs.forward = forward_seconds / schedule.chunk_work;
  costs.backward = backward_seconds / schedule.chunk_work;
  costs.backward_weight = 0.0;    // BackwardInput runs the whole backward; W runs nothing
  costs.forward_backward = -1.0;  // F then B, not overlapped
  costs.latency = latency_seconds;
  return costs;
}

BubbleComparison compare_bubble(const Schedule& schedule,
                                const std::vector<std::vector<StepTiming>>& steps,
                                double latency_seconds) {
  OCTET_CHECK(!steps.empty(), "compare_bubble: no measured steps");
  std::vector<double> forwards, backwards, makespans, bubbles, fractions, step_times;
  for (size_t step = 0; step < steps.size(); ++step) {
    const std::vector<StepTiming>& ranks = steps[step];
    OCTET_CHECK(static_cast<int>(ranks.size()) == schedule.ranks, "compare_bubble: step ", step,
                " expected the timings of ", schedule.ranks, " ranks, got ", ranks.size());
    double makespan = 0.0, least_compute = INFINITY, step_time = 0.0;
    for (const StepTiming& t : ranks) {
      makespan = std::max(makespan, t.schedule_seconds);
      least_compute = std::min(least_compute, t.compute_seconds());
      step_time = std::max(step_time, t.step_seconds);
      forwards.insert(forwards.end(), t.forward_samples.begin(), t.forward_samples.end());
      backwards.insert(backwards.end(), t.backward_samples.begin(), t.backward_samples.end());
    }
    makespans.push_back(makespan);
    bubbles.push_back(makespan - least_compute);
    fractions.push_back(makespan > 0 ? (makespan - least_compute) / makespan : 0.0);
    step_times.push_back(step_time);
  }
  BubbleComparison c;
  c.forward_seconds = median(forwards);
  c.backward_seconds = median(backwards);
  c.costs = executed_costs(schedule, c.forward_seconds, c.backward_seconds, latency_seconds);
  c.measured_makespan = median(makespans);
  c.measured_bubble = median(bubbles);
  c.measured_bubble_fraction = median(fractions);
  c.measured_step = median(step_times);
  c.simulated = simulate(schedule, c.costs);
  c.bubble_ratio = c.simulated.bubble > 0 ? c.measured_bubble / c.simulated.bubble : NAN;
  return c;
}

}  // namespace octet::pipeline
