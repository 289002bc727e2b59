// Tensor and sequence parallelism at the world sizes CMake runs this under (TP = 1, 2, 4):
// every region mapping's forward and backward against the result computed locally, then the
// column / row Linear, the MLP block and the self-attention block (SP off and on) against
// the unsharded modules run in the same process on the same inputs (F32).
//
// Tolerance for the modules: max |TP - single| <= 1e-5 * max |single| per tensor. A TP run
// sums the row layer's K = in features in TP partial GEMMs plus a cross-rank sum, and under
// SP the norm and bias gradients as TP partial column sums: the same terms added in another
// order. FP32's epsilon is 1.2e-7; with K <= 64 terms of comparable size, reordering moves a
// sum by at most a few dozen ulps of its largest partial sum, ~1e-5 relative; measured: 0 at
// TP = 1 (the same GEMMs), 2.1e-7 at TP = 2, 4.7e-7 at TP = 4 (printed by the last test).
// The mappings move exact values (small integers and halves): they must match exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "octet/comm.h"
#include "octet/error.h"
#include "octet/modules.h"
#include "octet/tensor_parallel.h"

namespace octet {
namespace {

constexpr double kRelativeTolerance = 1e-5;

// Exact value rank r holds at index i (integers and halves: sums are exact in any order).
float exact_value(int r, int64_t i) {
  return static_cast<float>((r * 7 + i * 3) % 29) * 0.5f - 6.0f;
}

Tensor exact_tensor(int r, Shape shape) {
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = exact_value(r, i);
  return t;
}

// Deterministic pseudo-random values in [-scale, scale), the same on every rank.
Tensor random_tensor(Shape shape, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32);
  uint64_t state = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const double unit = static_cast<double>(state >> 11) / 9007199254740992.0;
    t.data<float>()[i] = static_cast<float>((2 * unit - 1) * scale);
  }
  return t;
}

// Columns [begin, begin + width) of x [N, C].
Tensor columns(const Tensor& x, int64_t begin, int64_t width) {
  const int64_t rows = x.rows(), cols = x.cols();
  Tensor out = Tensor::empty({rows, width}, DType::F32);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data<float>() + r * width, x.data<float>() + r * cols + begin,
                static_cast<size_t>(width) * sizeof(float));
  }
  return out;
}

// Rank r's share of a column-parallel dimension made of `blocks` (rows of a weight [out, in]
// or entries of a bias [out] seen as [out, 1]): the r-th slice of each block, concatenated.
Tensor block_rows(const Tensor& full, const std::vector<int64_t>& blocks, int r, int tp) {
  const Tensor rows2d = full.reshape({full.dim(0), full.numel() / full.dim(0)});
  std::vector<float> out;
  int64_t begin = 0;
  for (int64_t width : blocks) {
    const int64_t part = width / tp;
    const std::vector<float> slice =
        rows2d.slice_rows(begin + r * part, begin + (r + 1) * part).to_floats();
    out.insert(out.end(), slice.begin(), slice.end());
    begin += width;
  }
  return Tensor::from_floats({static_cast<int64_t>(out.size()) / rows2d.cols(), rows2d.cols()},
                             out);
}

Tensor row_block(const Tensor& full, int r, int tp) {
  const Tensor t = full.reshape({full.rows(), full.cols()});
  const int64_t rows = t.rows() / tp;
  return t.slice_rows(r * rows, (r + 1) * rows);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.to_floats()) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

double g_worst_relative = 0;  // the largest relative difference seen, printed at the end

void expect_close(const Tensor& actual, const Tensor& expected, const std::string& what) {
  const std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  ASSERT_EQ(a.size(), e.size()) << what;
  const double scale = std::max(max_abs(expected), 1e-30);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - e[i]));
  g_worst_relative = std::max(g_worst_relative, worst / scale);
  EXPECT_LE(worst, kRelativeTolerance * scale)
      << what << ": max difference " << worst << " of max |expected| " << scale;
}

void expect_equal(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  EXPECT_EQ(actual.to_floats(), expected.to_floats()) << what;
}

class TensorParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    std::shared_ptr<Communicator> world = world_communicator();
    state = std::make_unique<ParallelState>(world, world->size(), 1);
    tp = &state->tensor();
    n = tp->size();
    r = tp->rank();
  }
  std::unique_ptr<ParallelState> state;
  Communicator* tp = nullptr;
  int n = 1, r = 0;
};

