// `octet schedule`: every pipeline schedule simulated side by side with the same costs, beside
// its published bubble formula, and the timelines as an SVG (src/parallel/pipeline).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "octet/error.h"
#include "octet/pipeline.h"

namespace octet::cli {
namespace {

struct ScheduleOptions {
  int ranks = 4;
  int micro_batches = 8;
  int virtual_stages = 2;
  pipeline::Costs costs;
  std::string svg;
  bool json = false;
};

struct Row {
  pipeline::Schedule schedule;
  pipeline::SimulationReport report;
  pipeline::PublishedFigures published;
  std::string error;  // sizes this schedule does not accept
};

void print_table(const ScheduleOptions& o, const std::vector<Row>& rows) {
  std::printf(
      "pipeline schedules: PP=%d ranks, %d micro-batches, v=%d; F=%g B=%g W=%g F&B=%g "
      "latency=%g (per 1F1B stage; interleaved chunks cost 1/v, DualPipeV 1/2)\n",
      o.ranks, o.micro_batches, o.virtual_stages, o.costs.forward, o.costs.backward,
      o.costs.backward_weight, o.costs.overlapped(), o.costs.latency);
  std::printf("%-12s %9s %8s %7s  %-20s %8s %9s %9s %8s %6s %6s\n", "schedule", "makespan",
              "bubble", "bubble%", "published bubble", "= value", "peak act.", "published",
              "act. mem", "W held", "params");
  for (const Row& row : rows) {
    const char* name = pipeline::schedule_name(row.schedule.kind);
    if (!row.error.empty()) {
      std::printf("%-12s n/a: %s\n", name, row.error.c_str());
      continue;
    }
    const pipeline::SimulationReport& r = row.report;
    const pipeline::PublishedFigures& p = row.published;
    std::string formula = p.bubble_formula.substr(0, p.bubble_formula.find(','));
    std::printf("%-12s %9.2f %8.2f %6.1f%%  %-20s %8.2f %9d %9d %8.1f %6d %5.1fx\n", name,
                r.makespan, r.bubble, 100.0 * r.bubble_fraction, formula.c_str(), p.bubble,
                r.ranks[0].peak_activations, p.activations,
                r.ranks[0].peak_activations * row.schedule.chunk_work, r.peak_pending_weights,
                p.parameters_per_rank);
  }
  std::printf(
      "bubble: max over ranks of (makespan - its compute); published formulas at latency 0.\n"
      "peak act.: chunk activations alive on rank 0 (forwarded, input gradient not yet run);\n"
      "act. mem: the same in 1F1B stages; W held: most deferred weight gradients on one rank;\n"
      "params: per rank, x 1F1B's. DualPipeV runs 2 x PP half-size stages: its formula is taken\n"
      "at PP = 2 x ranks with costs / 2. DualPipe's formula is exact when F = B - W.\n");
}

void print_json(const ScheduleOptions& o, const std::vector<Row>& rows) {
  nlohmann::json out = {{"pipeline_model_parallel_size", o.ranks},
                        {"num_microbatches", o.micro_batches},
                        {"virtual_stages", o.virtual_stages},
                        {"costs",
                         {{"F", o.costs.forward},
                          {"B", o.costs.backward},
                          {"W", o.costs.backward_weight},
                          {"F&B", o.costs.overlapped()},
                          {"latency", o.costs.latency}}}};
  for (const Row& row : rows) {
    nlohmann::json item = {{"schedule", pipeline::schedule_name(row.schedule.kind)}};
    if (!row.error.empty()) {
      item["error"] = row.error;
    } else {
      std::vector<double> rank_bubbles;
      for (const pipeline::RankReport& r : row.report.ranks) rank_bubbles.push_back(r.bubble);
      item.update({{"makespan", row.report.makespan},
                   {"bubble", row.report.bubble},
                   {"bubble_fraction", row.report.bubble_fraction},
                   {"rank_bubbles", rank_bubbles},
                   {"published_bubble_formula", row.published.bubble_formula},
                   {"published_bubble", row.published.bubble},
                   {"peak_activations_rank0", row.report.ranks[0].peak_activations},
                   {"peak_activations", row.report.peak_activations},
                   {"published_activations", row.published.activations},
                   {"peak_pending_weights", row.report.peak_pending_weights},
                   {"parameters_per_rank", row.published.parameters_per_rank},
                   {"model_copies", row.schedule.model_copies}});
    }
    out["schedules"].push_back(item);
  }
  std::printf("%s\n", out.dump(2).c_str());
}

void run_schedules(const ScheduleOptions& o) {
  using pipeline::ScheduleKind;
  std::vector<Row> rows;
  for (ScheduleKind kind :
       {ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZeroBubbleH1,
        ScheduleKind::DualPipe, ScheduleKind::DualPipeV}) {
    Row row;
    row.schedule.kind = kind;
    try {
      row.schedule = pipeline::make_schedule(kind, o.ranks, o.micro_batches, o.virtual_stages);
    } catch (const Error& error) {
      row.error = error.what();
      rows.push_back(std::move(row));
      continue;
    }
    row.report = pipeline::simulate(row.schedule, o.costs);
    row.published = pipeline::published_figures(row.schedule, o.costs);
    rows.push_back(std::move(row));
  }
  const bool none =
      std::all_of(rows.begin(), rows.end(), [](const Row& r) { return !r.error.empty(); });
  if (none) fail(rows.front().error);
  if (o.json) {
    print_json(o, rows);
  } else {
    print_table(o, rows);
  }
  if (!o.svg.empty()) {
    std::vector<pipeline::TimelinePanel> panels;
    for (const Row& row : rows) {
      if (row.error.empty()) panels.push_back({&row.schedule, &row.report});
    }
    pipeline::write_timeline_svg(panels, o.svg);
    if (!o.json) std::printf("timeline: %s\n", o.svg.c_str());
  }
}

}  // namespace

void register_schedule(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "schedule", "Simulate the pipeline schedules side by side: makespan, bubble, memory");
  auto o = std::make_shared<ScheduleOptions>();
  cmd->add_option("--pipeline-model-parallel-size", o->ranks, "Pipeline ranks (PP)")
      ->required()
      ->check(at_least(1));
  cmd->add_option("--num-microbatches", o->micro_batches, "Micro-batches per step")
      ->required()
      ->check(at_least(1));
  cmd->add_option("--virtual-stages", o->virtual_stages, "Chunks per rank for interleaved 1F1B")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--cost-f", o->costs.forward, "F: forward of one rank's 1F1B share")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--cost-b", o->costs.backward, "B: full backward (input + weight)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--cost-w", o->costs.backward_weight, "W: weight-gradient part of B")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--cost-fb", o->costs.forward_backward,
                  "F&B: an overlapped forward + backward pair (default F + B)")
      ->check(at_least(0));
  cmd->add_option("--latency", o->costs.latency, "Point-to-point message latency")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--svg", o->svg, "Write the timelines to FILE (SVG)")->check(output_file());
  cmd->add_flag("--json", o->json, "One JSON object instead of the table");
  cmd->callback([o] { run_schedules(*o); });
}

}  // namespace octet::cli
