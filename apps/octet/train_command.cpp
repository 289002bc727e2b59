// `octet train`: trains a GPT or a ViT (Megatron's flag names), see src/train/trainer.cpp.
#include <memory>

#include "commands.h"
#include "octet/comm.h"
#include "octet/train.h"

namespace octet::cli {

namespace {

// Mixture of experts (configs with num_experts): Megatron's flags, each overriding the config.
void add_moe_flags(CLI::App* cmd, TrainOptions* o) {
  cmd->add_option("--moe-router-topk", o->moe_router_topk, "Experts per token (MoE configs)")
      ->check(at_least(1));
  cmd->add_option("--moe-aux-loss-coeff", o->moe_aux_loss_coeff,
                  "Switch-style load-balancing loss coefficient (MoE configs; 0: off)")
      ->check(at_least(0));
  cmd->add_option("--moe-z-loss-coeff", o->moe_z_loss_coeff, "Router z-loss coefficient")
      ->check(at_least(0));
  // A callback, so that the config's value holds unless one of the two is given.
  cmd->add_flag_function(
      "--moe-router-enable-expert-bias,!--no-moe-router-enable-expert-bias",
      [o](int64_t count) { o->moe_router_enable_expert_bias = count > 0; },
      "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the routing scores, "
      "moved after each step towards the mean load");
  cmd->add_option("--moe-router-bias-update-rate", o->moe_router_bias_update_rate,
                  "The expert bias's step per update (default 1e-3)")
      ->check(at_least(0));
  cmd->add_option("--moe-expert-capacity-factor", o->moe_expert_capacity_factor,
                  "Token dropping: each expert computes at most ceil(tokens x topk / experts x "
                  "factor) of its routed tokens (0: dropless, the default)")
      ->check(at_least(0));
  cmd->add_option("--moe-token-drop-policy", o->moe_token_drop_policy,
                  "Which routed tokens an expert over capacity keeps: probs (the highest "
                  "probabilities) | position (the first)")
      ->check(CLI::IsMember({"probs", "position"}));
  cmd->add_flag("--moe-dispatch-fp8", o->moe_dispatch_fp8,
                "With --expert-model-parallel-size under --precision fp8: dispatch tokens as E4M3 "
                "with 1x128 block scales (DeepEP's) instead of BF16");
}

// Parallelism: run under `mpirun -np N`; data-parallel size = N / (TP x PP).
void add_parallel_flags(CLI::App* cmd, TrainOptions* o) {
  cmd->add_option("--tensor-model-parallel-size", o->tensor_model_parallel_size,
                  "Tensor-parallel ranks (consecutive ranks)")
      ->check(at_least(1));
  cmd->add_flag("--sequence-parallel", o->sequence_parallel,
                "With tensor parallelism: norms, residuals and dropout-free adds on token shards");
  cmd->add_flag(
      "--tp-comm-overlap", o->tp_comm_overlap,
      "With --sequence-parallel: overlap each all-gather with the GEMM of the local rows");
  cmd->add_option("--pipeline-model-parallel-size", o->pipeline_model_parallel_size,
                  "Pipeline stages")
      ->check(at_least(1));
  cmd->add_option("--pipeline-schedule", o->pipeline_schedule,
                  "1f1b | interleaved | zb1p | dualpipe | dualpipev");
  cmd->add_option("--expert-model-parallel-size", o->expert_model_parallel_size,
                  "Mixture of experts: ranks splitting the experts (divides the data-parallel "
                  "size)")
      ->check(at_least(1));
  cmd->add_option("--context-parallel-size", o->context_parallel_size,
                  "Ranks splitting each sequence (divides the data-parallel size): attention "
                  "exchanges keys and values")
      ->check(at_least(1));
  cmd->add_option("--cp-comm-type", o->cp_comm_type,
                  "Context parallelism's exchange: p2p (ring attention) | a2a (Ulysses)")
      ->check(CLI::IsMember({"p2p", "a2a"}));
  cmd->add_flag("--dualpipe-overlap,!--no-dualpipe-overlap", o->dualpipe_overlap,
                "DualPipe with expert or context parallelism: run each F&B pair's forward and "
                "backward at once, one's exchanges under the other's compute (default on)");
  cmd->add_option("--virtual-pipeline-model-parallel-size", o->virtual_stages,
                  "Chunks per rank of the interleaved schedule")
      ->check(at_least(1));
  cmd->add_flag("--use-distributed-optimizer", o->use_distributed_optimizer,
                "ZeRO-1: shard AdamW state and master weights across data-parallel ranks");
  cmd->add_flag("--overlap-grad-reduce,!--no-overlap-grad-reduce", o->overlap_grad_reduce,
                "Reduce each gradient bucket as soon as backward finalizes it (default on)");
  cmd->add_option("--ddp-bucket-size", o->ddp_bucket_size, "Elements per gradient bucket")
      ->check(at_least(1));
}

}  // namespace

void register_train(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("train",
                                     "Train a GPT on a token shard, or a ViT (a config with "
                                     "\"model\": \"vit\") on IDX images (or --mock-data)");
  auto o = std::make_shared<TrainOptions>();
  o->config_path = "gpt-mini";
  cmd->add_option("--config", o->config_path, "Model config JSON, or a name (gpt-mini, vit-fmnist)")
      ->check(model_config_validator());
  cmd->add_option("--train-data", o->train_data,
                  "Training token shard (octet tokenize -o); for a ViT a directory of IDX files "
                  "(its train-* split, e.g. /usr/share/datasets/fashion-mnist)")
      ->check(CLI::ExistingPath);
  cmd->add_option("--valid-data", o->valid_data,
                  "Validation token shard; for a ViT a directory of IDX files (its t10k-* split)")
      ->check(CLI::ExistingPath);
  cmd->add_flag("--mock-data", o->mock_data, "Random tokens (or images) instead of a corpus");
  cmd->add_flag("--image-augment", o->image_augment,
                "Image models: random left-right flips and shifts of up to 2 pixels (training)");
  cmd->add_option("--seq-length", o->seq_length, "Tokens per sequence (default: the config's)")
      ->check(at_least(0));
  cmd->add_option("--vocab-size", o->vocab_size,
                  "Model vocabulary (default: the tokenizer's with --vocab-dir, else the "
                  "config's)")
      ->check(at_least(1));
  cmd->add_option("--vocab-dir", o->vocab_dir,
                  "Tokenizer the data was made with (octet learn-bpe -o): sets the vocabulary "
                  "and is saved in checkpoints for octet generate")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--micro-batch-size", o->micro_batch_size, "Sequences per forward/backward")
      ->check(at_least(1));
  cmd->add_option("--global-batch-size", o->global_batch_size,
                  "Sequences per optimizer step (gradient accumulation)")
      ->check(at_least(0));
  cmd->add_option("--train-iters", o->train_iters, "Optimizer steps")->check(at_least(1));
  cmd->add_option("--lr", o->lr, "Peak learning rate")->check(at_least(0));
  cmd->add_option("--min-lr", o->min_lr, "Learning rate at the end of the cosine decay")
      ->check(at_least(0));
  cmd->add_option("--lr-warmup-iters", o->lr_warmup_iters, "Linear warmup steps")
      ->check(at_least(0));
  cmd->add_option("--clip-grad", o->clip_grad, "Global gradient-norm clip (0: off)")
      ->check(at_least(0));
  cmd->add_option("--weight-decay", o->weight_decay, "AdamW weight decay (matrices only)")
      ->check(at_least(0));
  cmd->add_option("--adam-beta1", o->adam_beta1, "AdamW beta1")
      ->check(number_in(0, 1, false, true));
  cmd->add_option("--adam-beta2", o->adam_beta2, "AdamW beta2")
      ->check(number_in(0, 1, false, true));
  cmd->add_option("--precision", o->precision,
                  "fp32 | bf16 | fp8 | fp4 (fp4: the Linear layers' GEMMs in FP4, the rest BF16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp8", "fp4"}));
  cmd->add_option("--fp4-recipe", o->fp4_recipe,
                  "nvfp4 (1x16 E4M3 + FP32 tensor scales, 16x16 weights, stochastic rounding of "
                  "gradients, random Hadamard transform in wgrad) | mxfp4 (1x32 E8M0)")
      ->check(CLI::IsMember({"nvfp4", "mxfp4"}));
  cmd->add_option("--fp8-recipe", o->fp8_recipe, "delayed | current | mxfp8 | block")
      ->check(CLI::IsMember({"delayed", "current", "mxfp8", "block"}));
  cmd->add_option("--fp8-format", o->fp8_format, "hybrid | e4m3")
      ->check(CLI::IsMember({"hybrid", "e4m3"}));
  cmd->add_option("--fp8-amax-history-len", o->fp8_amax_history_len, "Delayed-scaling window")
      ->check(at_least(1));
  cmd->add_flag("--fp8-dpa", o->fp8_dpa,
                "FP8 attention (TransformerEngine's fp8_dpa): Q, K, V, the probabilities, dO and "
                "the score gradients in FP8 inside DotProductAttention (--fp8-recipe delayed)");
  cmd->add_option(
         "--freeze", o->freeze,
         "Parameter name prefixes, comma-separated (e.g. vision_model.,visual_projection): "
         "those parameters keep their weights and get no optimizer state")
      ->delimiter(',');
  cmd->add_option("--pretrained-checkpoint", o->pretrained_checkpoint,
                  "A checkpoint directory to start from: each tensor with a name and shape of "
                  "this model is loaded (e.g. a CLIP's vision_model.* into a captioner); "
                  "ignored when --load resumes")
      ->check(CLI::ExistingDirectory);
  cmd->add_flag("--first-last-layers-bf16", o->first_last_layers_bf16,
                "Under fp8 / fp4: the first and last transformer layers in BF16 (counts below)");
  cmd->add_option("--num-layers-at-start-in-bf16", o->num_layers_at_start_in_bf16,
                  "With --first-last-layers-bf16: leading layers in BF16")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--num-layers-at-end-in-bf16", o->num_layers_at_end_in_bf16,
                  "With --first-last-layers-bf16: trailing layers in BF16")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_flag("--fp8-stats", o->fp8_stats,
                "Per FP8 (or FP4) tensor: amax, scale, underflow and saturation in each metrics "
                "line, a summary table at the end");
  cmd->add_flag("--recompute-activations", o->recompute_activations,
                "Keep only layer inputs; recompute in backward");
  add_moe_flags(cmd, o.get());
  cmd->add_option("--eval-interval", o->eval_interval, "Validate every N steps")
      ->check(at_least(0));
  cmd->add_option("--eval-iters", o->eval_iters, "Validation micro-batches")->check(at_least(0));
  cmd->add_option("--log-interval", o->log_interval, "Print progress every N steps")
      ->check(at_least(0));
  cmd->add_option("--save", o->save, "Checkpoint directory to write")->check(output_directory());
  cmd->add_option("--load", o->load, "Checkpoint directory to resume from")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--save-interval", o->save_interval, "Checkpoint every N steps (0: at the end)")
      ->check(at_least(0));
  cmd->add_option("--dump-grads", o->dump_grads,
                  "After each step write DIR/step-N: the step's gradients (whole-model names, "
                  "gathered from every shard and stage), the updated parameters, FP8 states")
      ->check(output_directory());
  cmd->add_option("--dump-steps", o->dump_steps, "Steps --dump-grads writes (default: every one)")
      ->delimiter(',')
      ->check(at_least(1));
  cmd->add_flag("--skip-nonfinite-steps", o->skip_nonfinite_steps,
                "A step with a NaN/Inf loss or gradient norm is skipped (counted) instead of "
                "stopping the run; the update never happens either way");
  cmd->add_option("--metrics", o->metrics, "Write metrics as JSON lines to FILE")
      ->check(output_file());
  cmd->add_option("--plot", o->plot,
                  "Write the loss curve as an SVG to FILE (classifiers: also FILE-accuracy.svg)")
      ->check(output_file());
  cmd->add_option("--seed", o->seed, "Seed for initialization and data order");
  cmd->add_option("--peak-gflops", o->peak_gflops,
                  "BF16 GEMM peak for MFU (default: measured at start-up)")
      ->check(at_least(0));
  add_parallel_flags(cmd, o.get());
  auto comm_timeout = std::make_shared<double>(kDefaultCommunicationTimeout);
  CLI::Option* comm_timeout_flag =
      cmd->add_option("--comm-timeout", *comm_timeout,
                      "Seconds a collective or pipeline transfer may wait before the run stops "
                      "naming it and the ranks that do not answer (a stopped or lost rank); 0: "
                      "forever (default: OCTET_COMM_TIMEOUT, else 60)")
          ->check(number_in(0, 1e9));
  cmd->callback([o, comm_timeout, comm_timeout_flag] {
    if (comm_timeout_flag->count() > 0) set_communication_timeout(*comm_timeout);
    TrainOptions options = *o;
    options.config_path = resolve_config(o->config_path).string();
    const TrainResult result = train_gpt(options);
    // Stopped by SIGTERM/SIGINT after a step (and saved, with --save): EX_TEMPFAIL of
    // sysexits.h, "try again later", so a job script can tell a preemption from a failure.
    if (result.stop_signal != 0) throw CLI::RuntimeError(kExitStoppedBySignal);
  });
}

}  // namespace octet::cli
