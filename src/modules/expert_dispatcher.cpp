// ExpertDispatcher: expert parallelism's token exchange (see include/octet/modules.h). The
// experts want their rows expert by expert, each expert's source by source ([l][s]); every
// chunk is received straight into that place, and the combine sends each back to its place in
// the source's expert-grouped rows.
#include <algorithm>
#include <chrono>
#include <mutex>

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

// The chunk offsets: where this rank's rows for global expert g start in its input (grouped by
// expert), and where local expert l's rows from source s start in the expert-grouped order
// ([l][s]).
std::vector<int64_t> input_offsets(const std::vector<int64_t>& send_counts) {
  std::vector<int64_t> out(send_counts.size());
  int64_t at = 0;
  for (size_t g = 0; g < send_counts.size(); ++g) {
    out[g] = at;
    at += send_counts[g];
  }
  return out;
}

std::vector<int64_t> expert_offsets(const std::vector<int64_t>& per_source, int64_t ranks) {
  const int64_t local = static_cast<int64_t>(per_source.size()) / ranks;
  std::vector<int64_t> out(per_source.size());
  int64_t at = 0;
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t s = 0; s < ranks; ++s) {
      out[static_cast<size_t>(s * local + l)] = at;
      at += per_source[static_cast<size_t>(s * local + l)];
    }
  }
  return out;
}

// Message tags of the EP group's point-to-point chunks, one range per kind and local expert
// (within MPI's guaranteed tag range, 32767).
constexpr int kTagRange = 10000;
constexpr int kDispatchTag = 0, kScalesTag = kTagRange, kCombineTag = 2 * kTagRange;

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
  OCTET_CHECK(local_ <= kTagRange, "expert dispatch: at most ", kTagRange,
              " experts per rank, got ", local_);
}

ExpertDispatcher::Layout ExpertDispatcher::layout(const Tensor& rows_per_expert) {
  check_dtype(rows_per_expert, DType::I32, "expert dispatch: rows per expert");
  check_shape(rows_per_expert, {experts_}, "expert dispatch: rows per expert", "E");
  const int64_t ranks = ep_.size();
  const Tensor received = ep_.all_to_all(rows_per_expert);
  const int32_t* sent = rows_per_expert.data<int32_t>();
  const int32_t* got = received.data<int32_t>();
  Layout out;
  out.send_counts.assign(sent, sent + experts_);
  out.per_source.assign(got, got + experts_);
  out.send_rows.assign(static_cast<size_t>(ranks), 0);
  out.recv_rows.assign(static_cast<size_t>(ranks), 0);
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t l = 0; l < local_; ++l) {
      out.send_rows[static_cast<size_t>(r)] += sent[r * local_ + l];
      out.recv_rows[static_cast<size_t>(r)] += got[r * local_ + l];
    }
  }
  return out;
}

void ExpertDispatcher::post(const Tensor& rows, const Layout& layout, bool dispatch, int tag,
                            Tensor& out, std::vector<Work>& works) {
  const int64_t ranks = ep_.size(), me = ep_.rank();
  const std::vector<int64_t> at_source = input_offsets(layout.send_counts);
  const std::vector<int64_t> at_expert = expert_offsets(layout.per_source, ranks);
  int64_t total = 0;
  for (int64_t n : dispatch ? layout.recv_rows : layout.send_rows) total += n;
  out = Tensor::empty({total, rows.cols()}, rows.dtype());
  // Receives first (so every send finds its buffer), then sends; this rank's own chunks are
  // copied. Dispatch: chunk (s, l) lands at at_expert; combine: the chunk of global expert
  // r * L + l comes back from rank r to at_source.
  for (int pass = 0; pass < 3; ++pass) {
    for (int64_t peer = 0; peer < ranks; ++peer) {
      if ((pass < 2) == (peer == me)) continue;
      for (int64_t l = 0; l < local_; ++l) {
        // Rows of (source, local expert of the expert rank) for this transfer.
        const int64_t source = dispatch ? (pass == 0 ? peer : me) : (pass == 0 ? me : peer);
        const int64_t expert_rank = dispatch ? (pass == 0 ? me : peer) : (pass == 0 ? peer : me);
        const size_t global = static_cast<size_t>(expert_rank * local_ + l);
        const size_t chunk = static_cast<size_t>(source * local_ + l);
        const int64_t n = dispatch
                              ? (pass == 0 ? layout.per_source[chunk] : layout.send_counts[global])
                              : (pass == 0 ? layout.send_counts[global] : layout.per_source[chunk]);
        if (pass == 2) {  // this rank to itself
          const int64_t from = dispatch ? at_source[global] : at_expert[chunk];
          const int64_t to = dispatch ? at_expert[chunk] : at_source[global];
          const int64_t k = dispatch ? layout.send_counts[global] : layout.per_source[chunk];
          if (k > 0) out.slice_rows(to, to + k).copy_from(rows.slice_rows(from, from + k));
          continue;
        }
        if (n == 0) continue;
        const int t = tag + static_cast<int>(l);
        if (pass == 0) {  // receive
          const int64_t to = dispatch ? at_expert[chunk] : at_source[global];
          Tensor place = out.slice_rows(to, to + n);
          works.push_back(ep_.irecv(place, static_cast<int>(peer), t));
        } else {  // send
          const int64_t from = dispatch ? at_source[global] : at_expert[chunk];
          works.push_back(ep_.isend(rows.slice_rows(from, from + n), static_cast<int>(peer), t));
          stats_.bytes += static_cast<int64_t>(n * rows.cols() *
                                               static_cast<int64_t>(dtype_bytes(rows.dtype())));
        }
      }
    }
  }
  ++stats_.exchanges;
}

