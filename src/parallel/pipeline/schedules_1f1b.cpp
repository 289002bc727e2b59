// The one-directional schedules: 1F1B, interleaved 1F1B (virtual stages) and ZB-H1. Each rank
// runs three phases: warm-up (forwards only, filling the pipeline), steady state (one forward,
// one backward) and cool-down (the remaining backwards, draining it).
#include <algorithm>
#include <deque>
#include <utility>

#include "octet/error.h"
#include "parallel/pipeline/builder.h"

namespace octet::pipeline {
namespace {

void check_sizes(const char* name, int ranks, int micro_batches) {
  OCTET_CHECK(ranks >= 1, name, ": pipeline-model-parallel-size must be >= 1, got ", ranks);
  OCTET_CHECK(micro_batches >= 1, name, ": micro-batches must be >= 1, got ", micro_batches);
}

}  // namespace

// PipeDream-flush: rank r first forwards ranks-1-r micro-batches so that the last rank can
// start backward at once, then alternates, so at most ranks-r activations are alive.
Schedule schedule_1f1b(int ranks, int micro_batches) {
  check_sizes("1F1B", ranks, micro_batches);
  Schedule schedule =
      empty_schedule(ScheduleKind::OneFOneB, ranks, micro_batches, 1, straight_route(ranks, 0));
  ScheduleBuilder build(schedule);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - 1 - rank, micro_batches);
    const int steady = micro_batches - warmup;
    for (int m = 0; m < warmup; ++m) build.forward(rank, m, 0);
    for (int i = 0; i < steady; ++i) {
      build.forward(rank, warmup + i, 0);
      build.backward(rank, i, 0);
    }
    for (int m = steady; m < micro_batches; ++m) build.backward(rank, m, 0);
  }
  return schedule;
}

// Megatron's interleaved schedule: each rank holds v chunks; stage s = chunk * ranks + rank.
// Micro-batches go in groups of `ranks`: chunk 0 of a group, then chunk 1 ..., so the k-th
// forward of a rank is micro-batch (k / (ranks*v)) * ranks + k % ranks on chunk
// (k / ranks) % v, and backwards take the chunks in reverse.
Schedule schedule_interleaved_1f1b(int ranks, int micro_batches, int virtual_stages) {
  check_sizes("interleaved 1F1B", ranks, micro_batches);
  OCTET_CHECK(virtual_stages >= 1, "interleaved 1F1B: virtual stages per rank must be >= 1, got ",
              virtual_stages);
  OCTET_CHECK(micro_batches % ranks == 0,
              "interleaved 1F1B: micro-batches must be a multiple of pipeline-model-parallel-size ",
              ranks, ", got ", micro_batches);
  Schedule schedule = empty_schedule(ScheduleKind::Interleaved, ranks, micro_batches,
                                     virtual_stages, interleaved_route(ranks, virtual_stages));
  schedule.virtual_stages = virtual_stages;
  schedule.chunk_work = 1.0 / virtual_stages;
  ScheduleBuilder build(schedule);
  const int group = ranks * virtual_stages;
  const int total = micro_batches * virtual_stages;
  auto micro_batch = [&](int k) { return (k / group) * ranks + k % ranks; };
  auto forward_chunk = [&](int k) { return (k % group) / ranks; };
  auto backward_chunk = [&](int k) { return virtual_stages - 1 - forward_chunk(k); };
  for (int rank = 0; rank < ranks; ++rank) {
    // With as many micro-batches as ranks Megatron runs all forwards first.
    const int warmup = micro_batches == ranks
                           ? total
                           : std::min(total, (ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks);
    const int steady = total - warmup;
    for (int k = 0; k < warmup; ++k) build.forward(rank, micro_batch(k), forward_chunk(k));
    for (int i = 0; i < steady; ++i) {
      const int k = warmup + i;
      build.forward(rank, micro_batch(k), forward_chunk(k));
      build.backward(rank, micro_batch(i), backward_chunk(i));
    }
    for (int k = steady; k < total; ++k) build.backward(rank, micro_batch(k), backward_chunk(k));
  }
  return schedule;
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order with the backward split
// into BackwardInput, which the upstream rank waits for, and BackwardWeight, which nobody waits
// for. Rank r lets its weight gradients lag r backwards behind, so the later ranks pass input
// gradients upstream sooner and run the lagging W's in the cool-down, where 1F1B idles.
// Activation memory stays 1F1B's: ranks - r micro-batches in flight.
Schedule schedule_zero_bubble_h1(int ranks, int micro_batches) {
  check_sizes("ZB1P", ranks, micro_batches);
  Schedule schedule =
      empty_schedule(ScheduleKind::ZeroBubbleH1, ranks, micro_batches, 1, straight_route(ranks, 0));
  ScheduleBuilder build(schedule);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - 1 - rank, micro_batches);
    const int steady = micro_batches - warmup;
    const int lag = rank;
    std::deque<int> pending_weights;
    auto backward = [&](int m) {
      build.backward_input(rank, m, 0);
      pending_weights.push_back(m);
      if (static_cast<int>(pending_weights.size()) > lag) {
        build.backward_weight(rank, pending_weights.front(), 0);
        pending_weights.pop_front();
      }
    };
    for (int m = 0; m < warmup; ++m) build.forward(rank, m, 0);
    for (int i = 0; i < steady; ++i) {
      build.forward(rank, warmup + i, 0);
      backward(i);
    }
    for (int m = steady; m < micro_batches; ++m) backward(m);
    for (int m : pending_weights) build.backward_weight(rank, m, 0);
  }
  return schedule;
}

}  // namespace octet::pipeline
