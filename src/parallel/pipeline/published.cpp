// The closed forms the schedules are known by, from the DualPipe README's comparison table
// (1F1B, ZB1P, DualPipe, DualPipeV) and the Megatron-LM paper (interleaved), at latency 0.
// F, B, W, F&B are per chunk of one rank's 1F1B share; where a schedule's chunks are smaller
// (interleaved: 1/v, DualPipeV: 1/2) its formula is written in its own stages and scaled.
#include <algorithm>

#include "octet/pipeline.h"

namespace octet::pipeline {

PublishedFigures published_figures(const Schedule& schedule, const Costs& costs) {
  const double P = schedule.ranks;
  const double F = costs.forward;
  const double B = costs.backward;
  const double W = costs.backward_weight;
  const double FB = costs.overlapped();
  const int ranks = schedule.ranks;
  const int m = schedule.micro_batches;
  PublishedFigures out;
  switch (schedule.kind) {
    case ScheduleKind::OneFOneB:
      out.bubble_formula = "(PP-1)(F+B)";
      out.bubble = (P - 1) * (F + B);
      out.activations = std::min(ranks, m);
      break;
    case ScheduleKind::Interleaved: {
      const int v = schedule.virtual_stages;
      out.bubble_formula = "(PP-1)(F+B)/v";
      out.bubble = (P - 1) * (F + B) / v;
      // Megatron: rank 0 forwards 2(PP-1) + (v-1)PP chunks before its first backward, plus one.
      out.activations = m == ranks ? m * v : std::min(m * v, 2 * (ranks - 1) + (v - 1) * ranks + 1);
      out.parameters_per_rank = 1.0;
      break;
    }
    case ScheduleKind::ZeroBubbleH1:
      out.bubble_formula = "(PP-1)(F+B-2W)";
      out.bubble = (P - 1) * (F + B - 2 * W);
      out.activations = std::min(ranks, m);
      break;
    case ScheduleKind::DualPipe:
      out.bubble_formula = "(PP/2-1)(F&B+B-3W)";
      out.bubble = (P / 2 - 1) * (FB + B - 3 * W);
      out.activations = ranks + 1;
      out.parameters_per_rank = 2.0;
      break;
    case ScheduleKind::DualPipeV:
      // PP = 2 x ranks stages of half a rank's share each: (PP/2-1)(F&B+B-3W) at half cost.
      out.bubble_formula = "(PP/2-1)(F&B+B-3W), PP=2xranks, costs/2";
      out.bubble = (P - 1) * (FB + B - 3 * W) / 2;
      out.activations = 2 * ranks + 1;
      out.parameters_per_rank = 1.0;
      break;
  }
  return out;
}

}  // namespace octet::pipeline
