// Context-parallel attention. Rank r of CP holds chunks r and 2CP-1-r of every sequence (2CP
// chunks of c = T / 2CP tokens), so that under a causal mask every rank has the same work.
//
// P2P (ring attention): K/V blocks travel around the ring, one step per rank, each step's send
// overlapped with the attention of the block in hand. At step i rank r holds the block of
// rank s = r - i (mod CP). Causally, step 0 is the causal attention of the local tokens; for
// s < r every local query sees the first half (chunk s) of the block and nothing of the second;
// for s > r only the second half of the queries (chunk 2CP-1-r) sees the block, all of it. Each
// step's output is merged into the running one by log-sum-exp. The backward walks the same
// ring with the forward's final output and log-sum-exp (so each block's probabilities are the
// final ones); each block's dK/dV accumulator travels with it and arrives home after CP steps.
//
// A2A (Ulysses): an all-to-all turns [local tokens, every head] into [every token, CP-th of
// the heads], the whole-sequence attention runs on those heads, and a second all-to-all turns
// the output back.
#include "modules/context_parallel.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "octet/error.h"

namespace octet::modules_detail {

namespace {

constexpr int kKvTag = 7101;
constexpr int kDkvTag = 7102;

char* bytes(Tensor& x) {
  return static_cast<char*>(x.raw());
}
const char* bytes(const Tensor& x) {
  return static_cast<const char*>(x.raw());
}

// Tokens [begin, begin + count) of x [B, T, ...] as a new contiguous [B, count, ...].
Tensor tokens(const Tensor& x, int64_t begin, int64_t count) {
  Shape shape = x.shape();
  const int64_t B = shape[0], T = shape[1];
  shape[1] = count;
  Tensor out = Tensor::empty(shape, x.dtype());
  const size_t row = x.nbytes() / static_cast<size_t>(B * T);
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(bytes(out) + static_cast<size_t>(b * count) * row,
                bytes(x) + static_cast<size_t>(b * T + begin) * row,
                static_cast<size_t>(count) * row);
  }
  return out;
}

// Rows [begin, begin + count) of every (b, h) of lse [B, H, T, 2].
Tensor lse_rows(const Tensor& lse, int64_t begin, int64_t count) {
  const int64_t BH = lse.dim(0) * lse.dim(1), T = lse.dim(2);
  Tensor out = Tensor::empty({lse.dim(0), lse.dim(1), count, 2}, DType::F32);
  for (int64_t bh = 0; bh < BH; ++bh) {
    std::memcpy(out.data<float>() + bh * count * 2, lse.data<float>() + (bh * T + begin) * 2,
                static_cast<size_t>(count) * 2 * sizeof(float));
  }
  return out;
}

// dst [B, T, ...] F32 tokens [begin, begin + src.dim(1)) += src [B, count, ...].
void add_tokens(Tensor& dst, int64_t begin, const Tensor& src) {
  const Tensor s = src.dtype() == DType::F32 ? src : src.to(DType::F32);
  const int64_t B = dst.dim(0), T = dst.dim(1), count = s.dim(1);
  const int64_t row = dst.numel() / (B * T);
  float* d = dst.data<float>();
  const float* p = s.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    float* to = d + (b * T + begin) * row;
    const float* from = p + b * count * row;
    for (int64_t e = 0; e < count * row; ++e) to[e] += from[e];
  }
}

// k and v packed as one [2, B, S, Hkv, D] message, and each half seen as [B, S, Hkv, D].
Tensor pack_kv(const Tensor& k, const Tensor& v) {
  Tensor kv = Tensor::empty({2, k.numel()}, k.dtype());
  std::memcpy(bytes(kv), bytes(k), k.nbytes());
  std::memcpy(bytes(kv) + k.nbytes(), bytes(v), v.nbytes());
  return kv;
}

Tensor half_of(const Tensor& packed, int which, const Shape& shape) {
  return packed.slice_rows(which, which + 1).reshape(shape);
}

// The running output and log-sum-exp over the blocks seen so far.
struct Merged {
  Tensor out;               // [B, T, H, D] F32
  std::vector<double> lse;  // [B, H, T]
  int64_t B = 0, T = 0, H = 0, D = 0;

  Merged(int64_t b, int64_t t, int64_t h, int64_t d)
      : out(Tensor::zeros({b, t, h, d}, DType::F32)),
        lse(static_cast<size_t>(b * h * t), -std::numeric_limits<double>::infinity()),
        B(b),
        T(t),
        H(h),
        D(d) {}

