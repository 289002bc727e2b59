// Softmax cross-entropy over the vocabulary, forward fused with its backward (llm.c's
// fused_classifier): one read of the logits gives the per-row loss and, in a second pass over
// the same row, the gradient, which may overwrite the logits in place. The vocabulary is
// walked in chunks with an online max / sum-exp, so no second [N,V] buffer ever exists.
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

struct CrossEntropyOptions {
  // PyTorch's label_smoothing eps in [0,1]: loss = (1-eps) * nll + eps * mean_j(-log p_j).
  float label_smoothing = 0.0f;
  // Rows whose target equals this contribute 0 loss and 0 gradient.
  int64_t ignore_index = -100;
  // dlogits = grad_scale * d(row loss)/d(logits); 1 / count_valid_targets(...) gives the
  // gradient of the mean loss (torch's reduction='mean').
  float grad_scale = 1.0f;
};

// logits  [N,V] F32|BF16 (leading dims flattened into N).
// targets [N] I32|I64, each in [0,V) or equal to ignore_index (else an error naming the id).
// losses  [N] F32, written: the per-row loss, 0 for ignored rows.
// dlogits [N,V], the dtype of logits, written; or null for the forward only. It may be the
//         logits tensor itself (in place), or must not overlap it.
// Returns the mean of losses over rows not ignored (NaN when every row is ignored, as torch).
float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options = {});

// Number of targets [N] I32|I64 not equal to ignore_index.
int64_t count_valid_targets(const Tensor& targets, int64_t ignore_index = -100);

// The CPU kernels: OpenMP over rows / heads, inner loops vectorized per instruction set and
// chosen at run time (OCTET_ISA lowers the choice). The functions above check that every
// tensor is on one device and dispatch there (the CPU today; a CUDA file adds ops::cuda).
namespace cpu {
float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options = {});
}  // namespace cpu

namespace reference {
float cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor* dlogits, const CrossEntropyOptions& options = {});
}  // namespace reference

}  // namespace octet::ops
