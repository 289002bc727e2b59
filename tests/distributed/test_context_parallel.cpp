// Context parallelism at the world sizes CMake runs this under (1, 2, 4 ranks): the context
// groups of ParallelState, the micro-batch split into chunks r and 2CP-1-r, and attention over
// a sequence split across the ranks - ring (p2p) and Ulysses (a2a), causal and unmasked, F32
// and BF16, grouped-query heads, scores of large and tiny magnitude - against the whole
// sequence's attention in one process: outputs and q, k, v gradients. A self-attention module
// with RoPE (positions from the chunks' own) against the whole module: outputs, input and
// parameter gradients.
#include <gtest/gtest.h>

#include <cstring>

#include "octet/comm.h"
#include "octet/modules.h"
#include "octet/trainable_model.h"
#include "unit/test_util.h"

namespace octet {
namespace {

using testing::random_tensor;
using testing::worst;

class ContextParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    world = world_communicator();
    n = world->size();
    r = world->rank();
  }
  std::shared_ptr<Communicator> world;
  int n = 1, r = 0;
};

// This rank's chunks of x [B, T, ...] (any trailing dims): [B, T / n, ...].
Tensor chunks_of(const Tensor& x, int rank, int size) {
  Shape shape = x.shape();
  const int64_t B = shape[0], T = shape[1], c = T / (2 * size);
  const size_t row = x.nbytes() / static_cast<size_t>(B * T);
  shape[1] = 2 * c;
  Tensor out = Tensor::empty(shape, x.dtype());
  for (int64_t b = 0; b < B; ++b) {
    for (int half = 0; half < 2; ++half) {
      std::memcpy(
          static_cast<char*>(out.raw()) + static_cast<size_t>(b * 2 * c + half * c) * row,
          static_cast<const char*>(x.raw()) +
              static_cast<size_t>(b * T + context_parallel_chunk(rank, size, half) * c) * row,
          static_cast<size_t>(c) * row);
    }
  }
  return out;
}

TEST_F(ContextParallel, GroupsSplitTheDataRanks) {
  for (int cp : {1, 2, 4}) {
    if (n % cp != 0) continue;
    ParallelState state(world, 1, 1, 1, cp);
    EXPECT_EQ(state.context().size(), cp);
    EXPECT_EQ(state.context_rank(), r % cp);
    EXPECT_EQ(state.context().rank(), r % cp);
    EXPECT_EQ(state.sample_size(), n / cp);
    EXPECT_EQ(state.sample_rank(), r / cp);
    // CP consecutive data ranks share a sample.
    const double sum = state.context().all_reduce(static_cast<double>(r));
    const int first = r - r % cp;
    EXPECT_EQ(sum, cp * first + cp * (cp - 1) / 2);
  }
  if (n % 3 != 0) {
    EXPECT_THROW(ParallelState(world, 1, 1, 1, 3), Error);
  }
}

TEST_F(ContextParallel, SplitTakesChunksRAndMirror) {
  const int64_t B = 2, T = 8 * n;
  Tensor ids = Tensor::empty({B, T}, DType::I32);
  for (int64_t i = 0; i < B * T; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(i);
  const pipeline::MicroBatch part = context_parallel_split({{"ids", ids}}, *world);
  const Tensor& got = part.at("ids");
  ASSERT_EQ(got.shape(), (Shape{B, T / n}));
  const int64_t c = T / (2 * n);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < 2 * c; ++t) {
      const int64_t chunk = t < c ? r : 2 * n - 1 - r;
      EXPECT_EQ(got.data<int32_t>()[b * 2 * c + t], b * T + chunk * c + t % c);
    }
  }
  if (n > 1) {
    Tensor odd = Tensor::zeros({B, 2 * n + 1}, DType::I32);
    EXPECT_NE(testing::error_of([&] {
                context_parallel_split({{"ids", odd}}, *world);
              }).find("multiple of 2 x CP"),
              std::string::npos);
  }
}

struct AttentionCase {
  CpCommType type;
  DType dtype;
  AttnMaskType mask;
  float magnitude;  // q and k scaled: scores of ~magnitude^2 * sqrt(D)
};

