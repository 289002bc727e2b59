// Gradient buckets reduced while backward runs (see include/octet/data_parallel.h).
#include "octet/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <unordered_map>

#include "octet/error.h"
#include "octet/ops/elementwise.h"
#include "octet/ops/embedding.h"
#include "octet/ops/optimizer.h"

namespace octet {

using Clock = std::chrono::steady_clock;

CommStats& CommStats::operator+=(const CommStats& other) {
  total_seconds += other.total_seconds;
  exposed_seconds += other.exposed_seconds;
  bytes += other.bytes;
  operations += other.operations;
  return *this;
}

namespace {

// Wall time covered by the union of [start, end) intervals.
double covered_seconds(std::vector<std::pair<Clock::time_point, Clock::time_point>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0;
  Clock::time_point reach{};
  bool any = false;
  for (auto [start, end] : intervals) {
    if (any && start < reach) start = reach;
    if (end > start) total += std::chrono::duration<double>(end - start).count();
    if (!any || end > reach) reach = end;
    any = true;
  }
  return total;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::vector<Parameter*> parameters,
                                                 Communicator& data,
                                                 const DataParallelOptions& options,
                                                 ExpertGroups experts)
    : data_(data), options_(options), experts_(experts), order_(std::move(parameters)) {
  OCTET_CHECK(options.bucket_elements > 0, "--ddp-bucket-size expected > 0, got ",
              options.bucket_elements);
  OCTET_CHECK((experts.expert == nullptr) == (experts.expert_data == nullptr),
              "data parallel: expert groups expected both or neither");
  // Consecutive parameters (in backward order) fill a bucket until it holds bucket_elements;
  // the experts' (under expert parallelism) fill buckets of their own.
  size_t open[2] = {SIZE_MAX, SIZE_MAX};  // the bucket being filled: dense, experts
  for (size_t i = 0; i < order_.size(); ++i) {
    Parameter* p = order_[i];
    OCTET_CHECK(p->value.dtype() == DType::F32 && p->grad.dtype() == DType::F32 &&
                    p->grad.numel() == p->value.numel(),
                "data parallel: parameter '", p->name, "' expected F32 value and gradient");
    const bool expert = p->shard.expert && experts.expert_data != nullptr;
    size_t& current = open[expert ? 1 : 0];
    if (current == SIZE_MAX || buckets_[current].elements >= options.bucket_elements) {
      current = buckets_.size();
      buckets_.emplace_back();
      buckets_.back().group = expert ? experts.expert_data : &data;
      buckets_.back().expert = expert;
    }
    Bucket& bucket = buckets_[current];
    location_.emplace_back(current, bucket.parameters.size());
    bucket.parameters.push_back(p);
    bucket.offsets.push_back(bucket.elements);
    bucket.elements += p->value.numel();
  }
  for (Bucket& bucket : buckets_) {
    const int64_t dp = bucket.group->size();
    bucket.elements = (bucket.elements + dp - 1) / dp * dp;
    bucket.values = Tensor::zeros({bucket.elements}, DType::F32);
    bucket.grads = Tensor::zeros({bucket.elements}, DType::F32);
    for (size_t k = 0; k < bucket.parameters.size(); ++k) {
      Parameter* p = bucket.parameters[k];
      const int64_t begin = bucket.offsets[k], end = begin + p->value.numel();
      Tensor value = bucket.values.slice_rows(begin, end).reshape(p->value.shape());
      value.copy_from(p->value);
      p->value = value;
      p->grad = bucket.grads.slice_rows(begin, end).reshape(p->grad.shape());
    }
    if (options.distributed_optimizer) {
      bucket.grad_shard = Tensor::zeros({bucket.elements / dp}, DType::F32);
    }
    bucket.group->broadcast(bucket.values, 0);
  }
}

void DistributedDataParallel::start(Bucket& bucket) {
  bucket.started = true;
  bucket.started_at = Clock::now();
  if (options_.distributed_optimizer) {
    bucket.work = bucket.group->ireduce_scatter(bucket.grads, bucket.grad_shard, ReduceOp::Sum);
  } else {
    bucket.work = bucket.group->iall_reduce(bucket.grads, ReduceOp::Sum);
  }
  stats_.bytes += static_cast<int64_t>(bucket.grads.nbytes());
  ++stats_.operations;
}

void DistributedDataParallel::grads_ready(const std::vector<Parameter*>& parameters) {
  if (!sync_ || !options_.overlap_grad_reduce) return;
  for (Parameter* p : parameters) {
    auto it = std::find(order_.begin(), order_.end(), p);
    OCTET_CHECK(it != order_.end(), "data parallel: gradient of unknown parameter '", p->name,
                "' reported ready");
    const size_t bucket_index = location_[static_cast<size_t>(it - order_.begin())].first;
    Bucket& bucket = buckets_[bucket_index];
    ++bucket.ready;
    OCTET_CHECK(bucket.ready <= static_cast<int64_t>(bucket.parameters.size()),
                "data parallel: parameter '", p->name, "' reported ready twice in one step");
    if (bucket.ready == static_cast<int64_t>(bucket.parameters.size())) start(bucket);
  }
}

void DistributedDataParallel::add_embedding_rows(Parameter& table, const Tensor& ids,
                                                 const Tensor& rows) {
  check_dtype(ids, DType::I32, "data parallel: embedding ids");
  check_dtype(rows, DType::F32, "data parallel: embedding rows");
  check_shape(rows, {ids.numel(), table.value.dim(1)}, "data parallel: embedding rows", "N,C");
  if (!sync_) {
    ops::embedding_backward(ids, rows, table.grad);
    return;
  }
  EmbeddingRows pending{&table, {}, {}, {}, {}};
  const int64_t n = data_.size();
  pending.ids = Tensor::empty({ids.numel() * n}, DType::I32);
  pending.rows = Tensor::empty({rows.dim(0) * n, rows.dim(1)}, DType::F32);
  // Kept alive (the Work needs its input until it completes) by holding the pair.
  Tensor ids_copy = ids.clone(), rows_copy = rows.clone();
  pending.ids_work = data_.iall_gather(ids_copy, pending.ids);
  pending.rows_work = data_.iall_gather(rows_copy, pending.rows);
  keep_alive_.push_back(ids_copy);
  keep_alive_.push_back(rows_copy);
  stats_.bytes += static_cast<int64_t>(ids.nbytes() + rows.nbytes());
  stats_.operations += 2;
  embedding_rows_.push_back(std::move(pending));
}

void DistributedDataParallel::apply(EmbeddingRows& pending) {
  Parameter* table = pending.table;
  const auto [bucket_index, slot] = location_[static_cast<size_t>(
      std::find(order_.begin(), order_.end(), table) - order_.begin())];
  Bucket& bucket = buckets_[bucket_index];
  if (!options_.distributed_optimizer) {
    ops::embedding_backward(pending.ids, pending.rows, table->grad);
    return;
  }
  // Only the part of the table inside this rank's shard of the bucket.
  const int64_t shard = bucket.grad_shard.numel(), lo = bucket.group->rank() * shard,
                hi = lo + shard;
  const int64_t base = bucket.offsets[slot], C = pending.rows.dim(1);
  const int32_t* ids = pending.ids.data<int32_t>();
  const float* rows = pending.rows.data<float>();
  float* out = bucket.grad_shard.data<float>();
  for (int64_t r = 0; r < pending.ids.numel(); ++r) {
    const int64_t first = base + static_cast<int64_t>(ids[r]) * C;
    const int64_t a = std::max(first, lo), b = std::min(first + C, hi);
    for (int64_t e = a; e < b; ++e) out[e - lo] += rows[r * C + (e - first)];
  }
}

void DistributedDataParallel::finish_grad_sync() {
  for (Bucket& bucket : buckets_) {
    if (!bucket.started) start(bucket);
  }
  for (Bucket& bucket : buckets_) {
    bucket.work.wait();
    stats_.exposed_seconds += bucket.work.waited_seconds();
    intervals_.emplace_back(
        bucket.started_at,
        bucket.started_at + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(bucket.work.transfer_seconds())));
    bucket.work = Work();
    bucket.started = false;
    bucket.ready = 0;
  }
  for (EmbeddingRows& pending : embedding_rows_) {
    for (Work* work : {&pending.ids_work, &pending.rows_work}) {
      work->wait();
      stats_.exposed_seconds += work->waited_seconds();
    }
    apply(pending);
  }
  embedding_rows_.clear();
  keep_alive_.clear();
}

void DistributedDataParallel::gather_grad_shards() {
  if (!options_.distributed_optimizer) return;
  for (Bucket& bucket : buckets_) bucket.group->iall_gather(bucket.grad_shard, bucket.grads).wait();
}

void DistributedDataParallel::zero_grad() {
  for (Bucket& bucket : buckets_) bucket.grads.zero_();
}

CommStats DistributedDataParallel::take_stats() {
  CommStats out = stats_;
  out.total_seconds = std::max(covered_seconds(intervals_), out.exposed_seconds);
  stats_ = CommStats{};
  intervals_.clear();
  return out;
}

DistributedOptimizer::DistributedOptimizer(DistributedDataParallel& ddp,
                                           const AdamWOptions& options, GradNormScope scope)
    : ddp_(ddp), options_(options), model_group_(scope.model_group) {
  OCTET_CHECK(ddp.options().distributed_optimizer,
              "DistributedOptimizer needs buckets built with distributed_optimizer");
  const bool count_all = !scope.counted.has_value();
  const std::vector<Parameter*> listed = scope.counted.value_or(std::vector<Parameter*>{});
  const std::set<const Parameter*> counted(listed.begin(), listed.end());
  for (const Parameter* p : listed) {
    bool found = false;
    for (auto& bucket : ddp.buckets()) {
      found = found || std::find(bucket.parameters.begin(), bucket.parameters.end(), p) !=
                           bucket.parameters.end();
    }
    OCTET_CHECK(found, "DistributedOptimizer: the norm scope counts '", p->name,
                "', which no gradient bucket holds");
  }
  for (auto& bucket : ddp.buckets()) {
    const int64_t dp = bucket.group->size(), rank = bucket.group->rank();
    const int64_t shard = bucket.elements / dp, lo = rank * shard, hi = lo + shard;
    exp_avg_.push_back(Tensor::zeros({shard}, DType::F32));
    exp_avg_sq_.push_back(Tensor::zeros({shard}, DType::F32));
    std::vector<Piece> pieces;
    for (size_t k = 0; k < bucket.parameters.size(); ++k) {
      const int64_t begin = bucket.offsets[k];
      const int64_t end = begin + bucket.parameters[k]->value.numel();
      const int64_t a = std::max(begin, lo), b = std::min(end, hi);
      if (a < b) {
        Parameter* p = bucket.parameters[k];
        pieces.push_back({p, a, a - lo, b - a, a - begin, count_all || counted.count(p) > 0});
      }
    }
    pieces_.push_back(std::move(pieces));
  }
}

double DistributedOptimizer::step(float lr) {
  auto& buckets = ddp_.buckets();
  // The global norm: squares summed over this rank's shards, then over the ranks (the
  // experts' over their expert-data group, then over the expert group that splits them).
  double squares = 0, expert_squares = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    std::vector<Tensor> grads;
    for (const Piece& piece : pieces_[i]) {
      if (!piece.counted) continue;
      grads.push_back(buckets[i].grad_shard.slice_rows(piece.shard_offset,
                                                       piece.shard_offset + piece.elements));
    }
    const double norm = ops::global_grad_norm(grads);
    (buckets[i].expert ? expert_squares : squares) += norm * norm;
  }
  squares = ddp_.data().all_reduce(squares, ReduceOp::Sum);
  if (const ExpertGroups& experts = ddp_.experts(); experts.expert_data != nullptr) {
    expert_squares = experts.expert_data->all_reduce(expert_squares, ReduceOp::Sum);
    squares += experts.expert->all_reduce(expert_squares, ReduceOp::Sum);
  }
  if (model_group_) squares = model_group_->all_reduce(squares, ReduceOp::Sum);
  const double norm = std::sqrt(squares);
  if (!std::isfinite(norm)) return norm;
  ++steps_;
  const double coefficient = options_.clip_grad / (norm + 1e-6);
  std::vector<ops::AdamWTensor> tensors;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (options_.clip_grad > 0 && coefficient < 1.0) {
      Tensor shard[] = {buckets[i].grad_shard};
      ops::scale(shard, static_cast<float>(coefficient));
    }
    for (const Piece& piece : pieces_[i]) {
      ops::AdamWTensor t;
      const int64_t s0 = piece.shard_offset, s1 = s0 + piece.elements;
      t.param =
          buckets[i].values.slice_rows(piece.bucket_offset, piece.bucket_offset + piece.elements);
      t.grad = buckets[i].grad_shard.slice_rows(s0, s1);
      t.exp_avg = exp_avg_[i].slice_rows(s0, s1);
      t.exp_avg_sq = exp_avg_sq_[i].slice_rows(s0, s1);
      t.weight_decay = piece.parameter->value.ndim() >= 2 ? options_.weight_decay : 0.0f;
      tensors.push_back(t);
    }
  }
  ops::AdamWHyper hyper{lr, options_.beta1, options_.beta2, options_.eps, steps_};
  ops::adamw_step(tensors, hyper);
  // Every rank's updated shard to every rank, in place in the parameter buckets.
  std::vector<Work> works;
  std::vector<Clock::time_point> starts;
  for (auto& bucket : buckets) {
    const int64_t dp = bucket.group->size(), rank = bucket.group->rank();
    const int64_t shard = bucket.elements / dp;
    Tensor mine = bucket.values.slice_rows(rank * shard, (rank + 1) * shard);
    starts.push_back(Clock::now());
    works.push_back(bucket.group->iall_gather(mine, bucket.values));
    stats_.bytes += static_cast<int64_t>(mine.nbytes());
    ++stats_.operations;
  }
  const auto wait_start = Clock::now();
  for (Work& work : works) work.wait();
  const double waited = std::chrono::duration<double>(Clock::now() - wait_start).count();
  stats_.exposed_seconds += waited;
  stats_.total_seconds += std::chrono::duration<double>(Clock::now() - starts.front()).count();
  return norm;
}

