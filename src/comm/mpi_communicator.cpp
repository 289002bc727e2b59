// Communicator over an MPI communicator. Every call is handed to the MPI thread as a
// non-blocking MPI operation; groups of one never reach MPI.
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "comm/mpi_engine.h"
#include "comm/self_communicator.h"
#include "octet/error.h"
#include "octet/profile.h"

namespace octet {

using namespace parallel_detail;

namespace {

MPI_Datatype element_type(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
    case DType::F16:
      return MPI_UINT16_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::E4M3:
    case DType::E5M2:
    case DType::U8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

int checked_count(int64_t count, const std::string& what) {
  OCTET_CHECK(count >= 0 && count <= INT_MAX, what, ": ", count,
              " elements exceed MPI's int count; split the tensor");
  return static_cast<int>(count);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    MpiEngine::instance().run([&] {
      MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      // World ranks of the members, to name a peer and roll-call the group.
      MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
      MPI_Comm_group(comm_, &group);
      MPI_Comm_group(MPI_COMM_WORLD, &world);
      std::vector<int> ranks(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) ranks[static_cast<size_t>(r)] = r;
      world_ranks_.resize(ranks.size());
      MPI_Group_translate_ranks(group, size_, ranks.data(), world, world_ranks_.data());
      MPI_Group_free(&group);
      MPI_Group_free(&world);
    });
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) others_.push_back(world_ranks_[static_cast<size_t>(r)]);
    }
  }
  // Communicators are never freed: they live as long as the job (a handful per process),
  // and one destroyed during exit would call MPI after MPI_Finalize.

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  Work iall_reduce(Tensor& tensor, ReduceOp op) override {
    if (size_ == 1) return identity_all_reduce(tensor, op, name_);
    const std::string what = name_ + ": all_reduce";
    check_contiguous_cpu(tensor, what);
    check_reducible(tensor, op, what);
    const int count = checked_count(tensor.numel(), what);
    void* data = tensor.raw();
    MPI_Datatype type = element_type(tensor.dtype());
    MPI_Op mpi_op = reduction(tensor.dtype(), op);
    return submit(describe(what, tensor), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, count, type, mpi_op, comm_, &requests[0]),
                "MPI_Iallreduce");
      return requests;
    });
  }

  Work iall_gather(const Tensor& input, Tensor& output) override {
    const std::string what = name_ + ": all_gather";
    check_gathered(input, output, what);
    if (size_ == 1) return identity_copy(input, output, what);
    const int count = checked_count(input.numel(), what);
    // The input may already be this rank's block of the output (ZeRO's parameter gather).
    const bool in_place = static_cast<const char*>(input.raw()) ==
                          static_cast<const char*>(output.raw()) + rank_ * input.nbytes();
    const void* send = in_place ? MPI_IN_PLACE : input.raw();
    void* receive = output.raw();
    MPI_Datatype type = element_type(input.dtype());
    return submit(describe(what, input), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Iallgather(send, count, type, receive, count, type, comm_, &requests[0]),
                "MPI_Iallgather");
      return requests;
    });
  }

  Work ireduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    const std::string what = name_ + ": reduce_scatter";
    check_reducible(input, op, what);
    check_gathered(output, input, what);
    if (size_ == 1) return identity_reduce_scatter(input, output, op, what);
    const int count = checked_count(output.numel(), what);
    const void* send = input.raw();
    void* receive = output.raw();
    MPI_Datatype type = element_type(input.dtype());
    MPI_Op mpi_op = reduction(input.dtype(), op);
    return submit(describe(what, input), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Ireduce_scatter_block(send, receive, count, type, mpi_op, comm_, &requests[0]),
                "MPI_Ireduce_scatter_block");
      return requests;
    });
  }

  Work iall_to_all(const Tensor& input, Tensor& output) override {
    const std::string what = name_ + ": all_to_all";
    check_contiguous_cpu(input, what);
    check_contiguous_cpu(output, what);
    OCTET_CHECK(input.dtype() == output.dtype() && input.shape() == output.shape(), what,
                ": output expected ", dtype_name(input.dtype()), " ", shape_str(input.shape()),
                ", got ", dtype_name(output.dtype()), " ", shape_str(output.shape()));
    OCTET_CHECK(rows_of(input) % size_ == 0, what, ": expected rows divisible by ", size_, ", got ",
                shape_str(input.shape()));
    if (size_ == 1) return identity_copy(input, output, what);
    const int count = checked_count(input.numel() / size_, what);
    const void* send = input.raw();
    void* receive = output.raw();
    MPI_Datatype type = element_type(input.dtype());
    return submit(describe(what, input), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Ialltoall(send, count, type, receive, count, type, comm_, &requests[0]),
                "MPI_Ialltoall");
      return requests;
    });
  }

  Work iall_to_allv(const Tensor& input, std::span<const int64_t> send_rows, Tensor& output,
                    std::span<const int64_t> recv_rows) override {
    const std::string what = name_ + ": all_to_allv";
    if (size_ == 1) return identity_all_to_allv(input, send_rows, output, recv_rows, what);
    check_contiguous_cpu(input, what + " input");
    check_contiguous_cpu(output, what + " output");
    OCTET_CHECK(input.dtype() == output.dtype(), what, ": output dtype expected ",
                dtype_name(input.dtype()), ", got ", dtype_name(output.dtype()));
    OCTET_CHECK(
        static_cast<int>(send_rows.size()) == size_ && static_cast<int>(recv_rows.size()) == size_,
        what, ": expected ", size_, " row counts each, got ", send_rows.size(), " and ",
        recv_rows.size());
    const int64_t row_elements = rows_of(input) ? input.numel() / rows_of(input) : 0;
    const int64_t out_row_elements = rows_of(output) ? output.numel() / rows_of(output) : 0;
    OCTET_CHECK(rows_of(output) == 0 || rows_of(input) == 0 || row_elements == out_row_elements,
                what, ": input rows of ", row_elements, " elements, output rows of ",
                out_row_elements);
    auto layout = [&](std::span<const int64_t> rows, int64_t total, const char* side) {
      std::vector<int> counts(static_cast<size_t>(size_)), offsets(counts.size());
      int64_t sum = 0;
      for (int r = 0; r < size_; ++r) {
        OCTET_CHECK(rows[r] >= 0, what, ": negative ", side, " row count ", rows[r]);
        offsets[r] = checked_count(sum * row_elements, what);
        counts[r] = checked_count(rows[r] * row_elements, what);
        sum += rows[r];
      }
      OCTET_CHECK(sum == total, what, ": ", side, " row counts sum to ", sum, ", the tensor has ",
                  total, " rows");
      return std::pair(counts, offsets);
    };
    std::vector<int> send_counts, send_offsets, recv_counts, recv_offsets;
    std::tie(send_counts, send_offsets) = layout(send_rows, rows_of(input), "send");
    std::tie(recv_counts, recv_offsets) = layout(recv_rows, rows_of(output), "receive");
    const void* send = input.raw();
    void* receive = output.raw();
    MPI_Datatype type = element_type(input.dtype());
    return submit(describe(what, input), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Ialltoallv(send, send_counts.data(), send_offsets.data(), type, receive,
                               recv_counts.data(), recv_offsets.data(), type, comm_, &requests[0]),
                "MPI_Ialltoallv");
      return requests;
    });
  }

  Work ibroadcast(Tensor& tensor, int root) override {
    const std::string what = name_ + ": broadcast";
    check_contiguous_cpu(tensor, what);
    OCTET_CHECK(root >= 0 && root < size_, what, ": root expected in [0, ", size_, "), got ", root);
    if (size_ == 1) return Work();
    const int count = checked_count(tensor.numel(), what);
    void* data = tensor.raw();
    MPI_Datatype type = element_type(tensor.dtype());
    return submit(describe(what, tensor), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Ibcast(data, count, type, root, comm_, &requests[0]), "MPI_Ibcast");
      return requests;
    });
  }

  Work isend(const Tensor& tensor, int peer, int tag) override {
    const std::string what = detail::concat(name_, ": send to ", peer_name(peer), " tag ", tag);
    check_peer(peer, tag, what);
    check_contiguous_cpu(tensor, what);
    const int count = checked_count(tensor.numel(), what);
    const void* data = tensor.raw();
    MPI_Datatype type = element_type(tensor.dtype());
    return submit_to(
        describe(what, tensor),
        [=, this] {
          std::vector<MPI_Request> requests(1);
          check_mpi(MPI_Isend(data, count, type, peer, tag, comm_, &requests[0]), "MPI_Isend");
          return requests;
        },
        {}, std::vector<int>{world_ranks_[static_cast<size_t>(peer)]});
  }

  Work irecv(Tensor& tensor, int peer, int tag) override {
    const std::string what =
        detail::concat(name_, ": receive from ", peer_name(peer), " tag ", tag);
    check_peer(peer, tag, what);
    check_contiguous_cpu(tensor, what);
    const int count = checked_count(tensor.numel(), what);
    void* data = tensor.raw();
    MPI_Datatype type = element_type(tensor.dtype());
    const int64_t expected = tensor.numel();
    // A message of another size is a mismatched pair of calls, reported as such.
    return submit_to(
        describe(what, tensor),
        [=, this] {
          std::vector<MPI_Request> requests(1);
          check_mpi(MPI_Irecv(data, count, type, peer, tag, comm_, &requests[0]), "MPI_Irecv");
          return requests;
        },
        [=](std::span<MPI_Status> statuses) {
          int received = 0;
          MPI_Get_count(&statuses[0], type, &received);
          OCTET_CHECK(received == expected, "mismatched message: expected ", expected,
                      " elements, the sender sent ", received);
        },
        std::vector<int>{world_ranks_[static_cast<size_t>(peer)]});
  }

  Work ibarrier() override {
    if (size_ == 1) return Work();
    return submit(name_ + ": barrier", [this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
      return requests;
    });
  }

  double all_reduce_scalar(double value, ReduceOp op) override {
    const profile::Scope scope(profile::Category::Communication);
    if (size_ == 1) return value;
    // Non-blocking on the MPI thread, so that a wait for a stopped peer times out like any other.
    auto result = std::make_shared<double>(value);
    MPI_Op mpi_op = op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? MPI_MAX : MPI_MIN;
    submit(detail::concat(name_, ": all_reduce (", reduce_op_name(op), " of a scalar)"), [=, this] {
      std::vector<MPI_Request> requests(1);
      check_mpi(
          MPI_Iallreduce(MPI_IN_PLACE, result.get(), 1, MPI_DOUBLE, mpi_op, comm_, &requests[0]),
          "MPI_Iallreduce");
      return requests;
    }).wait();
    return *result;
  }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override {
    MPI_Comm comm = MPI_COMM_NULL;
    MpiEngine::instance().run(
        [&] { check_mpi(MPI_Comm_split(comm_, color, key, &comm), "MPI_Comm_split"); });
    return std::make_shared<MpiCommunicator>(comm, name);
  }

 private:
  // Collectives roll-call the other members on a timeout; point-to-point passes its peer to
  // submit_to.
  Work submit(std::string description, std::function<std::vector<MPI_Request>()> start,
              std::function<void(std::span<MPI_Status>)> finish = {}) {
    return submit_to(std::move(description), std::move(start), std::move(finish), others_);
  }
  Work submit_to(std::string description, std::function<std::vector<MPI_Request>()> start,
                 std::function<void(std::span<MPI_Status>)> finish, std::vector<int> peers) {
    return MpiEngine::instance().submit(std::move(description), std::move(start), std::move(finish),
                                        std::move(peers));
  }

  MPI_Op reduction(DType dtype, ReduceOp op) const {
    const MpiEngine& engine = MpiEngine::instance();
    if (dtype == DType::BF16) return engine.bf16_op(op);
    if (dtype == DType::F32) return engine.f32_op(op);
    return op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? MPI_MAX : MPI_MIN;
  }

  static std::string describe(const std::string& what, const Tensor& tensor) {
    return detail::concat(what, " (", dtype_name(tensor.dtype()), " ", shape_str(tensor.shape()),
                          ")");
  }

  // "rank 1", or in a group other than the world "rank 1 (world rank 2)".
  std::string peer_name(int peer) const {
    if (peer < 0 || peer >= size_ || world_ranks_[static_cast<size_t>(peer)] == peer) {
      return detail::concat("rank ", peer);
    }
    return detail::concat("rank ", peer, " (world rank ", world_ranks_[static_cast<size_t>(peer)],
                          ")");
  }

  void check_peer(int peer, int tag, const std::string& what) const {
    OCTET_CHECK(peer >= 0 && peer < size_ && peer != rank_, what, ": peer expected in [0, ", size_,
                ") and not this rank (", rank_, ")");
    OCTET_CHECK(tag >= 0 && tag <= 32767, what, ": tag expected in [0, 32767]");
  }

  // `whole` holds this group's `part`s stacked along rows, one per rank.
  void check_gathered(const Tensor& part, const Tensor& whole, const std::string& what) const {
    check_contiguous_cpu(part, what);
    check_contiguous_cpu(whole, what);
    OCTET_CHECK(part.dtype() == whole.dtype(), what, ": dtypes differ (", dtype_name(part.dtype()),
                " and ", dtype_name(whole.dtype()), ")");
    OCTET_CHECK(rows_of(whole) == rows_of(part) * size_ && whole.numel() == part.numel() * size_,
                what, ": expected ", shape_str(part.shape()), " on each of ", size_,
                " ranks stacked along rows, got ", shape_str(whole.shape()));
  }

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;  // of each member
  std::vector<int> others_;       // world ranks of the members but this one
};

}  // namespace

int launcher_world_size() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* value = std::getenv(variable)) return std::max(1, std::atoi(value));
  }
  return 1;
}

void abort_job(int status) {
  // Before MPI started no peer can be waiting on this process in a collective: the launcher
  // ends the job when it sees the non-zero exit.
  if (launcher_world_size() <= 1 || !MpiEngine::started()) return;
  std::fflush(nullptr);
  MpiEngine::instance().abort(status);
}

std::shared_ptr<Communicator> world_communicator() {
  static std::shared_ptr<Communicator> world =
      std::make_shared<MpiCommunicator>(MPI_COMM_WORLD, "world");
  return world;
}

}  // namespace octet
