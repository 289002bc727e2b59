// The pipeline executor: one training step of any schedule, action by action, with the real
// model (any StagedModel) and point-to-point messages over the pipeline group.
#include <algorithm>
#include <chrono>
#include <exception>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "octet/comm.h"
#include "octet/error.h"
#include "octet/fp4.h"
#include "octet/module.h"
#include "octet/modules.h"
#include "octet/pipeline.h"
#include "octet/pipeline_stage.h"
#include "octet/recipe.h"

namespace octet::pipeline {

std::vector<int> stages_of_rank(const Schedule& schedule, int rank) {
  std::vector<int> stages(static_cast<size_t>(schedule.chunks_per_rank), -1);
  for (int chunk = 0; chunk < schedule.chunks_per_rank; ++chunk) {
    for (int m = 0; m < schedule.micro_batches && stages[chunk] < 0; ++m) {
      stages[chunk] = schedule.stage_of(m, rank, chunk);
    }
    OCTET_CHECK(stages[chunk] >= 0, "pipeline: no micro-batch passes rank ", rank, " chunk ",
                chunk);
  }
  return stages;
}

namespace {

using Key = std::pair<int, int>;  // (micro-batch, chunk)
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double receive_timeout(const ExecutorOptions& options) {
  return options.receive_timeout_seconds > 0 ? options.receive_timeout_seconds
                                             : communication_timeout();
}

// Takes the tensor stored under key, or throws naming what is missing.
Tensor take(std::map<Key, Tensor>& tensors, const Key& key, const char* what) {
  auto it = tensors.find(key);
  OCTET_CHECK(it != tensors.end(), "no ", what, " for micro-batch ", key.first, " chunk ",
              key.second, " (a missing receive, or out of order?)");
  Tensor tensor = std::move(it->second);
  tensors.erase(it);
  return tensor;
}

std::string describe_stages(const std::vector<int>& stages) {
  std::string text = "{";
  for (size_t i = 0; i < stages.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(stages[i]);
  }
  return text + "}";
}

}  // namespace

const Tensor& batch_tensor(const MicroBatch& batch, const std::string& name, const char* who) {
  auto it = batch.find(name);
  if (it == batch.end()) {
    std::string held;
    for (const auto& [key, tensor] : batch) held += (held.empty() ? "" : ", ") + key;
    fail(detail::concat(who, ": the micro-batch has no '", name,
                        "' (it holds: ", held.empty() ? "nothing" : held, ")"));
  }
  return it->second;
}

std::vector<int> StagedModel::chunks_in_stage_order() const {
  std::vector<int> order(static_cast<size_t>(chunks()));
  for (int c = 0; c < chunks(); ++c) order[static_cast<size_t>(c)] = c;
  std::sort(order.begin(), order.end(),
            [this](int a, int b) { return stage_of_chunk(a) < stage_of_chunk(b); });
  return order;
}

std::vector<Parameter*> StagedModel::tied_copies() {
  std::vector<Parameter*> copies;
  for (const TiedParameters& group : tied_parameters()) {
    copies.insert(copies.end(), group.parameters.begin(), group.parameters.end());
  }
  return copies;
}

struct PipelineExecutor::State {
  Schedule schedule;
  StagedModel& model;
  ParallelState& parallel;
  ExecutorOptions options;
  int rank = 0;
  // Each group of tied parameters whose stages sit on several pipeline ranks: the ranks'
  // communicator (null where this rank holds no copy) and this rank's copies. Their gradients
  // are summed after each step; the copy on the group's lowest rank counts as the parameter.
  struct TiedGroup {
    std::shared_ptr<Communicator> comm;
    std::vector<Parameter*> copies;
    int owner = 0;  // the lowest pipeline rank holding a copy
  };
  std::vector<TiedGroup> tied_groups;
  std::shared_ptr<Communicator> copies;  // DualPipe: ranks r and ranks-1-r
  std::vector<Tensor> abandoned;         // buffers of receives that timed out
  std::vector<int> backwards_per_chunk;  // micro-batches whose route passes each chunk
  std::vector<int> backwards_left;       // this step's, counting down