TensorMap DistributedOptimizer::state() {
  TensorMap out;
  auto& buckets = ddp_.buckets();
  for (size_t i = 0; i < buckets.size(); ++i) {
    Tensor whole_avg = buckets[i].group->all_gather(exp_avg_[i]);
    Tensor whole_sq = buckets[i].group->all_gather(exp_avg_sq_[i]);
    for (size_t k = 0; k < buckets[i].parameters.size(); ++k) {
      Parameter* p = buckets[i].parameters[k];
      const int64_t begin = buckets[i].offsets[k], end = begin + p->value.numel();
      out[p->name + ".exp_avg"] = whole_avg.slice_rows(begin, end).reshape(p->value.shape());
      out[p->name + ".exp_avg_sq"] = whole_sq.slice_rows(begin, end).reshape(p->value.shape());
    }
  }
  return out;
}

void DistributedOptimizer::load_state(const TensorMap& state, int64_t steps) {
  auto& buckets = ddp_.buckets();
  for (size_t i = 0; i < buckets.size(); ++i) {
    for (const Piece& piece : pieces_[i]) {
      for (auto [suffix, target] : {std::pair<const char*, Tensor*>{".exp_avg", &exp_avg_[i]},
                                    {".exp_avg_sq", &exp_avg_sq_[i]}}) {
        const std::string name = piece.parameter->name + suffix;
        auto it = state.find(name);
        OCTET_CHECK(it != state.end(), "optimizer state: missing tensor '", name, "'");
        check_shape(it->second, piece.parameter->value.shape(), "optimizer state: " + name);
        check_dtype(it->second, DType::F32, "optimizer state: " + name);
        const Tensor flat = it->second.reshape({it->second.numel()});
        target->slice_rows(piece.shard_offset, piece.shard_offset + piece.elements)
            .copy_from(
                flat.slice_rows(piece.parameter_offset, piece.parameter_offset + piece.elements));
      }
    }
  }
  steps_ = steps;
}

CommStats DistributedOptimizer::take_stats() {
  CommStats out = stats_;
  stats_ = CommStats{};
  return out;
}

}  // namespace octet
