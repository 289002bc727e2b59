// Megatron-Core's region mappings (tensor_parallel/mappings.py) over a tensor-parallel
// Communicator of TP ranks: what tensor- and sequence-parallel modules need of communication.
//
// Paired operators: each named region mapping has a forward and the backward that is its
// adjoint. Activations are token rows: x [N, C] (leading dims flattened, F32|BF16). Under
// sequence parallelism a rank holds rows [r*N/TP, (r+1)*N/TP) of the full [N, C].
//
//   mapping                                     forward                 backward
//   copy_to_tensor_parallel_region              identity                all-reduce
//   reduce_from_tensor_parallel_region          all-reduce              identity
//   scatter_to_sequence_parallel_region         own row block           all-gather rows
//   gather_from_sequence_parallel_region        all-gather rows         reduce-scatter rows
//   reduce_scatter_to_sequence_parallel_region  reduce-scatter rows     all-gather rows
#pragma once

#include "octet/comm.h"
#include "octet/tensor.h"

namespace octet {

// ---------------------------------------------------------------------------------------------
// Region mappings. x, dy [N, C] (any shape is seen as [rows, cols]); F32|BF16 for the
// reducing ones, any dtype for the others. Results are new tensors (or x itself when nothing
// moves: a group of one, identities), never x modified in place. Sequence-parallel ones need
// N divisible by TP where they split rows.

// fwd: x [N, C] -> x. bwd: dy [N, C] -> sum over ranks.
Tensor copy_to_tensor_parallel_region(const Tensor& x, Communicator& tp);
Tensor copy_to_tensor_parallel_region_backward(const Tensor& dy, Communicator& tp);
// fwd: x [N, C] partial sums -> sum over ranks. bwd: dy -> dy.
Tensor reduce_from_tensor_parallel_region(const Tensor& x, Communicator& tp);
Tensor reduce_from_tensor_parallel_region_backward(const Tensor& dy, Communicator& tp);
// fwd: x [N, C] -> this rank's rows [N/TP, C]. bwd: dy [N/TP, C] -> all-gathered [N, C].
Tensor scatter_to_sequence_parallel_region(const Tensor& x, Communicator& tp);
Tensor scatter_to_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp);
// fwd: x [N/TP, C] -> all-gathered [N, C]. bwd: dy [N, C] -> reduce-scattered [N/TP, C].
Tensor gather_from_sequence_parallel_region(const Tensor& x, Communicator& tp);
Tensor gather_from_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp);
// fwd: x [N, C] partial sums -> reduce-scattered [N/TP, C]. bwd: dy [N/TP, C] -> [N, C].
Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& x, Communicator& tp);
Tensor reduce_scatter_to_sequence_parallel_region_backward(const Tensor& dy, Communicator& tp);

// Column blocks (the feature dimension), for layers whose output is gathered or input split:
// x [N, C] -> this rank's columns [N, C/TP]; and its adjoint, [N, C/TP] -> [N, C].
Tensor split_columns_to_tensor_parallel_region(const Tensor& x, Communicator& tp);
Tensor gather_columns_from_tensor_parallel_region(const Tensor& x, Communicator& tp);

}  // namespace octet
