// The GPT training loop: deterministic batches from a token shard, gradient accumulation,
// AdamW with a cosine schedule, validation, metrics, checkpoints, progress and the loss curve.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <variant>

#include "octet/comm.h"
#include "octet/data.h"
#include "octet/data_parallel.h"
#include "octet/gemm.h"
#include "octet/model.h"
#include "octet/model_tensor_parallel.h"
#include "octet/ops/optimizer.h"
#include "octet/pipeline.h"
#include "octet/rng.h"
#include "octet/tensor_parallel.h"
#include "octet/train.h"

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

// Batches of [micro_batch, T+1] windows at positions drawn from Philox(seed, stream, index):
// the same (seed, iteration, micro-batch) always gives the same batch, so a resumed run sees
// exactly the data an uninterrupted one would.
class Batcher {
 public:
  Batcher(const std::string& path, bool mock, int64_t vocab, int64_t seq_len, uint64_t seed,
          uint64_t stream)
      : mock_(mock), vocab_(vocab), seq_len_(seq_len), seed_(seed), stream_(stream) {
    if (mock_) return;
    shard_ = std::make_unique<TokenShard>(TokenShard::open(path, /*check_ids=*/false));
    OCTET_CHECK(shard_->vocab_size() <= vocab, "data '", path, "' has vocabulary ",
                shard_->vocab_size(), ", larger than the model's ", vocab);
    OCTET_CHECK(shard_->size() > seq_len + 1, "data '", path, "' holds ", shard_->size(),
                " tokens: expected more than seq_length + 1 = ", seq_len + 1);
  }

  void fill(int64_t batch_index, int64_t micro_batch, Tensor& ids, Tensor& targets) const {
    ids = Tensor::empty({micro_batch, seq_len_}, DType::I32);
    targets = Tensor::empty({micro_batch, seq_len_}, DType::I32);
    std::vector<int32_t> window(static_cast<size_t>(seq_len_ + 1));
    for (int64_t b = 0; b < micro_batch; ++b) {
      uint64_t index = static_cast<uint64_t>(batch_index * micro_batch + b);
      auto words = philox4x32(seed_, index, stream_);
      uint64_t random = (uint64_t{words[0]} << 32) | words[1];
      if (mock_) {
        for (int64_t t = 0; t <= seq_len_; ++t) {
          auto w =
              philox4x32(seed_ ^ 0x5bd1e995u, index * 65536 + static_cast<uint64_t>(t), stream_);
          window[t] = static_cast<int32_t>(w[0] % static_cast<uint64_t>(vocab_));
        }
      } else {
        uint64_t span = static_cast<uint64_t>(shard_->size() - seq_len_ - 1);
        shard_->read(static_cast<int64_t>(random % span), seq_len_ + 1, window.data());
      }
      std::copy(window.begin(), window.end() - 1, ids.data<int32_t>() + b * seq_len_);
      std::copy(window.begin() + 1, window.end(), targets.data<int32_t>() + b * seq_len_);
    }
  }

 private:
  bool mock_;
  int64_t vocab_, seq_len_;
  uint64_t seed_, stream_;
  std::unique_ptr<TokenShard> shard_;
};

recipe::Recipe make_recipe(const TrainOptions& o) {
  OCTET_CHECK(o.fp8_format == "hybrid" || o.fp8_format == "e4m3",
              "--fp8-format expected hybrid or e4m3, got '", o.fp8_format, "'");
  recipe::Format format = o.fp8_format == "hybrid" ? recipe::Format::HYBRID : recipe::Format::E4M3;
  if (o.fp8_recipe == "delayed") {
    recipe::DelayedScaling r;
    r.fp8_format = format;
    r.amax_history_len = static_cast<int>(o.fp8_amax_history_len);
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
  if (precision == "bf16" || precision == "fp8") return DType::BF16;
  fail(detail::concat("--precision expected fp32, bf16 or fp8, got '", precision, "'"));
}

// Entropy (nats) of the token frequencies of a shard: the loss of the best model that ignores
// context. A language model worth training ends well below it.
// Global-norm clipping with a norm computed across ranks (pipeline stages, tensor shards):
// scales every gradient by clip / (norm + 1e-6) when that is below 1, as AdamW does.
void clip_gradients(double norm, float clip, const std::vector<Parameter*>& parameters) {
  const double coefficient = clip / (norm + 1e-6);
  if (clip <= 0 || !std::isfinite(norm) || coefficient >= 1.0) return;
  for (Parameter* p : parameters) {
    float* g = p->grad.data<float>();
    for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] *= static_cast<float>(coefficient);
  }
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
    const float* old_value = before.mapped().data<float>();
    float* delta = update.data<float>();
    for (int64_t i = 0; i < update.numel(); ++i) delta[i] -= old_value[i];
    tensors["update." + name] = update;
  }
  return tensors;
}