  // One step's bookkeeping, keyed by (micro-batch, chunk).
  std::map<Key, std::unique_ptr<StagedModel::Context>> contexts;
  std::map<Key, Tensor> inputs;    // a Forward's input activation
  std::map<Key, Tensor> outputs;   // a Forward's output, until SendForward
  std::map<Key, Tensor> doutputs;  // a Backward's output gradient
  std::map<Key, Tensor> dinputs;   // a Backward's input gradient, until SendBackward
  std::map<Key, WeightGradientQueue> weight_gradients;  // a BackwardInput's, until its W
  std::vector<std::pair<Work, Tensor>> sends;
  const std::vector<MicroBatch>* batches = nullptr;
  float grad_scale = 1.0f;
  double loss_sum = 0.0;
  StepTiming timing;

  State(Schedule s, StagedModel& m, ParallelState& p, ExecutorOptions o)
      : schedule(std::move(s)), model(m), parallel(p), options(o) {}

  int stage(const Key& key) const {
    const int stage = schedule.stage_of(key.first, rank, key.second);
    OCTET_CHECK(stage >= 0, "micro-batch ", key.first, " does not pass rank ", rank, " chunk ",
                key.second);
    return stage;
  }
  // Each boundary between stage s and s+1 of a micro-batch has a forward and a backward tag.
  int tag(int micro_batch, int boundary, bool backward) const {
    return (micro_batch * schedule.stages + boundary) * 2 + (backward ? 1 : 0);
  }
  // The activation entering stage `stage` (or its gradient).
  Tensor activation_buffer(int micro_batch, int stage) const {
    const MicroBatch& batch = (*batches)[static_cast<size_t>(micro_batch)];
    return Tensor::empty(model.boundary_shape(batch, stage), options.dtype);
  }

  // Forward and backward each in three parts: begin and end touch the step's bookkeeping (this
  // thread only), compute runs the model - for an overlapped F&B pair, on two threads at once.
  struct ForwardJob {
    Key key;
    int stage = 0;
    Tensor input, output;
    StagedModel::Context* ctx = nullptr;
    double seconds = 0;
  };
  struct BackwardJob {
    Key key;
    int stage = 0;
    bool deferred = false;
    Tensor doutput, dinput;
    StagedModel::Context* ctx = nullptr;
    WeightGradientQueue* queue = nullptr;  // deferred: the weight-gradient GEMMs wait here
    double seconds = 0;
  };

  ForwardJob forward_begin(const Key& key) {
    ForwardJob job;
    job.key = key;
    job.stage = stage(key);
    job.input = job.stage > 0 ? take(inputs, key, "input activation") : Tensor();
    std::unique_ptr<StagedModel::Context>& slot = contexts[key];
    slot = model.make_context();
    job.ctx = slot.get();
    return job;
  }

  void forward_compute(ForwardJob& job) {
    const size_t m = static_cast<size_t>(job.key.first);
    const Clock::time_point start = Clock::now();
    job.output = model.forward(job.key.second, job.input, (*batches)[m], options.dtype, grad_scale,
                               *job.ctx);
    job.seconds = seconds_since(start);
  }

  void forward_end(ForwardJob& job) {
    timing.forward_seconds += job.seconds;
    timing.forward_samples.push_back(job.seconds);
    if (options.after_compute) options.after_compute();
    if (job.stage == schedule.stages - 1) {
      loss_sum += job.ctx->loss;
      return;
    }
    const Place& next = schedule.place(job.key.first, job.stage + 1);
    if (next.rank == rank) {
      inputs[{job.key.first, next.chunk}] = job.output;
    } else {
      outputs[job.key] = job.output;
    }
  }

  void forward(const Key& key) {
    ForwardJob job = forward_begin(key);
    forward_compute(job);
    forward_end(job);
  }