  // A block's result for queries [row0, row0 + part.dim(1)): part [B, Tp, H, D], part_lse
  // [B, H, Tp, 2] (hi + lo); rows the block masked wholly (lse +inf) are left alone.
  void add(const Tensor& part, const Tensor& part_lse, int64_t row0) {
    const Tensor p = part.dtype() == DType::F32 ? part : part.to(DType::F32);
    const int64_t Tp = p.dim(1);
    const float* pl = part_lse.data<float>();
    const float* pv = p.data<float>();
    float* o = out.data<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t t = 0; t < Tp; ++t) {
          const int64_t pr = (b * H + h) * Tp + t;
          const double l = double{pl[2 * pr]} + double{pl[2 * pr + 1]};
          if (!std::isfinite(l)) continue;
          double& L = lse[static_cast<size_t>((b * H + h) * T + row0 + t)];
          const double m = std::max(L, l);
          const double merged = m + std::log(std::exp(L - m) + std::exp(l - m));
          const auto keep = static_cast<float>(std::exp(L - merged));
          const auto take = static_cast<float>(std::exp(l - merged));
          float* orow = o + ((b * T + row0 + t) * H + h) * D;
          const float* prow = pv + ((b * Tp + t) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] = orow[d] * keep + prow[d] * take;
          L = merged;
        }
      }
    }
  }

  Tensor lse_tensor() const {  // [B, H, T, 2] hi + lo
    Tensor t = Tensor::empty({B, H, T, 2}, DType::F32);
    float* p = t.data<float>();
    for (size_t i = 0; i < lse.size(); ++i) {
      const auto hi = static_cast<float>(lse[i]);
      p[2 * i] = hi;
      p[2 * i + 1] = std::isfinite(lse[i]) ? static_cast<float>(lse[i] - hi) : 0.0f;
    }
    return t;
  }
};

void check_local(const Tensor& q, Communicator& group, CpCommType type, int64_t kv_heads) {
  const int P = group.size();
  OCTET_CHECK(q.dim(1) % 2 == 0, "context parallelism: each rank's ", q.dim(1),
              " tokens must be two equal chunks (the sequence divisible by 2 x CP = ", 2 * P, ")");
  if (type == CpCommType::A2A) {
    OCTET_CHECK(q.dim(2) % P == 0 && kv_heads % P == 0, "context parallelism (a2a): ", q.dim(2),
                " query and ", kv_heads, " key/value heads per rank must be divisible by CP=", P,
                " (use --cp-comm-type p2p)");
  }
}

// What ring step i computes on rank r: queries [q_begin, q_begin + q_count) of the local ones
// against the first kv_count keys of the block in hand (from rank r - i), causally or not. Step
// 0 is the local causal attention; later, causally, a block from a lower rank is seen by every
// query up to its first half (chunk s), one from a higher rank wholly by the second half of
// the queries (chunk 2CP-1-r) only; without a mask, everything.
struct RingStep {
  int64_t q_begin = 0, q_count = 0, kv_count = 0;
  bool causal = false;
};

RingStep ring_step(int i, int r, int P, int64_t local, bool causal) {
  const int source = (r - i + P) % P;
  const int64_t c = local / 2;
  if (i == 0 || !causal) return {0, local, local, causal && i == 0};
  if (source < r) return {0, local, c, false};
  return {c, c, local, false};
}

// x's tokens [begin, begin + count): x itself when that is all of them.
Tensor span(const Tensor& x, int64_t begin, int64_t count) {
  return begin == 0 && count == x.dim(1) ? x : tokens(x, begin, count);
}

// One step of the ring: its queries against the visible part of the block k, v, merged in.
void ring_block(const RingStep& step, const Tensor& q, const Tensor& k, const Tensor& v,
                ops::AttentionOptions a, Merged& merged) {
  a.causal = step.causal;
  const Tensor qs = span(q, step.q_begin, step.q_count);
  Tensor out = Tensor::empty(qs.shape(), q.dtype());
  Tensor lse = Tensor::empty({q.dim(0), q.dim(2), step.q_count, 2}, DType::F32);
  ops::flash_attention_forward(qs, span(k, 0, step.kv_count), span(v, 0, step.kv_count), a, out,
                               lse);
  merged.add(out, lse, step.q_begin);
}

}  // namespace

namespace {

// Ulysses' exchange as one plan: for every rank r's share of every sequence b (its T / CP
// tokens t, chunks r and 2CP-1-r), row (r, b, t) of the all-to-all buffer [CP][B][T/CP] holds
// the token at position pos of the whole sequence, with one head block [H/CP, D] per row.
// f(rank, b, t, pos, buffer row) for each.
template <typename F>
void for_each_exchanged_row(int P, int64_t B, int64_t Tl, F f) {
  const int64_t c = Tl / 2;
  for (int r = 0; r < P; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < Tl; ++t) {
        f(r, b, t, cp_chunk(r, P, static_cast<int>(t / c)) * c + t % c, (r * B + b) * Tl + t);
      }
    }
  }
}

}  // namespace

