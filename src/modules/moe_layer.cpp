// MoELayer: a mixture-of-experts MLP on the routing ops (ops/moe.h). The router runs in FP32
// outside any FP8 / FP4 scope (as Megatron keeps it); the experts are two GroupedLinears whose
// row groups are the permuted tokens of each expert, quantized under fp8_autocast per expert;
// the shared expert is a plain MLP on the same normalized tokens. Dropless: an expert with no
// token runs no GEMM.
#include <cmath>

#include "modules/common.h"
#include "modules/tensor_columns.h"
#include "octet/fp4.h"

namespace octet {

using modules_detail::add;

namespace {

const MoELayerOptions& checked(const MoELayerOptions& o, Communicator* tp) {
  OCTET_CHECK(tp == nullptr || tp->size() == 1 || !ops::is_gated(o.activation), o.name,
              ": gated activations (", ops::activation_name(o.activation),
              ") in a mixture of experts under tensor parallelism are not supported yet (TP=",
              tp ? tp->size() : 1, ")");
  OCTET_CHECK(o.hidden > 0 && o.ffn_hidden > 0, o.name,
              ": hidden and the experts' ffn_hidden expected > 0, got ", o.hidden, " and ",
              o.ffn_hidden);
  OCTET_CHECK(o.num_experts >= 1, o.name, ": num_experts expected >= 1, got ", o.num_experts);
  OCTET_CHECK(o.router.topk >= 1 && o.router.topk <= o.num_experts, o.name,
              ": moe_router_topk expected in [1, num_experts = ", o.num_experts, "], got ",
              o.router.topk);
  OCTET_CHECK(o.shared_expert_ffn_hidden >= 0, o.name,
              ": shared_expert_ffn_hidden expected >= 0, got ", o.shared_expert_ffn_hidden);
  OCTET_CHECK(std::isfinite(o.router.scaling) && o.router.scaling > 0.0f, o.name,
              ": router scaling expected > 0, got ", o.router.scaling);
  OCTET_CHECK(o.router.aux_loss_coeff >= 0.0f && o.router.z_loss_coeff >= 0.0f, o.name,
              ": moe_aux_loss_coeff and moe_z_loss_coeff expected >= 0, got ",
              o.router.aux_loss_coeff, " and ", o.router.z_loss_coeff);
  OCTET_CHECK(std::isfinite(o.expert_bias_update_rate) && o.expert_bias_update_rate >= 0.0f, o.name,
              ": expert_bias_update_rate expected >= 0, got ", o.expert_bias_update_rate);
  OCTET_CHECK(std::isfinite(o.capacity_factor) && o.capacity_factor >= 0, o.name,
              ": capacity_factor expected >= 0 (0: dropless), got ", o.capacity_factor);
  OCTET_CHECK(o.norm.hidden == o.hidden, o.name, ": norm hidden (", o.norm.hidden,
              ") must equal hidden (", o.hidden, ")");
  return o;
}

LinearOptions router_options(const MoELayerOptions& o) {
  LinearOptions l;
  l.in_features = o.hidden;
  l.out_features = o.num_experts;
  l.bias = false;
  l.init_std = o.init_std;
  l.seed = o.seed * 8 + 1;
  l.name = o.name + ".router";
  return l;
}

GroupedLinearOptions expert_options(const MoELayerOptions& o, bool first, Communicator* ep) {
  GroupedLinearOptions g;
  // Under expert parallelism this rank's share of the experts, named and initialized as the
  // single process's.
  const int ranks = ep ? ep->size() : 1;
  OCTET_CHECK(o.num_experts % ranks == 0, o.name, ": num_experts (", o.num_experts,
              ") expected a multiple of --expert-model-parallel-size (", ranks, ")");
  g.num_gemms = static_cast<int>(o.num_experts / ranks);
  g.first_gemm = ep ? ep->rank() * g.num_gemms : 0;
  const int64_t fc1_out = ops::is_gated(o.activation) ? 2 * o.ffn_hidden : o.ffn_hidden;
  g.in_features = first ? o.hidden : o.ffn_hidden;
  g.out_features = first ? fc1_out : o.hidden;
  g.bias = o.bias;
  g.init_std = first ? o.init_std : o.output_init_std;
  g.seed = o.seed * 8 + (first ? 2 : 3);
  g.name = o.name + (first ? ".experts.fc1" : ".experts.fc2");
  // Under a tensor-parallel group: FC1 by output columns, FC2 by input columns (the sum over
  // the group after FC2, with the biases added once).
  g.parallel_mode = first ? ParallelMode::Column : ParallelMode::Row;
  return g;
}

LinearOptions shared_options(const MoELayerOptions& o, bool first) {
  LinearOptions l;
  const int64_t f = o.shared_expert_ffn_hidden;
  l.in_features = first ? o.hidden : f;
  l.out_features = first ? (ops::is_gated(o.activation) ? 2 * f : f) : o.hidden;
  l.bias = o.bias;
  l.init_std = first ? o.init_std : o.output_init_std;
  l.seed = o.seed * 8 + (first ? 4 : 5);
  l.name = o.name + (first ? ".shared_experts.fc1" : ".shared_experts.fc2");
  l.parallel_mode = first ? ParallelMode::Column : ParallelMode::Row;
  return l;
}

Tensor activation(ops::ActivationKind kind, const Tensor& h, int64_t width) {
  Tensor a = Tensor::empty({h.rows(), width}, h.dtype());
  ops::activation_forward(kind, h, nullptr, a);
  return a;
}

Tensor activation_grad(ops::ActivationKind kind, const Tensor& da, const Tensor& h) {
  Tensor dh = Tensor::empty(h.shape(), da.dtype());
  ops::activation_backward(kind, da, h, nullptr, dh, nullptr);
  return dh;
}

}  // namespace

MoELayer::MoELayer(const MoELayerOptions& options, Communicator* tp, Communicator* ep)
    : norm(checked(options, tp).norm),
      router(router_options(options)),
      fc1(expert_options(options, true, ep), tp),
      fc2(expert_options(options, false, ep), tp),
      expert_bias(Tensor::zeros({options.num_experts}, DType::F32)),
      options_(options),
      tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {
  if (ep != nullptr && ep->size() > 1) dispatcher_.emplace(*ep, options.num_experts);
  for (GroupedLinear* experts : {&fc1, &fc2}) {
    for (Parameter* p : experts->parameters()) p->shard.expert = true;
  }
  if (options.shared_expert_ffn_hidden > 0) {
    shared_fc1.emplace(shared_options(options, true), tp);
    shared_fc2.emplace(shared_options(options, false), tp);
  }
  // Under sequence parallelism the norm sees this rank's tokens: its gradients are partial.
  for (Parameter* p : norm.parameters()) {
    p->shard.sequence_parallel = tp_ != nullptr && options.sequence_parallel;
  }
  load_.tokens.assign(static_cast<size_t>(options.num_experts), 0.0);
}

void MoELayer::collect_parameters(std::vector<Parameter*>& out) {
  norm.collect_parameters(out);
  router.collect_parameters(out);
  fc1.collect_parameters(out);
  fc2.collect_parameters(out);
  if (shared_fc1) {
    shared_fc1->collect_parameters(out);
    shared_fc2->collect_parameters(out);
  }
}

void MoELayer::on_parameters_updated() {
  router.on_parameters_updated();
  fc1.on_parameters_updated();
  fc2.on_parameters_updated();
  if (shared_fc1) {
    shared_fc1->on_parameters_updated();
    shared_fc2->on_parameters_updated();
  }
}

std::vector<Fp8State*> MoELayer::fp8_states() {
  std::vector<Fp8State*> states = {&fc1.fp8_state(), &fc2.fp8_state()};
  if (shared_fc1) {
    states.push_back(&shared_fc1->fp8_state());
    states.push_back(&shared_fc2->fp8_state());
  }
  return states;
}

Tensor MoELayer::forward(const Tensor& x, Context& ctx) {
  const auto& o = options_;
  check_dtype_in(x, {DType::F32, DType::BF16}, o.name + ": input");
  OCTET_CHECK(x.ndim() >= 2 && x.cols() == o.hidden, o.name,
              ": input expected [..., C] with C=", o.hidden, ", got ", shape_str(x.shape()));
  ctx = Context{};
  ctx.shape = x.shape();
  ctx.loss_scale = loss_scale_;
  const bool sp = tp_ != nullptr && o.sequence_parallel;
  // Sequence parallelism: the norm on this rank's rows, then every rank's (the experts and the
  // router see all tokens, identically on every rank).
  Tensor xn = norm.forward(x.reshape({x.numel() / o.hidden, o.hidden}), ctx.norm);
  if (sp) xn = tp_->all_gather(xn);
  const int64_t n = xn.rows(), k = o.router.topk, e = o.num_experts;
  {
    // The router in FP32, never quantized: small, and its choice must not flicker with scales.
    fp8_autocast no_fp8(false);
    fp4_autocast no_fp4(false);
    ctx.logits = router.forward(xn.dtype() == DType::F32 ? xn : xn.to(DType::F32), ctx.router);
  }
  ctx.scores = Tensor::empty({n, e}, DType::F32);
  ctx.probs = Tensor::empty({n, k}, DType::F32);
  ctx.experts = Tensor::empty({n, k}, DType::I32);
  ctx.counts = Tensor::empty({e}, DType::I32);
  ops::RouterOptions route = o.router;
  route.expert_bias = o.enable_expert_bias ? &expert_bias : nullptr;
  ctx.losses =
      ops::router_forward(ctx.logits, route, ctx.scores, ctx.probs, ctx.experts, ctx.counts);

  // The rows each expert computes: all routed to it, or its capacity's worth. Dropped pairs
  // are permuted after every expert's rows (as expert E) and their output rows stay zero.
  Tensor dispatch = ctx.experts, rows_per_expert = ctx.counts;
  if (o.capacity_factor > 0) {
    dispatch = Tensor::empty({n, k}, DType::I32);
    rows_per_expert = Tensor::empty({e}, DType::I32);
    ops::moe_capacity_drop(ctx.experts, ctx.probs, e, ops::moe_capacity(n, k, e, o.capacity_factor),
                           o.drop_policy, dispatch, rows_per_expert);
  }
  std::vector<int64_t> splits(static_cast<size_t>(e));
  const int32_t* rows = rows_per_expert.data<int32_t>();
  for (int64_t i = 0; i < e; ++i) {
    splits[static_cast<size_t>(i)] = rows[i];
    ctx.kept_rows += rows[i];
  }
  ctx.dropped = n * k - ctx.kept_rows;
  Tensor permuted = Tensor::empty({n * k, o.hidden}, xn.dtype());
  ctx.row_map = Tensor::empty({n, k}, DType::I32);
  ops::moe_permute(xn, dispatch, ctx.dropped > 0 ? e + 1 : e, permuted, ctx.row_map);
  const int64_t halves = ops::is_gated(o.activation) ? 2 : 1;  // a gated FC1's [a | b]
  // Expert parallelism: the rows travel to their experts' ranks while the shared expert runs.
  Tensor expert_input = permuted.slice_rows(0, ctx.kept_rows);
  ExpertDispatcher::Pending dispatched;
  if (dispatcher_) {
    ctx.layout = dispatcher_->layout(rows_per_expert);
    dispatched =
        dispatcher_->start_dispatch(expert_input, ctx.layout, fp8_dispatch_ && fp8_enabled());
  }
  // The shared expert's FC1 under the dispatch, its FC2 under the combine.
  Tensor shared;
  if (shared_fc1) {
    ctx.shared_fc1_output = shared_fc1->forward(xn, ctx.shared_fc1);
    const int64_t local_shared = shared_fc1->options().out_features / halves;  // width / TP
    shared = activation(o.activation, ctx.shared_fc1_output, local_shared);
  }
  auto shared_fc2_forward = [&] {
    if (shared_fc1) shared = shared_fc2->forward(shared, ctx.shared_fc2);
  };
  if (dispatcher_) {
    expert_input = dispatcher_->finish_dispatch(dispatched, ctx.layout);
    splits = ctx.layout.expert_rows();
  }
  ctx.fc1_output = fc1.forward(expert_input, splits, ctx.fc1);
  const int64_t local_ffn = fc1.options().out_features / halves;  // ffn_hidden / TP
  Tensor y = fc2.forward(activation(o.activation, ctx.fc1_output, local_ffn), splits, ctx.fc2);
  if (dispatcher_) {
    // Combine: the outputs back to the ranks their tokens came from.
    ExpertDispatcher::Pending combined = dispatcher_->start_combine(y, ctx.layout);
    shared_fc2_forward();
    y = dispatcher_->finish_combine(combined);
  } else {
    shared_fc2_forward();
  }
  if (ctx.dropped > 0) {
    ctx.expert_output = Tensor::zeros({n * k, o.hidden}, y.dtype());
    ctx.expert_output.slice_rows(0, ctx.kept_rows).copy_from(y);
  } else {
    ctx.expert_output = y;
  }
  Tensor out = Tensor::empty({n, o.hidden}, x.dtype());
  ops::moe_unpermute(ctx.expert_output, ctx.row_map, ctx.probs, out);
  if (shared_fc1) out = add(out, shared);
  // Sequence parallelism: this rank's rows of the (equal on every rank) output.
  if (sp) out = out.slice_rows(tp_->rank() * x.rows(), (tp_->rank() + 1) * x.rows()).clone();
  return out.reshape(ctx.shape);
}

Tensor MoELayer::backward(const Tensor& dy, Context& ctx) {
  const auto& o = options_;
  OCTET_CHECK(ctx.expert_output.defined(), o.name, ": backward called without a forward context");
  check_shape(dy, ctx.shape, o.name + ": output gradient", "the forward's output shape");
  const bool sp = tp_ != nullptr && o.sequence_parallel;
  const int64_t n = ctx.probs.rows(), k = o.router.topk, e = o.num_experts;
  const int64_t rows = dy.numel() / o.hidden;  // this rank's (all of them without SP)
  // Sequence parallelism: the gradient of every token (the forward's output rows were a slice
  // of a tensor equal on every rank).
  const Tensor dout =
      sp ? tp_->all_gather(dy.reshape({rows, o.hidden})) : dy.reshape({n, o.hidden});

  // Unpermute's backward: each expert row's gradient (weighted) and the probabilities'.
  Tensor dexpert = Tensor::empty({n * k, o.hidden}, ctx.expert_output.dtype());
  Tensor dprobs = Tensor::empty({n, k}, DType::F32);
  ops::moe_unpermute_backward(dout, ctx.expert_output, ctx.row_map, ctx.probs, dexpert, dprobs);
  // The dropped rows' gradients (probs * dout) reach nothing: their outputs were zeros.
  // Expert parallelism: the rows' gradients travel to the experts' ranks while the router's
  // and the shared expert's backward run.
  Tensor dexpert_rows = dexpert.slice_rows(0, ctx.kept_rows);
  ExpertDispatcher::Pending dispatched;
  if (dispatcher_) dispatched = dispatcher_->start_dispatch(dexpert_rows, ctx.layout);
  // The router: the probabilities' gradient plus the auxiliary losses', scaled as the main
  // loss's gradient is.
  ops::RouterOptions route = o.router;
  route.expert_bias = o.enable_expert_bias ? &expert_bias : nullptr;
  route.aux_loss_coeff *= ctx.loss_scale;
  route.z_loss_coeff *= ctx.loss_scale;
  Tensor dlogits = Tensor::empty({n, e}, DType::F32);
  ops::router_backward(dprobs, ctx.logits, ctx.scores, ctx.experts, ctx.counts, route, dlogits);
  const Tensor drouter = router.backward(dlogits, ctx.router);
  // The shared expert's FC2 backward under the gradients' dispatch, its FC1's under the combine.
  Tensor dshared;
  if (shared_fc1) {
    dshared = activation_grad(o.activation, shared_fc2->backward(dout, ctx.shared_fc2),
                              ctx.shared_fc1_output);
  }
  auto shared_fc1_backward = [&] {
    if (shared_fc1) dshared = shared_fc1->backward(dshared, ctx.shared_fc1);
  };
  if (dispatcher_) dexpert_rows = dispatcher_->finish_dispatch(dispatched, ctx.layout);
  const Tensor da = fc2.backward(dexpert_rows, ctx.fc2);
  Tensor dpermuted = fc1.backward(activation_grad(o.activation, da, ctx.fc1_output), ctx.fc1);
  if (dispatcher_) {
    ExpertDispatcher::Pending combined = dispatcher_->start_combine(dpermuted, ctx.layout);
    shared_fc1_backward();
    dpermuted = dispatcher_->finish_combine(combined);
  } else {
    shared_fc1_backward();
  }
  if (ctx.dropped > 0) {
    Tensor whole = Tensor::zeros({n * k, o.hidden}, dpermuted.dtype());
    whole.slice_rows(0, ctx.kept_rows).copy_from(dpermuted);
    dpermuted = whole;
  }
  Tensor dxn = Tensor::empty({n, o.hidden}, dpermuted.dtype());
  ops::moe_permute_backward(dpermuted, ctx.row_map, dxn);

  dxn = add(dxn, drouter.dtype() == dxn.dtype() ? drouter : drouter.to(dxn.dtype()));
  if (shared_fc1) dxn = add(dxn, dshared);
  // Every part of dxn is whole on every rank (the column layers' backward sums over the group):
  // under SP this rank's rows go to the norm.
  if (sp) dxn = dxn.slice_rows(tp_->rank() * rows, (tp_->rank() + 1) * rows).clone();
  Tensor dx = norm.backward(dxn, ctx.norm).reshape(ctx.shape);

  const int32_t* counts = ctx.counts.data<int32_t>();
  for (int64_t i = 0; i < e; ++i) load_.tokens[static_cast<size_t>(i)] += counts[i];
  load_.aux_loss += ctx.losses.aux;
  load_.z_loss += ctx.losses.z;
  load_.dropped += static_cast<double>(ctx.dropped);
  ++load_.micro_batches;
  ctx = Context{};
  return dx;
}

MoELayer::Load MoELayer::take_load() {
  Load out = std::move(load_);
  load_ = Load{};
  load_.tokens.assign(static_cast<size_t>(options_.num_experts), 0.0);
  return out;
}

void MoELayer::update_expert_bias(const std::vector<double>& tokens) {
  if (!options_.enable_expert_bias) return;
  const int64_t e = options_.num_experts;
  OCTET_CHECK(static_cast<int64_t>(tokens.size()) == e, options_.name, ": expected the load of ", e,
              " experts, got ", tokens.size());
  double mean = 0.0;
  for (double t : tokens) mean += t;
  mean /= static_cast<double>(e);
  float* bias = expert_bias.data<float>();
  for (int64_t i = 0; i < e; ++i) {
    const double gap = mean - tokens[static_cast<size_t>(i)];
    const float sign = gap > 0 ? 1.0f : (gap < 0 ? -1.0f : 0.0f);
    bias[i] += options_.expert_bias_update_rate * sign;
  }
}

}  // namespace octet
