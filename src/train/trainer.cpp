// The training loop over a TrainingRun (training_run.h): per step, this rank's micro-batches
// (through the pipeline executor when the model is staged), the gradients finished across
// ranks, clipping and the optimizer, then metrics, validation, progress and checkpoints; at
// the end the summary and the loss curve. Any TrainableModel in any layout.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <optional>

#include "octet/gemm.h"
#include "octet/ops/elementwise.h"
#include "octet/ops/optimizer.h"
#include "octet/tensor_parallel.h"
#include "train/stop_signals.h"
#include "train/training_run.h"

namespace octet {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_duration(double seconds) {
  char text[32];
  int s = static_cast<int>(seconds + 0.5);
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%dh%02dm", s / 3600, (s / 60) % 60);
  } else if (s >= 60) {
    std::snprintf(text, sizeof text, "%dm%02ds", s / 60, s % 60);
  } else {
    std::snprintf(text, sizeof text, "%ds", s);
  }
  return text;
}

// Global-norm clipping with a norm computed across ranks (pipeline stages, tensor shards):
// scales every gradient by clip / (norm + 1e-6) when that is below 1, as AdamW does.
void clip_gradients(double norm, float clip, const std::vector<Parameter*>& parameters) {
  const double coefficient = clip / (norm + 1e-6);
  if (clip <= 0 || !std::isfinite(norm) || coefficient >= 1.0) return;
  std::vector<Tensor> grads;
  for (Parameter* p : parameters) grads.push_back(p->grad);
  ops::scale(grads, static_cast<float>(coefficient));
}

bool dump_this_step(const TrainOptions& o, int64_t step) {
  if (o.dump_grads.empty()) return false;
  return o.dump_steps.empty() ||
         std::find(o.dump_steps.begin(), o.dump_steps.end(), step) != o.dump_steps.end();
}

// --dump-grads: replaces each "before.NAME" of `tensors` by "update.NAME" = after - before.
TensorMap with_updates(TensorMap tensors, const TensorMap& after) {
  for (const auto& [name, value] : after) {
    auto before = tensors.extract("before." + name);
    OCTET_CHECK(!before.empty(), "--dump-grads: no value of '", name, "' before the step");
    Tensor update = value.clone();
    ops::add_scaled(before.mapped(), -1.0f, update);
    tensors["update." + name] = update;
  }
  return tensors;
}

}  // namespace

double measure_bf16_peak_gflops() {
  const int64_t n = 2048;
  Tensor a = Tensor::zeros({n, n}, DType::BF16), c = Tensor::empty({n, n}, DType::F32);
  PackedWeight b(Tensor::zeros({n, n}, DType::BF16), true);
  gemm(a, b, c, false);  // warm-up: primitive creation and packing
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto start = Clock::now();
    gemm(a, b, c, false);
    best = std::max(best, 2.0 * n * n * n / seconds_since(start) / 1e9);
  }
  return best;
}

TrainResult train_gpt(const TrainOptions& options) {
  return train_detail::TrainingRun(options).run();
}