  // The whole backward, or with `deferred` its input-gradient part: the weight-gradient GEMMs
  // wait in weight_gradients[key] for the BackwardWeight action.
  BackwardJob backward_begin(const Key& key, bool deferred) {
    BackwardJob job;
    job.key = key;
    job.stage = stage(key);
    job.deferred = deferred;
    job.doutput =
        job.stage < schedule.stages - 1 ? take(doutputs, key, "output gradient") : Tensor();
    auto it = contexts.find(key);
    OCTET_CHECK(it != contexts.end(), "backward before its forward");
    job.ctx = it->second.get();
    if (deferred) {
      OCTET_CHECK(!weight_gradients.count(key), "a second BackwardInput");
      job.queue = &weight_gradients[key];
    }
    return job;
  }

  void backward_compute(BackwardJob& job) {
    const Clock::time_point start = Clock::now();
    if (job.queue) {
      defer_weight_gradients scope(*job.queue);
      job.dinput = model.backward(job.key.second, job.doutput, *job.ctx);
    } else {
      job.dinput = model.backward(job.key.second, job.doutput, *job.ctx);
    }
    job.seconds = seconds_since(start);
  }

  void backward_end(BackwardJob& job) {
    timing.backward_seconds += job.seconds;
    (job.deferred ? timing.backward_input_samples : timing.backward_samples).push_back(job.seconds);
    if (options.after_compute) options.after_compute();
    contexts.erase(job.key);
    if (!job.deferred) weight_gradients_done(job.key.second);
    if (job.stage == 0) return;
    const Place& previous = schedule.place(job.key.first, job.stage - 1);
    if (previous.rank == rank) {
      doutputs[{job.key.first, previous.chunk}] = job.dinput;
    } else {
      dinputs[job.key] = job.dinput;
    }
  }

  void backward(const Key& key, bool deferred = false) {
    BackwardJob job = backward_begin(key, deferred);
    backward_compute(job);
    backward_end(job);
  }

  // DualPipe's F&B pair: with options.overlap_forward_backward the backward runs on a second
  // thread (under this thread's FP8 / FP4 scopes) while this one runs the forward, so that
  // either one's communication waits while the other computes.
  void forward_backward(const Key& forward_key, const Key& backward_key) {
    ForwardJob f = forward_begin(forward_key);
    BackwardJob b = backward_begin(backward_key, false);
    if (options.overlap_forward_backward) {
      const Clock::time_point start = Clock::now();
      std::exception_ptr failed;
      WeightGradientQueue shared;  // the backward's sums into tensors the forward adds to
      const bool fp8 = fp8_enabled(), fp4 = fp4_enabled(), stats = fp8_stats_enabled();
      const recipe::Recipe fp8_scope_recipe = fp8_recipe();
      const Fp4Options fp4_scope_options = fp4_options();
      // The dispatcher's exposed time counts waits while no thread computes: the worker
      // computes from here to its end; this thread pauses while it joins.
      ExpertDispatcher::enter_compute();
      std::thread worker([&] {
        struct Leaves {
          ~Leaves() { ExpertDispatcher::leave_compute(); }
        } leaves;
        try {
          fp8_autocast fp8_scope(fp8, fp8_scope_recipe);
          fp4_autocast fp4_scope(fp4, fp4_scope_options);
          fp8_stats_scope stats_scope(stats);
          defer_shared_gradients shared_scope(shared);
          backward_compute(b);
        } catch (...) {
          failed = std::current_exception();
        }
      });
      auto join = [&worker] {
        ExpertDispatcher::leave_compute();
        worker.join();
        ExpertDispatcher::enter_compute();
      };
      try {
        forward_compute(f);
      } catch (...) {
        join();
        throw;
      }
      join();
      if (failed) std::rethrow_exception(failed);
      shared.run();  // after the forward's sums, as the pair run in order makes them
      timing.overlapped_pair_seconds += seconds_since(start);
      timing.overlapped_pair_compute_seconds += f.seconds + b.seconds;
    } else {
      forward_compute(f);
      backward_compute(b);
    }
    forward_end(f);
    backward_end(b);
  }

