// The trainer's mixture-of-experts parts: after each step the loads summed over every copy of a
// layer and the expert biases moved; the balance over a window of steps; the expert-parallel
// exchange's figures; and which tensors an expert rank writes into its checkpoint shard.
#include <algorithm>
#include <cstdio>
#include <set>
#include <span>

#include "octet/ops/elementwise.h"
#include "train/training_run.h"

namespace octet::train_detail {

nlohmann::json TrainingRun::balance_experts(bool applied) {
  const std::vector<TrainableModel::MoELayerRef> held = model_->moe_layers();
  // A mixture-of-experts model has one in every layer: every stage holds some, or none does.
  if (held.empty()) return nullptr;
  // Per layer of the whole model: E loads, then the auxiliary and z losses, the dropped pairs
  // and the micro-batches, filled where held and summed over the world: every copy of a layer
  // (data replicas, pipeline ranks under DualPipe) adds its micro-batches. Tensor ranks hold
  // the same tokens: their sum is divided out.
  const int64_t experts = held.front().moe->options().num_experts, width = experts + 4;
  const int64_t layers = family_->num_layers();
  Tensor sums = Tensor::zeros({layers * width}, DType::F32);
  for (const TrainableModel::MoELayerRef& ref : held) {
    const MoELayer::Load load = ref.moe->take_load();
    float* v = sums.data<float>() + ref.layer * width;
    for (int64_t e = 0; e < experts; ++e)
      v[e] += static_cast<float>(load.tokens[static_cast<size_t>(e)]);
    v[experts] += static_cast<float>(load.aux_loss);
    v[experts + 1] += static_cast<float>(load.z_loss);
    v[experts + 2] += static_cast<float>(load.dropped);
    v[experts + 3] += static_cast<float>(load.micro_batches);
  }
  parallel_->world().all_reduce(sums, ReduceOp::Sum);
  ops::scale(std::span<Tensor>(&sums, 1), 1.0f / static_cast<float>(parallel_->tensor().size()));
  double worst = 0.0, aux = 0.0, z = 0.0, dropped = 0.0, routed = 0.0;
  std::vector<std::vector<double>> tokens(static_cast<size_t>(layers));
  for (int64_t layer = 0; layer < layers; ++layer) {
    const float* v = sums.data<float>() + layer * width;
    std::vector<double>& t = tokens[static_cast<size_t>(layer)];
    t.assign(v, v + experts);
    double total = 0.0, most = 0.0;
    for (double x : t) {
      total += x;
      most = std::max(most, x);
    }
    const double micro_batches = std::max<double>(v[experts + 3], 1.0);
    if (total > 0) worst = std::max(worst, most / (total / static_cast<double>(experts)));
    aux += v[experts] / micro_batches;
    z += v[experts + 1] / micro_batches;
    dropped += v[experts + 2];
    routed += total;
  }
  if (applied) {
    for (const TrainableModel::MoELayerRef& ref : held) {
      ref.moe->update_expert_bias(tokens[static_cast<size_t>(ref.layer)]);
    }
  }
  const double count = static_cast<double>(layers);
  return {{"load_max_over_mean", worst},
          {"tokens_per_expert", tokens},  // [layer][expert], this step's (for windowed balance)
          {"aux_loss", aux / count},
          {"z_loss", z / count},
          {"dropped", routed > 0 ? dropped / routed : 0.0}};
}

void TrainingRun::remember_balance(const nlohmann::json& moe) {
  recent_loads_.push_back(moe["tokens_per_expert"].get<std::vector<std::vector<double>>>());
  recent_step_balance_.push_back(moe["load_max_over_mean"].get<double>());
  if (recent_loads_.size() > kBalanceWindow) {
    recent_loads_.pop_front();
    recent_step_balance_.pop_front();
  }
}

// The expert all-to-all of the step (every MoE layer's dispatcher) into its metrics record.
void TrainingRun::record_exchange_stats(nlohmann::json& record) {
  ExpertDispatcher::Stats sum;
  for (const TrainableModel::MoELayerRef& ref : model_->moe_layers()) {
    const ExpertDispatcher::Stats s = ref.moe->take_exchange_stats();
    sum.transfer_seconds += s.transfer_seconds;
    sum.waited_seconds += s.waited_seconds;
    sum.bytes += s.bytes;
  }
  record["expert_a2a_s"] = sum.transfer_seconds;
  // Exposed: the seconds every thread of model work waited on an exchange at once (with one
  // thread, the sum of the waits; DualPipe's overlapped F&B hides one thread's wait under the
  // other's compute).
  const double exposed = ExpertDispatcher::take_exposed_seconds();
  record["expert_a2a_exposed_s"] = exposed;
  record["expert_a2a_bytes"] = sum.bytes;
  result_.expert_comm_seconds += sum.transfer_seconds;
  result_.expert_exposed_seconds += exposed;
  result_.expert_comm_bytes += sum.bytes;
}

void TrainingRun::print_experts_summary() const {
  if (!recent_loads_.empty()) {
    // Balance over the window: each layer's tokens per expert summed over the last steps
    // (what the expert bias steers), beside the single steps' (one batch's content moves it).
    double worst = 0.0;
    for (size_t layer = 0; layer < recent_loads_.front().size(); ++layer) {
      std::vector<double> sum(recent_loads_.front()[layer].size(), 0.0);
      for (const auto& step : recent_loads_) {
        for (size_t e = 0; e < sum.size(); ++e) sum[e] += step[layer][e];
      }
      double total = 0.0, most = 0.0;
      for (double t : sum) {
        total += t;
        most = std::max(most, t);
      }
      if (total > 0) worst = std::max(worst, most * static_cast<double>(sum.size()) / total);
    }
    double per_step = 0.0;
    for (double b : recent_step_balance_) per_step += b;
    per_step /= static_cast<double>(recent_step_balance_.size());
    std::printf(
        "experts: tokens per expert over the last %zu steps, worst layer max/mean %.3f (single "
        "steps: %.3f on average)\n",
        recent_loads_.size(), worst, per_step);
  }
  if (experts_split_) {
    const double total = result_.expert_comm_seconds;
    std::printf(
        "expert all-to-all (dispatch and combine, forward and backward; rank 0): %.2f s in "
        "flight, %.2f s exposed (%.0f%% hidden behind compute), %.1f MB sent%s\n",
        total, result_.expert_exposed_seconds,
        100.0 * (total > 0 ? 1.0 - result_.expert_exposed_seconds / total : 1.0),
        static_cast<double>(result_.expert_comm_bytes) / 1e6,
        fp8_ && o_.moe_dispatch_fp8 ? " (forward dispatch in FP8)" : "");
  }
}

// Under expert parallelism expert rank 0 writes the stage's shared tensors and every expert
// rank its own experts: the others leave out what rank 0 writes (every tensor named after a
// parameter that is not an expert's: "NAME", "grad.NAME", "NAME.exp_avg", ...).
void TrainingRun::keep_own_experts(Checkpoint& part) {
  if (!experts_split_ || parallel_->expert_rank() == 0) return;
  TensorMap experts;
  for (Parameter* p : model_->parameters()) {
    if (p->shard.expert) experts[p->name] = p->value;
  }
  std::set<std::string> kept;
  for (const auto& [name, value] : experts) {
    for (const char* prefix : {"", "grad.", "before.", "update."}) kept.insert(prefix + name);
    for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) kept.insert(name + suffix);
  }
  for (const auto& [name, value] : model_->to_checkpoint_names(experts)) kept.insert(name);
  for (TensorMap* map : {&part.model, &part.optimizer}) {
    for (auto it = map->begin(); it != map->end();) {
      it = kept.count(it->first) ? std::next(it) : map->erase(it);
    }
  }
}

}  // namespace octet::train_detail
