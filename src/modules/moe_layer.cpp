// MoELayer: a mixture-of-experts MLP on the routing ops (ops/moe.h). The router runs in FP32
// outside any FP8 / FP4 scope (as Megatron keeps it); the experts are two GroupedLinears whose
// row groups are the permuted tokens of each expert, quantized under fp8_autocast per expert;
// the shared expert is a plain MLP on the same normalized tokens. Dropless: an expert with no
// token runs no GEMM.
#include <cmath>
#include <cstring>

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

// Expert parallelism's layout pass (DeepEP's get_dispatch_layout): rows_per_expert [E] are this
// rank's routed rows per global expert; each rank learns how many rows every source sends to
// each of its local experts (an all-to-all of the counts).
void exchange_layout(const Tensor& rows_per_expert, Communicator& ep, MoELayer::Context& ctx) {
  const int64_t ranks = ep.size(), experts = rows_per_expert.numel(), local = experts / ranks;
  const Tensor received = ep.all_to_all(rows_per_expert);
  const int32_t* sent = rows_per_expert.data<int32_t>();
  const int32_t* got = received.data<int32_t>();
  ctx.send_rows.assign(static_cast<size_t>(ranks), 0);
  ctx.recv_rows.assign(static_cast<size_t>(ranks), 0);
  ctx.per_source.assign(got, got + experts);
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t l = 0; l < local; ++l) {
      ctx.send_rows[static_cast<size_t>(r)] += sent[r * local + l];
      ctx.recv_rows[static_cast<size_t>(r)] += got[r * local + l];
    }
  }
}

// The received rows come source by source, each source's by local expert ([s][l]); the experts
// want them expert by expert ([l][s]). to_experts: [s][l] -> [l][s]; else back.
Tensor reorder_chunks(const Tensor& rows, const std::vector<int64_t>& per_source, int64_t ranks,
                      bool to_experts) {
  const int64_t local = static_cast<int64_t>(per_source.size()) / ranks;
  std::vector<int64_t> start(per_source.size());  // each [s][l] chunk's first row in [s][l]
  int64_t at = 0;
  for (size_t i = 0; i < per_source.size(); ++i) {
    start[i] = at;
    at += per_source[i];
  }
  Tensor out = Tensor::empty(rows.shape(), rows.dtype());
  const int64_t row_bytes = rows.rows() > 0 ? static_cast<int64_t>(rows.nbytes()) / rows.rows() : 0;
  const char* in = static_cast<const char*>(rows.raw());
  char* to = static_cast<char*>(out.raw());
  int64_t sorted = 0;  // the chunk's first row in [l][s]
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t s = 0; s < ranks; ++s) {
      const size_t chunk = static_cast<size_t>(s * local + l);
      const int64_t n = per_source[chunk], grouped = start[chunk];
      const int64_t from = to_experts ? grouped : sorted, dest = to_experts ? sorted : grouped;
      std::memcpy(to + dest * row_bytes, in + from * row_bytes, static_cast<size_t>(n * row_bytes));
      sorted += n;
    }
  }
  return out;
}

// FP8 dispatch: E4M3 codes [R, C] with a power-of-2 scale per 1x128 block [R, ceil(C/128)].
constexpr int kDispatchBlock = 128;

Float8Tensor quantize_rows(const Tensor& rows) {
  if (rows.rows() > 0) {
    return Quantizer::block(DType::E4M3, 1, kDispatchBlock, /*power_2_scale=*/true).quantize(rows);
  }
  Float8Tensor none;  // nothing to send (the exchange still runs: the peers may send)
  none.data = Tensor::empty({0, rows.cols()}, DType::E4M3);
  none.scale_inv =
      Tensor::empty({0, (rows.cols() + kDispatchBlock - 1) / kDispatchBlock}, DType::F32);
  return none;
}

Tensor dequantize_rows(const Tensor& codes, const Tensor& scale_inv, DType dtype) {
  if (codes.rows() == 0) return Tensor::empty(codes.shape(), dtype);
  Float8Tensor received;
  received.format = DType::E4M3;
  received.mode = ScalingMode::Block;
  received.rows = codes.rows();
  received.cols = codes.cols();
  received.block_rows = 1;
  received.block_cols = kDispatchBlock;
  received.data = codes;
  received.scale_inv = scale_inv;
  const Tensor values = received.dequantize();
  return dtype == DType::F32 ? values : values.to(dtype);
}

}  // namespace

Tensor MoELayer::exchange(const Tensor& rows, bool dispatch, const Context& ctx, Work& work) {
  const std::vector<int64_t>& send = dispatch ? ctx.send_rows : ctx.recv_rows;
  const std::vector<int64_t>& recv = dispatch ? ctx.recv_rows : ctx.send_rows;
  int64_t total = 0;
  for (int64_t n : recv) total += n;
  Tensor out = Tensor::empty({total, rows.cols()}, rows.dtype());
  work = ep_->iall_to_allv(rows, send, out, recv);
  exchange_stats_.bytes += static_cast<int64_t>(rows.nbytes());
  ++exchange_stats_.exchanges;
  return out;
}

