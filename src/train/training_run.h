// One training run: what a rank trains and how, assembled from the layout by one factory
// (TrainingRun::TrainingRun, run_factory.cpp), and the loop over steps made of short
// functions (trainer.cpp). Nothing here asks which model it trains: the model is a
// TrainableModel; only the factory knows the layout (which model part, whether a pipeline
// executor runs it, which optimizer and data-parallel wrapper hold its gradients).
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "octet/comm.h"
#include "octet/data_parallel.h"
#include "octet/fp4.h"
#include "octet/model.h"
#include "octet/pipeline.h"
#include "octet/recipe.h"
#include "octet/train.h"
#include "train/batcher.h"
#include "train/model_family.h"

namespace octet::train_detail {

class TrainingRun {
 public:
  explicit TrainingRun(const TrainOptions& options);  // the factory: checks, then builds
  TrainResult run();

 private:
  using Clock = std::chrono::steady_clock;

  // --- the factory (run_factory.cpp) ---
  void check_options();
  void open_data();
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout) const;
  void build_pipeline();
  void load_checkpoint_state();
  void build_data_parallel();
  void build_optimizer();
  void restore_fp8_state();
  void print_setup() const;
  std::vector<Parameter*> pipeline_backward_order() const;
  // The part's parameters outside --freeze (checked: each prefix names a parameter).
  std::vector<Parameter*> select_trained() const;
  // --pretrained-checkpoint: the tensors of the model that the directory holds.
  void load_pretrained();

  // --- the loop (trainer.cpp) ---
  double run_micro_batches(int64_t iteration);
  void finish_gradients();
  double optimizer_step(float lr);
  // Mixture of experts, after the step: each layer's load summed over the data ranks, its
  // expert bias moved (if the step was applied), the balance as a record (null: dense model).
  nlohmann::json balance_experts(bool applied);
  std::string first_nonfinite_gradient() const;
  void skip_nonfinite_step(int64_t step, double loss, double grad_norm);
  float evaluate();
  void save(int64_t iteration);
  int agreed_stop_signal(int received);
  void stop_early(int64_t iteration, int signal);
  TensorMap whole_parameters();
  TensorMap whole_gradients();
  void dump(int64_t step, TensorMap tensors);
  void save_fp8_states(TensorMap& out) const;
  // Mixture of experts (experts.cpp).
  void keep_own_experts(Checkpoint& part);
  void remember_balance(const nlohmann::json& moe);
  void record_exchange_stats(nlohmann::json& record);
  void print_experts_summary() const;
  nlohmann::json record_step(int64_t iteration, double loss, float lr, double grad_norm,
                             double step_seconds);
  void print_progress(int64_t iteration, const nlohmann::json& record, double busy_seconds) const;
  void finish(double run_seconds);
  nlohmann::json trainer_state(int64_t iteration) const;
  int64_t optimizer_steps() const;

  const TrainOptions& o_;
  std::unique_ptr<ModelFamily> family_;  // what is trained: GPT, ViT
  int64_t seq_len_ = 0, global_batch_ = 0;
  DType dtype_ = DType::F32;
  bool fp8_ = false, delayed_scaling_ = false;
  recipe::Recipe recipe_;
  bool fp4_ = false;
  Fp4Options fp4_options_;

  std::shared_ptr<Communicator> world_;
  std::unique_ptr<ParallelState> parallel_;
  // DualPipe's overlapped F&B: second copies of the expert and context groups for chunk 1.
  std::shared_ptr<Communicator> expert_copy_, context_copy_;
  bool pipelined_ = false, chief_ = true, quiet_ = false, data_parallel_ = false;
  // dp_: the data group that reduces gradients (DP x CP ranks); samples_: the ranks of it that
  // read different samples (DP / CP), sample_rank_ this rank's index among them; cp_: the ranks
  // that split each of those samples' sequences.
  int64_t dp_ = 1, samples_ = 1, sample_rank_ = 0, cp_ = 1;
  bool experts_split_ = false;  // expert parallelism (EP > 1)
  // Micro-batches per step on this rank; the step's k-th micro-batch of sample rank d is the
  // step's (k * samples + d)-th, so any DP size sees the same global batch.
  int64_t accumulation_ = 1, micro_batches_per_step_ = 1;

  std::unique_ptr<DataSource> train_batches_, valid_batches_;
  // Nats of a model that ignores its input (a language model's unigram entropy, a
  // classifier's uniform guess); NaN: not known.
  double entropy_ = 0;
  float last_val_accuracy_ = NAN;  // classifiers

  std::unique_ptr<TrainableModel> model_;  // this rank's part of the model
  std::vector<Parameter*> trained_;        // the part's parameters the optimizer updates (--freeze)
  std::vector<Parameter*> frozen_;         // the others: outside the data-parallel buckets
  std::unique_ptr<pipeline::PipelineExecutor> executor_;  // pipeline parallelism only
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<DistributedOptimizer> zero_;
  std::unique_ptr<AdamW> adamw_;
  AdamWOptions adam_;
  // Gradients reduced over the data ranks while backward runs (and sequence-parallel ones
  // summed over the tensor ranks there too).
  bool overlap_ = false;
  bool last_micro_batch_ = true;  // of the step: the one whose gradients are final

  TensorMap loaded_model_, loaded_optimizer_;
  int64_t loaded_steps_ = 0, start_iteration_ = 0;
  int64_t saved_iteration_ = -1;  // of the last checkpoint this run wrote

  std::vector<Fp8State*> fp8_part_;
  std::vector<int64_t> fp8_index_;

  double peak_gflops_ = 0, flops_per_token_ = 0;
  int64_t tokens_per_iteration_ = 0;
  std::unique_ptr<MetricsWriter> metrics_;
  Fp8StatsSummary fp8_summary_;
  TrainResult result_;
  std::vector<CurvePoint> train_curve_, valid_curve_;
  std::vector<CurvePoint> accuracy_curve_;  // classifiers: validation accuracy in percent
  // Mixture of experts: the tokens per expert of the last kBalanceWindow steps ([layer][expert]
  // each), and the steps' worst-layer max/mean, for the summary's balance over a window.
  static constexpr size_t kBalanceWindow = 100;
  std::deque<std::vector<std::vector<double>>> recent_loads_;
  std::deque<double> recent_step_balance_;
};

}  // namespace octet::train_detail
