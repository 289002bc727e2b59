// ExpertDispatcher: expert parallelism's token exchange (see include/octet/modules.h). The
// received rows come source by source, each source's grouped by local expert ([s][l]); the
// experts want them expert by expert ([l][s]), and the combine undoes that order.
#include <cstring>

#include "modules/common.h"

namespace octet {

namespace {

// FP8 dispatch: E4M3 codes [R, C] with a power-of-2 scale per 1x128 block [R, ceil(C/128)]:
// Float8BlockScaling's GEMM input quantizer (1x128, power-of-2) gives the received values the
// same codes again.
constexpr int kBlock = 128;

Float8Tensor quantize_rows(const Tensor& rows) {
  if (rows.rows() > 0) {
    return Quantizer::block(DType::E4M3, 1, kBlock, /*power_2_scale=*/true).quantize(rows);
  }
  Float8Tensor none;  // nothing to send (the exchange still runs: the peers may send)
  none.data = Tensor::empty({0, rows.cols()}, DType::E4M3);
  none.scale_inv = Tensor::empty({0, (rows.cols() + kBlock - 1) / kBlock}, DType::F32);
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
  received.block_cols = kBlock;
  received.data = codes;
  received.scale_inv = scale_inv;
  const Tensor values = received.dequantize();
  return dtype == DType::F32 ? values : values.to(dtype);
}

// to_experts: [s][l] -> [l][s]; else back.
Tensor reorder_chunks(const Tensor& rows, const std::vector<int64_t>& per_source, int64_t ranks,
                      bool to_experts) {
  const int64_t local = static_cast<int64_t>(per_source.size()) / ranks;
  std::vector<int64_t> start(per_source.size());  // each [s][l] chunk's first row in [s][l]
  int64_t at = 0;
  for (size_t i = 0; i < per_source.size(); ++i) {
    start[i] = at;
    at += per_source[i];
  }
  OCTET_CHECK(at == rows.rows(), "expert dispatch: ", rows.rows(), " rows, the layout says ", at);
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

}  // namespace

std::vector<int64_t> ExpertDispatcher::Layout::expert_rows() const {
  const size_t ranks = send_rows.size(), local = ranks > 0 ? per_source.size() / ranks : 0;
  std::vector<int64_t> out(local, 0);
  for (size_t i = 0; i < per_source.size(); ++i) out[i % local] += per_source[i];
  return out;
}

ExpertDispatcher::ExpertDispatcher(Communicator& ep, int64_t num_experts)
    : ep_(ep), experts_(num_experts), local_(num_experts / ep.size()) {
  OCTET_CHECK(num_experts > 0 && num_experts % ep.size() == 0, "expert dispatch: num_experts (",
              num_experts, ") expected a multiple of the expert-parallel size (", ep.size(), ")");
}

ExpertDispatcher::Layout ExpertDispatcher::layout(const Tensor& rows_per_expert) {
  check_dtype(rows_per_expert, DType::I32, "expert dispatch: rows per expert");
  check_shape(rows_per_expert, {experts_}, "expert dispatch: rows per expert", "E");
  const int64_t ranks = ep_.size();
  const Tensor received = ep_.all_to_all(rows_per_expert);
  const int32_t* sent = rows_per_expert.data<int32_t>();
  const int32_t* got = received.data<int32_t>();
  Layout out;
  out.send_rows.assign(static_cast<size_t>(ranks), 0);
  out.recv_rows.assign(static_cast<size_t>(ranks), 0);
  out.per_source.assign(got, got + experts_);
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t l = 0; l < local_; ++l) {
      out.send_rows[static_cast<size_t>(r)] += sent[r * local_ + l];
      out.recv_rows[static_cast<size_t>(r)] += got[r * local_ + l];
    }
  }
  return out;
}

Work ExpertDispatcher::send(const Tensor& rows, const std::vector<int64_t>& send_rows,
                            const std::vector<int64_t>& recv_rows, Tensor& out) {
  int64_t total = 0;
  for (int64_t n : recv_rows) total += n;
  out = Tensor::empty({total, rows.cols()}, rows.dtype());
  stats_.bytes += static_cast<int64_t>(rows.nbytes());
  ++stats_.exchanges;
  return ep_.iall_to_allv(rows, send_rows, out, recv_rows);
}

void ExpertDispatcher::wait(Work& work) {
  work.wait();
  stats_.transfer_seconds += work.transfer_seconds();
  stats_.waited_seconds += work.waited_seconds();
  work = Work();
}

ExpertDispatcher::Pending ExpertDispatcher::start_dispatch(const Tensor& rows, const Layout& layout,
                                                           bool fp8) {
  Pending p;
  p.dtype = rows.dtype();
  if (fp8) {
    Float8Tensor q = quantize_rows(rows);
    p.sent = q.data;
    p.sent_scales = q.scale_inv;
    p.rows = send(p.sent, layout.send_rows, layout.recv_rows, p.received);
    p.scales = send(p.sent_scales, layout.send_rows, layout.recv_rows, p.received_scales);
  } else {
    p.sent = rows;
    p.rows = send(p.sent, layout.send_rows, layout.recv_rows, p.received);
  }
  return p;
}

Tensor ExpertDispatcher::finish_dispatch(Pending& pending, const Layout& layout) {
  wait(pending.rows);
  wait(pending.scales);
  Tensor rows = pending.received;
  if (pending.sent_scales.defined()) {
    rows = dequantize_rows(pending.received, pending.received_scales, pending.dtype);
  }
  pending = Pending{};
  return reorder_chunks(rows, layout.per_source, ep_.size(), true);
}

ExpertDispatcher::Pending ExpertDispatcher::start_combine(const Tensor& expert_rows,
                                                          const Layout& layout) {
  Pending p;
  p.dtype = expert_rows.dtype();
  p.sent = reorder_chunks(expert_rows, layout.per_source, ep_.size(), false);
  p.rows = send(p.sent, layout.recv_rows, layout.send_rows, p.received);
  return p;
}

Tensor ExpertDispatcher::finish_combine(Pending& pending) {
  wait(pending.rows);
  Tensor rows = pending.received;
  pending = Pending{};
  return rows;
}

}  // namespace octet
