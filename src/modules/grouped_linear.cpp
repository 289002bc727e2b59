// GroupedLinear: one Linear per consecutive row group of the input (TransformerEngine's
// GroupedLinear, the expert FFNs of a mixture of experts). Each group is its own GEMM on a
// row slice of the shared input and output; under fp8_autocast GEMM i uses the quantizers of
// index i in one Fp8State(num_gemms). Given a tensor-parallel group, each GEMM's weight is split
// by rows (column-parallel) or columns (row-parallel), as Linear's.
#include <numeric>

#include "modules/common.h"
#include "octet/mappings.h"
#include "octet/ops/elementwise.h"
#include "octet/tensor_parallel.h"

namespace octet {

using modules_detail::kept_for_backward;
using modules_detail::needs_columnwise;

namespace {

// The shard's options: the whole module's with one dimension divided by TP.
GroupedLinearOptions shard_options(const GroupedLinearOptions& whole, Communicator* tp) {
  GroupedLinearOptions l = whole;
  l.parallel_mode = ParallelMode::None;
  if (tp == nullptr || whole.parallel_mode == ParallelMode::None) return l;
  const bool column = whole.parallel_mode == ParallelMode::Column;
  int64_t& split = column ? l.out_features : l.in_features;
  OCTET_CHECK(split > 0 && split % tp->size() == 0, whole.name, ": ",
              column ? "column-parallel out_features=" : "row-parallel in_features=", split,
              " is not divisible by TP=", tp->size());
  split /= tp->size();
  return l;
}

}  // namespace

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options, Communicator* tp)
    : whole_(options),
      options_(shard_options(options, tp)),
      tp_(options.parallel_mode == ParallelMode::None ? nullptr : tp),
      fp8_(options.num_gemms) {
  OCTET_CHECK(options.num_gemms > 0 && options.first_gemm >= 0, options.name,
              ": num_gemms must be positive and first_gemm >= 0, got ", options.num_gemms, " and ",
              options.first_gemm);
  OCTET_CHECK(options.in_features > 0 && options.out_features > 0, options.name,
              ": in_features and out_features must be positive, got ", options.in_features, " and ",
              options.out_features);
  const bool column = whole_.parallel_mode == ParallelMode::Column;
  for (int i = 0; i < options.num_gemms; ++i) {
    const int global = options.first_gemm + i;
    const std::string index = std::to_string(global);
    // The whole weight with the same seed, then this rank's slice: shards equal TP = 1's.
    Parameter w = modules_detail::make_parameter(
        options.name + ".weight" + index, {options.out_features, options.in_features},
        options.init_std, options.seed * 1000003 + static_cast<uint64_t>(global));
    Parameter b;
    if (options.bias) {
      b = modules_detail::constant_parameter(options.name + ".bias" + index, {options.out_features},
                                             0.0f);
    }
    if (tp_) {
      // This rank's slice of the whole tensor (TensorShard), as its own parameter.
      auto split = [&](Parameter& whole, TensorShard shard, Shape local) {
        Parameter part{whole.name, Tensor::empty(local, DType::F32),
                       Tensor::zeros(local, DType::F32), std::move(shard)};
        part.value = shard_of(part, whole.value, *tp_);
        whole = std::move(part);
      };
      const Shape shape = w.value.shape(), local = {options_.out_features, options_.in_features};
      split(w, column ? TensorShard::rows(shape) : TensorShard::columns(shape), local);
      if (options.bias && column) {
        split(b, TensorShard::rows(b.value.shape()), {options_.out_features});
      }
    }
    weights.push_back(std::move(w));
    if (options.bias) biases.push_back(std::move(b));
  }
  packed_.resize(options.num_gemms);
  packed_dtype_.assign(options.num_gemms, DType::F32);
}

void GroupedLinear::collect_parameters(std::vector<Parameter*>& out) {
  for (int i = 0; i < options_.num_gemms; ++i) {
    out.push_back(&weights[i]);
    if (options_.bias) out.push_back(&biases[i]);
  }
}

void GroupedLinear::on_parameters_updated() {
  for (auto& p : packed_) p.reset();
  fp8_.drop_weight_cache();
}

