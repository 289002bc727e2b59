// Pipeline parallelism as data: a schedule is, per rank, an ordered list of actions (compute a
// forward / backward / weight-gradient of one micro-batch on one model chunk, or send / receive
// its activation or gradient). Generators build the schedules (1F1B, interleaved 1F1B,
// zero-bubble ZB-H1, DualPipe, DualPipeV); one simulator runs any of them with given costs,
// checks it (dependencies, message matching, deadlock) and measures makespan, bubble and memory.
// The executor runs the same action lists with the real model and checks them here first.
//
// Terms. A micro-batch passes through `stages` pipeline stages in order (its route); stage s of
// micro-batch m lives on one (rank, chunk) place. A rank holds `chunks_per_rank` model chunks.
// Messages are point-to-point and non-blocking on the sending side (isend): a send never waits,
// its data arrives `latency` later; a receive waits for the matching send's data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "octet/dtype.h"
#include "octet/pipeline_stage.h"

namespace octet {
class ParallelState;
struct Parameter;
class Tensor;
}  // namespace octet

namespace octet::pipeline {

enum class ActionKind : std::uint8_t {
  Forward,          // forward of (micro_batch, chunk)
  Backward,         // full backward: input gradient and weight gradient together
  BackwardInput,    // input-gradient half of a split backward (sent upstream at once)
  BackwardWeight,   // weight-gradient half, deferred to fill bubbles; needs BackwardInput first
  ForwardBackward,  // DualPipe's overlapped pair: forward of (micro_batch, chunk) together with
                    // the full backward of (backward_micro_batch, backward_chunk)
  SendForward,      // send the activation that Forward(micro_batch, chunk) produced to `peer`
  RecvForward,      // receive the input activation of (micro_batch, chunk) from `peer`
  SendBackward,     // send the input gradient of (micro_batch, chunk) to `peer`
  RecvBackward,     // receive the output gradient of (micro_batch, chunk) from `peer`
};

struct Action {
  ActionKind kind = ActionKind::Forward;
  int micro_batch = 0;
  int chunk = 0;                  // model chunk on this rank, 0 .. chunks_per_rank-1
  int peer = -1;                  // send / receive only: the other rank
  int backward_micro_batch = -1;  // ForwardBackward only: the backward half
  int backward_chunk = -1;
};

bool is_compute(ActionKind kind);
const char* kind_name(ActionKind kind);      // "F", "B", "BI", "W", "F&B", "SendF", ...
std::string describe(const Action& action);  // "F(mb 3, chunk 1)", "RecvB(mb 2, chunk 0) from 1"

struct Place {
  int rank = 0;
  int chunk = 0;
};

enum class ScheduleKind : std::uint8_t { OneFOneB, Interleaved, ZeroBubbleH1, DualPipe, DualPipeV };

const char* schedule_name(ScheduleKind kind);  // "1F1B", "interleaved", "ZB1P", "DualPipe", ...
ScheduleKind parse_schedule_kind(
    const std::string& text);  // 1f1b|interleaved|zb1p|dualpipe|dualpipev

struct Schedule {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int ranks = 1;
  int micro_batches = 1;
  int chunks_per_rank = 1;  // v for interleaved, 2 for DualPipe / DualPipeV
  int virtual_stages = 1;   // the v asked for (interleaved); 1 otherwise
  int stages = 1;           // stages in a micro-batch's route
  // Share of one rank's 1F1B work (L/ranks layers) that one chunk holds: 1/v interleaved, 1/2
  // DualPipeV; the simulator scales the costs by it so all schedules run the same model.
  double chunk_work = 1.0;
  int model_copies = 1;                      // 2 for DualPipe (one per direction)
  std::vector<std::vector<Place>> routes;    // routes[route][stage]
  std::vector<int> route_of_micro_batch;     // [micro_batches]
  std::vector<std::vector<Action>> actions;  // [ranks], each in execution order

  const Place& place(int micro_batch, int stage) const;
  // The stage micro_batch runs on (rank, chunk), or -1 when its route does not pass there.
  int stage_of(int micro_batch, int rank, int chunk) const;
};

// Generators. Invalid sizes throw octet::Error saying what is needed and what came.
Schedule schedule_1f1b(int ranks, int micro_batches);  // PipeDream-flush / Megatron
Schedule schedule_interleaved_1f1b(int ranks, int micro_batches, int virtual_stages);  // Megatron
Schedule schedule_zero_bubble_h1(int ranks, int micro_batches);  // ZB-H1 ("ZB1P")
Schedule schedule_dualpipe(int ranks, int micro_batches);        // DeepSeek-V3 DualPipe
Schedule schedule_dualpipev(int ranks, int micro_batches);       // V-shape, "cut-in-half"
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages = 2);

