// A world of one: collectives are the identity (a copy only when the output is another
// buffer), point-to-point has no peer.
#include <cstring>

#include "comm/self_communicator.h"
#include "comm/work.h"
#include "octet/error.h"

namespace octet::parallel_detail {

namespace {

void copy_if_distinct(const Tensor& input, Tensor& output, const std::string& what) {
  check_contiguous_cpu(input, what + " input");
  check_contiguous_cpu(output, what + " output");
  OCTET_CHECK(input.dtype() == output.dtype() && input.numel() == output.numel(), what,
              ": output expected ", dtype_name(input.dtype()), " ", shape_str(input.shape()),
              ", got ", dtype_name(output.dtype()), " ", shape_str(output.shape()));
  if (input.raw() != output.raw() && input.nbytes() > 0) {
    std::memcpy(output.raw(), input.raw(), input.nbytes());
  }
}

}  // namespace

Work identity_all_reduce(Tensor& tensor, ReduceOp op, const std::string& name) {
  check_contiguous_cpu(tensor, name + ": all_reduce");
  check_reducible(tensor, op, name + ": all_reduce");
  return Work();
}

Work identity_copy(const Tensor& input, Tensor& output, const std::string& what) {
  copy_if_distinct(input, output, what);
  return Work();
}

Work identity_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op,
                             const std::string& what) {
  check_reducible(input, op, what);
  copy_if_distinct(input, output, what);
  return Work();
}

Work identity_all_to_allv(const Tensor& input, std::span<const int64_t> send_rows, Tensor& output,
                          std::span<const int64_t> recv_rows, const std::string& what) {
  OCTET_CHECK(send_rows.size() == 1 && recv_rows.size() == 1, what,
              ": expected one row count per rank (1), got ", send_rows.size(), " and ",
              recv_rows.size());
  OCTET_CHECK(send_rows[0] == rows_of(input) && recv_rows[0] == rows_of(output), what,
              ": row counts (", send_rows[0], ", ", recv_rows[0], ") must match the tensors (",
              rows_of(input), ", ", rows_of(output), ")");
  copy_if_distinct(input, output, what);
  return Work();
}

}  // namespace octet::parallel_detail

namespace octet {

namespace {

using namespace parallel_detail;

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "self"; }
  Work iall_reduce(Tensor& tensor, ReduceOp op) override {
    return identity_all_reduce(tensor, op, name());
  }
  Work iall_gather(const Tensor& input, Tensor& output) override {
    return identity_copy(input, output, "self: all_gather");
  }
  Work ireduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    return identity_reduce_scatter(input, output, op, "self: reduce_scatter");
  }
  Work iall_to_all(const Tensor& input, Tensor& output) override {
    return identity_copy(input, output, "self: all_to_all");
  }
  Work iall_to_allv(const Tensor& input, std::span<const int64_t> send_rows, Tensor& output,
                    std::span<const int64_t> recv_rows) override {
    return identity_all_to_allv(input, send_rows, output, recv_rows, "self: all_to_allv");
  }
  Work ibroadcast(Tensor& tensor, int root) override {
    OCTET_CHECK(root == 0, "self: broadcast root expected 0, got ", root);
    return Work();
  }
  Work isend(const Tensor&, int peer, int) override {
    fail(detail::concat("self: send to rank ", peer, " in a world of one"));
  }
  Work irecv(Tensor&, int peer, int) override {
    fail(detail::concat("self: receive from rank ", peer, " in a world of one"));
  }
  Work ibarrier() override { return Work(); }
  double all_reduce_scalar(double value, ReduceOp) override { return value; }
  std::shared_ptr<Communicator> split(int, int, const std::string&) override {
    return std::make_shared<SelfCommunicator>();
  }
};

}  // namespace

std::shared_ptr<Communicator> self_communicator() {
  return std::make_shared<SelfCommunicator>();
}

}  // namespace octet