namespace train_detail {

TrainResult TrainingRun::run() {
  const auto run_start = Clock::now();
  double busy_seconds = 0;
  std::optional<StopSignals> signals;
  if (o_.exit_signal_handler) signals.emplace();
  for (int64_t iteration = start_iteration_; iteration < o_.train_iters; ++iteration) {
    // Between steps: a signal on any rank stops every rank after the same step.
    if (signals && iteration > start_iteration_) {
      if (const int signal = agreed_stop_signal(signals->received())) {
        stop_early(iteration, signal);
        break;
      }
    }
    const auto step_start = Clock::now();
    const float lr = LrSchedule{o_.lr, o_.min_lr, o_.lr_warmup_iters, o_.train_iters}.at(iteration);
    if (ddp_) {
      ddp_->zero_grad();
      for (Parameter* p : frozen_) p->grad.zero_();  // outside the buckets
    } else {
      model_->zero_grad();
    }
    double loss = run_micro_batches(iteration);
    finish_gradients();
    // Equal on every rank (summed over the data ranks, each pipeline rank holds the sum over
    // stages), so every rank takes the same branch below.
    loss = parallel_->data().all_reduce(loss, ReduceOp::Sum) /
           static_cast<double>(accumulation_ * dp_);
    if (o_.after_gradients) o_.after_gradients(iteration + 1, model_->parameters());
    const bool dumping = dump_this_step(o_, iteration + 1);
    TensorMap dumped_gradients;
    if (dumping) dumped_gradients = whole_gradients();  // before clipping and the update
    // The step's last micro-batch, per quantized tensor. Under TP: tensor rank 0's shards
    // (rank 0 writes the metrics); under PP every stage's, gathered over the pipeline ranks.
    nlohmann::json fp8_stats = o_.fp8_stats ? take_fp8_stats(fp8_part_) : nlohmann::json();
    if (o_.fp8_stats && executor_) fp8_stats = gather_fp8_stats(fp8_stats, parallel_->pipeline());
    // A non-finite loss skips the update at once; a non-finite gradient norm makes the
    // optimizer skip it (the norm is reduced over the model group: equal on every rank).
    const double grad_norm = std::isfinite(loss) ? optimizer_step(lr) : NAN;
    const bool finite = std::isfinite(loss) && std::isfinite(grad_norm);
    if (!finite) skip_nonfinite_step(iteration + 1, loss, grad_norm);  // or stop the run
    if (dumping) dump(iteration + 1, std::move(dumped_gradients));
    const nlohmann::json moe = balance_experts(finite);
    const double step_seconds = seconds_since(step_start);
    busy_seconds += step_seconds;
    nlohmann::json record = record_step(iteration, loss, lr, grad_norm, step_seconds);
    if (!moe.is_null()) {
      record["moe"] = moe;
      remember_balance(moe);
    }
    if (o_.skip_nonfinite_steps) record["skipped_steps"] = result_.skipped_steps;
    if (o_.fp8_stats) {
      record["fp8"] = fp8_stats;
      fp8_summary_.add(fp8_stats);
    }
    const bool last = iteration + 1 == o_.train_iters;
    if (valid_batches_ && o_.eval_iters > 0 &&
        (last || (o_.eval_interval > 0 && (iteration + 1) % o_.eval_interval == 0))) {
      result_.last_val_loss = evaluate();
      record["val_loss"] = result_.last_val_loss;
      if (family_->classifies()) {
        result_.last_val_accuracy = last_val_accuracy_;
        record["val_accuracy"] = last_val_accuracy_;
        accuracy_curve_.push_back({static_cast<double>(iteration + 1), 100.0 * last_val_accuracy_});
      }
      valid_curve_.push_back({static_cast<double>(iteration + 1), result_.last_val_loss});
    }
    if (chief_) metrics_->write(record);
    print_progress(iteration, record, busy_seconds);
    if (!o_.save.empty() &&
        (last || (o_.save_interval > 0 && (iteration + 1) % o_.save_interval == 0))) {
      save(iteration + 1);
    }
    result_.iterations = iteration + 1;
  }
  const int64_t trained = result_.iterations - start_iteration_;
  if (trained > 0) {
    result_.tokens_per_second = trained * tokens_per_iteration_ / busy_seconds;
    result_.mfu = flops_per_token_ * result_.tokens_per_second /
                  (peak_gflops_ * 1e9 * parallel_->world_size());
  }
  result_.world_size = parallel_->world_size();
  finish(seconds_since(run_start));
  return result_;
}

// This rank's micro-batches of the step: through the pipeline schedule at once, or one by
// one through the whole model. Returns the sum of their mean losses.
double TrainingRun::run_micro_batches(int64_t iteration) {
  const float grad_scale = 1.0f / static_cast<float>(accumulation_ * dp_);
  auto batch = [&](int64_t micro) {
    return context_parallel_split(
        train_batches_->batch(iteration * micro_batches_per_step_ + micro * samples_ + sample_rank_,
                              o_.micro_batch_size),
        parallel_->context());
  };
  // Training micro-batches only: evaluation's forwards would overwrite the stats.
  fp8_stats_scope stats_scope(o_.fp8_stats);
  if (executor_) {
    std::vector<pipeline::MicroBatch> batches;
    for (int64_t micro = 0; micro < accumulation_; ++micro) batches.push_back(batch(micro));
    fp8_autocast scope(fp8_, recipe_);
    fp4_autocast fp4_scope(fp4_, fp4_options_);
    return executor_->train_step(batches, grad_scale) * static_cast<double>(accumulation_);
  }
  double loss = 0;
  for (int64_t micro = 0; micro < accumulation_; ++micro) {
    // Gradients start reducing in the last micro-batch's backward.
    last_micro_batch_ = micro + 1 == accumulation_;
    if (ddp_) ddp_->set_sync(last_micro_batch_);
    fp8_autocast scope(fp8_, recipe_);
    fp4_autocast fp4_scope(fp4_, fp4_options_);
    loss += model_->train_step(batch(micro), dtype_, grad_scale);
    if (delayed_scaling_) reduce_fp8_amax(fp8_part_, parallel_->tensor_and_data());
  }
  return loss;
}

void TrainingRun::finish_gradients() {
  if (!overlap_) {
    // Sequence-parallel replicated parameters saw only this rank's tokens: summed over the
    // tensor ranks before the data-parallel reduction (ZeRO-1 keeps only a shard after it).
    // With overlap they were summed as their backward finished.
    all_reduce_sequence_parallel_gradients(model_->sequence_parallel_parameters(),
                                           parallel_->tensor());
  }
  if (ddp_) ddp_->finish_grad_sync();
}

// The name of this rank's first parameter whose gradient holds a NaN or an infinity.
std::string TrainingRun::first_nonfinite_gradient() const {
  for (Parameter* p : model_->parameters()) {
    if (has_nonfinite(p->grad)) return p->name;
  }
  return "";
}

void TrainingRun::skip_nonfinite_step(int64_t step, double loss, double grad_norm) {
  const std::string bad = first_nonfinite_gradient();
  const std::string what = detail::concat(
      "step ", step, ": ",
      std::isfinite(loss) ? detail::concat("gradient norm ", grad_norm)
                          : detail::concat("loss ", loss),
      bad.empty()
          ? std::string(", every gradient on rank ") + std::to_string(parallel_->rank()) + " finite"
          : detail::concat(", first non-finite gradient '", bad, "' (rank ", parallel_->rank(),
                           ")"));
  if (!o_.skip_nonfinite_steps) {
    fail("non-finite " + what +
         ". Stopped before the update: the parameters and the last checkpoint are intact "
         "(--skip-nonfinite-steps skips such steps; or try a lower --lr, --clip-grad, "
         "--precision bf16)");
  }
  ++result_.skipped_steps;
  if (!quiet_)
    std::printf("skipped %s: no update (%lld skipped so far)\n", what.c_str(),
                (long long)result_.skipped_steps);
}

// Clipping and the update; returns the gradient norm before clipping.
double TrainingRun::optimizer_step(float lr) {
  double grad_norm = 0;
  if (zero_) {
    grad_norm = zero_->step(lr);
  } else if (parallel_->model().size() == 1 && !experts_split_) {
    grad_norm = adamw_->step(lr);  // the whole model here: AdamW clips
  } else {
    // Over the model group, each model parameter counted once.
    std::vector<Parameter*> counted =
        model_->counted_in_norm(executor_ ? executor_->owned_parameters() : model_->parameters());
    // Frozen parameters (--freeze) are not counted.
    counted.erase(std::remove_if(counted.begin(), counted.end(),
                                 [&](Parameter* p) {
                                   return std::find(trained_.begin(), trained_.end(), p) ==
                                          trained_.end();
                                 }),
                  counted.end());
    if (experts_split_) {
      // Expert parallelism: the expert ranks hold different experts, summed over them too.
      std::vector<Parameter*> shared, experts;
      for (Parameter* p : counted) (p->shard.expert ? experts : shared).push_back(p);
      const double rest = grad_norm_over(shared, parallel_->model());
      const double held = grad_norm_over(experts, parallel_->model());
      grad_norm =
          std::sqrt(rest * rest + parallel_->expert().all_reduce(held * held, ReduceOp::Sum));
    } else {
      grad_norm = grad_norm_over(counted, parallel_->model());
    }
    clip_gradients(grad_norm, o_.clip_grad, trained_);
    if (std::isfinite(grad_norm)) adamw_->step(lr);
  }
  model_->on_parameters_updated();
  return grad_norm;
}

float TrainingRun::evaluate() {
  // Data-parallel ranks split the batches; under FP8 every rank runs them all, so the amaxes
  // these forwards record (and the scales they lead to) stay equal across ranks.
  // Under expert parallelism too: the ranks exchange tokens in every forward.
  const bool every_rank = fp8_ || experts_split_;
  // Under context parallelism the CP ranks of a sample run its batches (each its chunks).
  const int64_t first = every_rank ? 0 : sample_rank_, stride = every_rank ? 1 : samples_;
  double sum = 0;
  for (int64_t k = first; k < o_.eval_iters; k += stride) {
    const pipeline::MicroBatch batch =
        context_parallel_split(valid_batches_->batch(k, o_.micro_batch_size), parallel_->context());
    fp8_autocast scope(fp8_, recipe_);
    fp4_autocast fp4_scope(fp4_, fp4_options_);
    if (executor_) {
      // Through the pipeline stages, forward only (the executor's after_compute keeps the
      // FP8 amaxes equal over each stage's tensor x data ranks).
      sum += executor_->evaluate({batch});
    } else {
      sum += model_->evaluate(batch, dtype_);
      // Tensor shards' weight amaxes differ: reduce so the tensor ranks keep equal scales.
      if (delayed_scaling_) reduce_fp8_amax(fp8_part_, parallel_->tensor());
    }
  }
  // Each CP rank's losses are the means over its chunks: averaged over the CP ranks.
  if (!every_rank) {
    sum = parallel_->data().all_reduce(sum, ReduceOp::Sum) / static_cast<double>(cp_);
  } else if (cp_ > 1) {
    sum = parallel_->context().all_reduce(sum, ReduceOp::Sum) / static_cast<double>(cp_);
  }
  if (family_->classifies()) {
    // Counted where the head ran (the last stage, tensor rank 0); under FP8 every data rank
    // ran every batch, so data rank 0's counts are the whole.
    auto [correct, seen] = model_->take_eval_counts();
    const bool counts = !every_rank || parallel_->data_rank() == 0;
    const double total_correct =
        parallel_->world().all_reduce(counts ? static_cast<double>(correct) : 0.0, ReduceOp::Sum);
    const double total_seen =
        parallel_->world().all_reduce(counts ? static_cast<double>(seen) : 0.0, ReduceOp::Sum);
    last_val_accuracy_ = total_seen > 0 ? static_cast<float>(total_correct / total_seen) : NAN;
  }
  return static_cast<float>(sum / static_cast<double>(o_.eval_iters));
}

int64_t TrainingRun::optimizer_steps() const {
  return zero_ ? zero_->steps() : adamw_->steps();
}

nlohmann::json TrainingRun::trainer_state(int64_t iteration) const {
  return {{"iteration", iteration},
          {"optimizer_steps", optimizer_steps()},
          {"config", family_->config_json()},
          {"seed", o_.seed},
          {"precision", o_.precision}};
}

int TrainingRun::agreed_stop_signal(int received) {
  if (parallel_->world_size() == 1) return received;
  return static_cast<int>(
      parallel_->world().all_reduce(static_cast<double>(received), ReduceOp::Max));
}

// After `steps` steps: a checkpoint of them (unless the last save was of them), then the loop
// ends and the summary follows.
void TrainingRun::stop_early(int64_t steps, int signal) {
  result_.stop_signal = signal;
  const char* name = signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "a signal";
  if (!o_.save.empty() && saved_iteration_ != steps) save(steps);
  if (quiet_) return;
  if (o_.save.empty()) {
    std::printf("%s: stopped after step %lld of %lld (no --save: nothing kept)\n", name,
                (long long)steps, (long long)o_.train_iters);
  } else {
    std::printf("%s: stopped after step %lld of %lld; checkpoint in %s (resume with --load %s)\n",
                name, (long long)steps, (long long)o_.train_iters, o_.save.c_str(),
                o_.save.c_str());
  }
  std::fflush(stdout);
}

void TrainingRun::save(int64_t iteration) {
  // Whole-model tensors under the checkpoint's names (tensor shards and ZeRO's shards
  // gathered: collective), so it loads at any layout. Each pipeline stage writes its own part.
  Checkpoint checkpoint;
  checkpoint.optimizer =
      gather_optimizer_state(*model_, trained_, zero_ ? zero_->state() : adamw_->state());
  checkpoint.model = model_->to_checkpoint_names(model_->state_dict());
  save_fp8_states(checkpoint.optimizer);
  keep_own_experts(checkpoint);
  checkpoint.trainer = trainer_state(iteration);
  if (!o_.vocab_dir.empty()) {
    for (const char* file : {"encoder.json", "vocab.bpe"})
      checkpoint.files.emplace_back(std::string("tokenizer/") + file, o_.vocab_dir + "/" + file);
  }
  // Never a non-finite model over a good checkpoint: every rank checks its part and all
  // agree before anything is written.
  std::string bad = first_nonfinite(checkpoint.model);
  if (bad.empty()) bad = first_nonfinite(checkpoint.optimizer);
  const double any_bad = parallel_->world().all_reduce(bad.empty() ? 0.0 : 1.0, ReduceOp::Max);
  OCTET_CHECK(any_bad == 0, "not saving the checkpoint of iteration ", iteration, " to '", o_.save,
              "': ", bad.empty() ? std::string("another rank's tensors") : "'" + bad + "'",
              " hold NaN or infinite values; the previous checkpoint there is kept");
  if (pipelined_ || experts_split_) {
    save_checkpoint_sharded(o_.save, checkpoint, *parallel_);
  } else if (chief_) {
    save_checkpoint(o_.save, checkpoint);
  }
  saved_iteration_ = iteration;
}

// The FP8 states (amax histories, scales) into `out`. Under expert parallelism a rank's
// experts hold other GEMMs than one process's: their states are not kept (delayed scaling,
// whose histories matter, is refused with EP; the other recipes scale from the current
// tensors).
void TrainingRun::save_fp8_states(TensorMap& out) const {
  if (experts_split_) return;
  for (size_t i = 0; i < fp8_part_.size(); ++i) {
    fp8_part_[i]->save_state(out, "fp8." + std::to_string(fp8_index_[i]) + ".");
  }
}

// --dump-grads: whole-model tensors under their names whatever the layout, so two layouts'
// dumps compare tensor by tensor (tests/distributed/train_layouts.sh).
TensorMap TrainingRun::whole_parameters() {
  // Tensor shards gathered (collective over the tensor group), copied: the step changes them.
  TensorMap out = model_->state_dict();
  for (auto& [name, tensor] : out) tensor = tensor.clone();
  return out;
}

// Before the step: the summed, unclipped gradients ("grad.NAME") and the parameters.
TensorMap TrainingRun::whole_gradients() {
  if (ddp_) ddp_->gather_grad_shards();  // ZeRO-1 keeps only its reduced shard (collective)
  TensorMap out;
  for (Parameter* p : model_->parameters()) {
    // Copied, since clipping scales the gradients in place.
    out["grad." + p->name] = model_->gather(*p, p->grad).clone();
  }
  for (auto& [name, value] : whole_parameters()) out["before." + name] = value;
  return out;
}

// After it: the parameters, each one's update ("update.NAME" = after - before) and the FP8
// states, one file per pipeline stage (its tensor and data rank 0 write it) in every layout.
void TrainingRun::dump(int64_t step, TensorMap tensors) {
  Checkpoint part;
  part.model = whole_parameters();
  part.optimizer = with_updates(std::move(tensors), part.model);
  save_fp8_states(part.optimizer);
  keep_own_experts(part);
  part.trainer = {
      {"iteration", step}, {"config", family_->config_json()}, {"precision", o_.precision}};
  save_checkpoint_sharded(o_.dump_grads + "/step-" + std::to_string(step), part, *parallel_);
}

nlohmann::json TrainingRun::record_step(int64_t iteration, double loss, float lr, double grad_norm,
                                        double step_seconds) {
  const double tokens_per_second = tokens_per_iteration_ / step_seconds;
  const double mfu =
      flops_per_token_ * tokens_per_second / (peak_gflops_ * 1e9 * parallel_->world_size());
  result_.losses.push_back(static_cast<float>(loss));
  result_.last_loss = static_cast<float>(loss);
  if (std::isfinite(loss)) train_curve_.push_back({static_cast<double>(iteration + 1), loss});
  nlohmann::json record = {{"step", iteration + 1},
                           {"loss", loss},
                           {"lr", lr},
                           {"grad_norm", grad_norm},
                           {"tokens_per_s", tokens_per_second},
                           {"mfu", mfu}};
  if (ddp_) {
    const CommStats grads = ddp_->take_stats();
    record["grad_comm_s"] = grads.total_seconds;
    record["grad_comm_exposed_s"] = grads.exposed_seconds;
    result_.grad_comm_seconds += grads.total_seconds;
    result_.grad_exposed_seconds += grads.exposed_seconds;
  }
  if (experts_split_) record_exchange_stats(record);
  if (zero_) {
    const CommStats gathers = zero_->take_stats();
    record["param_gather_s"] = gathers.total_seconds;
    result_.param_gather_seconds += gathers.total_seconds;
  }
  return record;
}

void TrainingRun::print_progress(int64_t iteration, const nlohmann::json& record,
                                 double busy_seconds) const {
  const bool last = iteration + 1 == o_.train_iters;
  const int64_t done = iteration + 1 - start_iteration_;
  if (quiet_ ||
      !(last || done == 1 || (o_.log_interval > 0 && (iteration + 1) % o_.log_interval == 0))) {
    return;
  }
  const double eta = busy_seconds / done * static_cast<double>(o_.train_iters - iteration - 1);
  std::printf(
      "iter %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.1f%% | ETA %s",
      (long long)(iteration + 1), (long long)o_.train_iters, record["loss"].get<double>(),
      record["lr"].get<double>(), record["grad_norm"].get<double>(),
      record["tokens_per_s"].get<double>(), 100 * record["mfu"].get<double>(),
      format_duration(eta).c_str());
  if (record.contains("moe")) {
    std::printf(" | experts max/mean %.2f", record["moe"]["load_max_over_mean"].get<double>());
    if (record["moe"]["aux_loss"].get<double>() > 0)
      std::printf(" aux %.4f", record["moe"]["aux_loss"].get<double>());
    if (record["moe"]["dropped"].get<double>() > 0)
      std::printf(" dropped %.1f%%", 100 * record["moe"]["dropped"].get<double>());
  }
  if (record.contains("val_loss")) std::printf(" | val loss %.4f", result_.last_val_loss);
  if (record.contains("val_accuracy"))
    std::printf(" | val %s %.2f%%", family_->accuracy_name().c_str(), 100 * last_val_accuracy_);
  std::printf("\n");
  std::fflush(stdout);
}

void TrainingRun::finish(double run_seconds) {
  if (!o_.plot.empty() && chief_) {
    std::vector<std::pair<std::string, std::vector<CurvePoint>>> series = {{"train", train_curve_}};
    if (!valid_curve_.empty()) series.emplace_back("validation", valid_curve_);
    if (std::isfinite(entropy_) && !train_curve_.empty()) {
      series.emplace_back(family_->baseline_name(),
                          std::vector<CurvePoint>{{train_curve_.front().x, entropy_},
                                                  {train_curve_.back().x, entropy_}});
    }
    write_loss_svg(o_.plot, family_->name() + " loss (" + o_.precision + ")", series);
    if (!accuracy_curve_.empty()) {
      // Beside the loss curve: PLOT's name with -accuracy before its extension.
      const size_t dot = o_.plot.rfind('.');
      const size_t slash = o_.plot.rfind('/');
      const bool has_extension =
          dot != std::string::npos && (slash == std::string::npos || dot > slash);
      const std::string path = has_extension
                                   ? o_.plot.substr(0, dot) + "-accuracy" + o_.plot.substr(dot)
                                   : o_.plot + "-accuracy.svg";
      write_loss_svg(path,
                     family_->name() + " validation " + family_->accuracy_name() + ", % (" +
                         o_.precision + ")",
                     {{"validation " + family_->accuracy_name(), accuracy_curve_}});
    }
  }
  if (!quiet_) {
    const int64_t trained = result_.iterations - start_iteration_;
    std::printf("done: %lld iterations in %s, %.0f tok/s, MFU %.1f%%, final loss %.4f",
                (long long)trained, format_duration(run_seconds).c_str(), result_.tokens_per_second,
                100 * result_.mfu, result_.last_loss);
    if (std::isfinite(result_.last_val_loss)) std::printf(", val loss %.4f", result_.last_val_loss);
    if (std::isfinite(result_.last_val_accuracy)) {
      std::printf(", val %s %.2f%%", family_->accuracy_name().c_str(),
                  100 * result_.last_val_accuracy);
    } else if (std::isfinite(result_.last_val_loss) && std::isfinite(entropy_)) {
      const double gap = entropy_ - result_.last_val_loss;
      std::printf(" (%.3f nats %s the unigram entropy %.3f)", std::fabs(gap),
                  gap >= 0 ? "below" : "above", entropy_);
    }
    std::printf("\n");
    if (ddp_) {
      std::printf(
          "data-parallel gradient reduction: %.2f s in flight, %.2f s exposed (%.0f%% hidden "
          "behind backward)%s\n",
          result_.grad_comm_seconds, result_.grad_exposed_seconds,
          100.0 * (result_.grad_comm_seconds > 0
                       ? 1.0 - result_.grad_exposed_seconds / result_.grad_comm_seconds
                       : 1.0),
          zero_ ? detail::concat("; parameter all-gathers ", result_.param_gather_seconds, " s")
                      .c_str()
                : "");
    }
    print_experts_summary();
    if (!fp8_summary_.empty()) {
      std::printf("%s tensors over %lld steps (underflow: mean, saturated: max):\n%s",
                  fp4_ ? "FP4" : "FP8", (long long)trained, fp8_summary_.table().c_str());
    }
  }
  // With validation asked for (--eval-iters): every rank of the model takes part (its forwards are
  // collective under TP); the chief prints.
  if (!o_.quiet && !executor_ && valid_batches_ && o_.eval_iters > 0) {
    family_->report(*model_, *valid_batches_, dtype_, o_, chief_);
  }
}

}  // namespace train_detail

}  // namespace octet
