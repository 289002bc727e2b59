// The column- and row-parallel Linear (Megatron's ColumnParallelLinear / RowParallelLinear)
// built on the region mappings, and the sequence-parallel gradient sum.
#include <cstring>

#include "octet/tensor_parallel.h"

namespace octet {

namespace {

Tensor as_rows(const Tensor& x) {
  return x.reshape({x.rows(), x.cols()});
}

// y [N, C] += bias [C] (F32) on every row.
void add_bias(Tensor& y, const Tensor& bias) {
  const int64_t rows = y.rows(), cols = y.cols();
  const float* b = bias.data<float>();
  if (y.dtype() == DType::F32) {
    float* out = y.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] += b[c];
    }
    return;
  }
  Tensor wide = y.to(DType::F32);
  add_bias(wide, bias);
  y.copy_from(wide.to(y.dtype()));
}

// grad [C] += column sums of dy [N, C].
void add_column_sums(const Tensor& dy, Tensor& grad) {
  const Tensor wide = dy.dtype() == DType::F32 ? dy : dy.to(DType::F32);
  const int64_t rows = wide.rows(), cols = wide.cols();
  const float* d = wide.data<float>();
  float* g = grad.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) g[c] += d[r * cols + c];
  }
}

LinearOptions checked_full(const ParallelLinearOptions& o, ParallelMode mode, const char* kind) {
  const LinearOptions& l = o.linear;
  OCTET_CHECK(l.parallel_mode == ParallelMode::None || l.parallel_mode == mode, l.name, ": a ",
              kind, " layer got another parallel_mode");
  LinearOptions full = l;
  full.parallel_mode = ParallelMode::None;
  full.sequence_parallel = false;
  return full;
}

// The local shard's options: the whole layer's with one dimension divided by TP.
LinearOptions column_local(const ParallelLinearOptions& o, Communicator& tp) {
  LinearOptions l = checked_full(o, ParallelMode::Column, "column-parallel");
  const int64_t size = tp.size();
  OCTET_CHECK(l.out_features > 0 && l.out_features % size == 0, l.name,
              ": column-parallel out_features=", l.out_features, " is not divisible by TP=", size);
  OCTET_CHECK(!(o.gather_output && l.sequence_parallel), l.name,
              ": gather_output and sequence_parallel exclude each other");
  int64_t total = 0;
  for (int64_t width : o.output_blocks) {
    OCTET_CHECK(width > 0 && width % size == 0, l.name, ": output block of width ", width,
                " is not divisible by TP=", size);
    total += width;
  }
  OCTET_CHECK(o.output_blocks.empty() || total == l.out_features, l.name, ": output blocks sum to ",
              total, ", expected out_features=", l.out_features);
  l.out_features /= size;
  return l;
}

LinearOptions row_local(const ParallelLinearOptions& o, Communicator& tp) {
  LinearOptions l = checked_full(o, ParallelMode::Row, "row-parallel");
  const int64_t size = tp.size();
  OCTET_CHECK(l.in_features > 0 && l.in_features % size == 0, l.name,
              ": row-parallel in_features=", l.in_features, " is not divisible by TP=", size);
  OCTET_CHECK(o.output_blocks.empty() && !o.gather_output, l.name,
              ": output_blocks and gather_output are column-parallel options");
  l.in_features /= size;
  l.bias = false;  // added once after the reduction, by the row layer itself
  l.return_bias = false;
  return l;
}

}  // namespace

void all_reduce_sequence_parallel_gradients(const std::vector<Parameter*>& parameters,
                                            Communicator& tp) {
  if (tp.size() == 1) return;
  for (Parameter* p : parameters) tp.all_reduce(p->grad, ReduceOp::Sum);
}

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear.

ColumnParallelLinear::ColumnParallelLinear(const ParallelLinearOptions& options, Communicator& tp)
    : linear(column_local(options, tp)), options_(options), tp_(&tp) {
  // The whole layer, made once with the same seed, then sliced: TP shards equal TP = 1's.
  Linear full(checked_full(options, ParallelMode::Column, "column-parallel"));
  load_full(full.weight.value, full.options().bias ? &full.bias.value : nullptr);
}

void ColumnParallelLinear::load_full(const Tensor& weight, const Tensor* bias) {
  const LinearOptions& l = options_.linear;
  check_shape(weight, {l.out_features, l.in_features}, l.name + ": full weight", "out,in");
  OCTET_CHECK((bias != nullptr) == l.bias, l.name, ": full bias expected ",
              l.bias ? "present" : "absent");
  const std::vector<int64_t> blocks = options_.output_blocks.empty()
                                          ? std::vector<int64_t>{l.out_features}
                                          : options_.output_blocks;
  const int64_t size = tp_->size(), rank = tp_->rank();
  int64_t block_begin = 0, local_row = 0;
  for (int64_t width : blocks) {
    const int64_t rows = width / size, begin = block_begin + rank * rows;
    linear.weight.value.slice_rows(local_row, local_row + rows)
        .copy_from(weight.slice_rows(begin, begin + rows));
    if (bias != nullptr) {
      std::memcpy(linear.bias.value.data<float>() + local_row, bias->data<float>() + begin,
                  static_cast<size_t>(rows) * sizeof(float));
    }
    block_begin += width;
    local_row += rows;
  }
  linear.on_parameters_updated();
}

