// The collectives of a group of one, shared by the self communicator and by MPI groups of
// size one (which then never call MPI).
#pragma once

#include <span>
#include <string>

#include "octet/comm.h"

namespace octet::parallel_detail {

Work identity_all_reduce(Tensor& tensor, ReduceOp op, const std::string& name);
Work identity_copy(const Tensor& input, Tensor& output, const std::string& what);
Work identity_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op,
                             const std::string& what);
Work identity_all_to_allv(const Tensor& input, std::span<const int64_t> send_rows, Tensor& output,
                          std::span<const int64_t> recv_rows, const std::string& what);

}  // namespace octet::parallel_detail
