// What every schedule shares: names, the route lookup, and the builder that adds messages.
#include <array>
#include <cctype>
#include <string>

#include "octet/error.h"
#include "parallel/pipeline/builder.h"

namespace octet::pipeline {

bool is_compute(ActionKind kind) {
  return kind == ActionKind::Forward || kind == ActionKind::Backward ||
         kind == ActionKind::BackwardInput || kind == ActionKind::BackwardWeight ||
         kind == ActionKind::ForwardBackward;
}

const char* kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward:
      return "F";
    case ActionKind::Backward:
      return "B";
    case ActionKind::BackwardInput:
      return "BI";
    case ActionKind::BackwardWeight:
      return "W";
    case ActionKind::ForwardBackward:
      return "F&B";
    case ActionKind::SendForward:
      return "SendF";
    case ActionKind::RecvForward:
      return "RecvF";
    case ActionKind::SendBackward:
      return "SendB";
    case ActionKind::RecvBackward:
      return "RecvB";
  }
  return "?";
}

std::string describe(const Action& action) {
  std::string text =
      detail::concat(kind_name(action.kind), "(mb ", action.micro_batch, ", chunk ", action.chunk);
  if (action.kind == ActionKind::ForwardBackward) {
    text +=
        detail::concat(" | mb ", action.backward_micro_batch, ", chunk ", action.backward_chunk);
  }
  text += ")";
  if (action.kind == ActionKind::SendForward || action.kind == ActionKind::SendBackward) {
    text += detail::concat(" to ", action.peer);
  } else if (action.kind == ActionKind::RecvForward || action.kind == ActionKind::RecvBackward) {
    text += detail::concat(" from ", action.peer);
  }
  return text;
}

namespace {
constexpr std::array<ScheduleKind, 5> kAllKinds = {
    ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZeroBubbleH1,
    ScheduleKind::DualPipe, ScheduleKind::DualPipeV};
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::OneFOneB:
      return "1F1B";
    case ScheduleKind::Interleaved:
      return "interleaved";
    case ScheduleKind::ZeroBubbleH1:
      return "ZB1P";
    case ScheduleKind::DualPipe:
      return "DualPipe";
    case ScheduleKind::DualPipeV:
      return "DualPipeV";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& text) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (ScheduleKind kind : kAllKinds) {
    std::string name;
    for (const char* c = schedule_name(kind); *c != 0; ++c) {
      name += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
    if (lower == name) return kind;
  }
  if (lower == "zb-h1" || lower == "zbh1") return ScheduleKind::ZeroBubbleH1;
  fail(detail::concat("pipeline schedule: expected 1f1b | interleaved | zb1p | dualpipe | ",
                      "dualpipev, got '", text, "'"));
}

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages) {
  switch (kind) {
    case ScheduleKind::OneFOneB:
      return schedule_1f1b(ranks, micro_batches);
    case ScheduleKind::Interleaved:
      return schedule_interleaved_1f1b(ranks, micro_batches, virtual_stages);
    case ScheduleKind::ZeroBubbleH1:
      return schedule_zero_bubble_h1(ranks, micro_batches);
    case ScheduleKind::DualPipe:
      return schedule_dualpipe(ranks, micro_batches);
    case ScheduleKind::DualPipeV:
      return schedule_dualpipev(ranks, micro_batches);
  }
  fail("pipeline schedule: unknown kind");
}

const Place& Schedule::place(int micro_batch, int stage) const {
  return routes[route_of_micro_batch[micro_batch]][stage];
}

int Schedule::stage_of(int micro_batch, int rank, int chunk) const {
  if (micro_batch < 0 || micro_batch >= micro_batches) return -1;
  const std::vector<Place>& route = routes[route_of_micro_batch[micro_batch]];
  for (int stage = 0; stage < static_cast<int>(route.size()); ++stage) {
    if (route[stage].rank == rank && route[stage].chunk == chunk) return stage;
  }
  return -1;
}

std::vector<Place> straight_route(int ranks, int chunk) {
  std::vector<Place> route;
  for (int rank = 0; rank < ranks; ++rank) route.push_back({rank, chunk});
  return route;
}

std::vector<Place> reverse_route(int ranks, int chunk) {
  std::vector<Place> route;
  for (int rank = ranks - 1; rank >= 0; --rank) route.push_back({rank, chunk});
  return route;
}