  void backward_weight(const Key& key) {
    auto it = weight_gradients.find(key);
    OCTET_CHECK(it != weight_gradients.end(), "BackwardWeight before its BackwardInput");
    const Clock::time_point start = Clock::now();
    it->second.run();
    const double seconds = seconds_since(start);
    timing.weight_seconds += seconds;
    timing.weight_samples.push_back(seconds);
    weight_gradients.erase(it);
    weight_gradients_done(key.second);
  }

  // A chunk's gradients are final after its last weight gradient of the step.
  void weight_gradients_done(int chunk) {
    if (--backwards_left[static_cast<size_t>(chunk)] == 0 && options.chunk_gradients_final &&
        !copies) {
      options.chunk_gradients_final(chunk);
    }
  }

  void receive(const Action& action, std::map<Key, Tensor>& into, bool backward) {
    const Key key{action.micro_batch, action.chunk};
    const int s = stage(key);
    Tensor buffer = activation_buffer(action.micro_batch, backward ? s + 1 : s);
    const Clock::time_point start = Clock::now();
    Work work = parallel.pipeline().irecv(buffer, action.peer,
                                          tag(action.micro_batch, backward ? s : s - 1, backward));
    try {
      work.wait(receive_timeout(options));
    } catch (...) {
      abandoned.push_back(buffer);  // MPI may still write into it
      timing.wait_seconds += seconds_since(start);
      throw;
    }
    timing.wait_seconds += seconds_since(start);
    into[key] = buffer;
  }

  void send(const Action& action, std::map<Key, Tensor>& from, bool backward) {
    const Key key{action.micro_batch, action.chunk};
    const int s = stage(key);
    Tensor tensor = take(from, key, backward ? "input gradient to send" : "activation to send");
    Work work = parallel.pipeline().isend(tensor, action.peer,
                                          tag(action.micro_batch, backward ? s - 1 : s, backward));
    sends.emplace_back(std::move(work), std::move(tensor));
  }

  void run(const Action& action) {
    const Key key{action.micro_batch, action.chunk};
    switch (action.kind) {
      case ActionKind::Forward:
        forward(key);
        break;
      case ActionKind::Backward:
        backward(key);
        break;
      case ActionKind::BackwardInput:
        backward(key, /*deferred=*/true);
        break;
      case ActionKind::BackwardWeight:
        backward_weight(key);
        break;
      case ActionKind::ForwardBackward:
        forward_backward(key, {action.backward_micro_batch, action.backward_chunk});
        break;
      case ActionKind::SendForward:
        send(action, outputs, false);
        break;
      case ActionKind::RecvForward:
        receive(action, inputs, false);
        break;
      case ActionKind::SendBackward:
        send(action, dinputs, true);
        break;
      case ActionKind::RecvBackward:
        receive(action, doutputs, true);
        break;
    }
  }