// Costs of one action on a chunk holding one rank's 1F1B share (scaled by Schedule::chunk_work).
struct Costs {
  double forward = 1.0;            // F
  double backward = 2.0;           // B: full backward (input + weight)
  double backward_weight = 1.0;    // W; BackwardInput costs B - W
  double forward_backward = -1.0;  // F&B, the overlapped pair; negative means F + B
  double latency = 0.0;            // point-to-point: arrival = send time + latency
  // Measured runs: the F, B and W of one action of each pipeline stage (seconds of that
  // stage's chunk; chunk_work is not applied), e.g. the last stage's F carrying the loss.
  // Empty: every stage costs the uniform figures above. F&B costs its forward stage's F plus
  // its backward stage's B (the executor runs them one after the other).
  std::vector<double> stage_forward, stage_backward, stage_weight;
  double overlapped() const { return forward_backward < 0 ? forward + backward : forward_backward; }
};

struct TimedAction {
  int index = 0;  // into Schedule::actions[rank]
  double start = 0.0;
  double end = 0.0;
};

struct RankReport {
  double busy = 0.0;    // compute time
  double bubble = 0.0;  // makespan - busy: idle time on this rank inside [0, makespan]
  double first_start = 0.0;
  double last_end = 0.0;
  int peak_activations = 0;           // chunks forwarded whose BackwardInput / Backward has not run
  int peak_pending_weights = 0;       // split backwards whose BackwardWeight has not run
  std::vector<TimedAction> timeline;  // compute actions only
};

// Bubble: the longest idle time of any rank, max over ranks of (makespan - its compute time),
// i.e. makespan minus the compute of the least busy rank (with latency 0 every rank starts at
// 0, so this counts warm-up, waits and cool-down). It is the "bubble" of the published
// formulas: in 1F1B / interleaved / ZB1P every rank computes the same and idles the same; in
// DualPipe / DualPipeV the ranks nearer the middle overlap more F&B pairs, compute less and
// idle more, and the DualPipe README's (PP/2-1)(F&B+B-3W) is their idle time. That formula
// is exact when a forward costs as much as a backward-input (F = B - W, as the cells of the
// README's figure are drawn); for other costs the simulated bubble is the true one.
struct SimulationReport {
  double makespan = 0.0;
  double bubble = 0.0;
  double bubble_fraction = 0.0;  // bubble / makespan
  int peak_activations = 0;      // max over ranks, in chunks
  int peak_pending_weights = 0;
  std::vector<RankReport> ranks;
};

// Runs the schedule as a discrete-event simulation (each rank in order, a receive waits for its
// send). Throws octet::Error on: an action out of dependency order (backward before forward,
// send before compute, compute before its receive), a place the micro-batch's route does not
// pass, a duplicated or missing forward / backward / weight gradient, a message sent to the
// wrong rank or never received, and deadlock (naming what each stuck rank waits for).
SimulationReport simulate(const Schedule& schedule, const Costs& costs);
// Pre-flight check for the executor: simulate with unit costs, throw on any defect.
void check_schedule(const Schedule& schedule);