Tensor cp_heads_to_sequence(const Tensor& x, Communicator& group) {
  const int P = group.size();
  const int64_t B = x.dim(0), Tl = x.dim(1), H = x.dim(2), D = x.dim(3), Hp = H / P;
  const size_t unit = dtype_bytes(x.dtype()), row = static_cast<size_t>(Hp * D) * unit;
  Tensor send = Tensor::empty({P, B * Tl * Hp * D}, x.dtype());
  Tensor recv = Tensor::empty(send.shape(), x.dtype());
  Tensor y = Tensor::empty({B, Tl * P, Hp, D}, x.dtype());
  // Send: rank j gets head block j of each of this rank's tokens.
  for_each_exchanged_row(P, B, Tl, [&](int j, int64_t b, int64_t t, int64_t, int64_t at) {
    std::memcpy(bytes(send) + static_cast<size_t>(at) * row,
                bytes(x) + static_cast<size_t>(((b * Tl + t) * H + j * Hp) * D) * unit, row);
  });
  group.iall_to_all(send, recv).wait();
  // Receive: rank i's tokens of this rank's heads, placed at their positions.
  for_each_exchanged_row(P, B, Tl, [&](int, int64_t b, int64_t, int64_t pos, int64_t at) {
    std::memcpy(bytes(y) + static_cast<size_t>(b * Tl * P + pos) * row,
                bytes(recv) + static_cast<size_t>(at) * row, row);
  });
  return y;
}

Tensor cp_sequence_to_heads(const Tensor& y, Communicator& group) {
  const int P = group.size();
  const int64_t B = y.dim(0), T = y.dim(1), Hp = y.dim(2), D = y.dim(3), Tl = T / P, H = Hp * P;
  const size_t unit = dtype_bytes(y.dtype()), row = static_cast<size_t>(Hp * D) * unit;
  Tensor send = Tensor::empty({P, B * Tl * Hp * D}, y.dtype());
  Tensor recv = Tensor::empty(send.shape(), y.dtype());
  Tensor x = Tensor::empty({B, Tl, H, D}, y.dtype());
  // The reverse: rank i gets its tokens of this rank's heads back; rank j's head block lands in
  // its place among the heads of each of this rank's tokens.
  for_each_exchanged_row(P, B, Tl, [&](int, int64_t b, int64_t, int64_t pos, int64_t at) {
    std::memcpy(bytes(send) + static_cast<size_t>(at) * row,
                bytes(y) + static_cast<size_t>(b * T + pos) * row, row);
  });
  group.iall_to_all(send, recv).wait();
  for_each_exchanged_row(P, B, Tl, [&](int j, int64_t b, int64_t t, int64_t, int64_t at) {
    std::memcpy(bytes(x) + static_cast<size_t>(((b * Tl + t) * H + j * Hp) * D) * unit,
                bytes(recv) + static_cast<size_t>(at) * row, row);
  });
  return x;
}

Tensor cp_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                            const ops::AttentionOptions& a, Communicator& group, CpCommType type,
                            DotProductAttention::Context& ctx) {
  check_local(q, group, type, k.dim(2));
  if (type == CpCommType::A2A) {
    ctx.q = cp_heads_to_sequence(q, group);
    ctx.k = cp_heads_to_sequence(k, group);
    ctx.v = cp_heads_to_sequence(v, group);
    ctx.out = Tensor::empty(ctx.q.shape(), q.dtype());
    ctx.lse = Tensor::empty({q.dim(0), ctx.q.dim(2), ctx.q.dim(1), 2}, DType::F32);
    ops::flash_attention_forward(ctx.q, ctx.k, ctx.v, a, ctx.out, ctx.lse);
    return cp_sequence_to_heads(ctx.out, group);
  }
  const int P = group.size(), r = group.rank(), next = (r + 1) % P, prev = (r + P - 1) % P;
  Merged merged(q.dim(0), q.dim(1), q.dim(2), q.dim(3));
  Tensor held = pack_kv(k, v), incoming = Tensor::empty(held.shape(), held.dtype());
  for (int i = 0; i < P; ++i) {
    Work send, recv;
    if (i + 1 < P) {  // the next block travels while this one is computed
      send = group.isend(held, next, kKvTag);
      recv = group.irecv(incoming, prev, kKvTag);
    }
    ring_block(ring_step(i, r, P, q.dim(1), a.causal), q, half_of(held, 0, k.shape()),
               half_of(held, 1, v.shape()), a, merged);
    if (i + 1 < P) {
      send.wait();
      recv.wait();
      std::swap(held, incoming);
    }
  }
  ctx.q = q;
  ctx.k = k;
  ctx.v = v;
  ctx.out = merged.out.to(q.dtype());
  ctx.lse = merged.lse_tensor();
  return ctx.out;
}

