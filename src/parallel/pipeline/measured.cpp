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

// What one action of a rank's list took in a measured step: its forward part (Forward, the
// forward of F&B) and its backward part (Backward, BackwardInput, BackwardWeight, the
// backward of F&B); zeros for messages.
struct ActionTime {
  double forward = 0.0, backward = 0.0;
};

// The executor's samples of one rank's step matched to its actions, in order.
std::vector<ActionTime> action_times(const Schedule& schedule, int rank, const StepTiming& t) {
  size_t forwards = 0, backwards = 0, inputs = 0, weights = 0;
  auto sample = [rank](const std::vector<double>& samples, size_t& index) {
    OCTET_CHECK(index < samples.size(), "replay: rank ", rank, " has only ", samples.size(),
                " timed actions of a kind its schedule runs more often");
    return samples[index++];
  };
  const std::vector<Action>& actions = schedule.actions[static_cast<size_t>(rank)];
  std::vector<ActionTime> times(actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    const ActionKind kind = actions[i].kind;
    if (kind == ActionKind::Forward || kind == ActionKind::ForwardBackward) {
      times[i].forward = sample(t.forward_samples, forwards);
    }
    if (kind == ActionKind::Backward || kind == ActionKind::ForwardBackward) {
      times[i].backward = sample(t.backward_samples, backwards);
    }
    if (kind == ActionKind::BackwardInput) {
      times[i].backward = sample(t.backward_input_samples, inputs);
    }
    if (kind == ActionKind::BackwardWeight) times[i].backward = sample(t.weight_samples, weights);
  }
  return times;
}

// One step replayed: every rank runs its actions in order, each compute action taking the
// duration the executor measured for it (F&B: its forward plus its backward), a receive
// waiting for its send + latency. Returns the makespan.
double replay_makespan(const Schedule& schedule, const std::vector<StepTiming>& ranks,
                       double latency_seconds) {
  const size_t n = static_cast<size_t>(schedule.ranks);
  std::vector<size_t> next(n, 0);
  std::vector<double> clock(n, 0.0);
  std::vector<std::vector<ActionTime>> times(n);
  for (size_t r = 0; r < n; ++r) times[r] = action_times(schedule, static_cast<int>(r), ranks[r]);
  std::map<MessageKey, double> arrivals;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < n; ++r) {
      const std::vector<Action>& actions = schedule.actions[r];
      const int rank = static_cast<int>(r);
      for (; next[r] < actions.size(); ++next[r], progress = true) {
        const Action& a = actions[next[r]];
        clock[r] += times[r][next[r]].forward + times[r][next[r]].backward;
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
  // Per stage: forward, whole backward, BackwardInput and W samples.
  const size_t stages = static_cast<size_t>(schedule.stages);
  std::vector<std::vector<double>> stage_forwards(stages), stage_backwards(stages),
      stage_inputs(stages), stage_weights(stages);
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
    for (int rank = 0; rank < schedule.ranks; ++rank) {
      const std::vector<Action>& actions = schedule.actions[static_cast<size_t>(rank)];
      const std::vector<ActionTime> times =
          action_times(schedule, rank, ranks[static_cast<size_t>(rank)]);
      for (size_t i = 0; i < actions.size(); ++i) {
        const Action& a = actions[i];
        if (!is_compute(a.kind)) continue;
        const auto stage = static_cast<size_t>(schedule.stage_of(a.micro_batch, rank, a.chunk));
        switch (a.kind) {
          case ActionKind::Forward:
            stage_forwards[stage].push_back(times[i].forward);
            break;
          case ActionKind::Backward:
            stage_backwards[stage].push_back(times[i].backward);
            break;
          case ActionKind::BackwardInput:
            stage_inputs[stage].push_back(times[i].backward);
            break;
          case ActionKind::BackwardWeight:
            stage_weights[stage].push_back(times[i].backward);
            break;
          default: {  // F&B: the forward's stage and the backward's
            stage_forwards[stage].push_back(times[i].forward);
            const auto backward_stage = static_cast<size_t>(
                schedule.stage_of(a.backward_micro_batch, rank, a.backward_chunk));
            stage_backwards[backward_stage].push_back(times[i].backward);
          }
        }
      }
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
  c.uniform_costs = executed_costs(schedule, c.forward_seconds, c.backward_seconds,
                                   c.weight_seconds, latency_seconds);
  c.uniform = simulate(schedule, c.uniform_costs);
  c.costs = c.uniform_costs;
  for (size_t stage = 0; stage < stages; ++stage) {
    const double w = stage_weights[stage].empty() ? 0.0 : median(stage_weights[stage]);
    const double b = stage_backwards[stage].empty() ? median(stage_inputs[stage]) + w
                                                    : median(stage_backwards[stage]);
    c.costs.stage_forward.push_back(median(stage_forwards[stage]));
    c.costs.stage_backward.push_back(b);
    c.costs.stage_weight.push_back(std::min(w, b));
  }
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
