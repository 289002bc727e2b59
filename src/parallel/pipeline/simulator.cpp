// Discrete-event simulation of a schedule. Each rank runs its list in order on its own clock; a
// compute action advances the clock by its cost, a send posts a message that arrives `latency`
// later, a receive waits for that arrival. With no shared resources the times do not depend on
// the order in which ranks are advanced, so the loop below advances every rank as far as it can
// until all are done (or none can move: deadlock). Every check names rank, action and index.
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "octet/error.h"
#include "octet/pipeline.h"

namespace octet::pipeline {
namespace {

enum class Payload { Activation, Gradient };

struct MessageKey {
  Payload payload;
  int micro_batch;
  int stage;  // the receiving stage
  bool operator<(const MessageKey& o) const {
    return std::tie(payload, micro_batch, stage) < std::tie(o.payload, o.micro_batch, o.stage);
  }
};

struct Message {
  int from = 0;
  int to = 0;
  double arrival = 0.0;
  bool received = false;
};

// Per (micro-batch, stage): what has run, on whose rank, and what that rank has received.
struct StageState {
  bool forwarded = false;
  bool input_grad = false;  // Backward or BackwardInput done
  bool split = false;       // done as BackwardInput: a BackwardWeight must follow
  bool weight_grad = false;
  bool activation_received = false;
  bool gradient_received = false;
};

class Simulation {
 public:
  Simulation(const Schedule& schedule, const Costs& costs)
      : s_(schedule), costs_(costs), state_(schedule.micro_batches * schedule.stages) {
    OCTET_CHECK(static_cast<int>(s_.actions.size()) == s_.ranks, "schedule: expected ", s_.ranks,
                " action lists, got ", s_.actions.size());
    OCTET_CHECK(static_cast<int>(s_.route_of_micro_batch.size()) == s_.micro_batches,
                "schedule: expected a route for each of ", s_.micro_batches, " micro-batches, got ",
                s_.route_of_micro_batch.size());
    for (int route : s_.route_of_micro_batch) {
      OCTET_CHECK(route >= 0 && route < static_cast<int>(s_.routes.size()), "schedule: route ",
                  route, " of ", s_.routes.size());
    }
    for (const std::vector<Place>& route : s_.routes) {
      OCTET_CHECK(static_cast<int>(route.size()) == s_.stages, "schedule: expected routes of ",
                  s_.stages, " stages, got ", route.size());
      for (const Place& p : route) {
        OCTET_CHECK(
            p.rank >= 0 && p.rank < s_.ranks && p.chunk >= 0 && p.chunk < s_.chunks_per_rank,
            "schedule: a route passes rank ", p.rank, " chunk ", p.chunk, ", expected ", s_.ranks,
            " ranks of ", s_.chunks_per_rank, " chunks");
      }
    }
    clock_.assign(s_.ranks, 0.0);
    pc_.assign(s_.ranks, 0);
    live_.assign(s_.ranks, 0);
    pending_.assign(s_.ranks, 0);
    report_.ranks.resize(s_.ranks);
  }

  SimulationReport run() {
    for (bool moved = true; moved;) {
      moved = false;
      for (int rank = 0; rank < s_.ranks; ++rank) {
        while (pc_[rank] < static_cast<int>(s_.actions[rank].size()) && step(rank)) moved = true;
      }
    }
    check_finished();
    summarize();
    return report_;
  }

 private:
  const Action& current(int rank) const { return s_.actions[rank][pc_[rank]]; }

  [[noreturn]] void fail_at(int rank, const std::string& why) const {
    fail(detail::concat("pipeline schedule ", schedule_name(s_.kind), ": rank ", rank, " action #",
                        pc_[rank], " ", describe(current(rank)), ": ", why));
  }

  // The stage (micro_batch, chunk) runs on this rank; fails when the route does not pass here.
  int stage_here(int rank, int micro_batch, int chunk) const {
    const int stage = s_.stage_of(micro_batch, rank, chunk);
    if (stage < 0) {
      fail_at(rank, detail::concat("micro-batch ", micro_batch, " has no stage on rank ", rank,
                                   " chunk ", chunk, " (micro-batches ", s_.micro_batches,
                                   ", chunks per rank ", s_.chunks_per_rank, ")"));
    }
    return stage;
  }
  StageState& at(int micro_batch, int stage) { return state_[micro_batch * s_.stages + stage]; }

