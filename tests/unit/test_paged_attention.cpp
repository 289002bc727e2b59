// Paged decode attention: the kernel on every instruction-set path against the float64
// reference, over scattered blocks, contexts longer than one partition, grouped-query heads,
// a left window, BF16 pools and scores of large magnitude; bad tables refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "octet/ops/attention.h"
#include "test_util.h"

namespace octet {
namespace {

struct PagedCase {
  int64_t heads, kv_heads, head_dim, block_size;
  std::vector<int32_t> lengths;
  float magnitude = 1.0f;  // q scale: scores grow with it
  int64_t window_left = -1;
};

void check_case(const PagedCase& c, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t S = static_cast<int64_t>(c.lengths.size());
  int64_t widest = 0, total_blocks = 0;
  for (int32_t len : c.lengths) {
    const int64_t blocks = (len + c.block_size - 1) / c.block_size;
    widest = std::max(widest, blocks);
    total_blocks += blocks;
  }
  const int64_t pool_blocks = total_blocks + 3;
  // Each sequence's blocks scattered over the pool.
  std::vector<int32_t> order(static_cast<size_t>(pool_blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Tensor tables = Tensor::zeros({S, widest}, DType::I32);
  Tensor lens = Tensor::empty({S}, DType::I32);
  size_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int32_t len = c.lengths[static_cast<size_t>(s)];
    lens.data<int32_t>()[s] = len;
    for (int64_t b = 0; b < (len + c.block_size - 1) / c.block_size; ++b) {
      tables.data<int32_t>()[s * widest + b] = order[next++];
    }
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](Shape shape, float scale) {
    std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
    for (float& v : values) v = normal(rng) * scale;
    return Tensor::from_floats(shape, values).to(dtype);
  };
  Tensor q = random({S, c.heads, c.head_dim}, c.magnitude);
  Tensor k = random({pool_blocks, c.block_size, c.kv_heads, c.head_dim}, 1.0f);
  Tensor v = random({pool_blocks, c.block_size, c.kv_heads, c.head_dim}, 1.0f);
  ops::AttentionOptions options;
  options.window_left = c.window_left;
  Tensor expected = Tensor::empty(q.shape(), dtype);
  ops::reference::paged_attention_decode(q, k, v, tables, lens, options, expected);
  const std::vector<float> want = expected.to_floats();
  for (Isa isa : testing::available_isas()) {
    testing::IsaGuard guard;
    set_active_isa(isa);
    Tensor out = Tensor::empty(q.shape(), dtype);
    ops::paged_attention_decode(q, k, v, tables, lens, options, out);
    const std::vector<float> got = out.to_floats();
    float worst = 0.0f;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
    // Outputs are averages of unit-normal values: F32 to summation order, BF16 to one
    // rounding of the output (both sides round once).
    EXPECT_LE(worst, dtype == DType::F32 ? 2e-5f : 2e-2f)
        << isa_name(isa) << " " << dtype_name(dtype) << " magnitude " << c.magnitude;
  }
}

TEST(PagedAttention, MatchesTheReferenceOnEveryPath) {
  const std::vector<PagedCase> cases = {
      {4, 4, 16, 4, {1, 7, 13}},
      {6, 2, 64, 16, {300, 17, 1, 529}},  // GQA, several partitions
      {2, 1, 24, 5, {40, 3}},             // head size not a multiple of the vector width
      {4, 2, 32, 8, {100, 9}, 1.0f, 20},  // left window
      {4, 4, 32, 16, {257, 64}, 300.0f},  // scores in the thousands
      {20, 4, 128, 8, {70, 1200}},        // two groups of heads; partitions of 256 past 1024
  };
  uint32_t seed = 1;
  for (const PagedCase& c : cases) {
    for (DType dtype : {DType::F32, DType::BF16}) check_case(c, dtype, seed++);
  }
}

TEST(PagedAttention, Fp8PoolsMatchTheReferenceOnEveryPath) {
  // E4M3 pools with one scale per (token, head): the kernel widens the codes in place; the
  // reference takes code * scale in float64.
  const int64_t blocks = 12, block_size = 8, kv_heads = 2, heads = 4, D = 32;
  std::mt19937 rng(7);
  Tensor k = Tensor::empty({blocks, block_size, kv_heads, D}, DType::E4M3);
  Tensor v = Tensor::empty({blocks, block_size, kv_heads, D}, DType::E4M3);
  for (Tensor* pool : {&k, &v}) {
    auto* codes = static_cast<uint8_t*>(pool->raw());
    for (int64_t i = 0; i < pool->numel(); ++i) {
      uint8_t code = static_cast<uint8_t>(rng() & 0xff);
      if ((code & 0x7f) == 0x7f) code = 0;  // no NaN codes
      codes[i] = code;
    }
  }
  std::uniform_real_distribution<float> uniform(1e-3f, 2e-2f);
  std::vector<float> ks(static_cast<size_t>(blocks * block_size * kv_heads)), vs(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    ks[i] = uniform(rng);
    vs[i] = uniform(rng);
  }
  Tensor k_scale = Tensor::from_floats({blocks, block_size, kv_heads}, ks);
  Tensor v_scale = Tensor::from_floats({blocks, block_size, kv_heads}, vs);
  Tensor tables = Tensor::zeros({3, 6}, DType::I32);
  const std::vector<std::vector<int32_t>> t = {{3, 0, 7, 1, 11, 2}, {5, 9}, {4}};
  const std::vector<int32_t> lengths = {45, 16, 1};
  Tensor lens = Tensor::empty({3}, DType::I32);
  for (size_t s = 0; s < 3; ++s) {
    std::copy(t[s].begin(), t[s].end(), tables.data<int32_t>() + s * 6);
    lens.data<int32_t>()[s] = lengths[s];
  }
  ops::AttentionOptions options;
  for (DType dtype : {DType::F32, DType::BF16}) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> qv(static_cast<size_t>(3 * heads * D));
    for (float& x : qv) x = normal(rng);
    Tensor q = Tensor::from_floats({3, heads, D}, qv).to(dtype);
    Tensor expected = Tensor::empty(q.shape(), dtype);
    ops::reference::paged_attention_decode(q, k, v, tables, lens, options, expected, &k_scale,
                                           &v_scale);
    const std::vector<float> want = expected.to_floats();
    for (Isa isa : testing::available_isas()) {
      testing::IsaGuard guard;
      set_active_isa(isa);
      Tensor out = Tensor::empty(q.shape(), dtype);
      ops::paged_attention_decode(q, k, v, tables, lens, options, out, &k_scale, &v_scale);
      const std::vector<float> got = out.to_floats();
      float worst = 0.0f;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, std::fabs(got[i] - want[i]) / (1.0f + std::fabs(want[i])));
      }
      EXPECT_LE(worst, dtype == DType::F32 ? 2e-5f : 1e-2f) << isa_name(isa) << dtype_name(dtype);
    }
  }
  Tensor out = Tensor::empty({3, heads, D}, DType::F32);
  EXPECT_THROW(ops::paged_attention_decode(Tensor::zeros({3, heads, D}, DType::F32), k, v, tables,
                                           lens, options, out),
               Error);  // FP8 pools without their scales
}