// The executor: runs one training step of a schedule on this rank with the real model.
//
// Each action in order: Forward receives nothing on the first stage, otherwise the input
// [B,T,C] in the compute dtype (from RecvForward, or from the chunk before it on this rank),
// runs the chunk and keeps its context per (micro-batch, chunk); on the last stage it also
// computes the loss and the output layer's gradient. Backward takes the output gradient (from
// RecvBackward, the chunk after it on this rank, or the loss) and runs the chunk's backward.
// Sends are isends waited at the end of the step; receives are irecv + wait with a timeout,
// so a deadlock or a mismatched message is an error naming the action, never a hang.
//
// BackwardInput runs the chunk's backward with its weight-gradient GEMMs deferred
// (defer_weight_gradients: each Linear queues dy^T x), so the input gradient goes upstream at
// once; BackwardWeight runs that queue. Bias and norm gradients (column sums) are computed
// in BackwardInput. A chunk's gradients are final after its last W of the step.
// ForwardBackward (DualPipe's F&B pair) runs its forward, then its backward, or with
// overlap_forward_backward both at once on two threads.
struct ExecutorOptions {
  DType dtype = DType::F32;  // compute dtype: F32 or BF16
  // A receive or send pending this long is an error naming it and the peer's state (0: the
  // process's communication_timeout(), --comm-timeout).
  double receive_timeout_seconds = 0;
  bool check = true;  // check_schedule before the first step
  // Called after each forward and each backward of a chunk (e.g. the FP8 amax reduction over
  // the stage's tensor x data ranks, which run the same action list): may be empty.
  std::function<void()> after_compute;
  // Called once per step right after chunk c's last backward on this rank: its gradients are
  // final (data parallelism starts reducing them while the schedule goes on). The tied
  // embedding's copies are summed after the schedule, so wte must not be reduced from here.
  // Not called for DualPipe, whose two model copies are summed after the schedule.
  std::function<void(int chunk)> chunk_gradients_final;
  // DualPipe's overlapped F&B: the pair's backward runs on a second thread while the forward
  // runs on this one, so that either one's communication (a mixture of experts' all-to-all,
  // context parallelism's exchanges) waits while the other computes. The model's two chunks
  // must then be independent and exchange over communicators of their own (see
  // ModelLayout::chunk_expert); tensor parallelism's collectives are not split that way.
  bool overlap_forward_backward = false;
};

// The pipeline stage each chunk of `rank` holds (StagedModel::stage_of_chunk); Schedule::stages
// is the number of stages the model is cut into.
std::vector<int> stages_of_rank(const Schedule& schedule, int rank);

// Where one train_step's time went on this rank (steady_clock around each action; seconds).
// The schedule part runs from the step's start to the end of its last action plus the wait for
// its sends; compare it with the simulator's makespan after aligning the ranks' starts (a
// barrier before the step), as `octet bench parallel` does. Receives count as waiting: irecv
// is posted when the schedule reaches it, so with Open MPI's rendezvous protocol a large
// message moves inside that wait and its transfer time is counted here too.
struct StepTiming {
  double step_seconds = 0.0;      // the whole train_step
  double schedule_seconds = 0.0;  // the action list plus the final wait for the sends
  double forward_seconds = 0.0;   // Forward actions and the forward half of F&B
  double backward_seconds = 0.0;  // Backward, BackwardInput and the backward half of F&B
  double weight_seconds = 0.0;    // BackwardWeight: the deferred weight-gradient GEMMs
  // Overlapped F&B pairs: their wall time, and the sum of their forwards' and backwards' own
  // times (more than the wall time by what the overlap saved, waits included).
  double overlapped_pair_seconds = 0.0;
  double overlapped_pair_compute_seconds = 0.0;
  double wait_seconds = 0.0;    // blocked in receives (irecv + wait) and in the send waits
  double reduce_seconds = 0.0;  // after the schedule: gradient and loss all-reduces
  // Each forward / backward of one (micro-batch, chunk), in execution order: for medians.
  std::vector<double> forward_samples;
  std::vector<double> backward_samples;        // whole backwards (B, the half of F&B)
  std::vector<double> backward_input_samples;  // BackwardInput
  std::vector<double> weight_samples;          // BackwardWeight
  double compute_seconds() const { return forward_seconds + backward_seconds + weight_seconds; }
  // schedule - compute - wait: sends posted, bookkeeping, buffers allocated.
  double other_seconds() const { return schedule_seconds - compute_seconds() - wait_seconds; }
};