  double cost(int rank, const Action& a) const {
    if (!costs_.stage_forward.empty()) return stage_cost(rank, a);
    const double scale = s_.chunk_work;
    switch (a.kind) {
      case ActionKind::Forward:
        return costs_.forward * scale;
      case ActionKind::Backward:
        return costs_.backward * scale;
      case ActionKind::BackwardInput:
        return (costs_.backward - costs_.backward_weight) * scale;
      case ActionKind::BackwardWeight:
        return costs_.backward_weight * scale;
      case ActionKind::ForwardBackward:
        return costs_.overlapped() * scale;
      default:
        return 0.0;
    }
  }
  double stage_cost(int rank, const Action& a) const {
    auto of = [&](const std::vector<double>& per_stage, int micro_batch, int chunk) {
      return per_stage[static_cast<size_t>(s_.stage_of(micro_batch, rank, chunk))];
    };
    switch (a.kind) {
      case ActionKind::Forward:
        return of(costs_.stage_forward, a.micro_batch, a.chunk);
      case ActionKind::Backward:
        return of(costs_.stage_backward, a.micro_batch, a.chunk);
      case ActionKind::BackwardInput:
        return of(costs_.stage_backward, a.micro_batch, a.chunk) -
               of(costs_.stage_weight, a.micro_batch, a.chunk);
      case ActionKind::BackwardWeight:
        return of(costs_.stage_weight, a.micro_batch, a.chunk);
      case ActionKind::ForwardBackward:
        return of(costs_.stage_forward, a.micro_batch, a.chunk) +
               of(costs_.stage_backward, a.backward_micro_batch, a.backward_chunk);
      default:
        return 0.0;
    }
  }

  void do_forward(int rank, int micro_batch, int chunk) {
    const int stage = stage_here(rank, micro_batch, chunk);
    StageState& st = at(micro_batch, stage);
    if (st.forwarded) fail_at(rank, "forward runs twice");
    if (stage > 0) {
      const Place prev = s_.place(micro_batch, stage - 1);
      if (prev.rank == rank && !at(micro_batch, stage - 1).forwarded) {
        fail_at(rank, detail::concat("its input, the forward of stage ", stage - 1, " (chunk ",
                                     prev.chunk, "), has not run on this rank"));
      }
      if (prev.rank != rank && !st.activation_received) {
        fail_at(rank, detail::concat("its input activation has not been received from rank ",
                                     prev.rank, " (RecvForward missing or later)"));
      }
    }
    st.forwarded = true;
    raise_peak(report_.ranks[rank].peak_activations, ++live_[rank]);
  }

  void do_backward(int rank, int micro_batch, int chunk, bool split) {
    const int stage = stage_here(rank, micro_batch, chunk);
    StageState& st = at(micro_batch, stage);
    if (!st.forwarded) fail_at(rank, "backward before its forward");
    if (st.input_grad) fail_at(rank, "backward runs twice");
    if (stage + 1 < s_.stages) {
      const Place next = s_.place(micro_batch, stage + 1);
      if (next.rank == rank && !at(micro_batch, stage + 1).input_grad) {
        fail_at(rank, detail::concat("its output gradient, the backward of stage ", stage + 1,
                                     " (chunk ", next.chunk, "), has not run on this rank"));
      }
      if (next.rank != rank && !st.gradient_received) {
        fail_at(rank, detail::concat("its output gradient has not been received from rank ",
                                     next.rank, " (RecvBackward missing or later)"));
      }
    }
    st.input_grad = true;
    st.split = split;
    --live_[rank];
    if (split) raise_peak(report_.ranks[rank].peak_pending_weights, ++pending_[rank]);
  }

  void do_weight(int rank, int micro_batch, int chunk) {
    StageState& st = at(micro_batch, stage_here(rank, micro_batch, chunk));
    if (!st.input_grad || !st.split) fail_at(rank, "BackwardWeight before its BackwardInput");
    if (st.weight_grad) fail_at(rank, "BackwardWeight runs twice");
    st.weight_grad = true;
    --pending_[rank];
  }

