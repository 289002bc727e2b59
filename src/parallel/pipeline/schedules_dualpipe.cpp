// DualPipe (DeepSeek-V3) and DualPipeV (Sea AI Lab's "cut-in-half"). Both run the same eight
// phases on each rank over two "phases" of work. In DualPipe the phases are the two directions:
// micro-batches 0..M/2-1 enter at rank 0 and go down a first model copy (chunk 0), the others
// enter at the last rank and go up a second copy (chunk 1). In DualPipeV every micro-batch goes
// down chunk 0 and back up chunk 1 of the same ranks. Steady state overlaps the forward of one
// phase with the backward of the other (F&B), and W's split off the backward fill the edges.
#include <deque>
#include <utility>
#include <vector>

#include "octet/error.h"
#include "parallel/pipeline/builder.h"

namespace octet::pipeline {
namespace {

// One rank's work in the two phases: each phase is a chunk and the micro-batches it processes
// in order (forwards and backwards each first-in first-out).
class PhaseRank {
 public:
  PhaseRank(ScheduleBuilder& build, int rank) : build_(build), rank_(rank) {}

  void set_phase(int phase, int chunk, std::vector<int> micro_batches) {
    chunk_[phase] = chunk;
    micro_batches_[phase] = std::move(micro_batches);
  }
  void forward(int phase) { build_.forward(rank_, next_forward(phase), chunk_[phase]); }
  // split: zero-bubble backward, BackwardInput now, BackwardWeight queued for weight().
  void backward(int phase, bool split = false) {
    const int m = next_backward(phase);
    if (!split) return build_.backward(rank_, m, chunk_[phase]);
    build_.backward_input(rank_, m, chunk_[phase]);
    pending_weights_.emplace_back(m, chunk_[phase]);
  }
  void weight() {
    OCTET_CHECK(!pending_weights_.empty(), "DualPipe: rank ", rank_, " has no W to run");
    build_.backward_weight(rank_, pending_weights_.front().first, pending_weights_.front().second);
    pending_weights_.pop_front();
  }
  void forward_backward(int forward_phase, int backward_phase) {
    const int f = next_forward(forward_phase);
    const int b = next_backward(backward_phase);
    build_.forward_backward(rank_, f, chunk_[forward_phase], b, chunk_[backward_phase]);
  }
  bool done() const { return pending_weights_.empty(); }

 private:
  int next_forward(int phase) { return micro_batches_[phase].at(forwards_[phase]++); }
  int next_backward(int phase) { return micro_batches_[phase].at(backwards_[phase]++); }

