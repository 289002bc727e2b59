// A measured pipeline step against the simulator: the executor's timings give the measured
// bubble and the costs to simulate, so the two bubbles can be held side by side.
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

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

// Message key: (micro-batch, boundary between stage b and b+1, backward), as the executor's tags.
using MessageKey = std::tuple<int, int, bool>;

MessageKey message_key(const Schedule& schedule, int rank, const Action& action) {
  const int stage = schedule.stage_of(action.micro_batch, rank, action.chunk);
  OCTET_CHECK(stage >= 0, "replay: ", describe(action), " off the micro-batch's route");
  switch (action.kind) {
    case ActionKind::SendForward:
      return {action.micro_batch, stage, false};
    case ActionKind::RecvForward:
      return {action.micro_batch, stage - 1, false};
    case ActionKind::SendBackward:
      return {action.micro_batch, stage - 1, true};
    default:  // RecvBackward
      return {action.micro_batch, stage, true};
  }
}

// One step replayed: every rank runs its actions in order, each compute action taking the
// duration the executor measured for it (F&B: its forward plus its backward), a receive
// waiting for its send + latency. Returns the makespan.
double replay_makespan(const Schedule& schedule, const std::vector<StepTiming>& ranks,
                       double latency_seconds) {
  const size_t n = static_cast<size_t>(schedule.ranks);
  std::vector<size_t> next(n, 0), forwards(n, 0), backwards(n, 0), inputs(n, 0), weights(n, 0);
  std::vector<double> clock(n, 0.0);
  std::map<MessageKey, double> arrivals;
  auto sample = [](const std::vector<double>& samples, size_t& index, int rank) {
    OCTET_CHECK(index < samples.size(), "replay: rank ", rank, " has only ", samples.size(),
                " timed actions of a kind its schedule runs more often");
    return samples[index++];
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < n; ++r) {
      const std::vector<Action>& actions = schedule.actions[r];
      const StepTiming& t = ranks[r];
      const int rank = static_cast<int>(r);
      for (; next[r] < actions.size(); ++next[r], progress = true) {
        const Action& a = actions[next[r]];
        if (a.kind == ActionKind::Forward || a.kind == ActionKind::ForwardBackward) {
          clock[r] += sample(t.forward_samples, forwards[r], rank);
        }
        if (a.kind == ActionKind::Backward || a.kind == ActionKind::ForwardBackward) {
          clock[r] += sample(t.backward_samples, backwards[r], rank);
        }
        if (a.kind == ActionKind::BackwardInput) {
          clock[r] += sample(t.backward_input_samples, inputs[r], rank);
        }
        if (a.kind == ActionKind::BackwardWeight) {
          clock[r] += sample(t.weight_samples, weights[r], rank);
        }
        if (a.kind == ActionKind::SendForward || a.kind == ActionKind::SendBackward) {
          arrivals[message_key(schedule, rank, a)] = clock[r] + latency_seconds;
        }
        if (a.kind == ActionKind::RecvForward || a.kind == ActionKind::RecvBackward) {
          auto it = arrivals.find(message_key(schedule, rank, a));
          if (it == arrivals.end()) break;  // its send has not run yet: another rank's turn
          clock[r] = std::max(clock[r], it->second);
        }
      }
    }
  }
  for (size_t r = 0; r < n; ++r) {
    OCTET_CHECK(next[r] == schedule.actions[r].size(), "replay: rank ", r, " stuck at action ",
                next[r]);
  }
  return *std::max_element(clock.begin(), clock.end());
}

}  // namespace

Costs executed_costs(const Schedule& schedule, double forward_seconds, double backward_seconds,
                     double weight_seconds, double latency_seconds) {
  OCTET_CHECK(schedule.chunk_work > 0, "pipeline: chunk_work expected > 0, got ",
              schedule.chunk_work);
  Costs costs;
  costs.forward = forward_seconds / schedule.chunk_work;
  costs.backward = backward_seconds / schedule.chunk_work;
  // A W measured longer than a whole B (noise) would make BackwardInput negative.
  costs.backward_weight = std::min(weight_seconds, backward_seconds) / schedule.chunk_work;
  costs.forward_backward = -1.0;  // F then B, not overlapped
  costs.latency = latency_seconds;
  return costs;
}

BubbleComparison compare_bubble(const Schedule& schedule,
                                const std::vector<std::vector<StepTiming>>& steps,
                                double latency_seconds) {
  OCTET_CHECK(!steps.empty(), "compare_bubble: no measured steps");
  std::vector<double> forwards, backwards, inputs, weights, makespans, bubbles, fractions,
      step_times, replayed, replayed_bubbles;
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
      inputs.insert(inputs.end(), t.backward_input_samples.begin(), t.backward_input_samples.end());
      weights.insert(weights.end(), t.weight_samples.begin(), t.weight_samples.end());
    }
    const double replay = replay_makespan(schedule, ranks, latency_seconds);
    replayed.push_back(replay);
    replayed_bubbles.push_back(replay - least_compute);
    makespans.push_back(makespan);
    bubbles.push_back(makespan - least_compute);
    fractions.push_back(makespan > 0 ? (makespan - least_compute) / makespan : 0.0);
    step_times.push_back(step_time);
  }
  BubbleComparison c;
  c.forward_seconds = median(forwards);
  c.weight_seconds = weights.empty() ? 0.0 : median(weights);
  // B is a whole backward: measured as one where the schedule runs any, else as BI + W.
  c.backward_seconds = backwards.empty() ? median(inputs) + c.weight_seconds : median(backwards);
  c.costs = executed_costs(schedule, c.forward_seconds, c.backward_seconds, c.weight_seconds,
                           latency_seconds);
  c.measured_makespan = median(makespans);
  c.measured_bubble = median(bubbles);
  c.measured_bubble_fraction = median(fractions);
  c.measured_step = median(step_times);
  c.replayed_makespan = median(replayed);
  c.replayed_bubble = median(replayed_bubbles);
  c.simulated = simulate(schedule, c.costs);
  c.bubble_ratio = c.simulated.bubble > 0 ? c.measured_bubble / c.simulated.bubble : NAN;
  return c;
}

}  // namespace octet::pipeline