  // Posts a message to the stage `offset` away; the data must exist.
  void do_send(int rank, const Action& a, Payload payload) {
    const int stage = stage_here(rank, a.micro_batch, a.chunk);
    const StageState& st = at(a.micro_batch, stage);
    const bool activation = payload == Payload::Activation;
    if (activation ? !st.forwarded : !st.input_grad) {
      fail_at(rank, activation ? "sends an activation its forward has not produced"
                               : "sends a gradient its backward has not produced");
    }
    const int target = activation ? stage + 1 : stage - 1;
    if (target < 0 || target >= s_.stages) fail_at(rank, "there is no stage to send to");
    const int to = s_.place(a.micro_batch, target).rank;
    if (a.peer != to) {
      fail_at(rank, detail::concat("the next stage is on rank ", to, ", not ", a.peer));
    }
    const MessageKey key{payload, a.micro_batch, target};
    if (messages_.count(key) != 0) fail_at(rank, "sent twice");
    messages_[key] = Message{rank, to, clock_[rank] + costs_.latency, false};
  }

  // Returns false while the message has not been sent (the rank waits).
  bool do_recv(int rank, const Action& a, Payload payload) {
    const int stage = stage_here(rank, a.micro_batch, a.chunk);
    const bool activation = payload == Payload::Activation;
    const int source = activation ? stage - 1 : stage + 1;
    if (source < 0 || source >= s_.stages) fail_at(rank, "there is no stage to receive from");
    const int from = s_.place(a.micro_batch, source).rank;
    if (a.peer != from) {
      fail_at(rank, detail::concat("that stage is on rank ", from, ", not ", a.peer));
    }
    auto it = messages_.find({payload, a.micro_batch, stage});
    if (it == messages_.end()) return false;
    if (it->second.received) fail_at(rank, "received twice");
    it->second.received = true;
    clock_[rank] = std::max(clock_[rank], it->second.arrival);
    StageState& st = at(a.micro_batch, stage);
    (activation ? st.activation_received : st.gradient_received) = true;
    return true;
  }

  // Runs the rank's current action; false when it must wait for a message.
  bool step(int rank) {
    const Action& a = current(rank);
    switch (a.kind) {
      case ActionKind::Forward:
        do_forward(rank, a.micro_batch, a.chunk);
        break;
      case ActionKind::Backward:
      case ActionKind::BackwardInput:
        do_backward(rank, a.micro_batch, a.chunk, a.kind == ActionKind::BackwardInput);
        break;
      case ActionKind::BackwardWeight:
        do_weight(rank, a.micro_batch, a.chunk);
        break;
      case ActionKind::ForwardBackward:
        if (a.micro_batch == a.backward_micro_batch && a.chunk == a.backward_chunk) {
          fail_at(rank, "F&B pairs a chunk's forward with its own backward");
        }
        do_forward(rank, a.micro_batch, a.chunk);
        do_backward(rank, a.backward_micro_batch, a.backward_chunk, false);
        break;
      case ActionKind::SendForward:
        do_send(rank, a, Payload::Activation);
        break;
      case ActionKind::SendBackward:
        do_send(rank, a, Payload::Gradient);
        break;
      case ActionKind::RecvForward:
        if (!do_recv(rank, a, Payload::Activation)) return false;
        break;
      case ActionKind::RecvBackward:
        if (!do_recv(rank, a, Payload::Gradient)) return false;
        break;
    }
    if (is_compute(a.kind)) {
      const double start = clock_[rank];
      clock_[rank] += cost(rank, a);
      RankReport& r = report_.ranks[rank];
      if (r.timeline.empty()) r.first_start = start;
      r.timeline.push_back({pc_[rank], start, clock_[rank]});
      r.busy += clock_[rank] - start;
      r.last_end = clock_[rank];
    }
    ++pc_[rank];
    return true;
  }

  static void raise_peak(int& peak_value, int value) { peak_value = std::max(peak_value, value); }