TEST_F(ContextParallel, AttentionMatchesTheWholeSequence) {
  const int64_t B = 2, T = 8 * n, H = 8, Hkv = 4, D = 16;
  std::vector<AttentionCase> cases;
  for (CpCommType type : {CpCommType::P2P, CpCommType::A2A}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      for (AttnMaskType mask : {AttnMaskType::Causal, AttnMaskType::NoMask}) {
        cases.push_back({type, dtype, mask, 1.0f});
      }
    }
    cases.push_back({type, DType::F32, AttnMaskType::Causal, 8.0f});
    cases.push_back({type, DType::F32, AttnMaskType::Causal, 1e-3f});
  }
  for (const AttentionCase& k : cases) {
    SCOPED_TRACE(::testing::Message()
                 << (k.type == CpCommType::P2P ? "p2p " : "a2a ") << dtype_name(k.dtype)
                 << (k.mask == AttnMaskType::Causal ? " causal" : " no mask") << " magnitude "
                 << k.magnitude);
    DotProductAttentionOptions o;
    o.num_attention_heads = H;
    o.num_gqa_groups = Hkv;
    o.kv_channels = D;
    o.attn_mask_type = k.mask;
    // The same whole tensors on every rank.
    const Tensor q = random_tensor({B, T, H, D}, DType::F32, 11, 0.0f, k.magnitude).to(k.dtype);
    const Tensor kk = random_tensor({B, T, Hkv, D}, DType::F32, 12, 0.0f, k.magnitude).to(k.dtype);
    const Tensor v = random_tensor({B, T, Hkv, D}, k.dtype, 13);
    const Tensor dout = random_tensor({B, T, H, D}, k.dtype, 14);
    DotProductAttention whole(o);
    DotProductAttention::Context wctx;
    const Tensor out = whole.forward(q, kk, v, wctx);
    Tensor dq, dk, dv;
    whole.backward(dout, wctx, dq, dk, dv);

    DotProductAttention split(o);
    split.set_context_parallel(world.get(), k.type);
    DotProductAttention::Context sctx;
    const Tensor got =
        split.forward(chunks_of(q, r, n), chunks_of(kk, r, n), chunks_of(v, r, n), sctx);
    Tensor gq, gk, gv;
    split.backward(chunks_of(dout, r, n), sctx, gq, gk, gv);
    // F32: the ring merges blocks' results by log-sum-exp (another rounding order); BF16: each
    // block's output is rounded to BF16 before the merge.
    const double atol = k.dtype == DType::F32 ? 2e-6 : 2e-2;
    const double rtol = k.dtype == DType::F32 ? 1e-4 : 2e-2;
    const double scale_q = std::max(1.0, testing::max_abs(dq)),
                 scale_k = std::max(1.0, testing::max_abs(dk));
    EXPECT_LE(worst(got, chunks_of(out, r, n), atol, rtol), 1.0);
    EXPECT_LE(worst(gq, chunks_of(dq, r, n), atol * scale_q, rtol), 1.0);
    EXPECT_LE(worst(gk, chunks_of(dk, r, n), atol * scale_k, rtol), 1.0);
    EXPECT_LE(worst(gv, chunks_of(dv, r, n), atol, rtol), 1.0);
    EXPECT_EQ(gq.dtype(), k.dtype);
    EXPECT_EQ(gk.shape(), (Shape{B, T / n, Hkv, D}));
  }
}

TEST_F(ContextParallel, SelfAttentionWithRopeMatchesTheWholeModule) {
  const int64_t B = 2, T = 8 * n, C = 64;
  MultiheadAttentionOptions o;
  o.hidden_size = C;
  o.num_attention_heads = 4;
  o.input_layernorm = true;
  o.rope = true;
  o.seed = 5;
  for (CpCommType type : {CpCommType::P2P, CpCommType::A2A}) {
    if (type == CpCommType::A2A && 4 % n != 0) continue;
    const Tensor x = random_tensor({B, T, C}, DType::F32, 21);
    const Tensor dy = random_tensor({B, T, C}, DType::F32, 22);
    MultiheadAttention whole(o), split(o);
    split.core_attention.set_context_parallel(world.get(), type);
    MultiheadAttention::Context wctx, sctx;
    const Tensor y = whole.forward(x, wctx);
    const Tensor dx = whole.backward(dy, wctx);
    const Tensor got = split.forward(chunks_of(x, r, n), sctx);
    const Tensor gdx = split.backward(chunks_of(dy, r, n), sctx);
    EXPECT_LE(worst(got, chunks_of(y, r, n), 1e-5, 1e-4), 1.0);
    EXPECT_LE(worst(gdx, chunks_of(dx, r, n), 1e-5, 1e-4), 1.0);
    // Parameter gradients: each rank's from its tokens, summed over the ranks.
    std::vector<Parameter*> wp, sp;
    whole.collect_parameters(wp);
    split.collect_parameters(sp);
    ASSERT_EQ(wp.size(), sp.size());
    for (size_t i = 0; i < wp.size(); ++i) {
      Tensor sum = sp[i]->grad.clone();
      world->iall_reduce(sum, ReduceOp::Sum).wait();
      EXPECT_LE(worst(sum, wp[i]->grad, 1e-5 * std::max(1.0, testing::max_abs(wp[i]->grad)), 1e-4),
                1.0)
          << wp[i]->name;
    }
  }
}

TEST_F(ContextParallel, RefusesWhatItCannotSplit) {
  // (Excluded at one rank, where there is nothing to split.)
  DotProductAttentionOptions o;
  o.num_attention_heads = 2 * n + 1;
  o.kv_channels = 8;
  DotProductAttention odd_heads(o);
  EXPECT_NE(testing::error_of([&] {
              odd_heads.set_context_parallel(world.get(), CpCommType::A2A);
            }).find("divisible by CP"),
            std::string::npos);
  o.num_attention_heads = 4;
  o.attention_dropout = 0.1f;
  DotProductAttention dropout(o);
  EXPECT_NE(testing::error_of([&] {
              dropout.set_context_parallel(world.get());
            }).find("attention_dropout 0"),
            std::string::npos);
  o.attention_dropout = 0.0f;
  o.window_size = {4, 0};
  DotProductAttention window(o);
  EXPECT_NE(
      testing::error_of([&] { window.set_context_parallel(world.get()); }).find("sliding window"),
      std::string::npos);
  o.window_size = {-1, -1};
  DotProductAttention odd_tokens(o);
  odd_tokens.set_context_parallel(world.get());
  const Tensor q = random_tensor({1, 3, 4, 8}, DType::F32, 1);
  DotProductAttention::Context ctx;
  EXPECT_NE(testing::error_of([&] { odd_tokens.forward(q, q, q, ctx); }).find("two equal chunks"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