double unigram_entropy(const std::string& path) {
  TokenShard shard = TokenShard::open(path, /*check_ids=*/false);
  std::vector<int64_t> counts(static_cast<size_t>(shard.vocab_size()), 0);
  std::vector<int32_t> ids(1 << 16);
  for (int64_t begin = 0; begin < shard.size(); begin += static_cast<int64_t>(ids.size())) {
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(ids.size()), shard.size() - begin);
    shard.read(begin, count, ids.data());
    for (int64_t i = 0; i < count; ++i) ++counts[static_cast<size_t>(ids[i])];
  }
  double entropy = 0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(shard.size());
    entropy -= p * std::log(p);
  }
  return entropy;
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

TrainResult train_gpt(const TrainOptions& o) {
  GPTConfig config = GPTConfig::load(o.config_path);
  const int64_t T = o.seq_length ? o.seq_length : config.max_seq_len;
  OCTET_CHECK(T > 0 && T <= config.max_seq_len, "--seq-length ", T, " expected in [1, ",
              config.max_seq_len, "]");
  const int64_t global_batch = o.global_batch_size ? o.global_batch_size : o.micro_batch_size;
  OCTET_CHECK(o.micro_batch_size > 0 && global_batch % o.micro_batch_size == 0,
              "--global-batch-size (", global_batch,
              ") must be a positive multiple of --micro-batch-size (", o.micro_batch_size, ")");
  OCTET_CHECK(o.train_iters > 0, "--train-iters must be positive, got ", o.train_iters);
  OCTET_CHECK(o.mock_data || !o.train_data.empty(),
              "no training data: give --train-data SHARD (from `octet tokenize -o`) or "
              "--mock-data");
  OCTET_CHECK(o.dump_steps.empty() || !o.dump_grads.empty(),
              "--dump-steps names the steps --dump-grads writes: give --dump-grads DIR too");
  for (int64_t step : o.dump_steps) {
    OCTET_CHECK(step >= 1 && step <= o.train_iters, "--dump-steps expected steps in [1, ",
                o.train_iters, "], got ", step);
  }
  const DType dtype = compute_dtype(o.precision);
  const bool fp8 = o.precision == "fp8";
  const recipe::Recipe recipe = fp8 ? make_recipe(o) : recipe::Recipe{};
  const bool delayed_scaling = fp8 && std::holds_alternative<recipe::DelayedScaling>(recipe);

  // Without a launcher the world is this process alone, and MPI is never started.
  std::shared_ptr<Communicator> world =
      launcher_world_size() > 1 ? world_communicator() : self_communicator();
  ParallelState parallel(world, static_cast<int>(o.tensor_model_parallel_size),
                         static_cast<int>(o.pipeline_model_parallel_size));
  const bool pipelined = parallel.pipeline_size() > 1;
  const bool tensor_parallel = parallel.tensor_size() > 1;
  const int64_t dp = parallel.data_size(), dp_rank = parallel.data_rank();
  OCTET_CHECK(global_batch % (o.micro_batch_size * dp) == 0, "--global-batch-size (", global_batch,
              ") must be a multiple of --micro-batch-size (", o.micro_batch_size,
              ") x data-parallel size (", dp, ")");
  const bool chief = parallel.rank() == 0;  // prints, writes metrics, plots, checkpoints
  const bool quiet = o.quiet || !chief;
  // Micro-batches per step on this rank; the step's k-th micro-batch of data-parallel rank d
  // is the step's (k * DP + d)-th, so any DP size sees the same global batch.
  const int64_t accumulation = global_batch / (o.micro_batch_size * dp);
  const int64_t micro_batches_per_step = global_batch / o.micro_batch_size;
  OCTET_CHECK(!o.fp8_stats || fp8,
              "--fp8-stats measures FP8 GEMM inputs: it needs --precision "
              "fp8, got --precision ",
              o.precision);

  Batcher train_batches(o.train_data, o.mock_data, config.vocab_size, T, o.seed, 1);
  const double entropy = o.mock_data || !chief ? NAN : unigram_entropy(o.train_data);
  if (!quiet && std::isfinite(entropy)) {
    std::printf("training data: unigram entropy %.3f nats (a model below it uses context)\n",
                entropy);
  }
  std::unique_ptr<Batcher> valid_batches;
  if (o.mock_data || !o.valid_data.empty()) {
    valid_batches = std::make_unique<Batcher>(o.mock_data ? "" : o.valid_data, o.mock_data,
                                              config.vocab_size, T, o.seed, 2);
  }

  // The single-process model (also the data- and pipeline-parallel paths' full copy), or this
  // rank's tensor-parallel shards (of its pipeline stages, made below, under TP x PP).
  std::unique_ptr<GPT> gpt;
  std::unique_ptr<TensorParallelGPT> tp_model;
  if (tensor_parallel && !pipelined) {
    tp_model =
        std::make_unique<TensorParallelGPT>(config, o.seed, o.sequence_parallel, parallel.tensor(),
                                            1, std::vector<int>{0}, o.recompute_activations);
  } else if (!tensor_parallel) {
    gpt = std::make_unique<GPT>(config, o.seed, o.recompute_activations);
  }
  AdamWOptions adam{o.adam_beta1, o.adam_beta2, 1e-8f, o.weight_decay, o.clip_grad};
  std::unique_ptr<AdamW> adamw;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<DistributedOptimizer> zero;
  const bool data_parallel = dp > 1 || o.use_distributed_optimizer;
  if (!data_parallel && gpt) adamw = std::make_unique<AdamW>(gpt->parameters(), adam);
  auto optimizer_steps = [&] { return zero ? zero->steps() : adamw->steps(); };
  LrSchedule schedule{o.lr, o.min_lr, o.lr_warmup_iters, o.train_iters};
  int64_t start_iteration = 0;
  TensorMap loaded_model, loaded_optimizer;
  int64_t loaded_steps = 0;
  if (!o.load.empty()) {
    Checkpoint checkpoint = load_checkpoint(o.load);
    OCTET_CHECK(checkpoint.trainer.value("config", nlohmann::json()) == config.to_json(),
                "checkpoint '", o.load, "' was trained with another model config (",
                checkpoint.trainer.value("config", nlohmann::json()).dump(), ")");
    // A JSON object lacking a key would otherwise escape as nlohmann's exception.
    auto count = [&](const char* key) {
      const nlohmann::json& trainer = checkpoint.trainer;
      OCTET_CHECK(trainer.contains(key) && trainer[key].is_number_integer() &&
                      trainer[key].get<int64_t>() >= 0,
                  "checkpoint '", o.load, "': trainer.json expected a non-negative integer '", key,
                  "', got ", trainer.contains(key) ? trainer[key].dump() : "none");
      return trainer[key].get<int64_t>();
    };
    loaded_model = from_hf_gpt2_names(checkpoint.model);
    if (gpt) gpt->load_state_dict(loaded_model);
    if (adamw) adamw->load_state(checkpoint.optimizer, count("optimizer_steps"));
    loaded_optimizer = std::move(checkpoint.optimizer);
    loaded_steps = count("optimizer_steps");
    start_iteration = count("iteration");
  }

  // Pipeline parallelism: this rank's stages of the model, run by the schedule's executor.
  std::unique_ptr<GPTStage> stage;
  std::unique_ptr<pipeline::PipelineExecutor> executor;
  pipeline::StagedModel* pipeline_part = nullptr;
  // Pipeline x data: each chunk's gradients start reducing right after its last backward of
  // the step (DualPipe sums its two copies after the schedule first: reduced after).
  bool pipeline_overlap = false;
  if (pipelined) {
    pipeline::Schedule pipeline_schedule = pipeline::make_schedule(
        pipeline::parse_schedule_kind(o.pipeline_schedule), parallel.pipeline_size(),
        static_cast<int>(accumulation), static_cast<int>(o.virtual_stages));
    std::vector<int> held = pipeline::stages_of_rank(pipeline_schedule, parallel.pipeline_rank());
    pipeline::StagedModel*& part = pipeline_part;
    if (tensor_parallel) {
      // TP x PP: this rank's tensor shards of its pipeline stages.
      tp_model = std::make_unique<TensorParallelGPT>(config, o.seed, o.sequence_parallel,
                                                     parallel.tensor(), pipeline_schedule.stages,
                                                     std::move(held), o.recompute_activations);
      part = tp_model.get();
    } else {
      stage = std::make_unique<GPTStage>(config, o.seed, pipeline_schedule.stages, std::move(held),
                                         o.recompute_activations);
      part = stage.get();
    }
    pipeline::ExecutorOptions options;
    options.dtype = dtype;
    if (delayed_scaling && parallel.tensor_and_data().size() > 1) {
      // The stage's tensor x data ranks run the same action list: after each chunk's forward
      // and backward their amaxes become the group's maximum, as after a micro-batch.
      std::vector<Fp8State*> states = tp_model ? tp_model->fp8_states() : fp8_states(*stage);
      options.after_compute = [states, &parallel] {
        reduce_fp8_amax(states, parallel.tensor_and_data());
      };
    }
    pipeline_overlap = dp > 1 && o.overlap_grad_reduce && pipeline_schedule.model_copies == 1;
    if (pipeline_overlap) {
      options.chunk_gradients_final = [&ddp, &parallel, part, tp = tp_model.get()](int chunk) {
        // wte's copies are summed over the embedding group after the schedule: its bucket
        // starts in finish_grad_sync, after that.
        const std::vector<Parameter*> tied = part->tied_copies();
        std::vector<Parameter*> ready;
        for (Parameter* p : part->chunk_parameters(chunk)) {
          if (std::find(tied.begin(), tied.end(), p) == tied.end()) ready.push_back(p);
        }
        // Sequence-parallel partial gradients are summed over the tensor ranks before their
        // buckets reduce over the data ranks (the distributed optimizer keeps only a shard).
        if (tp) {
          all_reduce_sequence_parallel_gradients(among(ready, tp->sequence_parallel_parameters()),
                                                 parallel.tensor());
        }
        ddp->grads_ready(ready);
      };
    }
    executor =
        std::make_unique<pipeline::PipelineExecutor>(pipeline_schedule, *part, parallel, options);
    if (stage) {
      // Whole-model names: a checkpoint of any layout holds this stage's tensors.
      if (!o.load.empty()) stage->load_state_dict(loaded_model);
      if (!o.use_distributed_optimizer) {
        // Clipping needs the norm over every stage: AdamW clips nothing, the loop does.
        AdamWOptions unclipped = adam;
        unclipped.clip_grad = 0;
        adamw = std::make_unique<AdamW>(stage->parameters(), unclipped);
        if (!o.load.empty()) adamw->load_state(loaded_optimizer, loaded_steps);
      }
    }
  }
  // Global-norm clipping across pipeline stages: each rank's owned parameters count once.
  auto clip_pipeline_gradients = [&]() {
    if (tp_model) {
      // TP x PP: sharded parameters count on every tensor rank, replicated ones once, over
      // tensor x pipeline (sequence-parallel gradients were summed before).
      const double norm = tp_model->grad_norm(parallel.model(), executor->owned_parameters());
      clip_gradients(norm, o.clip_grad, tp_model->parameters());
      return norm;
    }
    double squares = 0;
    for (Parameter* p : executor->owned_parameters()) {
      const Tensor grads[] = {p->grad};
      const double norm = ops::global_grad_norm(grads);
      squares += norm * norm;
    }
    const double norm = std::sqrt(parallel.pipeline().all_reduce(squares, ReduceOp::Sum));
    clip_gradients(norm, o.clip_grad, stage->parameters());
    return norm;
  };

  if (tp_model) {
    tp_model->set_tp_comm_overlap(o.tp_comm_overlap);
    if (!o.load.empty()) {
      // Whole-model tensors (any layout's checkpoint): this rank's slices of the parameters
      // and of their optimizer state.
      tp_model->load_state_dict(loaded_model);
      TensorMap local;
      for (Parameter* p : tp_model->parameters()) {
        for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
          auto it = loaded_optimizer.find(p->name + suffix);
          OCTET_CHECK(it != loaded_optimizer.end(), "checkpoint '", o.load,
                      "': optimizer state misses '", p->name + suffix, "'");
          local[p->name + suffix] = tp_model->shard(*p, it->second);
        }
      }
      for (auto& [name, tensor] : local) loaded_optimizer[name] = tensor;
    }
    if (!o.use_distributed_optimizer) {
      // Clipping needs the norm over every shard: AdamW clips nothing, the loop does.
      AdamWOptions unclipped = adam;
      unclipped.clip_grad = 0;
      adamw = std::make_unique<AdamW>(tp_model->parameters(), unclipped);
      if (!o.load.empty()) adamw->load_state(loaded_optimizer, loaded_steps);
    }
  }

  // Tensor x data without PP: each layer's gradients start reducing as its backward ends.
  const bool tensor_overlap = tp_model && !pipelined && dp > 1 && o.overlap_grad_reduce;
  bool last_micro_batch = true;  // of the step: the one whose gradients are final
  if ((pipelined || tensor_parallel) && data_parallel) {
    // Pipeline or tensor x data: each stage's or shard's gradients are reduced over its
    // data-parallel replicas as backward finalizes them: under PP chunk by chunk as the
    // schedule finishes their backward (buckets in that order: later stages first, wte last),
    // under TP layer by layer.
    Module& part = stage ? static_cast<Module&>(*stage) : static_cast<Module&>(*tp_model);
    std::vector<Parameter*> order;
    if (pipeline_part) {
      // Later stages finish their backward first.
      std::vector<int> chunks = pipeline_part->chunks_in_stage_order();
      std::reverse(chunks.begin(), chunks.end());
      const std::vector<Parameter*> tied = pipeline_part->tied_copies();
      for (int chunk : chunks) {
        for (Parameter* p : pipeline_part->chunk_parameters(chunk)) {
          if (std::find(tied.begin(), tied.end(), p) == tied.end()) order.push_back(p);
        }
      }
      // Tied copies are summed between their stages after the schedule: reduced last.
      order.insert(order.end(), tied.begin(), tied.end());
    } else {
      order = tp_model->parameters_in_backward_order();
    }
    OCTET_CHECK(order.size() == part.parameters().size(), "octet train: ", order.size(),
                " parameters in backward order, the model part holds ", part.parameters().size());
    DataParallelOptions options;
    options.bucket_elements = o.ddp_bucket_size;
    options.overlap_grad_reduce = pipeline_overlap || tensor_overlap;
    options.distributed_optimizer = o.use_distributed_optimizer;
    ddp = std::make_unique<DistributedDataParallel>(order, parallel.data(), options);
    part.on_parameters_updated();
    if (tensor_overlap) {
      tp_model->set_grad_ready_hook([&ddp, &parallel, &last_micro_batch,
                                     tp = tp_model.get()](const std::vector<Parameter*>& ready) {
        // Only the step's last micro-batch: earlier ones' gradients are not final, and their
        // sequence-parallel parts must be summed once, after accumulation.
        if (!last_micro_batch) return;
        all_reduce_sequence_parallel_gradients(among(ready, tp->sequence_parallel_parameters()),
                                               parallel.tensor());
        ddp->grads_ready(ready);
      });
    }
    if (o.use_distributed_optimizer) {
      // ZeRO-1 over each stage's / shard's data-parallel replicas; the clipping norm counts
      // every model parameter once over the model group (tensor x pipeline ranks).
      GradNormScope scope;
      scope.counted = executor ? executor->owned_parameters() : part.parameters();
      if (tp_model) scope.counted = tp_model->counted_in_norm(*scope.counted);
      scope.model_group = &parallel.model();
      zero = std::make_unique<DistributedOptimizer>(*ddp, adam, scope);
      if (!o.load.empty()) zero->load_state(loaded_optimizer, loaded_steps);
    }
  } else if (data_parallel) {
    GPT& model = *gpt;
    // Buckets in the order backward finalizes gradients; parameters move into them.
    DataParallelOptions options;
    options.bucket_elements = o.ddp_bucket_size;
    options.overlap_grad_reduce = o.overlap_grad_reduce;
    options.distributed_optimizer = o.use_distributed_optimizer;
    ddp = std::make_unique<DistributedDataParallel>(model.parameters_in_backward_order(),
                                                    parallel.data(), options);
    model.on_parameters_updated();
    model.set_grad_ready_hook(
        [&ddp](const std::vector<Parameter*>& parameters) { ddp->grads_ready(parameters); });
    model.set_embedding_grad_hook([&ddp](Parameter& table, const Tensor& ids, const Tensor& rows) {
      ddp->add_embedding_rows(table, ids, rows);
    });
    if (o.use_distributed_optimizer) {
      zero = std::make_unique<DistributedOptimizer>(*ddp, adam);
      if (!o.load.empty()) zero->load_state(loaded_optimizer, loaded_steps);
    } else {
      adamw = std::make_unique<AdamW>(model.parameters(), adam);
      if (!o.load.empty()) adamw->load_state(loaded_optimizer, loaded_steps);
    }
  }

  // This rank's FP8 states, each with its index in the whole GPT's list: checkpoint entries
  // fp8.{i}. name the same GEMM at every layout.
  const std::vector<Fp8State*> fp8_part = tp_model ? tp_model->fp8_states()
                                          : stage  ? fp8_states(*stage)
                                                   : fp8_states(*gpt);
  const std::vector<int64_t> fp8_index =
      pipeline_part ? fp8_state_indices(*pipeline_part, fp8_part.size(), config.num_layers)
                    : fp8_state_indices(fp8_part.size());
  if (fp8 && !o.load.empty()) {
    // Amax histories and scales continue where they were, so FP8 resumes exactly.
    for (size_t i = 0; i < fp8_part.size(); ++i) {
      const std::string prefix = "fp8." + std::to_string(fp8_index[i]) + ".";
      if (loaded_optimizer.count(prefix + "calls")) {
        fp8_part[i]->load_state(loaded_optimizer, prefix, recipe);
      }
    }
  }

  const double peak = o.peak_gflops > 0 ? o.peak_gflops : measure_bf16_peak_gflops();
  const double flops_per_token = config.train_flops_per_token(T);
  const int64_t tokens_per_iteration = global_batch * T;
  if (!quiet) {
    std::printf("octet train: %s, %.2fM parameters, seq %lld, micro-batch %lld x %lld, %s%s\n",
                config.name.c_str(), config.num_parameters() / 1e6, (long long)T,
                (long long)o.micro_batch_size, (long long)accumulation, o.precision.c_str(),
                fp8 ? (" (" + recipe::describe(recipe) + ")").c_str() : "");
    if (parallel.world_size() > 1) {
      std::printf("parallel: %d processes, TP=%d x DP=%d x PP=%d%s, %s, %zu gradient bucket(s)%s\n",
                  parallel.world_size(), parallel.tensor_size(), parallel.data_size(),
                  parallel.pipeline_size(),
                  tensor_parallel && o.sequence_parallel ? " (sequence-parallel)" : "",
                  o.use_distributed_optimizer ? "distributed optimizer (ZeRO-1)" : "all-reduce",
                  ddp ? ddp->buckets().size() : size_t{0},
                  ddp && ddp->options().overlap_grad_reduce ? " reduced during backward" : "");
    }
    std::printf("measured BF16 GEMM peak %.0f GFLOP/s; %.2f GFLOP per token\n", peak,
                flops_per_token / 1e9);
  }

  MetricsWriter metrics(chief ? o.metrics : std::string());
  Fp8StatsSummary fp8_summary;
  TrainResult result;
  std::vector<CurvePoint> train_curve, valid_curve;
  auto evaluate = [&]() {
    // Data-parallel ranks split the batches; under FP8 every rank runs them all, so the
    // amaxes these forwards record (and the scales they lead to) stay equal across ranks.
    const int64_t first = fp8 ? 0 : dp_rank, stride = fp8 ? 1 : dp;
    double sum = 0;
    for (int64_t k = first; k < o.eval_iters; k += stride) {
      Tensor ids, targets;
      valid_batches->fill(k, o.micro_batch_size, ids, targets);
      fp8_autocast scope(fp8, recipe);
      if (executor) {
        // Through the pipeline stages, forward only (the executor's after_compute keeps the
        // FP8 amaxes equal over each stage's tensor x data ranks).
        sum += executor->evaluate({gpt_micro_batch(ids, targets)});
      } else if (tp_model) {
        sum += tp_model->evaluate(ids, targets, dtype);
        // The shards' weight amaxes differ: reduce so the tensor ranks keep equal scales.
        if (delayed_scaling) reduce_fp8_amax(tp_model->fp8_states(), parallel.tensor());
      } else {
        sum += gpt->evaluate(ids, targets, dtype);
      }
    }
    if (!fp8) sum = parallel.data().all_reduce(sum, ReduceOp::Sum);
    return static_cast<float>(sum / static_cast<double>(o.eval_iters));
  };
  auto save = [&](int64_t iteration) {
    // Written whole by rank 0 in the single-process layout, so it loads at any
    // data-parallel size (ZeRO's shards are gathered first: collective).
    Checkpoint checkpoint;
    checkpoint.optimizer = zero ? zero->state() : adamw->state();
    if (tp_model) {
      // Whole-model tensors gathered from the shards (collective over the tensor group).
      checkpoint.model = to_hf_gpt2_names(tp_model->state_dict());
      TensorMap whole;
      for (Parameter* p : tp_model->parameters()) {
        for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
          whole[p->name + suffix] = tp_model->gather(*p, checkpoint.optimizer.at(p->name + suffix));
        }
      }
      checkpoint.optimizer = std::move(whole);
    }
    for (size_t i = 0; i < fp8_part.size(); ++i) {
      fp8_part[i]->save_state(checkpoint.optimizer, "fp8." + std::to_string(fp8_index[i]) + ".");
    }
    if (executor) {
      // Each pipeline stage writes its own part (sharded, collective).
      if (stage) checkpoint.model = to_hf_gpt2_names(stage->state_dict());
      checkpoint.trainer = {{"iteration", iteration},
                            {"optimizer_steps", optimizer_steps()},
                            {"config", config.to_json()},
                            {"seed", o.seed},
                            {"precision", o.precision}};
      save_checkpoint_sharded(o.save, checkpoint, parallel);
      return;
    }
    if (!chief) return;
    if (gpt) checkpoint.model = to_hf_gpt2_names(gpt->state_dict());
    checkpoint.trainer = {{"iteration", iteration},
                          {"optimizer_steps", optimizer_steps()},
                          {"config", config.to_json()},
                          {"seed", o.seed},
                          {"precision", o.precision}};
    save_checkpoint(o.save, checkpoint);
  };

  // --dump-grads: whole-model tensors under their names whatever the layout, so two layouts'
  // dumps compare tensor by tensor (tests/distributed/train_layouts.sh).
  auto part_parameters = [&]() {
    return tp_model ? tp_model->parameters() : stage ? stage->parameters() : gpt->parameters();
  };
  auto whole_parameters = [&]() {
    // Tensor shards gathered (collective over the tensor group), copied: the step changes them.
    TensorMap out = tp_model ? tp_model->state_dict()
                    : stage  ? stage->state_dict()
                             : gpt->state_dict();
    for (auto& [name, tensor] : out) tensor = tensor.clone();
    return out;
  };
  // Before the step: the summed, unclipped gradients ("grad.NAME") and the parameters.
  auto whole_gradients = [&]() {
    if (ddp) ddp->gather_grad_shards();  // ZeRO-1 keeps only its reduced shard (collective)
    TensorMap out;
    for (Parameter* p : part_parameters()) {
      // Copied, since clipping scales the gradients in place.
      out["grad." + p->name] = tp_model ? tp_model->gather(*p, p->grad).clone() : p->grad.clone();
    }
    for (auto& [name, value] : whole_parameters()) out["before." + name] = value;
    return out;
  };
  // After it: the parameters, each one's update ("update.NAME" = after - before) and the FP8
  // states, one file per pipeline stage (its tensor and data rank 0 write it) in every layout.
  auto dump = [&](int64_t step, TensorMap tensors) {
    Checkpoint part;
    part.model = whole_parameters();
    part.optimizer = with_updates(std::move(tensors), part.model);
    for (size_t i = 0; i < fp8_part.size(); ++i) {
      fp8_part[i]->save_state(part.optimizer, "fp8." + std::to_string(fp8_index[i]) + ".");
    }
    part.trainer = {{"iteration", step}, {"config", config.to_json()}, {"precision", o.precision}};
    save_checkpoint_sharded(o.dump_grads + "/step-" + std::to_string(step), part, parallel);
  };

  const auto run_start = Clock::now();
  double busy_seconds = 0;
  for (int64_t iteration = start_iteration; iteration < o.train_iters; ++iteration) {
    const auto step_start = Clock::now();
    const float lr = schedule.at(iteration);
    if (ddp) {
      ddp->zero_grad();
    } else if (stage) {
      stage->zero_grad();
    } else if (tp_model) {
      tp_model->zero_grad();
    } else {
      gpt->zero_grad();
    }
    double loss = 0;
    if (executor) {
      // The whole step's micro-batches go through the pipeline schedule at once.
      std::vector<Tensor> ids(static_cast<size_t>(accumulation)), targets(ids.size());
      for (int64_t micro = 0; micro < accumulation; ++micro) {
        train_batches.fill(iteration * micro_batches_per_step + micro * dp + dp_rank,
                           o.micro_batch_size, ids[micro], targets[micro]);
      }
      fp8_autocast scope(fp8, recipe);
      fp8_stats_scope stats_scope(o.fp8_stats);
      loss = executor->train_step(gpt_micro_batches(ids, targets),
                                  1.0f / static_cast<float>(accumulation * dp)) *
             static_cast<double>(accumulation);
    } else {
      // Training micro-batches only: evaluation's forwards would overwrite the stats.
      fp8_stats_scope stats_scope(o.fp8_stats);
      for (int64_t micro = 0; micro < accumulation; ++micro) {
        Tensor ids, targets;
        train_batches.fill(iteration * micro_batches_per_step + micro * dp + dp_rank,
                           o.micro_batch_size, ids, targets);
        // Gradients start reducing in the last micro-batch's backward.
        last_micro_batch = micro + 1 == accumulation;
        if (ddp) ddp->set_sync(last_micro_batch);
        fp8_autocast scope(fp8, recipe);
        const float grad_scale = 1.0f / static_cast<float>(accumulation * dp);
        if (tp_model) {
          loss += tp_model->train_step(ids, targets, dtype, grad_scale);
          if (delayed_scaling) reduce_fp8_amax(tp_model->fp8_states(), parallel.tensor_and_data());
          continue;
        }
        loss += gpt->train_step(ids, targets, dtype, grad_scale);
        if (delayed_scaling) reduce_fp8_amax(*gpt, parallel.tensor_and_data());
      }
    }
    if (tp_model && !pipeline_overlap && !tensor_overlap) {
      // Sequence-parallel replicated parameters saw only this rank's tokens: summed over the
      // tensor ranks before the data-parallel reduction (ZeRO-1 keeps only a shard after it).
      // With PP x DP or TP x DP overlap they were summed as their backward finished.
      all_reduce_sequence_parallel_gradients(tp_model->sequence_parallel_parameters(),
                                             parallel.tensor());
    }
    if (ddp) ddp->finish_grad_sync();
    loss = parallel.data().all_reduce(loss, ReduceOp::Sum) / static_cast<double>(accumulation * dp);
    const bool dumping = dump_this_step(o, iteration + 1);
    TensorMap dumped_gradients;
    if (dumping) dumped_gradients = whole_gradients();  // before clipping and the update
    // The step's last micro-batch, per quantized tensor. Under TP: tensor rank 0's shards
    // (rank 0 writes the metrics); under PP every stage's, gathered over the pipeline ranks.
    nlohmann::json fp8_stats = o.fp8_stats ? take_fp8_stats(fp8_part) : nlohmann::json();
    if (o.fp8_stats && executor) fp8_stats = gather_fp8_stats(fp8_stats, parallel.pipeline());
    double grad_norm = 0;
    if (executor) {
      if (zero) {
        grad_norm = zero->step(lr);
      } else {
        grad_norm = clip_pipeline_gradients();
        if (std::isfinite(grad_norm)) adamw->step(lr);
      }
      if (stage) {
        stage->on_parameters_updated();
      } else {
        tp_model->on_parameters_updated();
      }
    } else if (tp_model) {
      if (zero) {
        grad_norm = zero->step(lr);
      } else {
        grad_norm = tp_model->grad_norm(parallel.model(), tp_model->parameters());
        clip_gradients(grad_norm, o.clip_grad, tp_model->parameters());
        if (std::isfinite(grad_norm)) adamw->step(lr);
      }
      tp_model->on_parameters_updated();
    } else {
      grad_norm = zero ? zero->step(lr) : adamw->step(lr);
      gpt->on_parameters_updated();
    }
    if (dumping) dump(iteration + 1, std::move(dumped_gradients));
    const double step_seconds = seconds_since(step_start);
    busy_seconds += step_seconds;
    const double tokens_per_second = tokens_per_iteration / step_seconds;
    const double mfu = flops_per_token * tokens_per_second / (peak * 1e9 * parallel.world_size());
    result.losses.push_back(static_cast<float>(loss));
    result.last_loss = static_cast<float>(loss);
    train_curve.push_back({static_cast<double>(iteration + 1), loss});
    OCTET_CHECK(std::isfinite(loss), "training diverged: loss is ", loss, " at iteration ",
                iteration + 1, " (try --precision bf16, a lower --lr, or --clip-grad)");

    nlohmann::json record = {{"step", iteration + 1},
                             {"loss", loss},
                             {"lr", lr},
                             {"grad_norm", grad_norm},
                             {"tokens_per_s", tokens_per_second},
                             {"mfu", mfu}};
    if (ddp) {
      const CommStats grads = ddp->take_stats();
      record["grad_comm_s"] = grads.total_seconds;
      record["grad_comm_exposed_s"] = grads.exposed_seconds;
      result.grad_comm_seconds += grads.total_seconds;
      result.grad_exposed_seconds += grads.exposed_seconds;
    }
    if (zero) {
      const CommStats gathers = zero->take_stats();
      record["param_gather_s"] = gathers.total_seconds;
      result.param_gather_seconds += gathers.total_seconds;
    }
    if (o.fp8_stats) {
      record["fp8"] = fp8_stats;
      fp8_summary.add(fp8_stats);
    }
    const bool last = iteration + 1 == o.train_iters;
    if (valid_batches && o.eval_iters > 0 &&
        (last || (o.eval_interval > 0 && (iteration + 1) % o.eval_interval == 0))) {
      result.last_val_loss = evaluate();
      record["val_loss"] = result.last_val_loss;
      valid_curve.push_back({static_cast<double>(iteration + 1), result.last_val_loss});
    }
    if (chief) metrics.write(record);
    const int64_t done = iteration + 1 - start_iteration;
    if (!quiet &&
        (last || done == 1 || (o.log_interval > 0 && (iteration + 1) % o.log_interval == 0))) {
      const double eta = busy_seconds / done * static_cast<double>(o.train_iters - iteration - 1);
      std::printf(
          "iter %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.1f%% "
          "| ETA %s",
          (long long)(iteration + 1), (long long)o.train_iters, loss, lr, grad_norm,
          tokens_per_second, 100 * mfu, format_duration(eta).c_str());
      if (record.contains("val_loss")) std::printf(" | val loss %.4f", result.last_val_loss);
      std::printf("\n");
      std::fflush(stdout);
    }
    if (!o.save.empty() &&
        (last || (o.save_interval > 0 && (iteration + 1) % o.save_interval == 0))) {
      save(iteration + 1);
    }
    result.iterations = iteration + 1;
  }
  const int64_t trained = result.iterations - start_iteration;
  if (trained > 0) {
    result.tokens_per_second = trained * tokens_per_iteration / busy_seconds;
    result.mfu = flops_per_token * result.tokens_per_second / (peak * 1e9 * parallel.world_size());
  }
  result.world_size = parallel.world_size();
  if (!o.plot.empty() && chief) {
    std::vector<std::pair<std::string, std::vector<CurvePoint>>> series = {{"train", train_curve}};
    if (!valid_curve.empty()) series.emplace_back("validation", valid_curve);
    if (std::isfinite(entropy) && !train_curve.empty()) {
      series.emplace_back("unigram entropy",
                          std::vector<CurvePoint>{{train_curve.front().x, entropy},
                                                  {train_curve.back().x, entropy}});
    }
    write_loss_svg(o.plot, config.name + " loss (" + o.precision + ")", series);
  }
  if (!quiet) {
    std::printf("done: %lld iterations in %s, %.0f tok/s, MFU %.1f%%, final loss %.4f",
                (long long)trained, format_duration(seconds_since(run_start)).c_str(),
                result.tokens_per_second, 100 * result.mfu, result.last_loss);
    if (std::isfinite(result.last_val_loss)) std::printf(", val loss %.4f", result.last_val_loss);
    if (std::isfinite(result.last_val_loss) && std::isfinite(entropy)) {
      const double gap = entropy - result.last_val_loss;
      std::printf(" (%.3f nats %s the unigram entropy %.3f)", std::fabs(gap),
                  gap >= 0 ? "below" : "above", entropy);
    }
    std::printf("\n");
    if (ddp) {
      std::printf(
          "data-parallel gradient reduction: %.2f s in flight, %.2f s exposed (%.0f%% hidden "
          "behind backward)%s\n",
          result.grad_comm_seconds, result.grad_exposed_seconds,
          100.0 * (result.grad_comm_seconds > 0
                       ? 1.0 - result.grad_exposed_seconds / result.grad_comm_seconds
                       : 1.0),
          zero ? detail::concat("; parameter all-gathers ", result.param_gather_seconds, " s")
                     .c_str()
               : "");
    }
    if (!fp8_summary.empty()) {
      std::printf("FP8 tensors over %lld steps (underflow: mean, saturated: max):\n%s",
                  (long long)trained, fp8_summary.table().c_str());
    }
  }
  return result;
}

}  // namespace octet