  // Deadlock: every unfinished rank waits on a receive; say what each waits for.
  void check_finished() const {
    std::string stuck;
    for (int rank = 0; rank < s_.ranks; ++rank) {
      if (pc_[rank] >= static_cast<int>(s_.actions[rank].size())) continue;
      const Action& a = current(rank);
      const int peer = a.peer;
      const bool peer_done =
          peer >= 0 && peer < s_.ranks && pc_[peer] >= static_cast<int>(s_.actions[peer].size());
      stuck += detail::concat("\n  rank ", rank, " waits at action #", pc_[rank], " ", describe(a),
                              ": rank ", peer,
                              peer_done ? " has finished without sending it" : " has not sent it");
      if (!peer_done && peer >= 0 && peer < s_.ranks) {
        stuck += detail::concat(" (rank ", peer, " is at #", pc_[peer], ")");
      }
    }
    if (!stuck.empty()) {
      fail(detail::concat("pipeline schedule ", schedule_name(s_.kind),
                          ": deadlock, no rank can progress:", stuck));
    }
    for (const auto& [key, message] : messages_) {
      if (!message.received) {
        fail(detail::concat(
            "pipeline schedule ", schedule_name(s_.kind), ": rank ", message.from, " sends the ",
            key.payload == Payload::Activation ? "activation" : "gradient", " of micro-batch ",
            key.micro_batch, " to rank ", message.to, ", which never receives it"));
      }
    }
    for (int m = 0; m < s_.micro_batches; ++m) {
      for (int stage = 0; stage < s_.stages; ++stage) {
        const StageState& st = state_[m * s_.stages + stage];
        const Place p = s_.place(m, stage);
        const char* missing = !st.forwarded                   ? "forward"
                              : !st.input_grad                ? "backward"
                              : (st.split && !st.weight_grad) ? "BackwardWeight"
                                                              : nullptr;
        if (missing != nullptr) {
          fail(detail::concat("pipeline schedule ", schedule_name(s_.kind), ": micro-batch ", m,
                              " stage ", stage, " (rank ", p.rank, " chunk ", p.chunk,
                              ") never gets its ", missing));
        }
      }
    }
  }

  void summarize() {
    double least_busy = report_.ranks.empty() ? 0.0 : report_.ranks[0].busy;
    for (const RankReport& r : report_.ranks) {
      report_.makespan = std::max(report_.makespan, r.last_end);
      least_busy = std::min(least_busy, r.busy);
      report_.peak_activations = std::max(report_.peak_activations, r.peak_activations);
      report_.peak_pending_weights = std::max(report_.peak_pending_weights, r.peak_pending_weights);
    }
    for (RankReport& r : report_.ranks) r.bubble = report_.makespan - r.busy;
    report_.bubble = report_.makespan - least_busy;
    report_.bubble_fraction = report_.makespan > 0 ? report_.bubble / report_.makespan : 0.0;
  }

  const Schedule& s_;
  Costs costs_;
  std::vector<StageState> state_;
  std::vector<double> clock_;
  std::vector<int> pc_;
  std::vector<int> live_;
  std::vector<int> pending_;
  std::map<MessageKey, Message> messages_;
  SimulationReport report_;
};

}  // namespace

SimulationReport simulate(const Schedule& schedule, const Costs& costs) {
  OCTET_CHECK(costs.forward >= 0 && costs.backward >= 0 && costs.latency >= 0,
              "pipeline costs: F, B and latency must be >= 0, got F=", costs.forward,
              " B=", costs.backward, " latency=", costs.latency);
  OCTET_CHECK(costs.backward_weight >= 0 && costs.backward_weight <= costs.backward,
              "pipeline costs: expected 0 <= W <= B (BackwardInput costs B - W), got W=",
              costs.backward_weight, " B=", costs.backward);
  if (!costs.stage_forward.empty()) {
    const size_t stages = static_cast<size_t>(schedule.stages);
    OCTET_CHECK(costs.stage_forward.size() == stages && costs.stage_backward.size() == stages &&
                    costs.stage_weight.size() == stages,
                "pipeline costs: per-stage F, B, W expected ", stages, " values each, got ",
                costs.stage_forward.size(), ", ", costs.stage_backward.size(), ", ",
                costs.stage_weight.size());
    for (size_t i = 0; i < stages; ++i) {
      OCTET_CHECK(costs.stage_forward[i] >= 0 && costs.stage_weight[i] >= 0 &&
                      costs.stage_weight[i] <= costs.stage_backward[i],
                  "pipeline costs: stage ", i,
                  " expected F >= 0 and 0 <= W <= B, got F=", costs.stage_forward[i],
                  " B=", costs.stage_backward[i], " W=", costs.stage_weight[i]);
    }
  }
  return Simulation(schedule, costs).run();
}

void check_schedule(const Schedule& schedule) {
  simulate(schedule, Costs{});
}

}  // namespace octet::pipeline
