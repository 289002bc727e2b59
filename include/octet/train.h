// Training pieces: the learning-rate schedule, AdamW over a module's parameters (FP32
// masters), checkpoints, metrics and the loss-curve picture.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/modules.h"
#include "octet/ops/optimizer.h"
#include "octet/pipeline_stage.h"
#include "octet/safetensors.h"
#include "octet/trainable_model.h"

namespace octet {

// Megatron's schedule: linear warmup from 0 to lr over warmup_iters, then cosine decay to
// min_lr at decay_iters, min_lr after.
struct LrSchedule {
  float lr = 6e-4f;
  float min_lr = 6e-5f;
  int64_t warmup_iters = 0;
  int64_t decay_iters = 1;
  float at(int64_t iteration) const;  // iteration counts from 0
};

class AdamW {
 public:
  AdamW(std::vector<Parameter*> parameters, const AdamWOptions& options);
  // Clips the gradients to the global norm, updates every parameter, returns the norm
  // before clipping. A non-finite norm skips the update (and is returned for the caller).
  double step(float lr);
  int64_t steps() const { return steps_; }
  // exp_avg / exp_avg_sq per parameter name, plus the step count.
  TensorMap state() const;
  void load_state(const TensorMap& state, int64_t steps);

 private:
  std::vector<Parameter*> parameters_;
  AdamWOptions options_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  int64_t steps_ = 0;
};

// A checkpoint directory: model.safetensors, optimizer.safetensors, trainer.json. Written
// into DIR.tmp and renamed over DIR, so an interrupted save never destroys the last one.
struct Checkpoint {
  TensorMap model;
  TensorMap optimizer;
  nlohmann::json trainer;  // config, step, rng state, data position ...
  // Files copied into the checkpoint as they are (name in the checkpoint -> source path), e.g.
  // the tokenizer's tokenizer/encoder.json and tokenizer/vocab.bpe; digested like the rest.
  std::vector<std::pair<std::string, std::string>> files;
};
void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint);
// Whether a floating-point tensor (F32, BF16, F16) holds a NaN or an infinity.
bool has_nonfinite(const Tensor& tensor);
// The name of the first floating-point tensor (in name order) holding a NaN or an infinity,
// or "" when all are finite.
std::string first_nonfinite(const TensorMap& tensors);
// Optimizer state (NAME.exp_avg and NAME.exp_avg_sq per parameter) between whole-model
// tensors and a model part's slices of them (TrainableModel::shard / gather; identities where
// nothing is split). Sharding replaces the entries of the part's parameters, keeps the others
// (FP8 state, other stages' tensors) and names `source` in the error for a missing one.
// Gathering returns the part's parameters' whole tensors (collective over the tensor group).
// `trained`: the parameters the optimizer updates (all of the part's but the frozen ones).
TensorMap shard_optimizer_state(TrainableModel& model, const std::vector<Parameter*>& trained,
                                TensorMap whole, const std::string& source);
TensorMap gather_optimizer_state(TrainableModel& model, const std::vector<Parameter*>& trained,
                                 const TensorMap& local);
// Sharded by pipeline stage (collective over the world): the first tensor- and data-parallel
// rank of each stage writes model-pp{S}.safetensors and optimizer-pp{S}.safetensors with its
// part (GPT names), rank 0 writes trainer.json listing the shards and the layout, then swaps
// the directory in. Tensors keep their whole-model names, so the checkpoint loads at any
// layout.
class ParallelState;
void save_checkpoint_sharded(const std::string& dir, const Checkpoint& part,
                             ParallelState& parallel);
// Either form; a sharded checkpoint comes back merged into whole-model maps. Clear errors for
// missing / corrupt parts.
Checkpoint load_checkpoint(const std::string& dir);

// Appends one JSON object per line; flushes each line so a crash loses nothing.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);
  void write(const nlohmann::json& record);
  bool enabled() const { return !path_.empty(); }

 private:
  std::string path_;
};

struct CurvePoint {
  double x = 0;
  double y = 0;
};
// An SVG line chart of one or more named series (e.g. train and validation loss by step).
void write_loss_svg(const std::string& path, const std::string& title,
                    const std::vector<std::pair<std::string, std::vector<CurvePoint>>>& series);

}  // namespace octet

namespace octet {

// Per tensor over a run: max amax, min and max scale, mean underflow, max saturation.
class Fp8StatsSummary {
 public:
  void add(const nlohmann::json& step_stats);  // one take_fp8_stats result
  bool empty() const { return entries_.empty(); }
  nlohmann::json to_json() const;  // {name: {max_amax, min_scale, max_scale, mean_underflow,
                                   //  max_saturated, steps}}
  std::string table() const;       // the same as aligned text, percentages for the fractions