namespace {

struct ComputeThreads {
  std::mutex mutex;
  int computing = 1;  // the trainer's thread
  std::chrono::steady_clock::time_point idle_since;
  double exposed = 0.0;
};

ComputeThreads& compute_threads() {
  static ComputeThreads threads;
  return threads;
}

}  // namespace

void ExpertDispatcher::leave_compute() {
  ComputeThreads& t = compute_threads();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (--t.computing == 0) t.idle_since = std::chrono::steady_clock::now();
}

void ExpertDispatcher::enter_compute() {
  ComputeThreads& t = compute_threads();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.computing++ == 0) {
    t.exposed +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t.idle_since).count();
  }
}

double ExpertDispatcher::take_exposed_seconds() {
  ComputeThreads& t = compute_threads();
  std::lock_guard<std::mutex> lock(t.mutex);
  const double seconds = t.exposed;
  t.exposed = 0.0;
  return seconds;
}

void ExpertDispatcher::wait(std::vector<Work>& works) {
  struct Paused {  // this thread waits (also when a wait throws)
    Paused() { leave_compute(); }
    ~Paused() { enter_compute(); }
    Paused(const Paused&) = delete;
    Paused& operator=(const Paused&) = delete;
  } paused;
  const auto start = std::chrono::steady_clock::now();
  double longest = 0.0;
  for (Work& work : works) {
    work.wait();
    longest = std::max(longest, work.transfer_seconds());
  }
  stats_.waited_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.transfer_seconds += longest;
  works.clear();
}

ExpertDispatcher::Pending ExpertDispatcher::start_dispatch(const Tensor& rows, const Layout& layout,
                                                           bool fp8) {
  Pending p;
  p.dtype = rows.dtype();
  if (fp8) {
    Float8Tensor q = quantize_rows(rows);
    p.sent = q.data;
    p.sent_scales = q.scale_inv;
    post(p.sent, layout, true, kDispatchTag, p.received, p.works);
    post(p.sent_scales, layout, true, kScalesTag, p.received_scales, p.works);
  } else {
    p.sent = rows;
    post(p.sent, layout, true, kDispatchTag, p.received, p.works);
  }
  return p;
}

Tensor ExpertDispatcher::finish_dispatch(Pending& pending, const Layout& layout) {
  (void)layout;
  wait(pending.works);
  Tensor rows = pending.received;
  if (pending.sent_scales.defined()) {
    rows = dequantize_rows(pending.received, pending.received_scales, pending.dtype);
  }
  pending = Pending{};
  return rows;
}

ExpertDispatcher::Pending ExpertDispatcher::start_combine(const Tensor& expert_rows,
                                                          const Layout& layout) {
  Pending p;
  p.dtype = expert_rows.dtype();
  p.sent = expert_rows;
  post(p.sent, layout, false, kCombineTag, p.received, p.works);
  return p;
}

Tensor ExpertDispatcher::finish_combine(Pending& pending) {
  wait(pending.works);
  Tensor rows = pending.received;
  pending = Pending{};
  return rows;
}

}  // namespace octet