TEST(PagedAttention, RefusesBadTables) {
  Tensor q = Tensor::zeros({1, 2, 8}, DType::F32);
  Tensor pool = Tensor::zeros({4, 4, 2, 8}, DType::F32);
  Tensor out = Tensor::empty({1, 2, 8}, DType::F32);
  Tensor tables = Tensor::zeros({1, 2}, DType::I32);
  Tensor lens = Tensor::empty({1}, DType::I32);
  ops::AttentionOptions options;
  lens.data<int32_t>()[0] = 9;  // needs 3 blocks, the table has 2
  EXPECT_THROW(ops::paged_attention_decode(q, pool, pool, tables, lens, options, out), Error);
  lens.data<int32_t>()[0] = 5;
  tables.data<int32_t>()[1] = 4;  // outside the pool
  EXPECT_THROW(ops::paged_attention_decode(q, pool, pool, tables, lens, options, out), Error);
  tables.data<int32_t>()[1] = 3;
  ops::paged_attention_decode(q, pool, pool, tables, lens, options, out);
  Tensor bf16_pool = Tensor::zeros({4, 4, 2, 8}, DType::BF16);
  EXPECT_THROW(ops::paged_attention_decode(q, bf16_pool, bf16_pool, tables, lens, options, out),
               Error);
}

}  // namespace
}  // namespace octet