 private:
  struct Entry {
    std::string name;
    double max_amax = 0, min_scale = 0, max_scale = 0;
    double underflow_sum = 0, max_saturated = 0;
    int64_t steps = 0;
  };
  std::vector<Entry> entries_;  // first-seen order
};

// Everything `octet train` takes (Megatron's flag names in the CLI).
struct TrainOptions {
  std::string config_path;  // configs/gpt-mini.json (GPT), configs/vit-fmnist.json (ViT)
  std::string train_data;   // token shard (octet tokenize -o); ViT: a directory of IDX files
  std::string valid_data;   // the same for validation (ViT: the directory's test split)
  bool mock_data = false;   // random tokens instead of the shards
  // Image models: each training image flipped left-right with probability 1/2 and shifted by
  // up to 2 pixels each way (zero fill), drawn from (seed, sample): the same on resume.
  bool image_augment = false;
  int64_t seq_length = 0;  // 0 = the config's max_seq_len
  int64_t vocab_size = 0;  // 0 = the config's vocab_size (else overrides it)
  std::string vocab_dir;   // the tokenizer the data was made with: copied into checkpoints
  int64_t micro_batch_size = 8;
  int64_t global_batch_size = 0;  // a multiple of micro_batch_size (accumulation); 0 = micro
  int64_t train_iters = 100;
  float lr = 6e-4f;
  float min_lr = 6e-5f;
  int64_t lr_warmup_iters = 10;
  float clip_grad = 1.0f;
  float weight_decay = 0.1f;
  float adam_beta1 = 0.9f;
  float adam_beta2 = 0.95f;
  std::string precision = "bf16";      // fp32 | bf16 | fp8 | fp4
  std::string fp8_recipe = "delayed";  // delayed | current | mxfp8 | block
  std::string fp4_recipe = "nvfp4";    // nvfp4 | mxfp4 (precision fp4: the Linear GEMMs)
  std::string fp8_format = "hybrid";   // hybrid | e4m3
  int64_t fp8_amax_history_len = 16;
  // FP8 attention (TransformerEngine's fp8_dpa): Q, K, V, P, dO and dS in FP8 inside
  // DotProductAttention. Needs precision fp8 with the delayed recipe.
  bool fp8_dpa = false;
  // Megatron's --first-last-layers-bf16: under fp8 or fp4, the first and last N transformer
  // layers run in BF16 (the published NVFP4 recipe keeps a few of each).
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = 1;
  int64_t num_layers_at_end_in_bf16 = 1;
  bool recompute_activations = false;
  // Mixture-of-experts overrides of the config's fields (Megatron's flags): unset, the
  // config's value holds. GPT configs with num_experts > 0 only.
  std::optional<int64_t> moe_router_topk;
  std::optional<float> moe_aux_loss_coeff, moe_z_loss_coeff, moe_router_bias_update_rate;
  std::optional<bool> moe_router_enable_expert_bias;
  std::optional<float> moe_expert_capacity_factor;
  std::optional<std::string> moe_token_drop_policy;
  // Expert parallelism under --precision fp8: the dispatched tokens travel as E4M3 with 1x128
  // block scales instead of in the activation dtype (MoELayer::set_fp8_dispatch).
  bool moe_dispatch_fp8 = false;
  // Frozen parameters: those whose names start with one of these prefixes (e.g.
  // "vision_model." for a CLIP's image tower) keep their values, and the optimizer holds no
  // state for them nor counts them in the clipping norm. Each prefix must name a parameter.
  std::vector<std::string> freeze;
  // FP8 health per quantized tensor (amax, scale, underflow, saturation) in each metrics line
  // ("fp8") and a summary table at the end. Needs precision fp8; off costs nothing.
  bool fp8_stats = false;
  int64_t eval_interval = 50;
  int64_t eval_iters = 10;
  int64_t log_interval = 10;
  std::string save;  // checkpoint directory
  std::string load;  // resume from this checkpoint directory
  // Start from another run's weights (Megatron's --pretrained-checkpoint): every tensor of the
  // model whose name and shape a checkpoint directory holds is loaded before step 1 (e.g. a
  // CLIP's vision_model.* into a captioner); the optimizer starts fresh. Ignored when --load
  // resumes a run.
  std::string pretrained_checkpoint;
  int64_t save_interval = 0;  // 0 = only at the end (when save is set)
  std::string metrics;        // JSON lines file
  std::string plot;           // loss curve SVG
  // Layout comparison: after each chosen step (1-based; empty = every step) a checkpoint-
  // shaped directory DIR/step-N with, under whole-model names gathered from shards and stages:
  // every parameter's summed, unclipped gradient ("grad.NAME"), the parameter after the
  // update ("NAME"), the update ("update.NAME") and the FP8 states.
  std::string dump_grads;
  std::vector<int64_t> dump_steps;
  uint64_t seed = 1234;
  double peak_gflops = 0;  // 0 = measure the BF16 GEMM peak at start-up
  bool quiet = false;
  // Parallelism, under `mpirun -np N`: data-parallel size = N / (tensor * pipeline). Every
  // data-parallel rank runs global_batch / (micro_batch * DP) micro-batches per step.
  int64_t tensor_model_parallel_size = 1;
  int64_t pipeline_model_parallel_size = 1;
  // A mixture of experts' experts split over this many data-parallel ranks (Megatron's
  // --expert-model-parallel-size; it divides DP): tokens travel to their experts' ranks and
  // back (all-to-all), the experts' gradients are reduced over DP / EP ranks.
  int64_t expert_model_parallel_size = 1;
  // Each sequence split over this many data-parallel ranks (Megatron's --context-parallel-size;
  // it divides DP): they read the same samples, each holds chunks r and 2CP-1-r of every
  // sequence, and self-attention exchanges keys and values - ring attention ("p2p") or
  // Ulysses' all-to-all over heads ("a2a", heads divisible by CP). GPT configs only.
  int64_t context_parallel_size = 1;
  // DualPipe with expert or context parallelism (and TP = 1): each F&B pair's forward and
  // backward run at once on two threads, so that one's all-to-all / K/V exchange waits while the
  // other computes.
  bool dualpipe_overlap = true;
  std::string cp_comm_type = "p2p";
  // With tensor parallelism: the residual stream, norms and position embedding on token
  // shards [B*T/TP, C] (Megatron's --sequence-parallel); ignored at TP = 1.
  bool sequence_parallel = false;
  // With --sequence-parallel: each column GEMM starts on this rank's token rows while the
  // all-gather brings the others' (Megatron's --tp-comm-overlap). Off by default: on one host
  // the gather costs 2-3% of the GEMM and the split GEMM lost more than that (measured).
  bool tp_comm_overlap = false;
  // Pipeline schedule (--pipeline-model-parallel-size > 1): 1f1b | interleaved | zb1p |
  // dualpipe | dualpipev; micro-batches per step = global batch / micro batch.
  std::string pipeline_schedule = "1f1b";
  int64_t virtual_stages = 2;                  // chunks per rank of the interleaved schedule
  bool use_distributed_optimizer = false;      // ZeRO-1: shard AdamW state and master weights
  bool overlap_grad_reduce = true;             // reduce gradient buckets while backward runs
  int64_t ddp_bucket_size = int64_t{1} << 22;  // elements per gradient bucket
  // A step whose loss or gradient norm is NaN or infinite never updates the parameters. By
  // default the run then stops with the step and the first non-finite gradient named
  // (Megatron's check_for_nan_in_loss_and_grad); with this set it skips the step, counts it
  // (TrainResult::skipped_steps, "skipped_steps" in the metrics) and goes on.
  bool skip_nonfinite_steps = false;
  // Megatron's --exit-signal-handler: during the run the first SIGTERM or SIGINT (on any rank)
  // finishes the current step, all ranks agree to stop after it, a checkpoint is saved when
  // `save` is set, and train_gpt returns with TrainResult::stop_signal set; a second signal
  // ends the process at once. Off: the signals keep their previous handling.
  bool exit_signal_handler = true;
  // For tests and tools: called on every rank once per step (1-based) with this rank's
  // parameters after the step's gradients are final (reduced over the data ranks), before
  // the non-finite check, clipping and the update. E.g. to inject a NaN into a gradient.
  std::function<void(int64_t step, const std::vector<Parameter*>& parameters)> after_gradients;
};

struct TrainResult {
  int64_t iterations = 0;
  float last_loss = 0;
  float last_val_loss = NAN;
  float last_val_accuracy = NAN;  // classifiers (ViT): the last validation's accuracy
  std::vector<float> losses;      // per iteration
  double tokens_per_second = 0;
  double mfu = 0;
  int world_size = 1;
  int64_t skipped_steps = 0;  // non-finite steps skipped (--skip-nonfinite-steps)
  int stop_signal = 0;        // SIGTERM / SIGINT that stopped the run early, else 0
  // Data-parallel gradient reduction over the run: wall time in flight, and the part the
  // step waited for (the rest was hidden behind backward); plus ZeRO's parameter gathers.
  double grad_comm_seconds = 0, grad_exposed_seconds = 0;
  double param_gather_seconds = 0;
  // Expert parallelism's token exchanges (MoELayer::ExchangeStats), summed over the run.
  double expert_comm_seconds = 0, expert_exposed_seconds = 0;
  int64_t expert_comm_bytes = 0;
};

// Trains the model options.config_path describes, a GPT or a ViT (its "model" key), in the
// layout mpirun gives (the name is the first model's).
TrainResult train_gpt(const TrainOptions& options);
// GFLOP/s of a BF16 2048^3 GEMM on this machine: the peak MFU is measured against.
double measure_bf16_peak_gflops();

}  // namespace octet