PackedWeight& GroupedLinear::packed_weight(int gemm, DType dtype) {
  if (!packed_[gemm] || packed_dtype_[gemm] != dtype) {
    const Tensor& w = weights[gemm].value;
    packed_[gemm].emplace(dtype == DType::F32 ? w : w.to(dtype), /*trans=*/true);
    packed_dtype_[gemm] = dtype;
  }
  return *packed_[gemm];
}

Tensor GroupedLinear::forward(const Tensor& x, const std::vector<int64_t>& m_splits, Context& ctx) {
  if (!tp_) return local_forward(x, m_splits, ctx);
  if (whole_.parallel_mode == ParallelMode::Column) {
    return local_forward(copy_to_tensor_parallel_region(x, *tp_), m_splits, ctx);
  }
  // Row: the partial sums over this rank's input columns, summed, then each group's bias.
  Tensor y = reduce_from_tensor_parallel_region(local_forward(x, m_splits, ctx), *tp_);
  if (whole_.bias && !whole_.return_bias) {
    Tensor rows = y.reshape({y.rows(), y.cols()});
    int64_t begin = 0;
    for (int i = 0; i < whole_.num_gemms; ++i) {
      Tensor group = rows.slice_rows(begin, begin + m_splits[i]);
      if (group.numel() > 0) ops::add_bias(group, biases[i].value);
      begin += m_splits[i];
    }
  }
  return y;
}

Tensor GroupedLinear::backward(const Tensor& dy, Context& ctx) {
  if (!tp_) return local_backward(dy, ctx);
  if (whole_.parallel_mode == ParallelMode::Column) {
    return copy_to_tensor_parallel_region_backward(local_backward(dy, ctx), *tp_);
  }
  if (whole_.bias && !whole_.return_bias) {
    // The biases were added after the sum: their gradients are dy's column sums per group.
    OCTET_CHECK(!ctx.m_splits.empty(), whole_.name, ": backward called without a forward context");
    const Tensor rows = dy.reshape({dy.numel() / whole_.out_features, whole_.out_features});
    int64_t begin = 0;
    for (int i = 0; i < whole_.num_gemms; ++i) {
      const Tensor group = rows.slice_rows(begin, begin + ctx.m_splits[i]);
      if (group.numel() > 0) ops::add_column_sums(group, biases[i].grad);
      begin += ctx.m_splits[i];
    }
  }
  return local_backward(reduce_from_tensor_parallel_region_backward(dy, *tp_), ctx);
}

Tensor GroupedLinear::local_forward(const Tensor& x, const std::vector<int64_t>& m_splits,
                                    Context& ctx) {
  const auto& o = options_;
  // A row-parallel shard adds no bias: the whole module adds it after the sum.
  const bool bias = o.bias && !o.return_bias && !(tp_ && whole_.parallel_mode == ParallelMode::Row);
  check_dtype_in(x, {DType::F32, DType::BF16}, o.name + ": input");
  OCTET_CHECK(static_cast<int>(m_splits.size()) == o.num_gemms, o.name, ": expected ", o.num_gemms,
              " m_splits, got ", m_splits.size());
  for (int64_t m : m_splits) OCTET_CHECK(m >= 0, o.name, ": m_splits must be >= 0, got ", m);
  const int64_t rows = std::accumulate(m_splits.begin(), m_splits.end(), int64_t{0});
  OCTET_CHECK(x.ndim() >= 1 && x.cols() == o.in_features && x.rows() == rows, o.name,
              ": input expected [sum(m_splits)=", rows, ", in_features=", o.in_features, "], got ",
              shape_str(x.shape()));
  const Tensor flat = x.reshape({rows, o.in_features});
  ctx = Context{};
  ctx.dtype = x.dtype();
  ctx.m_splits = m_splits;
  ctx.rows = rows;
  ctx.fp8 = fp8_enabled();
  Tensor y = Tensor::empty({rows, o.out_features}, x.dtype());
  if (ctx.fp8) {
    fp8_.begin_forward(fp8_recipe());
    ctx.input_fp8.resize(o.num_gemms);
    ctx.weight_fp8.resize(o.num_gemms);
  } else {
    ctx.input = flat;
  }
  int64_t begin = 0;
  for (int i = 0; i < o.num_gemms; ++i) {
    const int64_t end = begin + m_splits[i];
    if (end == begin) continue;  // an empty group: no GEMM, no FP8 statistics
    Tensor xs = flat.slice_rows(begin, end);
    Tensor ys = y.slice_rows(begin, end);
    Epilogue epilogue;
    if (bias) epilogue.bias = &biases[i].value;
    if (ctx.fp8) {
      const Quantizer quantizer = fp8_.input_quantizer(i);
      Float8Tensor xq = quantizer.quantize(xs, true, needs_columnwise(quantizer));
      if (fp8_stats_enabled()) fp8_.record_stats(o.name, "input" + std::to_string(i), xs, xq);
      const Fp8State::QuantizedWeight& w =
          fp8_.quantized_weight(i, weights[i].value, o.name, "weight" + std::to_string(i));
      PackedWeight packed = w.packed;
      gemm(xq, packed, ys, /*trans_a=*/false, 1.0f, 0.0f, epilogue);
      ctx.input_fp8[i] = kept_for_backward(std::move(xq));
      ctx.weight_fp8[i] = w.weight;
    } else {
      gemm(xs, packed_weight(i, x.dtype()), ys, /*trans_a=*/false, 1.0f, 0.0f, epilogue);
    }
    begin = end;
  }
  Shape out_shape = x.shape();
  out_shape.back() = o.out_features;
  return y.reshape(out_shape);
}

