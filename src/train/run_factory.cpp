// The one factory of a training run: checks the options, splits the world into the layout's
// groups, builds this rank's part of the model (tensor shards and pipeline stages come from
// the model's own layout), the pipeline executor when there are stages, data parallelism and
// the optimizer, and restores a checkpoint. The only code that knows the layout.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <variant>

#include "octet/data.h"
#include "octet/files.h"
#include "octet/tensor_parallel.h"
#include "train/training_run.h"

namespace octet::train_detail {

namespace {

recipe::Recipe make_recipe(const TrainOptions& o) {
  OCTET_CHECK(o.fp8_format == "hybrid" || o.fp8_format == "e4m3",
              "--fp8-format expected hybrid or e4m3, got '", o.fp8_format, "'");
  recipe::Format format = o.fp8_format == "hybrid" ? recipe::Format::HYBRID : recipe::Format::E4M3;
  OCTET_CHECK(!o.fp8_dpa || o.fp8_recipe == "delayed",
              "--fp8-dpa (FP8 attention) needs --fp8-recipe delayed, got --fp8-recipe ",
              o.fp8_recipe);
  if (o.fp8_recipe == "delayed") {
    recipe::DelayedScaling r;
    r.fp8_format = format;
    r.amax_history_len = static_cast<int>(o.fp8_amax_history_len);
    r.fp8_dpa = o.fp8_dpa;
    return r;
  }
  if (o.fp8_recipe == "current") {
    recipe::Float8CurrentScaling r;
    r.fp8_format = format;
    return r;
  }
  if (o.fp8_recipe == "mxfp8") return recipe::MXFP8BlockScaling{};
  if (o.fp8_recipe == "block") return recipe::Float8BlockScaling{};
  fail(detail::concat("--fp8-recipe expected delayed, current, mxfp8 or block, got '", o.fp8_recipe,
                      "'"));
}

DType compute_dtype(const std::string& precision) {
  if (precision == "fp32") return DType::F32;
  if (precision == "bf16" || precision == "fp8" || precision == "fp4") return DType::BF16;
  fail(detail::concat("--precision expected fp32, bf16, fp8 or fp4, got '", precision, "'"));
}

// The parameters of `from` that `set` also holds, in from's order.
std::vector<Parameter*> among(const std::vector<Parameter*>& from,
                              const std::vector<Parameter*>& set) {
  std::vector<Parameter*> out;
  for (Parameter* p : from) {
    if (std::find(set.begin(), set.end(), p) != set.end()) out.push_back(p);
  }
  return out;
}

bool contains(const std::vector<Parameter*>& set, const Parameter* p) {
  return std::find(set.begin(), set.end(), p) != set.end();
}

}  // namespace

TrainingRun::TrainingRun(const TrainOptions& options) : o_(options) {
  family_ = ModelFamily::from_options(o_);
  check_options();
  // Without a launcher the world is this process alone, and MPI is never started.
  world_ = launcher_world_size() > 1 ? world_communicator() : self_communicator();
  parallel_ = std::make_unique<ParallelState>(
      world_, static_cast<int>(o_.tensor_model_parallel_size),
      static_cast<int>(o_.pipeline_model_parallel_size),
      static_cast<int>(o_.expert_model_parallel_size), static_cast<int>(o_.context_parallel_size));
  experts_split_ = parallel_->expert_size() > 1;
  pipelined_ = parallel_->pipeline_size() > 1;
  dp_ = parallel_->data_size();
  samples_ = parallel_->sample_size();
  sample_rank_ = parallel_->sample_rank();
  cp_ = parallel_->context_size();
  OCTET_CHECK(global_batch_ % (o_.micro_batch_size * samples_) == 0, "--global-batch-size (",
              global_batch_, ") must be a multiple of --micro-batch-size (", o_.micro_batch_size,
              ") x data-parallel size (", samples_, cp_ > 1 ? " after context parallelism" : "",
              ")");
  chief_ = parallel_->rank() == 0;  // prints, writes metrics, plots, checkpoints
  quiet_ = o_.quiet || !chief_;
  accumulation_ = global_batch_ / (o_.micro_batch_size * samples_);
  micro_batches_per_step_ = global_batch_ / o_.micro_batch_size;
  data_parallel_ = dp_ > 1 || o_.use_distributed_optimizer;
  adam_ = AdamWOptions{o_.adam_beta1, o_.adam_beta2, 1e-8f, o_.weight_decay, o_.clip_grad};

  open_data();
  if (pipelined_) {
    build_pipeline();
  } else {
    model_ = make_model(ModelLayout{});
  }
  OCTET_CHECK(!experts_split_ || !model_->moe_layers().empty(), "--expert-model-parallel-size ",
              o_.expert_model_parallel_size,
              " splits a mixture of experts' experts: ", family_->name(),
              " has none (give a config with num_experts > 0)");
  for (const TrainableModel::MoELayerRef& ref : model_->moe_layers()) {
    ref.moe->set_fp8_dispatch(o_.moe_dispatch_fp8);
  }
  trained_ = select_trained();
  for (Parameter* p : model_->parameters()) {
    if (contains(trained_, p)) continue;
    p->requires_grad = false;
    frozen_.push_back(p);
  }
  if (!o_.load.empty()) {
    load_checkpoint_state();
  } else if (!o_.pretrained_checkpoint.empty()) {
    load_pretrained();
  }
  if (data_parallel_) build_data_parallel();
  build_optimizer();
  fp8_part_ = model_->fp8_states();
  fp8_index_ = model_->fp8_state_indices();
  if (fp8_ && !o_.load.empty() && !experts_split_) restore_fp8_state();  // (save_fp8_states)

  peak_gflops_ = o_.peak_gflops > 0 ? o_.peak_gflops : measure_bf16_peak_gflops();
  flops_per_token_ = family_->train_flops_per_token(seq_len_);
  tokens_per_iteration_ = global_batch_ * seq_len_;
  if (!quiet_) print_setup();
  metrics_ = std::make_unique<MetricsWriter>(chief_ ? o_.metrics : std::string());
}

void TrainingRun::check_options() {
  // Numbers finite and in range, output paths writable: before any work (the command line
  // checks the same while parsing; this holds for callers of train_gpt too).
  const struct {
    const char* flag;
    double value, min;
  } numbers[] = {{"--lr", o_.lr, 0},
                 {"--min-lr", o_.min_lr, 0},
                 {"--clip-grad", o_.clip_grad, 0},
                 {"--weight-decay", o_.weight_decay, 0},
                 {"--adam-beta1", o_.adam_beta1, 0},
                 {"--adam-beta2", o_.adam_beta2, 0},
                 {"--peak-gflops", o_.peak_gflops, 0},
                 {"--lr-warmup-iters", static_cast<double>(o_.lr_warmup_iters), 0},
                 {"--fp8-amax-history-len", static_cast<double>(o_.fp8_amax_history_len), 1},
                 {"--eval-interval", static_cast<double>(o_.eval_interval), 0},
                 {"--eval-iters", static_cast<double>(o_.eval_iters), 0},
                 {"--log-interval", static_cast<double>(o_.log_interval), 0},
                 {"--save-interval", static_cast<double>(o_.save_interval), 0},
                 {"--ddp-bucket-size", static_cast<double>(o_.ddp_bucket_size), 1}};
  for (const std::string& prefix : o_.freeze) {
    OCTET_CHECK(!prefix.empty(), "--freeze expected parameter name prefixes, got an empty one");
  }
  for (const auto& number : numbers) {
    OCTET_CHECK(std::isfinite(number.value) && number.value >= number.min, number.flag,
                " expected a finite number >= ", number.min, ", got ", number.value);
  }
  OCTET_CHECK(o_.adam_beta1 < 1 && o_.adam_beta2 < 1,
              "--adam-beta1 and --adam-beta2 expected in [0, 1), got ", o_.adam_beta1, " and ",
              o_.adam_beta2);
  if (!o_.save.empty()) check_writable_directory(o_.save, "--save");
  if (!o_.dump_grads.empty()) check_writable_directory(o_.dump_grads, "--dump-grads");
  if (!o_.metrics.empty()) check_writable_file(o_.metrics, "--metrics");
  if (!o_.plot.empty()) check_writable_file(o_.plot, "--plot");
  seq_len_ = family_->seq_len(o_);
  global_batch_ = o_.global_batch_size ? o_.global_batch_size : o_.micro_batch_size;
  OCTET_CHECK(o_.micro_batch_size > 0 && global_batch_ % o_.micro_batch_size == 0,
              "--global-batch-size (", global_batch_,
              ") must be a positive multiple of --micro-batch-size (", o_.micro_batch_size, ")");
  OCTET_CHECK(o_.train_iters > 0, "--train-iters must be positive, got ", o_.train_iters);
  OCTET_CHECK(o_.mock_data || !o_.train_data.empty(), "no training data: give ",
              family_->data_hint());
  OCTET_CHECK(o_.dump_steps.empty() || !o_.dump_grads.empty(),
              "--dump-steps names the steps --dump-grads writes: give --dump-grads DIR too");
  for (int64_t step : o_.dump_steps) {
    OCTET_CHECK(step >= 1 && step <= o_.train_iters, "--dump-steps expected steps in [1, ",
                o_.train_iters, "], got ", step);
  }
  dtype_ = compute_dtype(o_.precision);
  fp8_ = o_.precision == "fp8";
  fp4_ = o_.precision == "fp4";
  fp4_options_.recipe = parse_fp4_recipe(o_.fp4_recipe);
  fp4_options_.seed = o_.seed;
  recipe_ = fp8_ ? make_recipe(o_) : recipe::Recipe{};
  delayed_scaling_ = fp8_ && std::holds_alternative<recipe::DelayedScaling>(recipe_);
  OCTET_CHECK(!o_.fp8_dpa || fp8_,
              "--fp8-dpa (FP8 attention) needs --precision fp8, got --precision ", o_.precision);
  OCTET_CHECK(!o_.first_last_layers_bf16 || fp8_ || fp4_,
              "--first-last-layers-bf16 keeps layers out of FP8 / FP4: it needs --precision fp8 "
              "or fp4, got --precision ",
              o_.precision);
  OCTET_CHECK(
      !o_.first_last_layers_bf16 ||
          o_.num_layers_at_start_in_bf16 + o_.num_layers_at_end_in_bf16 <= family_->num_layers(),
      "--num-layers-at-start-in-bf16 (", o_.num_layers_at_start_in_bf16,
      ") + --num-layers-at-end-in-bf16 (", o_.num_layers_at_end_in_bf16,
      ") expected at most the model's ", family_->num_layers(), " layers");
  OCTET_CHECK(o_.expert_model_parallel_size == 1 || !delayed_scaling_,
              "--expert-model-parallel-size > 1 with --fp8-recipe delayed is not supported (each "
              "rank's experts would need amaxes reduced over their own ranks): use "
              "--fp8-recipe current, block or mxfp8");
  OCTET_CHECK(!o_.fp8_stats || fp8_ || fp4_,
              "--fp8-stats measures FP8 / FP4 GEMM inputs: it needs --precision fp8 or fp4, got "
              "--precision ",
              o_.precision);
}

void TrainingRun::open_data() {
  train_batches_ = family_->open_data(o_, /*train=*/true, seq_len_);
  entropy_ = chief_ ? family_->baseline_loss(o_) : NAN;
  if (!quiet_ && std::isfinite(entropy_)) {
    // What a model that ignores its input reaches: one below it has learned from the input.
    std::printf("training data: %s %.3f nats (a model below it uses its input)\n",
                family_->baseline_name().c_str(), entropy_);
  }
  valid_batches_ = family_->open_data(o_, /*train=*/false, seq_len_);
}

std::unique_ptr<TrainableModel> TrainingRun::make_model(ModelLayout layout) const {
  if (parallel_->tensor_size() > 1) {
    layout.tensor = &parallel_->tensor();
    layout.sequence_parallel = o_.sequence_parallel;
  }
  if (parallel_->expert_size() > 1) layout.expert = &parallel_->expert();
  if (cp_ > 1) {
    layout.context = &parallel_->context();
    layout.cp_comm_type = parse_cp_comm_type(o_.cp_comm_type);
  }
  return family_->make_model(std::move(layout), o_);
}

void TrainingRun::build_pipeline() {
  pipeline::Schedule schedule = pipeline::make_schedule(
      pipeline::parse_schedule_kind(o_.pipeline_schedule), parallel_->pipeline_size(),
      static_cast<int>(accumulation_), static_cast<int>(o_.virtual_stages));
  ModelLayout layout{schedule.stages,
                     pipeline::stages_of_rank(schedule, parallel_->pipeline_rank())};
  pipeline::ExecutorOptions options;
  options.dtype = dtype_;
  // DualPipe's F&B pairs overlapped (two threads): worth it where the chunks exchange tokens
  // (experts) or keys and values (context), each chunk on its own copy of those groups.
  // Tensor parallelism's collectives run inside many modules on one group: not overlapped.
  if (schedule.model_copies == 2 && o_.dualpipe_overlap && parallel_->tensor_size() == 1 &&
      (experts_split_ || cp_ > 1)) {
    options.overlap_forward_backward = true;
    const int rank = parallel_->rank();
    if (experts_split_) {
      expert_copy_ = parallel_->expert().split(0, rank, "expert-copy");
      layout.chunk_expert = {&parallel_->expert(), expert_copy_.get()};
    }
    if (cp_ > 1) {
      context_copy_ = parallel_->context().split(0, rank, "context-copy");
      layout.chunk_context = {&parallel_->context(), context_copy_.get()};
    }
  }
  model_ = make_model(std::move(layout));
  if (delayed_scaling_ && parallel_->tensor_and_data().size() > 1) {
    // The stage's tensor x data ranks run the same action list: after each chunk's forward
    // and backward their amaxes become the group's maximum, as after a micro-batch.
    options.after_compute = [states = model_->fp8_states(), group = &parallel_->tensor_and_data()] {
      reduce_fp8_amax(states, *group);
    };
  }
  // Pipeline x data: each chunk's gradients start reducing right after its last backward of
  // the step (DualPipe sums its two copies after the schedule first: reduced after).
  overlap_ = dp_ > 1 && o_.overlap_grad_reduce && schedule.model_copies == 1;
  if (overlap_) {
    options.chunk_gradients_final = [this](int chunk) {
      // Tied copies are summed between their stages after the schedule: their bucket starts
      // in finish_grad_sync, after that.
      const std::vector<Parameter*> tied = model_->tied_copies();
      std::vector<Parameter*> ready;
      for (Parameter* p : model_->chunk_parameters(chunk)) {
        if (!contains(tied, p) && contains(trained_, p)) ready.push_back(p);
      }
      // Sequence-parallel partial gradients are summed over the tensor ranks before their
      // buckets reduce over the data ranks (the distributed optimizer keeps only a shard).
      all_reduce_sequence_parallel_gradients(among(ready, model_->sequence_parallel_parameters()),
                                             parallel_->tensor());
      ddp_->grads_ready(ready);
    };
  }
  executor_ = std::make_unique<pipeline::PipelineExecutor>(schedule, *model_, *parallel_, options);
}

void TrainingRun::load_pretrained() {
  const std::string& dir = o_.pretrained_checkpoint;
  const TensorMap theirs = load_checkpoint(dir).model;
  // Compared under the names on disk (Hugging Face's, where the family writes them).
  TensorMap ours = model_->to_checkpoint_names(model_->state_dict());
  std::vector<std::string> loaded;
  for (auto& [name, tensor] : ours) {
    const auto it = theirs.find(name);
    if (it == theirs.end()) continue;
    OCTET_CHECK(it->second.shape() == tensor.shape() && it->second.dtype() == tensor.dtype(),
                "--pretrained-checkpoint '", dir, "': tensor '", name, "' is ",
                shape_str(it->second.shape()), " ", dtype_name(it->second.dtype()),
                "; this model's is ", shape_str(tensor.shape()), " ", dtype_name(tensor.dtype()));
    tensor = it->second;
    loaded.push_back(name);
  }
  OCTET_CHECK(!loaded.empty(), "--pretrained-checkpoint '", dir,
              "': no tensor of its has a name of this model's (", family_->name(), ")");
  model_->load_state_dict(model_->from_checkpoint_names(ours));
  model_->on_parameters_updated();
  if (!quiet_) {
    std::printf("pretrained: %zu of %zu tensors from %s (first: %s)\n", loaded.size(), ours.size(),
                dir.c_str(), loaded.front().c_str());
  }
}

void TrainingRun::load_checkpoint_state() {
  Checkpoint checkpoint = load_checkpoint(o_.load);
  OCTET_CHECK(checkpoint.trainer.value("config", nlohmann::json()) == family_->config_json(),
              "checkpoint '", o_.load, "' was trained with another model config (",
              checkpoint.trainer.value("config", nlohmann::json()).dump(), ")");
  // A JSON object lacking a key would otherwise escape as nlohmann's exception.
  auto count = [&](const char* key) {
    const nlohmann::json& trainer = checkpoint.trainer;
    OCTET_CHECK(trainer.contains(key) && trainer[key].is_number_integer() &&
                    trainer[key].get<int64_t>() >= 0,
                "checkpoint '", o_.load, "': trainer.json expected a non-negative integer '", key,
                "', got ", trainer.contains(key) ? trainer[key].dump() : "none");
    return trainer[key].get<int64_t>();
  };
  // Whole-model tensors (any layout's checkpoint): this rank's part of the parameters and
  // this rank's slices of their optimizer state.
  loaded_model_ = model_->from_checkpoint_names(checkpoint.model);
  model_->load_state_dict(loaded_model_);
  loaded_optimizer_ =
      shard_optimizer_state(*model_, trained_, std::move(checkpoint.optimizer), o_.load);
  loaded_steps_ = count("optimizer_steps");
  start_iteration_ = count("iteration");
}

std::vector<Parameter*> TrainingRun::pipeline_backward_order() const {
  // Later stages finish their backward first; tied copies are summed between their stages
  // after the schedule, so they are reduced last.
  std::vector<int> chunks = model_->chunks_in_stage_order();
  std::reverse(chunks.begin(), chunks.end());
  const std::vector<Parameter*> tied = model_->tied_copies();
  std::vector<Parameter*> order;
  for (int chunk : chunks) {
    for (Parameter* p : model_->chunk_parameters(chunk)) {
      if (!contains(tied, p)) order.push_back(p);
    }
  }
  order.insert(order.end(), tied.begin(), tied.end());
  return order;
}

void TrainingRun::build_data_parallel() {
  // Buckets in the order backward finalizes gradients; parameters move into them. Under PP
  // chunk by chunk as the schedule finishes their backward, otherwise layer by layer.
  const std::vector<Parameter*> order =
      pipelined_ ? pipeline_backward_order() : model_->parameters_in_backward_order();
  OCTET_CHECK(order.size() == model_->parameters().size(), "octet train: ", order.size(),
              " parameters in backward order, the model part holds ", model_->parameters().size());
  // Frozen parameters (--freeze) keep their weights on every rank: no gradient to reduce and
  // no optimizer state (ZeRO-1 shards only what the buckets hold).
  const std::vector<Parameter*> reduced = among(order, trained_);
  if (!pipelined_) overlap_ = o_.overlap_grad_reduce;  // (pipelined: set by build_pipeline)
  DataParallelOptions options;
  options.bucket_elements = o_.ddp_bucket_size;
  options.overlap_grad_reduce = overlap_;
  options.distributed_optimizer = o_.use_distributed_optimizer;
  // Expert parallelism: the experts' gradients reduced over the ranks holding the same experts.
  ExpertGroups experts;
  if (experts_split_) experts = {&parallel_->expert(), &parallel_->expert_data()};
  ddp_ = std::make_unique<DistributedDataParallel>(reduced, parallel_->data(), options, experts);
  model_->on_parameters_updated();
  if (pipelined_) return;  // the executor reports chunks (build_pipeline)
  if (overlap_) {
    model_->set_grad_ready_hook([this](const std::vector<Parameter*>& ready) {
      // Only the step's last micro-batch: earlier ones' gradients are not final, and their
      // sequence-parallel parts must be summed once, after accumulation.
      if (!last_micro_batch_) return;
      const std::vector<Parameter*> trained = among(ready, trained_);
      all_reduce_sequence_parallel_gradients(among(trained, model_->sequence_parallel_parameters()),
                                             parallel_->tensor());
      ddp_->grads_ready(trained);
    });
  }
  model_->set_embedding_grad_hook([this](Parameter& table, const Tensor& ids, const Tensor& rows) {
    // A frozen table takes no gradient (Parameter::requires_grad).
    if (contains(trained_, &table)) ddp_->add_embedding_rows(table, ids, rows);
  });
}

std::vector<Parameter*> TrainingRun::select_trained() const {
  const std::vector<Parameter*> all = model_->parameters();
  if (o_.freeze.empty()) return all;
  auto frozen = [&](const Parameter* p) {
    return std::any_of(o_.freeze.begin(), o_.freeze.end(), [&](const std::string& prefix) {
      return p->name.compare(0, prefix.size(), prefix) == 0;
    });
  };
  std::vector<Parameter*> trained;
  int64_t frozen_values = 0;
  for (Parameter* p : all) {
    if (frozen(p)) {
      frozen_values += p->value.numel();
    } else {
      trained.push_back(p);
    }
  }
  // Each prefix names a parameter of the model (of this rank's part where the model is cut
  // into pipeline stages, whose parts hold different names).
  if (!pipelined_) {
    for (const std::string& prefix : o_.freeze) {
      const bool found = std::any_of(all.begin(), all.end(), [&](const Parameter* p) {
        return p->name.compare(0, prefix.size(), prefix) == 0;
      });
      OCTET_CHECK(found, "--freeze '", prefix, "' names no parameter of ", family_->name(),
                  " (its names start e.g. '", all.front()->name, "', '", all.back()->name, "')");
    }
  }
  OCTET_CHECK(!trained.empty() || pipelined_, "--freeze leaves no parameter to train");
  if (!quiet_) {
    std::printf("frozen: %zu tensors (%.2fM values) keep their weights, without optimizer state\n",
                all.size() - trained.size(), static_cast<double>(frozen_values) / 1e6);
  }
  return trained;
}

void TrainingRun::build_optimizer() {
  // With the model split over tensor or pipeline ranks the clipping norm spans the model
  // group: AdamW clips nothing, the loop does (or ZeRO-1's scope).
  const bool split_model = parallel_->model().size() > 1;
  if (o_.use_distributed_optimizer) {  // (its norm sums the experts over the expert group)
    GradNormScope scope;
    if (split_model) {
      scope.counted =
          model_->counted_in_norm(executor_ ? executor_->owned_parameters() : model_->parameters());
      scope.model_group = &parallel_->model();
    }
    zero_ = std::make_unique<DistributedOptimizer>(*ddp_, adam_, scope);
    if (!o_.load.empty()) zero_->load_state(loaded_optimizer_, loaded_steps_);
    return;
  }
  AdamWOptions options = adam_;
  if (split_model || experts_split_) options.clip_grad = 0;
  adamw_ = std::make_unique<AdamW>(trained_, options);
  if (!o_.load.empty()) adamw_->load_state(loaded_optimizer_, loaded_steps_);
}

void TrainingRun::restore_fp8_state() {
  // Amax histories and scales continue where they were, so FP8 resumes exactly.
  for (size_t i = 0; i < fp8_part_.size(); ++i) {
    const std::string prefix = "fp8." + std::to_string(fp8_index_[i]) + ".";
    if (loaded_optimizer_.count(prefix + "calls")) {
      fp8_part_[i]->load_state(loaded_optimizer_, prefix, recipe_);
    }
  }
}

void TrainingRun::print_setup() const {
  const std::string recipe =
      fp8_   ? " (" + recipe::describe(recipe_) + ")"
      : fp4_ ? std::string(" (") + fp4_recipe_name(fp4_options_.recipe) + ", Linear GEMMs)"
             : "";
  // A mixture of experts: the parameters one token meets too.
  char active[48] = "";
  if (family_->num_active_parameters() != family_->num_parameters()) {
    std::snprintf(active, sizeof(active), " (%.2fM active per token)",
                  family_->num_active_parameters() / 1e6);
  }
  std::printf("octet train: %s, %.2fM parameters%s, seq %lld, micro-batch %lld x %lld, %s%s\n",
              family_->name().c_str(), family_->num_parameters() / 1e6, active, (long long)seq_len_,
              (long long)o_.micro_batch_size, (long long)accumulation_, o_.precision.c_str(),
              recipe.c_str());
  const ParallelState& parallel = *parallel_;
  if (parallel.world_size() > 1) {
    const std::string context = cp_ > 1 ? " (context: CP=" + std::to_string(cp_) +
                                              " x DP=" + std::to_string(samples_) + ", " +
                                              o_.cp_comm_type + ")"
                                        : std::string();
    std::printf(
        "parallel: %d processes, TP=%d x DP=%d x PP=%d%s%s%s, %s, %zu gradient bucket(s)%s\n",
        parallel.world_size(), parallel.tensor_size(), parallel.data_size(),
        parallel.pipeline_size(), context.c_str(),
        experts_split_ ? (" (experts: EP=" + std::to_string(parallel.expert_size()) +
                          " x EDP=" + std::to_string(parallel.expert_data_size()) + ")")
                             .c_str()
                       : "",
        parallel.tensor_size() > 1 && o_.sequence_parallel ? " (sequence-parallel)" : "",
        o_.use_distributed_optimizer ? "distributed optimizer (ZeRO-1)" : "all-reduce",
        ddp_ ? ddp_->buckets().size() : size_t{0},
        ddp_ && ddp_->options().overlap_grad_reduce ? " reduced during backward" : "");
  }
  std::printf("measured BF16 GEMM peak %.0f GFLOP/s; %.3g GFLOP per token\n", peak_gflops_,
              flops_per_token_ / 1e9);
}

}  // namespace octet::train_detail