std::vector<Place> interleaved_route(int ranks, int virtual_stages) {
  std::vector<Place> route;
  for (int chunk = 0; chunk < virtual_stages; ++chunk) {
    for (int rank = 0; rank < ranks; ++rank) route.push_back({rank, chunk});
  }
  return route;
}

std::vector<Place> v_route(int ranks) {
  std::vector<Place> route = straight_route(ranks, 0);
  for (const Place& place : reverse_route(ranks, 1)) route.push_back(place);
  return route;
}

Schedule empty_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks_per_rank,
                        std::vector<Place> route) {
  Schedule schedule;
  schedule.kind = kind;
  schedule.ranks = ranks;
  schedule.micro_batches = micro_batches;
  schedule.chunks_per_rank = chunks_per_rank;
  schedule.stages = static_cast<int>(route.size());
  schedule.routes = {std::move(route)};
  schedule.route_of_micro_batch.assign(micro_batches, 0);
  schedule.actions.resize(ranks);
  return schedule;
}

// Builder: messages go only where consecutive stages sit on different ranks.

void ScheduleBuilder::recv_forward(int rank, int micro_batch, int chunk) {
  const int stage = schedule_.stage_of(micro_batch, rank, chunk);
  if (stage <= 0) return;
  const int from = schedule_.place(micro_batch, stage - 1).rank;
  if (from != rank) push(rank, {ActionKind::RecvForward, micro_batch, chunk, from});
}

void ScheduleBuilder::send_forward(int rank, int micro_batch, int chunk) {
  const int stage = schedule_.stage_of(micro_batch, rank, chunk);
  if (stage < 0 || stage + 1 >= schedule_.stages) return;
  const int to = schedule_.place(micro_batch, stage + 1).rank;
  if (to != rank) push(rank, {ActionKind::SendForward, micro_batch, chunk, to});
}

void ScheduleBuilder::recv_backward(int rank, int micro_batch, int chunk) {
  const int stage = schedule_.stage_of(micro_batch, rank, chunk);
  if (stage < 0 || stage + 1 >= schedule_.stages) return;
  const int from = schedule_.place(micro_batch, stage + 1).rank;
  if (from != rank) push(rank, {ActionKind::RecvBackward, micro_batch, chunk, from});
}

void ScheduleBuilder::send_backward(int rank, int micro_batch, int chunk) {
  const int stage = schedule_.stage_of(micro_batch, rank, chunk);
  if (stage <= 0) return;
  const int to = schedule_.place(micro_batch, stage - 1).rank;
  if (to != rank) push(rank, {ActionKind::SendBackward, micro_batch, chunk, to});
}

void ScheduleBuilder::forward(int rank, int micro_batch, int chunk) {
  recv_forward(rank, micro_batch, chunk);
  push(rank, {ActionKind::Forward, micro_batch, chunk});
  send_forward(rank, micro_batch, chunk);
}

void ScheduleBuilder::backward(int rank, int micro_batch, int chunk) {
  recv_backward(rank, micro_batch, chunk);
  push(rank, {ActionKind::Backward, micro_batch, chunk});
  send_backward(rank, micro_batch, chunk);
}

void ScheduleBuilder::backward_input(int rank, int micro_batch, int chunk) {
  recv_backward(rank, micro_batch, chunk);
  push(rank, {ActionKind::BackwardInput, micro_batch, chunk});
  send_backward(rank, micro_batch, chunk);
}

void ScheduleBuilder::backward_weight(int rank, int micro_batch, int chunk) {
  push(rank, {ActionKind::BackwardWeight, micro_batch, chunk});
}

void ScheduleBuilder::forward_backward(int rank, int forward_micro_batch, int forward_chunk,
                                       int backward_micro_batch, int backward_chunk) {
  recv_forward(rank, forward_micro_batch, forward_chunk);
  recv_backward(rank, backward_micro_batch, backward_chunk);
  push(rank, {ActionKind::ForwardBackward, forward_micro_batch, forward_chunk, -1,
              backward_micro_batch, backward_chunk});
  send_forward(rank, forward_micro_batch, forward_chunk);
  send_backward(rank, backward_micro_batch, backward_chunk);
}

}  // namespace octet::pipeline