void cp_attention_backward(const Tensor& dout, DotProductAttention::Context& ctx,
                           const ops::AttentionOptions& a, Communicator& group, CpCommType type,
                           Tensor& dq, Tensor& dk, Tensor& dv) {
  const Tensor g = dout.dtype() == ctx.q.dtype() ? dout : dout.to(ctx.q.dtype());
  if (type == CpCommType::A2A) {
    const Tensor gs = cp_heads_to_sequence(g, group);
    Tensor dqs = Tensor::empty(ctx.q.shape(), ctx.q.dtype());
    Tensor dks = Tensor::empty(ctx.k.shape(), ctx.k.dtype());
    Tensor dvs = Tensor::empty(ctx.v.shape(), ctx.v.dtype());
    ops::flash_attention_backward(ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse, gs, a, dqs, dks, dvs);
    dq = cp_sequence_to_heads(dqs, group);
    dk = cp_sequence_to_heads(dks, group);
    dv = cp_sequence_to_heads(dvs, group);
    return;
  }
  const Tensor &q = ctx.q, &k = ctx.k, &v = ctx.v, &out = ctx.out, &lse = ctx.lse;
  const int P = group.size(), r = group.rank(), next = (r + 1) % P, prev = (r + P - 1) % P;
  Tensor dq_sum = Tensor::zeros(q.shape(), DType::F32);
  Tensor held = pack_kv(k, v), incoming = Tensor::empty(held.shape(), held.dtype());
  // Each block's dK/dV sums (F32), double-buffered: one may still be in flight.
  Tensor dkv[2] = {Tensor::empty({2, k.numel()}, DType::F32),
                   Tensor::empty({2, k.numel()}, DType::F32)};
  Tensor dkv_in = Tensor::empty({2, k.numel()}, DType::F32);
  Work dkv_sent[2];
  for (int i = 0; i < P; ++i) {
    Work send, recv, dkv_recv;
    if (i + 1 < P) {
      send = group.isend(held, next, kKvTag);
      recv = group.irecv(incoming, prev, kKvTag);
    }
    if (i > 0) dkv_recv = group.irecv(dkv_in, prev, kDkvTag);  // this block's sum so far
    Tensor& sum = dkv[i % 2];
    dkv_sent[i % 2].wait();
    sum.zero_();
    Tensor dk_sum = half_of(sum, 0, k.shape()), dv_sum = half_of(sum, 1, v.shape());
    const RingStep step = ring_step(i, r, P, q.dim(1), a.causal);
    const int64_t q0 = step.q_begin, qn = step.q_count, kvn = step.kv_count;
    ops::AttentionOptions b = a;
    b.causal = step.causal;
    const Tensor qs = span(q, q0, qn), ks = span(half_of(held, 0, k.shape()), 0, kvn),
                 vs = span(half_of(held, 1, v.shape()), 0, kvn);
    const Tensor ls = q0 == 0 && qn == q.dim(1) ? lse : lse_rows(lse, q0, qn);
    Tensor dqp = Tensor::empty(qs.shape(), q.dtype()), dkp = Tensor::empty(ks.shape(), k.dtype()),
           dvp = Tensor::empty(vs.shape(), v.dtype());
    ops::flash_attention_backward(qs, ks, vs, span(out, q0, qn), ls, span(g, q0, qn), b, dqp, dkp,
                                  dvp);
    add_tokens(dq_sum, q0, dqp);
    add_tokens(dk_sum, 0, dkp);
    add_tokens(dv_sum, 0, dvp);
    if (i > 0) {
      dkv_recv.wait();
      float* s = sum.data<float>();
      const float* in = dkv_in.data<float>();
      for (int64_t e = 0; e < sum.numel(); ++e) s[e] += in[e];
    }
    dkv_sent[i % 2] = group.isend(sum, next, kDkvTag);  // on to the block's next rank
    if (i + 1 < P) {
      send.wait();
      recv.wait();
      std::swap(held, incoming);
    }
  }
  group.irecv(dkv_in, prev, kDkvTag).wait();  // this rank's own block, summed over the ring
  dkv_sent[0].wait();
  dkv_sent[1].wait();
  dq = dq_sum.to(q.dtype());
  dk = half_of(dkv_in, 0, k.shape()).to(k.dtype());
  dv = half_of(dkv_in, 1, v.shape()).to(v.dtype());
}

}  // namespace octet::modules_detail