// ---------------------------------------------------------------------------------------------
// Mappings.

TEST_F(TensorParallel, CopyToAndReduceFromRegions) {
  const Shape shape = {3 * n, 5};
  const Tensor x = exact_tensor(r, shape);
  Tensor sum = Tensor::zeros(shape, DType::F32);
  for (int i = 0; i < n; ++i) {
    const Tensor xi = exact_tensor(i, shape);
    for (int64_t j = 0; j < sum.numel(); ++j) sum.data<float>()[j] += xi.data<float>()[j];
  }
  const Tensor kept = x.clone();
  expect_equal(copy_to_tensor_parallel_region(x, *tp), x, "copy_to forward");
  expect_equal(copy_to_tensor_parallel_region_backward(x, *tp), sum, "copy_to backward");
  expect_equal(reduce_from_tensor_parallel_region(x, *tp), sum, "reduce_from forward");
  expect_equal(reduce_from_tensor_parallel_region_backward(x, *tp), x, "reduce_from backward");
  expect_equal(x, kept, "the input is never modified");
}

TEST_F(TensorParallel, SequenceParallelRegions) {
  const int64_t rows = 3, cols = 5;
  const Shape full_shape = {rows * n, cols}, shard_shape = {rows, cols};
  // Every rank's shard, concatenated: what an all-gather gives.
  std::vector<float> concat;
  for (int i = 0; i < n; ++i) {
    const std::vector<float> part = exact_tensor(i, shard_shape).to_floats();
    concat.insert(concat.end(), part.begin(), part.end());
  }
  const Tensor gathered = Tensor::from_floats(full_shape, concat);
  // Block r of the sum over ranks of every rank's full tensor: what a reduce-scatter gives.
  Tensor sum = Tensor::zeros(full_shape, DType::F32);
  for (int i = 0; i < n; ++i) {
    const Tensor xi = exact_tensor(i, full_shape);
    for (int64_t j = 0; j < sum.numel(); ++j) sum.data<float>()[j] += xi.data<float>()[j];
  }
  const Tensor scattered = row_block(sum, r, n).clone();
  const Tensor shard = exact_tensor(r, shard_shape), full = exact_tensor(r, full_shape);
  const Tensor replicated = exact_tensor(0, full_shape);

  expect_equal(scatter_to_sequence_parallel_region(replicated, *tp),
               row_block(replicated, r, n).clone(), "scatter_to forward");
  expect_equal(scatter_to_sequence_parallel_region_backward(shard, *tp), gathered,
               "scatter_to backward");
  expect_equal(gather_from_sequence_parallel_region(shard, *tp), gathered, "gather_from forward");
  expect_equal(gather_from_sequence_parallel_region_backward(full, *tp), scattered,
               "gather_from backward");
  expect_equal(reduce_scatter_to_sequence_parallel_region(full, *tp), scattered,
               "reduce_scatter_to forward");
  expect_equal(reduce_scatter_to_sequence_parallel_region_backward(shard, *tp), gathered,
               "reduce_scatter_to backward");
  // Leading dimensions are flattened: [B, T, C] is N = B*T token rows.
  expect_equal(gather_from_sequence_parallel_region(shard.reshape({1, rows, cols}), *tp), gathered,
               "gather_from a [1, T, C] shard");
  if (n > 1) {
    const Tensor odd = exact_tensor(r, {rows * n + 1, cols});
    EXPECT_THROW(scatter_to_sequence_parallel_region(odd, *tp), Error);
    EXPECT_THROW(reduce_scatter_to_sequence_parallel_region(odd, *tp), Error);
  }
}

TEST_F(TensorParallel, ColumnRegions) {
  const Tensor x = exact_tensor(0, {4, 3 * n});
  const Tensor mine = split_columns_to_tensor_parallel_region(x, *tp);
  expect_equal(mine, columns(x, 3 * r, 3), "split columns");
  expect_equal(gather_columns_from_tensor_parallel_region(mine, *tp), x, "gather columns");
}

// ---------------------------------------------------------------------------------------------
// Column- and row-parallel Linear against Linear.

