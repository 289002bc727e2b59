// GroupedLinear: one Linear per consecutive row group of the input (TransformerEngine's
// GroupedLinear, the expert FFNs of a mixture of experts). Each group is its own GEMM on a
// row slice of the shared input and output; under fp8_autocast GEMM i uses the quantizers of
// index i in one Fp8State(num_gemms).
#include <numeric>

#include "modules/common.h"

namespace octet {

using modules_detail::add_column_sums;
using modules_detail::kept_for_backward;
using modules_detail::needs_columnwise;

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options)
    : options_(options), fp8_(options.num_gemms) {
  OCTET_CHECK(options.num_gemms > 0, options.name, ": num_gemms must be positive, got ",
              options.num_gemms);
  OCTET_CHECK(options.in_features > 0 && options.out_features > 0, options.name,
              ": in_features and out_features must be positive, got ", options.in_features, " and ",
              options.out_features);
  for (int i = 0; i < options.num_gemms; ++i) {
    const std::string index = std::to_string(i);
    weights.push_back(modules_detail::make_parameter(
        options.name + ".weight" + index, {options.out_features, options.in_features},
        options.init_std, options.seed * 1000003 + static_cast<uint64_t>(i)));
    if (options.bias) {
      biases.push_back(modules_detail::constant_parameter(options.name + ".bias" + index,
                                                          {options.out_features}, 0.0f));
    }
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
  const auto& o = options_;
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
    if (o.bias && !o.return_bias) epilogue.bias = &biases[i].value;
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

Tensor GroupedLinear::backward(const Tensor& dy_in, Context& ctx) {
  const auto& o = options_;
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
    if (o.bias && !o.return_bias) add_column_sums(dys, biases[i].grad);
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