  void reduce_gradients() {
    if (copies) {
      // Both ranks of a pair hold the same stages (r and ranks-1-r), listed in stage order.
      for (Parameter* p : model.parameters()) copies->all_reduce(p->grad);
    }
    for (const TiedGroup& group : tied_groups) {
      if (!group.comm) continue;
      for (Parameter* p : group.copies) group.comm->all_reduce(p->grad);
    }
  }
};

PipelineExecutor::PipelineExecutor(Schedule schedule, StagedModel& model, ParallelState& parallel,
                                   ExecutorOptions options)
    : state_(std::make_unique<State>(std::move(schedule), model, parallel, options)) {
  State& s = *state_;
  const Schedule& sc = s.schedule;
  s.rank = parallel.pipeline().rank();
  OCTET_CHECK(sc.ranks == parallel.pipeline().size(), "pipeline executor: ", schedule_name(sc.kind),
              " schedule for ", sc.ranks, " ranks, pipeline group has ",
              parallel.pipeline().size());
  if (options.check) check_schedule(sc);
  const std::vector<int> stages = stages_of_rank(sc, s.rank);
  bool matches = model.stages() == sc.stages && model.chunks() == sc.chunks_per_rank;
  for (int c = 0; matches && c < model.chunks(); ++c) {
    matches = model.stage_of_chunk(c) == stages[static_cast<size_t>(c)];
  }
  OCTET_CHECK(matches, "pipeline executor: rank ", s.rank, " of ", schedule_name(sc.kind),
              " expects a model of ", sc.stages, " stages holding stages_of_rank() per chunk");
  s.backwards_per_chunk.assign(static_cast<size_t>(sc.chunks_per_rank), 0);
  for (int m = 0; m < sc.micro_batches; ++m) {
    for (int c = 0; c < sc.chunks_per_rank; ++c) {
      if (sc.stage_of(m, s.rank, c) >= 0) ++s.backwards_per_chunk[static_cast<size_t>(c)];
    }
  }
  if (sc.model_copies == 2) {
    const int pair = std::min(s.rank, sc.ranks - 1 - s.rank);
    s.copies = parallel.pipeline().split(pair, s.rank, "pipeline-copies");
    // Each pair sums all of its gradients: ties must stay within the stages a pair holds, as the
    // first and the last stage's do.
    for (const TiedParameters& group : model.tied_parameters()) {
      for (int stage : group.stages) {
        OCTET_CHECK(stage == 0 || stage == sc.stages - 1,
                    "pipeline executor: DualPipe sums tied parameters between the first and the "
                    "last stage only; the model ties stages ",
                    describe_stages(group.stages));
      }
    }
  } else {
    // Every rank lists every group in the same order (pipeline_stage.h), so each group's split
    // of the pipeline group is one collective call on all of its ranks.
    for (const TiedParameters& group : model.tied_parameters()) {
      std::vector<int> ranks;
      for (int stage : group.stages) {
        OCTET_CHECK(stage >= 0 && stage < sc.stages, "pipeline executor: tied parameters on stage ",
                    stage, " of ", sc.stages, " (the model ties stages ",
                    describe_stages(group.stages), ")");
        ranks.push_back(sc.place(0, stage).rank);
      }
      std::sort(ranks.begin(), ranks.end());
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      if (ranks.size() < 2) continue;  // every copy on one rank: one parameter
      const bool holds = std::find(ranks.begin(), ranks.end(), s.rank) != ranks.end();
      OCTET_CHECK(holds == !group.parameters.empty(), "pipeline executor: rank ", s.rank,
                  (holds ? " holds stages of" : " holds none of"), " the tied stages ",
                  describe_stages(group.stages), " but ", group.parameters.size(),
                  " copies of their parameters");
      State::TiedGroup tied;
      std::shared_ptr<Communicator> comm = parallel.pipeline().split(holds ? 0 : 1, s.rank, "tied");
      if (holds) tied.comm = std::move(comm);
      tied.copies = group.parameters;
      tied.owner = ranks.front();
      s.tied_groups.push_back(std::move(tied));
    }
  }
}

PipelineExecutor::~PipelineExecutor() = default;

const Schedule& PipelineExecutor::schedule() const {
  return state_->schedule;
}

const StepTiming& PipelineExecutor::last_step_timing() const {
  return state_->timing;
}

std::vector<Parameter*> PipelineExecutor::owned_parameters() {
  State& s = *state_;
  if (s.copies && 2 * s.rank >= s.schedule.ranks) return {};
  std::vector<Parameter*> owned;
  // A tied copy counts on its group's lowest rank only.
  std::vector<Parameter*> others;
  for (const State::TiedGroup& group : s.tied_groups) {
    if (group.owner != s.rank)
      others.insert(others.end(), group.copies.begin(), group.copies.end());
  }
  for (Parameter* p : s.model.parameters()) {
    if (std::find(others.begin(), others.end(), p) == others.end()) owned.push_back(p);
  }
  return owned;
}

float PipelineExecutor::train_step(const std::vector<MicroBatch>& batches, float grad_scale) {
  State& s = *state_;
  const Clock::time_point step_start = Clock::now();
  s.timing = StepTiming{};
  const size_t micro_batches = static_cast<size_t>(s.schedule.micro_batches);
  OCTET_CHECK(batches.size() == micro_batches, "pipeline executor: expected ", micro_batches,
              " micro-batches, got ", batches.size());
  // A step that failed part-way leaves its bookkeeping behind: start clean.
  s.contexts.clear();
  s.inputs.clear();
  s.outputs.clear();
  s.doutputs.clear();
  s.dinputs.clear();
  s.weight_gradients.clear();
  s.backwards_left = s.backwards_per_chunk;
  s.batches = &batches;
  s.grad_scale = grad_scale;
  s.loss_sum = 0.0;
  const std::vector<Action>& actions = s.schedule.actions[static_cast<size_t>(s.rank)];
  for (size_t i = 0; i < actions.size(); ++i) {
    try {
      s.run(actions[i]);
    } catch (const Error& e) {
      fail(detail::concat("pipeline executor (", schedule_name(s.schedule.kind), "), rank ", s.rank,
                          ", action ", i, " ", describe(actions[i]), ": ", e.what()));
    }
  }
  const Clock::time_point sends_start = Clock::now();
  for (auto& [work, tensor] : s.sends) work.wait(receive_timeout(s.options));
  s.sends.clear();
  s.timing.wait_seconds += seconds_since(sends_start);
  s.timing.schedule_seconds = seconds_since(step_start);
  OCTET_CHECK(s.contexts.empty() && s.inputs.empty() && s.outputs.empty() && s.doutputs.empty() &&
                  s.dinputs.empty() && s.weight_gradients.empty(),
              "pipeline executor: rank ", s.rank, " ends the step with ", s.contexts.size(),
              " forwards without backward, ", s.weight_gradients.size(),
              " input gradients without their weight gradients and ",
              s.inputs.size() + s.outputs.size() + s.doutputs.size() + s.dinputs.size(),
              " tensors never used");
  const Clock::time_point reduce_start = Clock::now();
  s.reduce_gradients();
  const double loss = s.parallel.pipeline().all_reduce(s.loss_sum, ReduceOp::Sum);
  s.timing.reduce_seconds = seconds_since(reduce_start);
  s.timing.step_seconds = seconds_since(step_start);
  return static_cast<float>(loss / static_cast<double>(micro_batches));
}

double PipelineExecutor::evaluate(const std::vector<MicroBatch>& batches) {
  State& s = *state_;
  const std::vector<Place>& route = s.schedule.routes.at(0);
  const int stages = s.schedule.stages;
  Communicator& pipeline = s.parallel.pipeline();
  double loss_sum = 0.0;
  for (size_t m = 0; m < batches.size(); ++m) {
    Tensor activation;
    for (int stage = 0; stage < stages; ++stage) {
      const Place& here = route[static_cast<size_t>(stage)];
      const int from = stage > 0 ? route[static_cast<size_t>(stage - 1)].rank : here.rank;
      // Tags of training's micro-batch 0 boundaries: evaluation never overlaps a step.
      const int tag = s.tag(0, std::max(stage - 1, 0), false);
      if (here.rank != s.rank) {
        if (from == s.rank) {
          pipeline.isend(activation, here.rank, tag).wait(receive_timeout(s.options));
        }
        activation = Tensor();
        continue;
      }
      if (from != s.rank) {
        activation = Tensor::empty(s.model.boundary_shape(batches[m], stage), s.options.dtype);
        Work work = pipeline.irecv(activation, from, tag);
        try {
          work.wait(receive_timeout(s.options));
        } catch (...) {
          s.abandoned.push_back(activation);  // MPI may still write into it
          throw;
        }
      }
      float loss = 0.0f;
      activation = s.model.evaluate(here.chunk, activation, batches[m], s.options.dtype, &loss);
      if (s.options.after_compute) s.options.after_compute();
      if (stage == stages - 1) loss_sum += loss;
    }
  }
  return pipeline.all_reduce(loss_sum, ReduceOp::Sum);
}

}  // namespace octet::pipeline