class PipelineExecutor {
 public:
  // The model holds, per chunk, stages_of_rank(schedule, pipeline rank) of schedule.stages;
  // schedule.ranks must equal the pipeline group's size. Collective over the pipeline group
  // (DualPipe splits it into pairs r, ranks-1-r).
  PipelineExecutor(Schedule schedule, StagedModel& model, ParallelState& state,
                   ExecutorOptions options = {});
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // One step over schedule.micro_batches micro-batches (every rank passes all of them; each
  // stage reads what it needs). Gradients accumulate (+=) scaled by grad_scale per
  // micro-batch; then the tied parameters' gradients are summed over the embedding group
  // (first + last stage) and, for DualPipe, every gradient over the two model copies (ranks
  // r and ranks-1-r) - so gradients must be zero before the step. Returns the mean loss over
  // the micro-batches, on every pipeline rank.
  float train_step(const std::vector<MicroBatch>& batches, float grad_scale);
  // Validation: the summed loss of batches (any count, passed on every rank as in
  // train_step) through the stages in order, forward only - no contexts kept,
  // no gradient. Micro-batch by micro-batch along the first route (DualPipe: the first model
  // copy), each activation sent from the stage's rank to the next stage's; after_compute runs
  // after each forward. Returns the sum of the micro-batches' mean losses, on every pipeline
  // rank (collective over the pipeline group).
  double evaluate(const std::vector<MicroBatch>& batches);
  const Schedule& schedule() const;
  // The parameters this rank counts once for the whole model: summing a per-parameter
  // quantity (the squared gradient norm for clipping) over them on every pipeline rank counts
  // each model parameter exactly once. Leaves out the tied copies of ranks other than the
  // first stage's and, for DualPipe, everything on ranks >= ranks/2 (their pair
  // partner holds the same stages with the same, summed gradients).
  std::vector<Parameter*> owned_parameters();
  // This rank's timing of the last train_step (zeros before the first; a step that threw
  // leaves what it measured up to the error).
  const StepTiming& last_step_timing() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A measured run against the simulator. steps[step][rank]: the executor's timings of that
// step on every pipeline rank, their starts aligned (a barrier before each step). Per step the
// measured makespan is the longest schedule_seconds and the bubble, as simulate()'s, the
// makespan minus the least compute of any rank; the figures are medians over the steps.
//
// The simulation uses the costs of what the executor runs, not of the schedule's ideal: per
// pipeline stage, F, B and W are the medians of the measured forward / whole backward /
// BackwardWeight actions of that stage (all ranks and steps; B = BI + W where the stage runs
// no whole backward), F&B = F + B (run one after the other), and the latency given (e.g. a
// measured point-to-point transfer of one activation). `uniform` simulates the same with one
// F, B, W for every stage (the medians over all stages, divided by Schedule::chunk_work).
struct BubbleComparison {
  double forward_seconds = 0.0;   // median measured Forward of one (micro-batch, chunk)
  double backward_seconds = 0.0;  // median measured Backward of one (micro-batch, chunk)
  double weight_seconds = 0.0;    // median measured BackwardWeight (0: the schedule has none)
  Costs uniform_costs;            // one F, B, W for all stages
  SimulationReport uniform;       // simulated with them
  Costs costs;                    // what was simulated, in seconds
  double measured_makespan = 0.0;
  double measured_bubble = 0.0;
  double measured_bubble_fraction = 0.0;  // bubble / makespan
  double measured_step = 0.0;             // the longest step_seconds, reductions included
  // The schedule replayed with each step's own measured action durations (not their medians)
  // and the latency: what the spread of compute times alone makes of the bubble. Measured
  // minus replayed is what the executor adds between actions (messages, waking a rank).
  double replayed_makespan = 0.0;
  double replayed_bubble = 0.0;
  SimulationReport simulated;
  double bubble_ratio = 0.0;  // measured / simulated bubble (NaN when the simulated one is 0)
};
Costs executed_costs(const Schedule& schedule, double forward_seconds, double backward_seconds,
                     double weight_seconds, double latency_seconds);
BubbleComparison compare_bubble(const Schedule& schedule,
                                const std::vector<std::vector<StepTiming>>& steps,
                                double latency_seconds);

// The published closed forms, at latency 0, in the same cost units as simulate().
struct PublishedFigures {
  std::string bubble_formula;  // "(PP-1)(F+B)" ...
  double bubble = 0.0;
  int activations = 0;               // peak in-flight chunk activations on the first rank
  double parameters_per_rank = 1.0;  // relative to 1F1B's L/ranks layers
};
PublishedFigures published_figures(const Schedule& schedule, const Costs& costs);

// One row per rank, coloured boxes F / B / BI / W / F&B labelled by micro-batch, one panel per
// schedule. Written to a temporary name, then renamed.
struct TimelinePanel {
  const Schedule* schedule = nullptr;
  const SimulationReport* report = nullptr;
};
void write_timeline_svg(const std::vector<TimelinePanel>& panels, const std::string& path);

}  // namespace octet::pipeline