LinearOptions linear_options(int64_t in, int64_t out, uint64_t seed) {
  LinearOptions l;
  l.in_features = in;
  l.out_features = out;
  l.init_std = 0.2f;
  l.seed = seed;
  l.name = "fc";
  return l;
}

TEST_F(TensorParallel, ShardsAreSlicesOfTheSameSeedsWeight) {
  const LinearOptions l = linear_options(12, 8 * n, 5);
  Linear full(l);
  LinearOptions column = l;
  column.parallel_mode = ParallelMode::Column;
  column.output_blocks = {4 * n, 2 * n, 2 * n};
  Linear c(column, tp);
  expect_equal(c.weight.value, block_rows(full.weight.value, column.output_blocks, r, n),
               "column shard");
  LinearOptions row = linear_options(8 * n, 12, 6);
  Linear full_row(row);
  row.parallel_mode = ParallelMode::Row;
  Linear rp(row, tp);
  expect_equal(rp.weight.value, columns(full_row.weight.value, 8 * r, 8), "row shard");
}

TEST_F(TensorParallel, InvalidSizesAreClearErrors) {
  if (n == 1) GTEST_SKIP() << "every size divides TP = 1";
  LinearOptions o = linear_options(8 * n, 4 * n + 1, 1);
  o.parallel_mode = ParallelMode::Column;
  EXPECT_THROW(Linear(o, tp), Error);
  o = linear_options(4 * n + 1, 8, 1);
  o.parallel_mode = ParallelMode::Row;
  try {
    Linear row(o, tp);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by TP"), std::string::npos) << e.what();
  }
  o = linear_options(8, 6 * n, 1);
  o.parallel_mode = ParallelMode::Column;
  o.output_blocks = {3 * n + 1, 3 * n - 1};
  EXPECT_THROW(Linear(o, tp), Error);
}

struct LinearCase {
  bool sequence_parallel;
  bool gather_output;
  bool overlap_gather = false;
};

TEST_F(TensorParallel, ColumnParallelLinearEqualsLinear) {
  const int64_t tokens = 4 * n, in = 12, out = 6 * n;
  // The last case overlaps the sequence-parallel all-gather with the local rows' GEMM.
  for (LinearCase c : {LinearCase{false, false}, LinearCase{true, false}, LinearCase{false, true},
                       LinearCase{true, false, true}}) {
    const std::string what = std::string("column sp=") + (c.sequence_parallel ? "1" : "0") +
                             " gather=" + (c.gather_output ? "1" : "0") +
                             " overlap=" + (c.overlap_gather ? "1" : "0");
    const LinearOptions l = linear_options(in, out, 11);
    Linear full(l);
    full.bias.value.copy_from(random_tensor({out}, 12));
    LinearOptions o = l;
    o.parallel_mode = ParallelMode::Column;
    o.sequence_parallel = c.sequence_parallel;
    o.gather_output = c.gather_output;
    Linear column(o, tp);
    column.load_full(full.weight.value, &full.bias.value);
    column.set_overlap_gather(c.overlap_gather);

    const Tensor x = random_tensor({tokens, in}, 13), dy = random_tensor({tokens, out}, 14);
    Linear::Context full_ctx;
    const Tensor y = full.forward(x, full_ctx);
    const Tensor dx = full.backward(dy, full_ctx);

    Linear::Context ctx;
    const Tensor x_in = c.sequence_parallel ? row_block(x, r, n) : x;
    const Tensor y_tp = column.forward(x_in, ctx);
    expect_close(y_tp, c.gather_output ? y : columns(y, r * out / n, out / n), what + " y");
    const Tensor dy_in = c.gather_output ? dy : columns(dy, r * out / n, out / n);
    const Tensor dx_tp = column.backward(dy_in, ctx);
    expect_close(dx_tp, c.sequence_parallel ? row_block(dx, r, n) : dx, what + " dx");
    expect_close(column.weight.grad, block_rows(full.weight.grad, {out}, r, n), what + " dW");
    expect_close(column.bias.grad, block_rows(full.bias.grad, {out}, r, n), what + " db");
  }
}