  ScheduleBuilder& build_;
  int rank_;
  int chunk_[2] = {0, 1};
  std::vector<int> micro_batches_[2];
  int forwards_[2] = {0, 0};
  int backwards_[2] = {0, 0};
  std::deque<std::pair<int, int>> pending_weights_;  // (micro_batch, chunk), oldest first
};

// The eight phases. lanes: ranks a direction crosses before it meets the other (DualPipe: half
// the ranks; DualPipeV: all); position: this rank's distance from the outer edge; per_phase:
// micro-batches per phase; turning: the rank where the two phases meet (DualPipe's two middle
// ranks, DualPipeV's last rank), which does not overlap its first steady pair so that the
// forward it passes on is not held back by a backward.
void run_phases(PhaseRank& r, int lanes, int position, int per_phase, bool turning) {
  const int outer = lanes - position - 1;  // ranks between this one and the meeting point
  // 1. nF0: fill with phase-0 forwards.
  for (int i = 0; i < 2 * outer; ++i) r.forward(0);
  // 2. nF0F1: phase-1 forwards start arriving.
  for (int i = 0; i < position + 1; ++i) {
    r.forward(0);
    r.forward(1);
  }
  // 3. nB1W1F1: first phase-1 backwards, weight gradient at once (zero bubble).
  for (int i = 0; i < outer; ++i) {
    r.backward(1, /*split=*/true);
    r.weight();
    r.forward(1);
  }
  // 4. nF0B1F1B0, the main step: overlapped forward-backward pairs in both phases.
  for (int i = 0; i < per_phase - 2 * lanes + position + 1; ++i) {
    if (i == 0 && turning) {
      r.forward(0);
      r.backward(1);
    } else {
      r.forward_backward(0, 1);
    }
    r.forward_backward(1, 0);
  }
  // 5. nB1F1B0: phase-0 forwards are done.
  for (int i = 0; i < outer; ++i) {
    r.backward(1);
    r.forward_backward(1, 0);
  }
  // 6. nB1B0: drain; the second half of these backwards defer their W (zero bubble).
  bool split = false;
  const int drain = position + 1;
  for (int i = 0; i < drain; ++i) {
    if (i == drain / 2 && position % 2 == 1) split = true;
    r.backward(1, split);
    if (i == drain / 2 && position % 2 == 0) split = true;
    r.backward(0, split);
  }
  // 7. nWB0: deferred W's fill the wait for the last phase-0 gradients.
  for (int i = 0; i < outer; ++i) {
    r.weight();
    r.backward(0, /*split=*/true);
  }
  // 8. nW: the remaining weight gradients.
  for (int i = 0; i < position + 1; ++i) r.weight();
  OCTET_CHECK(r.done(), "DualPipe: weight gradients left over after the last phase");
}

std::vector<int> range(int begin, int end) {
  std::vector<int> values;
  for (int i = begin; i < end; ++i) values.push_back(i);
  return values;
}

}  // namespace

Schedule schedule_dualpipe(int ranks, int micro_batches) {
  OCTET_CHECK(ranks >= 2 && ranks % 2 == 0,
              "DualPipe: pipeline-model-parallel-size must be even and >= 2, got ", ranks);
  OCTET_CHECK(micro_batches % 2 == 0 && micro_batches >= 2 * ranks,
              "DualPipe: micro-batches must be even and >= 2 x pipeline-model-parallel-size = ",
              2 * ranks, " (half enter from each end), got ", micro_batches);
  Schedule schedule =
      empty_schedule(ScheduleKind::DualPipe, ranks, micro_batches, 2, straight_route(ranks, 0));
  schedule.routes.push_back(reverse_route(ranks, 1));
  schedule.model_copies = 2;
  const int half = micro_batches / 2;
  for (int m = half; m < micro_batches; ++m) schedule.route_of_micro_batch[m] = 1;
  ScheduleBuilder build(schedule);
  const int lanes = ranks / 2;
  for (int rank = 0; rank < ranks; ++rank) {
    // Phase 0 is the direction whose micro-batches reach this rank first.
    const int early = rank < lanes ? 0 : 1;
    PhaseRank r(build, rank);
    r.set_phase(0, early, early == 0 ? range(0, half) : range(half, micro_batches));
    r.set_phase(1, 1 - early, early == 0 ? range(half, micro_batches) : range(0, half));
    const int position = std::min(rank, ranks - 1 - rank);
    run_phases(r, lanes, position, half, position == lanes - 1);
  }
  return schedule;
}

Schedule schedule_dualpipev(int ranks, int micro_batches) {
  OCTET_CHECK(ranks >= 1, "DualPipeV: pipeline-model-parallel-size must be >= 1, got ", ranks);
  OCTET_CHECK(micro_batches >= 2 * ranks,
              "DualPipeV: micro-batches must be >= 2 x pipeline-model-parallel-size = ", 2 * ranks,
              ", got ", micro_batches);
  Schedule schedule =
      empty_schedule(ScheduleKind::DualPipeV, ranks, micro_batches, 2, v_route(ranks));
  schedule.chunk_work = 0.5;  // the model in 2 x ranks stages on `ranks` devices
  ScheduleBuilder build(schedule);
  for (int rank = 0; rank < ranks; ++rank) {
    PhaseRank r(build, rank);
    r.set_phase(0, 0, range(0, micro_batches));
    r.set_phase(1, 1, range(0, micro_batches));
    run_phases(r, ranks, rank, micro_batches, rank == ranks - 1);
  }
  return schedule;
}

}  // namespace octet::pipeline
