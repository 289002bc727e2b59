// Whole tensors and their tensor-parallel shards, by each parameter's TensorShard: gathering
// for checkpoints (and gathered optimizer state), slicing back at any group size, and which
// parameters a rank counts in a gradient norm.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "octet/ops/optimizer.h"
#include "octet/tensor_parallel.h"

namespace octet {

std::vector<Parameter*> sequence_parallel_parameters(const std::vector<Parameter*>& parameters) {
  std::vector<Parameter*> out;
  for (Parameter* p : parameters) {
    if (p->shard.sequence_parallel) out.push_back(p);
  }
  return out;
}

std::vector<Parameter*> counted_once(const std::vector<Parameter*>& candidates, Communicator& tp) {
  std::vector<Parameter*> out;
  for (Parameter* p : candidates) {
    if (p->shard.kind != TensorShard::Kind::Replicated || tp.rank() == 0) out.push_back(p);
  }
  return out;
}

double grad_norm_over(const std::vector<Parameter*>& parameters, Communicator& group) {
  double squares = 0;
  for (Parameter* p : parameters) {
    const Tensor grads[] = {p->grad};
    const double norm = ops::global_grad_norm(grads);
    squares += norm * norm;
  }
  return std::sqrt(group.all_reduce(squares, ReduceOp::Sum));
}

namespace {

using Segments = std::vector<std::pair<int64_t, int64_t>>;

// Per rank of the group: the (begin, count) ranges of the whole dimension (0 for Rows, 1 for
// Columns) that the rank's shard holds, in the shard's order.
std::vector<Segments> segments(const TensorShard& shard, int size) {
  std::vector<Segments> out(static_cast<size_t>(size));
  for (int q = 0; q < size; ++q) {
    Segments& ranges = out[static_cast<size_t>(q)];
    if (shard.kind == TensorShard::Kind::Columns) {
      const int64_t width = shard.whole_shape[1] / size;
      ranges.emplace_back(q * width, width);
    } else if (shard.vocabulary) {
      const VocabRange range = vocab_range(shard.whole_shape[0], q, size);
      ranges.emplace_back(range.begin, range.size());
    } else {
      std::vector<int64_t> blocks = shard.blocks;
      if (blocks.empty()) blocks.push_back(shard.whole_shape[0]);
      int64_t begin = 0;
      for (int64_t width : blocks) {
        ranges.emplace_back(begin + q * (width / size), width / size);
        begin += width;
      }
    }
  }
  return out;
}

int64_t inner_of(const Shape& shape) {
  int64_t inner = 1;
  for (size_t i = 1; i < shape.size(); ++i) inner *= shape[i];
  return inner;
}

}  // namespace

Tensor gather_shards(const Parameter& p, const Tensor& local, Communicator& tp) {
  const TensorShard& s = p.shard;
  check_shape(local, p.value.shape(), "gather of '" + p.name + "'");
  check_dtype(local, DType::F32, "gather of '" + p.name + "'");
  if (s.kind == TensorShard::Kind::Replicated) return local;
  const int size = tp.size();
  const auto ranges = segments(s, size);
  const bool rows = s.kind == TensorShard::Kind::Rows;
  const int64_t inner = inner_of(s.whole_shape), height = s.whole_shape[0];
  // Equal-sized buffers for the all-gather (vocabulary shards may differ by a row).
  int64_t largest = 0;
  for (const Segments& r : ranges) {
    int64_t count = 0;
    for (const auto& [begin, n] : r) count += n;
    largest = std::max(largest, rows ? count * inner : count * height);
  }
  Tensor buffer = Tensor::zeros({largest}, DType::F32);
  std::memcpy(buffer.raw(), local.raw(), static_cast<size_t>(local.numel()) * 4);
  const Tensor all = tp.all_gather(buffer);
  Tensor whole = Tensor::empty(s.whole_shape, DType::F32);
  Tensor matrix = whole.reshape({height, inner});
  for (int q = 0; q < size; ++q) {
    const Tensor part = all.slice_rows(q * largest, (q + 1) * largest);
    int64_t offset = 0;
    for (const auto& [begin, n] : ranges[static_cast<size_t>(q)]) {
      const int64_t count = rows ? n * inner : n * height;
      const Tensor piece = part.slice_rows(offset, offset + count);
      if (rows) {
        matrix.slice_rows(begin, begin + n).copy_from(piece.reshape({n, inner}));
      } else {
        copy_columns(piece.reshape({height, n}), 0, n, matrix, begin);
      }
      offset += count;
    }
  }
  return whole;
}

Tensor shard_of(const Parameter& p, const Tensor& whole, Communicator& tp) {
  const TensorShard& s = p.shard;
  if (s.kind == TensorShard::Kind::Replicated) {
    check_shape(whole, p.value.shape(), "whole tensor '" + p.name + "'");
    check_dtype(whole, DType::F32, "whole tensor '" + p.name + "'");
    return whole.clone();
  }
  check_shape(whole, s.whole_shape, "whole tensor '" + p.name + "'");
  check_dtype(whole, DType::F32, "whole tensor '" + p.name + "'");
  const Segments ranges = segments(s, tp.size())[static_cast<size_t>(tp.rank())];
  // p.value must be shaped as this rank's part: the whole shape with dimension 0 (rows) or 1
  // (columns) cut to the ranges.
  Shape expected = s.whole_shape;
  int64_t count = 0;
  for (const auto& [begin, n] : ranges) count += n;
  expected[s.kind == TensorShard::Kind::Rows ? 0 : 1] = count;
  check_shape(p.value, expected, "shard of '" + p.name + "'");
  Tensor local = Tensor::empty(p.value.shape(), DType::F32);
  if (s.kind == TensorShard::Kind::Rows) {
    int64_t row = 0;
    for (const auto& [begin, n] : ranges) {
      local.slice_rows(row, row + n).copy_from(whole.slice_rows(begin, begin + n));
      row += n;
    }
  } else {
    const auto [begin, width] = ranges.front();
    copy_columns(whole, begin, width, local, 0);
  }
  return local;
}

}  // namespace octet