Tensor ColumnParallelLinear::forward(const Tensor& x, Context& ctx) {
  Tensor y;
  if (overlap_gather_ && options_.linear.sequence_parallel && tp_->size() > 1 && !fp8_enabled()) {
    // The sequence-parallel all-gather moves the other ranks' token rows while the GEMM of
    // this rank's own rows runs (gather_from_sequence_parallel_region, overlapped).
    const Tensor mine = as_rows(x);
    const int64_t rows = mine.rows() * tp_->size();
    Tensor total = Tensor::empty({rows, mine.cols()}, mine.dtype());
    Work gather = tp_->iall_gather(mine, total);
    y = linear.forward_arriving(
        mine, tp_->rank() * mine.rows(), rows,
        [&] {
          gather.wait();
          return total;
        },
        ctx.linear);
  } else {
    const Tensor total = options_.linear.sequence_parallel
                             ? gather_from_sequence_parallel_region(x, *tp_)
                             : copy_to_tensor_parallel_region(as_rows(x), *tp_);
    y = linear.forward(total, ctx.linear);
  }
  if (options_.gather_output) y = gather_columns_from_tensor_parallel_region(y, *tp_);
  return y;
}

Tensor ColumnParallelLinear::backward(const Tensor& dy, Context& ctx) {
  const Tensor local_dy =
      options_.gather_output ? split_columns_to_tensor_parallel_region(dy, *tp_) : as_rows(dy);
  const Tensor dx = linear.backward(local_dy, ctx.linear);
  return options_.linear.sequence_parallel ? gather_from_sequence_parallel_region_backward(dx, *tp_)
                                           : copy_to_tensor_parallel_region_backward(dx, *tp_);
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear.

RowParallelLinear::RowParallelLinear(const ParallelLinearOptions& options, Communicator& tp)
    : linear(row_local(options, tp)), options_(options), tp_(&tp) {
  Linear full(checked_full(options, ParallelMode::Row, "row-parallel"));
  if (options.linear.bias) {
    bias = Parameter{options.linear.name + ".bias", full.bias.value.clone(),
                     Tensor::zeros({options.linear.out_features}, DType::F32)};
  }
  load_full(full.weight.value, options.linear.bias ? &full.bias.value : nullptr);
}

void RowParallelLinear::load_full(const Tensor& weight, const Tensor* full_bias) {
  const LinearOptions& l = options_.linear;
  check_shape(weight, {l.out_features, l.in_features}, l.name + ": full weight", "out,in");
  OCTET_CHECK((full_bias != nullptr) == l.bias, l.name, ": full bias expected ",
              l.bias ? "present" : "absent");
  const int64_t width = l.in_features / tp_->size();
  copy_columns(weight, tp_->rank() * width, width, linear.weight.value, 0);
  if (full_bias != nullptr) bias.value.copy_from(*full_bias);
  linear.on_parameters_updated();
}

void RowParallelLinear::collect_parameters(std::vector<Parameter*>& out) {
  linear.collect_parameters(out);
  if (options_.linear.bias) out.push_back(&bias);
}

std::vector<Parameter*> RowParallelLinear::sequence_parallel_parameters() {
  if (options_.linear.sequence_parallel && options_.linear.bias) return {&bias};
  return {};
}

Tensor RowParallelLinear::forward(const Tensor& x, Context& ctx) {
  const Tensor local_x =
      options_.input_is_parallel ? as_rows(x) : split_columns_to_tensor_parallel_region(x, *tp_);
  const Tensor partial = linear.forward(local_x, ctx.linear);
  Tensor y = options_.linear.sequence_parallel
                 ? reduce_scatter_to_sequence_parallel_region(partial, *tp_)
                 : reduce_from_tensor_parallel_region(partial, *tp_);
  // y is this module's own tensor (the GEMM output or a collective's result): add in place.
  if (options_.linear.bias && !options_.linear.return_bias) add_bias(y, bias.value);
  return y;
}

Tensor RowParallelLinear::backward(const Tensor& dy, Context& ctx) {
  // The bias was added to this rank's rows: under SP a partial gradient, summed over the
  // group by all_reduce_sequence_parallel_gradients.
  if (options_.linear.bias && !options_.linear.return_bias) add_column_sums(dy, bias.grad);
  const Tensor partial_dy = options_.linear.sequence_parallel
                                ? reduce_scatter_to_sequence_parallel_region_backward(dy, *tp_)
                                : reduce_from_tensor_parallel_region_backward(as_rows(dy), *tp_);
  const Tensor dx = linear.backward(partial_dy, ctx.linear);
  return options_.input_is_parallel ? dx : gather_columns_from_tensor_parallel_region(dx, *tp_);
}

}  // namespace octet
