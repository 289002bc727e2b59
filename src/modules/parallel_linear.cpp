// Linear's tensor-parallel half (Megatron's ColumnParallelLinear / RowParallelLinear): the
// shard's options and weights cut from the whole layer, and the paired region mappings around
// the shard's own forward and backward; plus the sequence-parallel gradient sum.

#include "modules/common.h"
#include "octet/ops/elementwise.h"
#include "octet/tensor_parallel.h"

namespace octet {

namespace {

Tensor as_rows(const Tensor& x) {
  return x.reshape({x.rows(), x.cols()});
}

// The shard's options: the whole layer's with one dimension divided by TP (none without a
// group or a parallel_mode).
LinearOptions shard_options(const LinearOptions& whole, Communicator* tp) {
  if (tp == nullptr || whole.parallel_mode == ParallelMode::None) return whole;
  LinearOptions l = whole;  // the shard is a plain Linear: the layer's parallelism is whole_'s
  l.parallel_mode = ParallelMode::None;
  l.sequence_parallel = false;
  l.output_blocks.clear();
  l.gather_output = false;
  const int64_t size = tp->size();
  if (whole.parallel_mode == ParallelMode::Column) {
    OCTET_CHECK(l.out_features > 0 && l.out_features % size == 0, l.name,
                ": column-parallel out_features=", l.out_features,
                " is not divisible by TP=", size);
    OCTET_CHECK(!(whole.gather_output && whole.sequence_parallel), whole.name,
                ": gather_output and sequence_parallel exclude each other");
    int64_t total = 0;
    for (int64_t width : whole.output_blocks) {
      OCTET_CHECK(width > 0 && width % size == 0, l.name, ": output block of width ", width,
                  " is not divisible by TP=", size);
      total += width;
    }
    OCTET_CHECK(whole.output_blocks.empty() || total == l.out_features, l.name,
                ": output blocks sum to ", total, ", expected out_features=", l.out_features);
    l.out_features /= size;
    return l;
  }
  OCTET_CHECK(l.in_features > 0 && l.in_features % size == 0, l.name,
              ": row-parallel in_features=", l.in_features, " is not divisible by TP=", size);
  OCTET_CHECK(whole.output_blocks.empty() && !whole.gather_output, l.name,
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

Linear::Linear(const LinearOptions& options, Communicator* tp)
    : whole_(options),
      options_(shard_options(options, tp)),
      tp_(options.parallel_mode == ParallelMode::None ? nullptr : tp) {
  OCTET_CHECK(options.in_features > 0 && options.out_features > 0, options.name,
              ": in_features and out_features must be positive, got ", options.in_features, " and ",
              options.out_features);
  OCTET_CHECK(options.params_dtype == DType::F32 || options.params_dtype == DType::BF16,
              options.name, ": params_dtype expected f32 or bf16, got ",
              dtype_name(options.params_dtype));
  weight = modules_detail::make_parameter(options_.name + ".weight",
                                          {options_.out_features, options_.in_features},
                                          options_.init_std, options_.seed);
  if (options_.bias) {
    bias =
        modules_detail::constant_parameter(options_.name + ".bias", {options_.out_features}, 0.0f);
  }
  if (!tp_) return;
  // The whole layer, made once with the same seed, then sliced: TP shards equal TP = 1's.
  LinearOptions plain = whole_;
  plain.parallel_mode = ParallelMode::None;
  plain.sequence_parallel = false;
  Linear full(plain);
  if (whole_.parallel_mode == ParallelMode::Row && whole_.bias) {
    bias = Parameter{whole_.name + ".bias", full.bias.value.clone(),
                     Tensor::zeros({whole_.out_features}, DType::F32)};
  }
  const Shape whole_weight = {whole_.out_features, whole_.in_features};
  if (whole_.parallel_mode == ParallelMode::Column) {
    weight.shard = TensorShard::rows(whole_weight, whole_.output_blocks);
    if (whole_.bias) bias.shard = TensorShard::rows({whole_.out_features}, whole_.output_blocks);
  } else {
    weight.shard = TensorShard::columns(whole_weight);
    // Added to this rank's token rows under SP: a partial gradient there.
    if (whole_.bias) bias.shard.sequence_parallel = whole_.sequence_parallel;
  }
  load_full(full.weight.value, whole_.bias ? &full.bias.value : nullptr);
}

void Linear::load_full(const Tensor& full_weight, const Tensor* full_bias) {
  const LinearOptions& l = whole_;
  check_shape(full_weight, {l.out_features, l.in_features}, l.name + ": full weight", "out,in");
  OCTET_CHECK((full_bias != nullptr) == l.bias, l.name, ": full bias expected ",
              l.bias ? "present" : "absent");
  // This rank's slices, as each parameter's TensorShard describes them.
  weight.value.copy_from(tp_ ? shard_of(weight, full_weight, *tp_) : full_weight);
  if (full_bias != nullptr)
    bias.value.copy_from(tp_ ? shard_of(bias, *full_bias, *tp_) : *full_bias);
  on_parameters_updated();
}

Tensor Linear::parallel_forward(const Tensor& x, Context& ctx) {
  if (whole_.parallel_mode == ParallelMode::Row) {
    const Tensor local_x =
        whole_.input_is_parallel ? as_rows(x) : split_columns_to_tensor_parallel_region(x, *tp_);
    const Tensor partial = local_forward(local_x, ctx, SavedInput::Fp8);
    Tensor y = whole_.sequence_parallel ? reduce_scatter_to_sequence_parallel_region(partial, *tp_)
                                        : reduce_from_tensor_parallel_region(partial, *tp_);
    // y is this module's own tensor (the GEMM output or a collective's result): add in place.
    if (whole_.bias && !whole_.return_bias) ops::add_bias(y, bias.value);
    return y;
  }
  Tensor y;
  if (overlap_gather_ && whole_.sequence_parallel && tp_->size() > 1 && !fp8_enabled()) {
    // The sequence-parallel all-gather moves the other ranks' token rows while the GEMM of
    // this rank's own rows runs (gather_from_sequence_parallel_region, overlapped).
    const Tensor mine = as_rows(x);
    const int64_t rows = mine.rows() * tp_->size();
    Tensor total = Tensor::empty({rows, mine.cols()}, mine.dtype());
    Work gather = tp_->iall_gather(mine, total);
    y = forward_arriving(
        mine, tp_->rank() * mine.rows(), rows,
        [&] {
          gather.wait();
          return total;
        },
        ctx);
  } else {
    const Tensor total = whole_.sequence_parallel
                             ? gather_from_sequence_parallel_region(x, *tp_)
                             : copy_to_tensor_parallel_region(as_rows(x), *tp_);
    y = local_forward(total, ctx, SavedInput::Fp8);
  }
  if (whole_.gather_output) y = gather_columns_from_tensor_parallel_region(y, *tp_);
  return y;
}

Tensor Linear::parallel_backward(const Tensor& dy, Context& ctx) {
  if (whole_.parallel_mode == ParallelMode::Row) {
    // The bias was added to this rank's rows: under SP a partial gradient, summed over the
    // group by all_reduce_sequence_parallel_gradients.
    if (whole_.bias && !whole_.return_bias) ops::add_column_sums(dy, bias.grad);
    const Tensor partial_dy = whole_.sequence_parallel
                                  ? reduce_scatter_to_sequence_parallel_region_backward(dy, *tp_)
                                  : reduce_from_tensor_parallel_region_backward(as_rows(dy), *tp_);
    const Tensor dx = local_backward(partial_dy, ctx);
    return whole_.input_is_parallel ? dx : gather_columns_from_tensor_parallel_region(dx, *tp_);
  }
  const Tensor local_dy =
      whole_.gather_output ? split_columns_to_tensor_parallel_region(dy, *tp_) : as_rows(dy);
  const Tensor dx = local_backward(local_dy, ctx);
  return whole_.sequence_parallel ? gather_from_sequence_parallel_region_backward(dx, *tp_)
                                  : copy_to_tensor_parallel_region_backward(dx, *tp_);
}

}  // namespace octet