void MoELayer::wait(Work& work) {
  work.wait();
  exchange_stats_.transfer_seconds += work.transfer_seconds();
  exchange_stats_.waited_seconds += work.waited_seconds();
}

MoELayer::MoELayer(const MoELayerOptions& options, Communicator* tp, Communicator* ep)
    : norm(checked(options, tp).norm),
      router(router_options(options)),
      fc1(expert_options(options, true, ep), tp),
      fc2(expert_options(options, false, ep), tp),
      expert_bias(Tensor::zeros({options.num_experts}, DType::F32)),
      options_(options),
      tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr),
      ep_(ep != nullptr && ep->size() > 1 ? ep : nullptr) {
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
  Work dispatched, dispatched_scales;
  Float8Tensor sent;  // FP8 dispatch: alive until the exchange completes
  Tensor codes, scales;
  if (ep_) {
    exchange_layout(rows_per_expert, *ep_, ctx);
    if (fp8_dispatch_ && fp8_enabled()) {
      sent = quantize_rows(expert_input);
      codes = exchange(sent.data, true, ctx, dispatched);
      scales = exchange(sent.scale_inv, true, ctx, dispatched_scales);
    } else {
      expert_input = exchange(expert_input, true, ctx, dispatched);
    }
  }
  Tensor shared;
  if (shared_fc1) {
    ctx.shared_fc1_output = shared_fc1->forward(xn, ctx.shared_fc1);
    const int64_t local_shared = shared_fc1->options().out_features / halves;  // width / TP
    shared = shared_fc2->forward(activation(o.activation, ctx.shared_fc1_output, local_shared),
                                 ctx.shared_fc2);
  }
  if (ep_) {
    wait(dispatched);
    wait(dispatched_scales);
    if (codes.defined()) expert_input = dequantize_rows(codes, scales, xn.dtype());
    expert_input = reorder_chunks(expert_input, ctx.per_source, ep_->size(), true);
    const int64_t local = fc1.options().num_gemms;
    splits.assign(static_cast<size_t>(local), 0);
    for (size_t i = 0; i < ctx.per_source.size(); ++i) {
      splits[i % static_cast<size_t>(local)] += ctx.per_source[i];
    }
  }
  ctx.fc1_output = fc1.forward(expert_input, splits, ctx.fc1);
  const int64_t local_ffn = fc1.options().out_features / halves;  // ffn_hidden / TP
  Tensor y = fc2.forward(activation(o.activation, ctx.fc1_output, local_ffn), splits, ctx.fc2);
  if (ep_) {
    // Combine: the outputs back to the ranks their tokens came from.
    // (The input stays alive until the exchange completes.)
    const Tensor by_source = reorder_chunks(y, ctx.per_source, ep_->size(), false);
    Work combined;
    y = exchange(by_source, false, ctx, combined);
    wait(combined);
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
  Work dispatched;
  if (ep_) {
    dexpert_rows = exchange(dexpert_rows, true, ctx, dispatched);
  }
  // The router: the probabilities' gradient plus the auxiliary losses', scaled as the main
  // loss's gradient is.
  ops::RouterOptions route = o.router;
  route.expert_bias = o.enable_expert_bias ? &expert_bias : nullptr;
  route.aux_loss_coeff *= ctx.loss_scale;
  route.z_loss_coeff *= ctx.loss_scale;
  Tensor dlogits = Tensor::empty({n, e}, DType::F32);
  ops::router_backward(dprobs, ctx.logits, ctx.scores, ctx.experts, ctx.counts, route, dlogits);
  const Tensor drouter = router.backward(dlogits, ctx.router);
  Tensor dshared;
  if (shared_fc1) {
    const Tensor dsa = shared_fc2->backward(dout, ctx.shared_fc2);
    dshared = shared_fc1->backward(activation_grad(o.activation, dsa, ctx.shared_fc1_output),
                                   ctx.shared_fc1);
  }
  if (ep_) {
    wait(dispatched);
    dexpert_rows = reorder_chunks(dexpert_rows, ctx.per_source, ep_->size(), true);
  }
  const Tensor da = fc2.backward(dexpert_rows, ctx.fc2);
  Tensor dpermuted = fc1.backward(activation_grad(o.activation, da, ctx.fc1_output), ctx.fc1);
  if (ep_) {
    const Tensor by_source = reorder_chunks(dpermuted, ctx.per_source, ep_->size(), false);
    Work combined;
    dpermuted = exchange(by_source, false, ctx, combined);
    wait(combined);
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