Tensor GroupedLinear::local_backward(const Tensor& dy_in, Context& ctx) {
  const auto& o = options_;
  const bool bias = o.bias && !o.return_bias && !(tp_ && whole_.parallel_mode == ParallelMode::Row);
  OCTET_CHECK(!ctx.m_splits.empty(), o.name, ": backward called without a forward context");
  OCTET_CHECK(dy_in.numel() == ctx.rows * o.out_features, o.name, ": dy expected [", ctx.rows, ",",
              o.out_features, "], got ", shape_str(dy_in.shape()));
  Tensor dy = dy_in.reshape({ctx.rows, o.out_features});
  if (dy.dtype() != ctx.dtype) dy = dy.to(ctx.dtype);
  Tensor dx = Tensor::empty({ctx.rows, o.in_features}, ctx.dtype);
  if (ctx.fp8) fp8_.begin_backward(fp8_.recipe());
  int64_t begin = 0;
  for (int i = 0; i < o.num_gemms; ++i) {
    const int64_t end = begin + ctx.m_splits[i];
    if (end == begin) continue;
    Tensor dys = dy.slice_rows(begin, end);
    Tensor dxs = dx.slice_rows(begin, end);
    if (bias) ops::add_column_sums(dys, biases[i].grad);
    if (ctx.fp8) {
      const Quantizer quantizer = fp8_.grad_output_quantizer(i);
      Float8Tensor dyq = quantizer.quantize(dys, true, needs_columnwise(quantizer));
      if (fp8_stats_enabled()) {
        fp8_.record_stats(o.name, "grad_output" + std::to_string(i), dys, dyq);
      }
      gemm(dyq, ctx.weight_fp8[i], dxs, /*trans_a=*/false, /*trans_b=*/false);
      gemm(dyq, ctx.input_fp8[i], weights[i].grad, /*trans_a=*/true, /*trans_b=*/false, 1.0f, 1.0f);
    } else {
      const Tensor w = ctx.dtype == DType::F32 ? weights[i].value : weights[i].value.to(ctx.dtype);
      gemm(dys, w, dxs, /*trans_a=*/false, /*trans_b=*/false);
      gemm(dys, ctx.input.slice_rows(begin, end), weights[i].grad, /*trans_a=*/true,
           /*trans_b=*/false, 1.0f, 1.0f);
    }
    begin = end;
  }
  ctx = Context{};
  Shape out_shape = dy_in.shape();
  out_shape.back() = o.in_features;
  return dx.reshape(out_shape);
}

}  // namespace octet
