// Pipeline schedules as data: the simulator against the published bubble and memory formulas,
// exactly, for several PP and micro-batch counts; dependency and message checks; clear errors
// for invalid sizes and for hand-broken schedules (deadlock, mismatched or missing messages).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "octet/error.h"
#include "octet/pipeline.h"

namespace octet::pipeline {
namespace {

Costs make_costs(double f, double b, double w, double fb, double latency = 0.0) {
  Costs c;
  c.forward = f;
  c.backward = b;
  c.backward_weight = w;
  c.forward_backward = fb;
  c.latency = latency;
  return c;
}

// Valid micro-batch counts per schedule: PP, 2PP, 4PP and an odd one where accepted.
std::vector<int> micro_batch_counts(ScheduleKind kind, int ranks) {
  switch (kind) {
    case ScheduleKind::OneFOneB:
      return {ranks, 2 * ranks, 4 * ranks, 2 * ranks + 1, 1};
    case ScheduleKind::ZeroBubbleH1:  // fewer than PP leave no room to defer W
      return {ranks, 2 * ranks, 4 * ranks, 2 * ranks + 1};
    case ScheduleKind::Interleaved:
      return {ranks, 2 * ranks, 4 * ranks, 3 * ranks};
    case ScheduleKind::DualPipe:
      return {2 * ranks, 4 * ranks, 2 * ranks + 2};
    case ScheduleKind::DualPipeV:
      return {2 * ranks, 4 * ranks, 2 * ranks + 1};
  }
  return {};
}

std::string error_of(const auto& body) {
  try {
    body();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

constexpr ScheduleKind kKinds[] = {ScheduleKind::OneFOneB, ScheduleKind::Interleaved,
                                   ScheduleKind::ZeroBubbleH1, ScheduleKind::DualPipe,
                                   ScheduleKind::DualPipeV};

// F=3, B=5, W=2 (so BackwardInput = 3 = F, the cell widths the DualPipe figure assumes),
// F&B=7 < F+B: every term of every formula changes the result.
TEST(PipelineSchedule, BubbleEqualsPublishedFormulaExactly) {
  const Costs costs[] = {make_costs(3, 5, 2, 7), make_costs(2, 3, 1, 4), make_costs(1, 2, 1, 3),
                         make_costs(4, 6, 2, 9)};
  for (const Costs& c : costs) {
    for (ScheduleKind kind : kKinds) {
      for (int ranks : {2, 4, 6, 8}) {
        for (int m : micro_batch_counts(kind, ranks)) {
          for (int v : {2, 3}) {
            if (kind != ScheduleKind::Interleaved && v != 2) continue;
            const Schedule s = make_schedule(kind, ranks, m, v);
            const SimulationReport r = simulate(s, c);
            const PublishedFigures p = published_figures(s, c);
            SCOPED_TRACE(::testing::Message()
                         << schedule_name(kind) << " PP=" << ranks << " M=" << m << " v=" << v
                         << " F=" << c.forward << " B=" << c.backward << " W=" << c.backward_weight
                         << " F&B=" << c.overlapped());
            EXPECT_NEAR(r.bubble, p.bubble, 1e-9) << p.bubble_formula;
            EXPECT_EQ(r.ranks[0].peak_activations, p.activations);
            EXPECT_NEAR(r.bubble_fraction, r.bubble / r.makespan, 1e-12);
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, OneFOneBMakespanAndLatency) {
  // One micro-batch is the critical path alone: down and back, one latency per boundary.
  for (int ranks : {1, 2, 4, 8}) {
    const SimulationReport r = simulate(schedule_1f1b(ranks, 1), make_costs(3, 6, 2, -1, 0.5));
    EXPECT_DOUBLE_EQ(r.makespan, ranks * 9.0 + 2 * (ranks - 1) * 0.5);
  }
  // PP=2, M=2, latency 0.5: rank 0 F0 [0,3] F1 [3,6]; rank 1 F0 [3.5,6.5] B0 [6.5,12.5]
  // F1 [12.5,15.5] B1 [15.5,21.5]; rank 0 B0 [13,19] B1 [22,28].
  EXPECT_DOUBLE_EQ(simulate(schedule_1f1b(2, 2), make_costs(3, 6, 2, -1, 0.5)).makespan, 28.0);
  // With more micro-batches the latency also enters the steady state: rank 0's B(i) -> F(i+2)
  // -> rank 1 F(i+2), B(i+2) -> rank 0 B(i+2) is a cycle with two hops per two micro-batches.
  EXPECT_GT(simulate(schedule_1f1b(2, 6), make_costs(3, 6, 2, -1, 0.5)).makespan, 7 * 9.0 + 1.0);
  const Costs c = make_costs(3, 6, 2, -1);
  for (int ranks : {1, 2, 4, 8}) {
    for (int m : {ranks, 2 * ranks + 1, 4 * ranks}) {
      const SimulationReport r = simulate(schedule_1f1b(ranks, m), c);
      EXPECT_DOUBLE_EQ(r.makespan, (m + ranks - 1) * 9.0) << ranks << " " << m;
      for (const RankReport& rank : r.ranks) EXPECT_DOUBLE_EQ(rank.bubble, (ranks - 1) * 9.0);
    }
  }
}

// Per-stage costs (measured runs): equal to the uniform ones they change nothing, for every
// schedule; a slower last stage (the loss) becomes the 1F1B bottleneck.
TEST(PipelineSchedule, PerStageCosts) {
  const Costs uniform = make_costs(1, 3, 1, -1);
  for (const Schedule& s :
       {schedule_1f1b(4, 8), schedule_interleaved_1f1b(4, 8, 2), schedule_zero_bubble_h1(4, 8),
        schedule_dualpipe(4, 8), schedule_dualpipev(4, 8)}) {
    SCOPED_TRACE(schedule_name(s.kind));
    Costs staged = uniform;
    staged.stage_forward.assign(static_cast<size_t>(s.stages), 1.0 * s.chunk_work);
    staged.stage_backward.assign(static_cast<size_t>(s.stages), 3.0 * s.chunk_work);
    staged.stage_weight.assign(static_cast<size_t>(s.stages), 1.0 * s.chunk_work);
    const SimulationReport a = simulate(s, uniform), b = simulate(s, staged);
    EXPECT_DOUBLE_EQ(a.makespan, b.makespan);
    EXPECT_DOUBLE_EQ(a.bubble, b.bubble);
  }
  // PP=2, M micro-batches, F = (1, 2), B = 2: rank 1 computes F+B = 4 per micro-batch without
  // a break from t = 1 (rank 0 feeds it faster), then rank 0 runs the last B: 1 + 4M + 2.
  Costs slow_last = make_costs(1, 2, 0, -1);
  slow_last.stage_forward = {1, 2};
  slow_last.stage_backward = {2, 2};
  slow_last.stage_weight = {0, 0};
  for (int m : {2, 4, 7}) {
    EXPECT_DOUBLE_EQ(simulate(schedule_1f1b(2, m), slow_last).makespan, 3.0 + 4.0 * m) << m;
  }
  slow_last.stage_weight = {0, 3};  // W > B
  EXPECT_THROW(simulate(schedule_1f1b(2, 2), slow_last), Error);
  slow_last.stage_weight = {0};  // one value for two stages
  EXPECT_THROW(simulate(schedule_1f1b(2, 2), slow_last), Error);
}

// compare_bubble attributes each measured action to its stage: when every stage's actions take
// a constant, stage-specific time, the per-stage simulation, the replay and the measurement
// agree exactly (here interleaved, stages on alternating ranks; uniform costs cannot).
TEST(PipelineSchedule, MeasuredStageCostsAreAttributedToTheirStages) {
  const Schedule s = schedule_interleaved_1f1b(2, 8, 2);
  Costs truth;
  truth.stage_forward = {1, 2, 3, 4};
  truth.stage_backward = {10, 11, 12, 13};
  truth.stage_weight = {0, 0, 0, 0};
  const SimulationReport run = simulate(s, truth);
  std::vector<StepTiming> ranks(2);
  for (int r = 0; r < 2; ++r) {
    StepTiming& t = ranks[static_cast<size_t>(r)];
    for (const Action& a : s.actions[static_cast<size_t>(r)]) {
      const auto stage = static_cast<size_t>(s.stage_of(a.micro_batch, r, a.chunk));
      if (a.kind == ActionKind::Forward) t.forward_samples.push_back(truth.stage_forward[stage]);
      if (a.kind == ActionKind::Backward) t.backward_samples.push_back(truth.stage_backward[stage]);
    }
    for (double v : t.forward_samples) t.forward_seconds += v;
    for (double v : t.backward_samples) t.backward_seconds += v;
    t.schedule_seconds = run.ranks[static_cast<size_t>(r)].last_end;
    t.step_seconds = run.makespan;
  }
  const BubbleComparison c = compare_bubble(s, {ranks}, 0.0);
  EXPECT_EQ(c.costs.stage_forward, truth.stage_forward);
  EXPECT_EQ(c.costs.stage_backward, truth.stage_backward);
  EXPECT_DOUBLE_EQ(c.measured_bubble, run.bubble);
  EXPECT_DOUBLE_EQ(c.replayed_bubble, run.bubble);
  EXPECT_DOUBLE_EQ(c.simulated.bubble, run.bubble);
  EXPECT_NE(c.uniform.bubble, run.bubble);
}

// Where F differs from B - W the DualPipe formula is no longer exact; the simulation is. With
// F&B = F + B every rank computes the same and idles the same.
TEST(PipelineSchedule, DualPipeBeyondTheFormula) {
  const SimulationReport a = simulate(schedule_dualpipe(8, 32), make_costs(3, 6, 2, 7));
  EXPECT_DOUBLE_EQ(a.bubble, 18.0);  // formula (8/2-1)(7+6-6) = 21
  EXPECT_DOUBLE_EQ(a.ranks[0].bubble, 14.0);
  const SimulationReport b = simulate(schedule_dualpipe(8, 32), make_costs(3, 6, 2, 9));
  for (const RankReport& rank : b.ranks) EXPECT_DOUBLE_EQ(rank.bubble, 24.0);  // formula 27
  // DualPipe holds two model copies; DualPipeV one, split in 2 x PP half-size chunks.
  EXPECT_EQ(schedule_dualpipe(4, 8).model_copies, 2);
  EXPECT_DOUBLE_EQ(published_figures(schedule_dualpipe(4, 8), Costs{}).parameters_per_rank, 2.0);
  EXPECT_DOUBLE_EQ(published_figures(schedule_dualpipev(4, 8), Costs{}).parameters_per_rank, 1.0);
  EXPECT_EQ(schedule_dualpipev(4, 8).stages, 8);
}

// Every schedule passes the checker, computes each stage once forward and once backward, and
// DualPipe overlaps: rank at distance h from the edge runs M - 3PP/2 + h + 1 F&B pairs, less
// one at the two middle ranks (their first steady pair is not overlapped).
TEST(PipelineSchedule, ComputeCountsAndOverlap) {
  for (ScheduleKind kind : kKinds) {
    for (int ranks : {2, 4, 8}) {
      for (int m : micro_batch_counts(kind, ranks)) {
        const Schedule s = make_schedule(kind, ranks, m, 2);
        EXPECT_NO_THROW(check_schedule(s));
        int forwards = 0, backwards = 0, weights = 0, inputs = 0;
        for (const auto& list : s.actions) {
          for (const Action& a : list) {
            forwards += a.kind == ActionKind::Forward || a.kind == ActionKind::ForwardBackward;
            backwards += a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput ||
                         a.kind == ActionKind::ForwardBackward;
            inputs += a.kind == ActionKind::BackwardInput;
            weights += a.kind == ActionKind::BackwardWeight;
          }
        }
        EXPECT_EQ(forwards, m * s.stages);
        EXPECT_EQ(backwards, m * s.stages);
        EXPECT_EQ(weights, inputs);
      }
    }
  }
  const int ranks = 8, m = 20;
  const Schedule s = schedule_dualpipe(ranks, m);
  for (int rank = 0; rank < ranks; ++rank) {
    const int h = std::min(rank, ranks - 1 - rank);
    const int pairs = static_cast<int>(
        std::count_if(s.actions[rank].begin(), s.actions[rank].end(),
                      [](const Action& a) { return a.kind == ActionKind::ForwardBackward; }));
    EXPECT_EQ(pairs, m - 3 * ranks / 2 + h + 1 - (h == ranks / 2 - 1 ? 1 : 0)) << rank;
  }
}

TEST(PipelineSchedule, DependencyOrderOnEachRank) {
  // On every rank a chunk's backward comes after its forward, its W after its BackwardInput,
  // a send after the compute that produced the data, a receive before the compute that uses it.
  for (ScheduleKind kind : kKinds) {
    const Schedule s = make_schedule(kind, 4, 16, 2);
    for (int rank = 0; rank < s.ranks; ++rank) {
      const auto& list = s.actions[rank];
      auto position = [&](ActionKind kind_wanted, int m, int c) {
        for (size_t i = 0; i < list.size(); ++i) {
          const Action& a = list[i];
          if (a.kind == kind_wanted && a.micro_batch == m && a.chunk == c) return int(i);
          if (a.kind == ActionKind::ForwardBackward && kind_wanted == ActionKind::Backward &&
              a.backward_micro_batch == m && a.backward_chunk == c) {
            return int(i);
          }
        }
        return -1;
      };
      for (size_t i = 0; i < list.size(); ++i) {
        const Action& a = list[i];
        const int here = static_cast<int>(i);
        if (a.kind == ActionKind::BackwardWeight) {
          EXPECT_LT(position(ActionKind::BackwardInput, a.micro_batch, a.chunk), here);
        }
        if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) {
          const int f = std::max(position(ActionKind::Forward, a.micro_batch, a.chunk),
                                 position(ActionKind::ForwardBackward, a.micro_batch, a.chunk));
          EXPECT_GE(f, 0);
          EXPECT_LT(f, here);
        }
        if (a.kind == ActionKind::RecvForward) {
          const int f = std::max(position(ActionKind::Forward, a.micro_batch, a.chunk),
                                 position(ActionKind::ForwardBackward, a.micro_batch, a.chunk));
          EXPECT_GT(f, here);
        }
      }
    }
  }
}

TEST(PipelineSchedule, InvalidSizesSayWhatIsNeeded) {
  EXPECT_NE(error_of([] { schedule_1f1b(0, 4); }).find("must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of([] { schedule_1f1b(4, 0); }).find("micro-batches must be >= 1, got 0"),
            std::string::npos);
  const std::string interleaved = error_of([] { schedule_interleaved_1f1b(4, 6, 2); });
  EXPECT_NE(interleaved.find("multiple of pipeline-model-parallel-size 4, got 6"),
            std::string::npos)
      << interleaved;
  EXPECT_NE(error_of([] { schedule_interleaved_1f1b(4, 8, 0); }).find("got 0"), std::string::npos);
  const std::string odd = error_of([] { schedule_dualpipe(3, 12); });
  EXPECT_NE(odd.find("must be even and >= 2, got 3"), std::string::npos) << odd;
  const std::string few = error_of([] { schedule_dualpipe(4, 6); });
  EXPECT_NE(few.find(">= 2 x pipeline-model-parallel-size = 8"), std::string::npos) << few;
  EXPECT_NE(few.find("got 6"), std::string::npos) << few;
  EXPECT_NE(error_of([] { schedule_dualpipe(4, 9); }).find("even"), std::string::npos);
  EXPECT_NE(error_of([] { schedule_dualpipev(4, 7); }).find("= 8, got 7"), std::string::npos);
  EXPECT_NE(error_of([] { parse_schedule_kind("gpipe"); }).find("got 'gpipe'"), std::string::npos);
  EXPECT_EQ(parse_schedule_kind("DualPipeV"), ScheduleKind::DualPipeV);
  EXPECT_EQ(parse_schedule_kind("zb1p"), ScheduleKind::ZeroBubbleH1);
  EXPECT_NE(error_of([] {
              simulate(schedule_1f1b(2, 2), make_costs(1, 2, 3, -1));
            }).find("expected 0 <= W <= B"),
            std::string::npos);
}

// Index of the first action of a kind for micro-batch m on a rank.
size_t find(const std::vector<Action>& list, ActionKind kind, int m) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind == kind && list[i].micro_batch == m) return i;
  }
  ADD_FAILURE() << "no " << kind_name(kind) << " for micro-batch " << m;
  return 0;
}

TEST(PipelineSchedule, DeadlockNamesWhatEachRankWaitsFor) {
  // Rank 0 waits for the gradient of micro-batch 0 before sending its activation: nobody moves.
  Schedule s = schedule_1f1b(2, 2);
  auto& rank0 = s.actions[0];
  const size_t recv = find(rank0, ActionKind::RecvBackward, 0);
  const Action wait = rank0[recv];
  rank0.erase(rank0.begin() + static_cast<std::ptrdiff_t>(recv));
  rank0.insert(rank0.begin(), wait);
  const std::string text = error_of([&] { check_schedule(s); });
  EXPECT_NE(text.find("deadlock"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 0 waits at action #0 RecvB(mb 0, chunk 0) from 1"), std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 1 waits at action #0 RecvF(mb 0, chunk 0) from 0"), std::string::npos)
      << text;
}

TEST(PipelineSchedule, BrokenMessagesAndOrderAreReported) {
  {  // a send to the wrong rank
    Schedule s = schedule_1f1b(4, 4);
    s.actions[1][find(s.actions[1], ActionKind::SendForward, 2)].peer = 3;
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
    EXPECT_NE(text.find("next stage is on rank 2, not 3"), std::string::npos) << text;
  }
  {  // a gradient sent that nobody receives: rank 0 drops its last backward
    Schedule s = schedule_1f1b(2, 3);
    auto& rank0 = s.actions[0];
    rank0.erase(rank0.begin() + static_cast<std::ptrdiff_t>(find(rank0, ActionKind::Backward, 2)));
    rank0.erase(rank0.begin() +
                static_cast<std::ptrdiff_t>(find(rank0, ActionKind::RecvBackward, 2)));
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("rank 1 sends the gradient of micro-batch 2 to rank 0, which never "
                        "receives it"),
              std::string::npos)
        << text;
  }
  {  // a finished rank the other waits for
    Schedule s = schedule_1f1b(2, 1);
    auto& rank1 = s.actions[1];
    rank1.erase(rank1.begin() +
                static_cast<std::ptrdiff_t>(find(rank1, ActionKind::SendBackward, 0)));
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("rank 0 waits at"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 1 has finished without sending it"), std::string::npos) << text;
  }
  {  // compute before its receive
    Schedule s = schedule_1f1b(2, 2);
    auto& rank1 = s.actions[1];
    std::swap(rank1[find(rank1, ActionKind::RecvForward, 0)],
              rank1[find(rank1, ActionKind::Forward, 0)]);
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("rank 1 action #0 F(mb 0, chunk 0): its input activation has not been "
                        "received from rank 0"),
              std::string::npos)
        << text;
  }
  {  // a weight gradient before its input gradient
    Schedule s = schedule_zero_bubble_h1(2, 2);
    auto& rank1 = s.actions[1];
    std::swap(rank1[find(rank1, ActionKind::BackwardInput, 0)],
              rank1[find(rank1, ActionKind::BackwardWeight, 0)]);
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("BackwardWeight before its BackwardInput"), std::string::npos) << text;
  }
  {  // a forward run twice, and one never run
    Schedule s = schedule_1f1b(1, 2);
    s.actions[0][find(s.actions[0], ActionKind::Forward, 1)].micro_batch = 0;
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("forward runs twice"), std::string::npos) << text;
  }
  {  // a chunk the micro-batch's route does not pass
    Schedule s = schedule_1f1b(2, 2);
    s.actions[0][find(s.actions[0], ActionKind::Forward, 0)].chunk = 1;
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("has no stage on rank 0 chunk 1"), std::string::npos) << text;
  }
  {  // a route through a chunk the ranks do not hold
    Schedule s = schedule_1f1b(2, 2);
    s.routes[0][1].chunk = 1;
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("a route passes rank 1 chunk 1, expected 2 ranks of 1 chunks"),
              std::string::npos)
        << text;
  }
  {  // a missing weight gradient
    Schedule s = schedule_zero_bubble_h1(2, 2);
    auto& rank0 = s.actions[0];
    rank0.erase(rank0.begin() +
                static_cast<std::ptrdiff_t>(find(rank0, ActionKind::BackwardWeight, 1)));
    const std::string text = error_of([&] { check_schedule(s); });
    EXPECT_NE(text.find("micro-batch 1 stage 0 (rank 0 chunk 0) never gets its BackwardWeight"),
              std::string::npos)
        << text;
  }
}

TEST(PipelineSchedule, TimelineSvg) {
  const Schedule a = schedule_1f1b(4, 8);
  const Schedule b = schedule_dualpipe(4, 8);
  const SimulationReport ra = simulate(a, Costs{});
  const SimulationReport rb = simulate(b, Costs{});
  const std::string path = ::testing::TempDir() + "octet_pipeline_timeline.svg";
  write_timeline_svg({{&a, &ra}, {&b, &rb}}, path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string svg = text.str();
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("DualPipe"), std::string::npos);
  EXPECT_NE(svg.find("rank 3"), std::string::npos);
  EXPECT_NE(svg.find("F&amp;B(mb"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace octet::pipeline