TEST_F(TensorParallel, RowParallelLinearEqualsLinear) {
  const int64_t tokens = 4 * n, in = 8 * n, out = 10;
  for (bool sp : {false, true}) {
    for (bool input_is_parallel : {true, false}) {
      const std::string what = std::string("row sp=") + (sp ? "1" : "0") +
                               " input_is_parallel=" + (input_is_parallel ? "1" : "0");
      const LinearOptions l = linear_options(in, out, 21);
      Linear full(l);
      full.bias.value.copy_from(random_tensor({out}, 22));
      LinearOptions o = l;
      o.parallel_mode = ParallelMode::Row;
      o.sequence_parallel = sp;
      o.input_is_parallel = input_is_parallel;
      Linear row(o, tp);
      row.load_full(full.weight.value, &full.bias.value);

      const Tensor x = random_tensor({tokens, in}, 23), dy = random_tensor({tokens, out}, 24);
      Linear::Context full_ctx;
      const Tensor y = full.forward(x, full_ctx);
      const Tensor dx = full.backward(dy, full_ctx);

      Linear::Context ctx;
      const Tensor x_in = input_is_parallel ? columns(x, r * in / n, in / n) : x;
      expect_close(row.forward(x_in, ctx), sp ? row_block(y, r, n) : y, what + " y");
      const Tensor dx_tp = row.backward(sp ? row_block(dy, r, n).clone() : dy, ctx);
      expect_close(dx_tp, input_is_parallel ? columns(dx, r * in / n, in / n) : dx, what + " dx");
      all_reduce_sequence_parallel_gradients(sequence_parallel_parameters(row.parameters()), *tp);
      expect_close(row.weight.grad, columns(full.weight.grad, r * in / n, in / n), what + " dW");
      expect_close(row.bias.grad, full.bias.grad, what + " db (added once, after the sum)");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Blocks.

void randomize(Parameter& p, uint64_t seed, float scale) {
  p.value.copy_from(random_tensor(p.value.shape(), seed, scale));
}

// Sets every parameter of the parallel module `part` to its shard (TensorShard) of the same
// parameter of `whole`, the same module without a group; gathering them back gives whole's.
void load_shards(Module& part, Module& whole, Communicator& group) {
  const std::vector<Parameter*> mine = part.parameters(), theirs = whole.parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    ASSERT_EQ(mine[i]->name, theirs[i]->name);
    mine[i]->value.copy_from(shard_of(*mine[i], theirs[i]->value, group));
    const Tensor gathered = gather_shards(*mine[i], mine[i]->value, group);
    EXPECT_EQ(std::memcmp(gathered.raw(), theirs[i]->value.raw(), gathered.nbytes()), 0)
        << mine[i]->name << ": gathering the shards gives the whole tensor back";
  }
  part.on_parameters_updated();
}

TEST_F(TensorParallel, LayerNormMLPEqualsTheUnshardedBlock) {
  const int64_t tokens = 4 * n, hidden = 16;
  for (ops::ActivationKind kind : {ops::ActivationKind::GeluTanh, ops::ActivationKind::SwiGlu}) {
    for (bool sp : {false, true}) {
      const std::string what =
          std::string("mlp ") + std::string(ops::activation_name(kind)) + " sp=" + (sp ? "1" : "0");
      LayerNormMLPOptions o;
      o.hidden = hidden;
      o.ffn_hidden = 8 * n;
      o.activation = kind;
      o.norm.hidden = hidden;
      o.init_std = 0.3f;
      o.output_init_std = 0.3f;
      o.seed = 3;
      LayerNormMLP full(o);
      randomize(full.norm.weight, 31, 1.0f);
      randomize(full.norm.bias, 32, 0.5f);
      randomize(full.fc1.bias, 33, 0.5f);
      randomize(full.fc2.bias, 34, 0.5f);
      o.sequence_parallel = sp;
      LayerNormMLP mlp(o, tp);
      load_shards(mlp, full, *tp);

      const Tensor x = random_tensor({tokens, hidden}, 35),
                   dy = random_tensor({tokens, hidden}, 36);
      LayerNormMLP::Context full_ctx;
      const Tensor y = full.forward(x, full_ctx);
      const Tensor dx = full.backward(dy, full_ctx);

      LayerNormMLP::Context ctx;
      const Tensor y_tp = mlp.forward(sp ? row_block(x, r, n) : x, ctx);
      expect_close(y_tp, sp ? row_block(y, r, n) : y, what + " y");
      const Tensor dx_tp = mlp.backward(sp ? row_block(dy, r, n).clone() : dy, ctx);
      expect_close(dx_tp, sp ? row_block(dx, r, n) : dx, what + " dx");
      all_reduce_sequence_parallel_gradients(sequence_parallel_parameters(mlp.parameters()), *tp);

      const int64_t f = o.ffn_hidden;
      const std::vector<int64_t> fc1_blocks =
          ops::is_gated(kind) ? std::vector<int64_t>{f, f} : std::vector<int64_t>{f};
      expect_close(mlp.fc1.weight.grad, block_rows(full.fc1.weight.grad, fc1_blocks, r, n),
                   what + " fc1 dW");
      expect_close(mlp.fc1.bias.grad, block_rows(full.fc1.bias.grad, fc1_blocks, r, n),
                   what + " fc1 db");
      expect_close(mlp.fc2.weight.grad, columns(full.fc2.weight.grad, r * f / n, f / n),
                   what + " fc2 dW");
      expect_close(mlp.fc2.bias.grad, full.fc2.bias.grad, what + " fc2 db");
      expect_close(mlp.norm.weight.grad, full.norm.weight.grad, what + " norm dgamma");
      expect_close(mlp.norm.bias.grad, full.norm.bias.grad, what + " norm dbeta");
    }
  }
}

TEST_F(TensorParallel, SelfAttentionEqualsTheUnshardedBlock) {
  const int64_t batch = 2, seq = 2 * n, heads = 2 * n, head_dim = 4, hidden = heads * head_dim;
  for (int64_t kv_heads : {heads, static_cast<int64_t>(n)}) {
    for (bool sp : {false, true}) {
      // The GQA case also rotates q and k (RoPE on this rank's heads).
      const bool rope = kv_heads != heads;
      const std::string what = "attention kv_heads=" + std::to_string(kv_heads) +
                               " rope=" + (rope ? "1" : "0") + " sp=" + (sp ? "1" : "0");
      MultiheadAttentionOptions o;
      o.rope = rope;
      o.hidden_size = hidden;
      o.num_attention_heads = heads;
      o.num_gqa_groups = kv_heads;
      o.attention_dropout = 0.0f;
      o.input_layernorm = true;
      o.init_std = 0.3f;
      o.output_init_std = 0.3f;
      o.seed = 4;
      MultiheadAttention full(o);
      randomize(full.layernorm_qkv->norm.weight, 41, 1.0f);
      randomize(full.layernorm_qkv->norm.bias, 42, 0.5f);
      randomize(full.layernorm_qkv->linear.bias, 43, 0.5f);
      randomize(full.proj.bias, 44, 0.5f);
      o.sequence_parallel = sp;
      MultiheadAttention attention(o, tp);
      load_shards(attention, full, *tp);

      const int64_t tokens = batch * seq;
      const Tensor x = random_tensor({tokens, hidden}, 45),
                   dy = random_tensor({tokens, hidden}, 46);
      MultiheadAttention::Context full_ctx;
      const Tensor y =
          full.forward(x.reshape({batch, seq, hidden}), full_ctx).reshape({tokens, hidden});
      const Tensor dx =
          full.backward(dy.reshape({batch, seq, hidden}), full_ctx).reshape({tokens, hidden});

      // Under SP the token rows of the flattened [B*T, C] with seq_len = T, else [B,T,C].
      MultiheadAttention::Context ctx;
      const Tensor y_tp =
          attention.forward(sp ? row_block(x, r, n) : x.reshape({batch, seq, hidden}), ctx, nullptr,
                            nullptr, nullptr, sp ? seq : 0);
      expect_close(y_tp.reshape({y_tp.numel() / hidden, hidden}), sp ? row_block(y, r, n) : y,
                   what + " y");
      const Tensor dx_tp = attention.backward(
          sp ? row_block(dy, r, n).clone() : dy.reshape({batch, seq, hidden}), ctx);
      expect_close(dx_tp.reshape({dx_tp.numel() / hidden, hidden}), sp ? row_block(dx, r, n) : dx,
                   what + " dx");
      all_reduce_sequence_parallel_gradients(sequence_parallel_parameters(attention.parameters()),
                                             *tp);

      const std::vector<int64_t> blocks = {heads * head_dim, kv_heads * head_dim,
                                           kv_heads * head_dim};
      const Linear& qkv = full.layernorm_qkv->linear;
      const Linear& qkv_tp = attention.layernorm_qkv->linear;
      expect_close(qkv_tp.weight.grad, block_rows(qkv.weight.grad, blocks, r, n), what + " qkv dW");
      expect_close(qkv_tp.bias.grad, block_rows(qkv.bias.grad, blocks, r, n), what + " qkv db");
      const int64_t local = hidden / n;
      expect_close(attention.proj.weight.grad, columns(full.proj.weight.grad, r * local, local),
                   what + " proj dW");
      expect_close(attention.proj.bias.grad, full.proj.bias.grad, what + " proj db");
      expect_close(attention.layernorm_qkv->norm.weight.grad, full.layernorm_qkv->norm.weight.grad,
                   what + " norm dgamma");
      expect_close(attention.layernorm_qkv->norm.bias.grad, full.layernorm_qkv->norm.bias.grad,
                   what + " norm dbeta");
    }
  }
}

// Cross-attention (T5's decoder): the query heads and the key / value heads split across the
// group, the encoder's output whole on every rank (or its token rows under SP): the output, the
// input's and the encoder output's gradients, and every parameter's gradient.
TEST_F(TensorParallel, CrossAttentionEqualsTheUnshardedBlock) {
  const int64_t batch = 2, seq = 2 * n, enc_seq = 3 * n, heads = 2 * n, head_dim = 4;
  const int64_t hidden = heads * head_dim;
  for (int64_t kv_heads : {heads, static_cast<int64_t>(n)}) {
    for (bool sp : {false, true}) {
      const std::string what =
          "cross-attention kv_heads=" + std::to_string(kv_heads) + " sp=" + (sp ? "1" : "0");
      MultiheadAttentionOptions o;
      o.attention_type = AttentionType::Cross;
      o.attn_mask_type = AttnMaskType::NoMask;
      o.hidden_size = hidden;
      o.num_attention_heads = heads;
      o.num_gqa_groups = kv_heads;
      o.attention_dropout = 0.0f;
      o.input_layernorm = true;
      o.init_std = 0.3f;
      o.output_init_std = 0.3f;
      o.seed = 5;
      MultiheadAttention full(o);
      randomize(full.layernorm_query->norm.weight, 51, 1.0f);
      randomize(full.layernorm_query->linear.bias, 52, 0.5f);
      randomize(full.key_value->bias, 53, 0.5f);
      o.sequence_parallel = sp;
      MultiheadAttention attention(o, tp);
      load_shards(attention, full, *tp);

      const int64_t tokens = batch * seq, enc_tokens = batch * enc_seq;
      const Tensor x = random_tensor({tokens, hidden}, 54),
                   dy = random_tensor({tokens, hidden}, 55);
      const Tensor e = random_tensor({enc_tokens, hidden}, 56);
      const Tensor e3 = e.reshape({batch, enc_seq, hidden});
      MultiheadAttention::Context full_ctx;
      const Tensor y =
          full.forward(x.reshape({batch, seq, hidden}), full_ctx, &e3).reshape({tokens, hidden});
      Tensor de;
      const Tensor dx =
          full.backward(dy.reshape({batch, seq, hidden}), full_ctx, &de).reshape({tokens, hidden});

      MultiheadAttention::Context ctx;
      const Tensor e_tp = sp ? row_block(e, r, n).clone() : e3;
      const Tensor y_tp =
          attention.forward(sp ? row_block(x, r, n) : x.reshape({batch, seq, hidden}), ctx, &e_tp,
                            nullptr, nullptr, sp ? seq : 0);
      expect_close(y_tp.reshape({y_tp.numel() / hidden, hidden}), sp ? row_block(y, r, n) : y,
                   what + " y");
      Tensor de_tp;
      const Tensor dx_tp = attention.backward(
          sp ? row_block(dy, r, n).clone() : dy.reshape({batch, seq, hidden}), ctx, &de_tp);
      expect_close(dx_tp.reshape({dx_tp.numel() / hidden, hidden}), sp ? row_block(dx, r, n) : dx,
                   what + " dx");
      const Tensor de_whole = de.reshape({enc_tokens, hidden});
      expect_close(de_tp.reshape({de_tp.numel() / hidden, hidden}),
                   sp ? row_block(de_whole, r, n) : de_whole, what + " d encoder output");
      all_reduce_sequence_parallel_gradients(sequence_parallel_parameters(attention.parameters()),
                                             *tp);

      const Linear& query = full.layernorm_query->linear;
      const Linear& query_tp = attention.layernorm_query->linear;
      expect_close(query_tp.weight.grad, block_rows(query.weight.grad, {heads * head_dim}, r, n),
                   what + " query dW");
      const std::vector<int64_t> kv_blocks = {kv_heads * head_dim, kv_heads * head_dim};
      expect_close(attention.key_value->weight.grad,
                   block_rows(full.key_value->weight.grad, kv_blocks, r, n), what + " kv dW");
      expect_close(attention.key_value->bias.grad,
                   block_rows(full.key_value->bias.grad, kv_blocks, r, n), what + " kv db");
      const int64_t local = hidden / n;
      expect_close(attention.proj.weight.grad, columns(full.proj.weight.grad, r * local, local),
                   what + " proj dW");
      expect_close(attention.layernorm_query->norm.weight.grad,
                   full.layernorm_query->norm.weight.grad, what + " norm dgamma");
    }
  }
}

// GroupedLinear split across the group, column- and row-parallel, against the whole module:
// every group's output, input gradient and weight / bias gradients (the empty group too).
TEST_F(TensorParallel, GroupedLinearEqualsTheUnshardedModule) {
  const int64_t in = 4 * n, out = 6 * n;
  const std::vector<int64_t> m_splits = {3, 0, 5};
  const int64_t rows = 8;
  for (ParallelMode mode : {ParallelMode::Column, ParallelMode::Row}) {
    const bool column = mode == ParallelMode::Column;
    const std::string what = column ? "grouped column" : "grouped row";
    GroupedLinearOptions o;
    o.num_gemms = 3;
    o.in_features = in;
    o.out_features = out;
    o.init_std = 0.3f;
    o.seed = 5;
    GroupedLinear full(o);
    for (int i = 0; i < o.num_gemms; ++i) randomize(full.biases[i], 50 + i, 0.5f);
    o.parallel_mode = mode;
    GroupedLinear grouped(o, tp);
    load_shards(grouped, full, *tp);

    const Tensor x = random_tensor({rows, in}, 55), dy = random_tensor({rows, out}, 56);
    GroupedLinear::Context full_ctx, ctx;
    const Tensor y = full.forward(x, m_splits, full_ctx);
    const Tensor dx = full.backward(dy, full_ctx);
    const int64_t local_in = in / n, local_out = out / n;
    const Tensor y_tp =
        grouped.forward(column ? x : columns(x, r * local_in, local_in), m_splits, ctx);
    expect_close(y_tp, column ? columns(y, r * local_out, local_out) : y, what + " y");
    const Tensor dx_tp =
        grouped.backward(column ? columns(dy, r * local_out, local_out).clone() : dy, ctx);
    expect_close(dx_tp, column ? dx : columns(dx, r * local_in, local_in), what + " dx");
    for (int i = 0; i < o.num_gemms; ++i) {
      const std::string gemm = what + " gemm " + std::to_string(i);
      expect_close(grouped.weights[i].grad,
                   column ? block_rows(full.weights[i].grad, {out}, r, n)
                          : columns(full.weights[i].grad, r * local_in, local_in),
                   gemm + " dW");
      expect_close(grouped.biases[i].grad,
                   column ? block_rows(full.biases[i].grad, {out}, r, n) : full.biases[i].grad,
                   gemm + " db");
    }
  }
}

TEST_F(TensorParallel, ZWorstDifferenceWithinTolerance) {
  // Defined last, so it runs last: the largest difference any comparison above saw.
  RecordProperty("worst_relative_difference", std::to_string(g_worst_relative));
  std::printf("rank %d: worst relative difference %.3g (tolerance %.0e)\n", r, g_worst_relative,
              kRelativeTolerance);
  EXPECT_LE(g_worst_relative, kRelativeTolerance);
}

}  // namespace
}  // namespace octet
