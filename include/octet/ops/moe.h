// Mixture-of-experts routing: the router (scores, top-k choice, the auxiliary losses) and the
// token permutation that groups each expert's tokens, forward and backward, with Megatron-Core's
// and TransformerEngine's semantics (moe_router_topk, moe_router_score_function,
// moe_router_enable_expert_bias, moe_aux_loss_coeff, moe_z_loss_coeff, permute / unpermute).
#pragma once

#include <cstdint>

#include "octet/tensor.h"

namespace octet::ops {

enum class RouterScore {
  Softmax,  // over every expert (Mixtral, Megatron's default)
  Sigmoid,  // each expert on its own (DeepSeek-V3)
};

struct RouterOptions {
  int64_t topk = 2;  // experts per token, in [1, E]
  RouterScore score = RouterScore::Softmax;
  // The chosen experts' scores divided by their sum (Megatron's topk then softmax over the k
  // chosen logits is Softmax with normalize; DeepSeek-V3 normalizes its sigmoid scores).
  bool normalize = false;
  float scaling = 1.0f;  // the probabilities' factor after normalization (routed_scaling_factor)
  // [E] F32 or null: added to the scores for the choice only, never to the probabilities
  // (DeepSeek-V3's auxiliary-loss-free balancing; the trainer moves it by the load).
  const Tensor* expert_bias = nullptr;
  // Switch-Transformer load balancing: coeff * E / (k * N^2) * sum_e P_e * f_e, with P_e the
  // sum of the tokens' scores for expert e (sigmoid scores normalized per token first) and f_e
  // the tokens routed to it. 0: off.
  float aux_loss_coeff = 0.0f;
  // Router z-loss (ST-MoE): coeff * mean over tokens of logsumexp(logits)^2. 0: off.
  float z_loss_coeff = 0.0f;
};

struct RouterLosses {
  double aux = 0.0;  // 0 where its coefficient is 0
  double z = 0.0;
};

// logits [N, E] F32 -> scores [N, E] F32 (the score function's output, kept for the backward),
// probs [N, k] F32 (the chosen experts' weights), experts [N, k] I32 (each token's chosen
// experts, highest score + bias first; equal keys: the lower index first) and counts [E] I32
// (tokens routed to each expert). All outputs are written whole. Returns the auxiliary losses.
RouterLosses router_forward(const Tensor& logits, const RouterOptions& options, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts);
// dprobs [N, k] F32 (the loss's gradient at probs), the forward's logits, scores, experts and
// counts -> dlogits [N, E] F32 (written): the probabilities' gradient plus the auxiliary
// losses' own (each counted once on top of the main loss).
void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& options,
                     Tensor& dlogits);

// tokens [N, C] F32|BF16 and experts [N, k] I32 (each in [0, num_experts)) -> permuted
// [N*k, C] (tokens' dtype): each expert's tokens together, expert 0's first, each in token
// order; row_map [N, k] I32: the row of permuted holding token n's copy for its j-th expert.
void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map);
// dpermuted [N*k, C] -> dtokens [N, C] (written): the sum of each token's copies' gradients.
void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens);
// The experts' outputs y [N*k, C] F32|BF16 (permuted order) and probs [N, k] F32 -> out [N, C]
// (y's dtype; written) = sum_j probs[n, j] * y[row_map[n, j]], summed in F32.
void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out);
// dout [N, C] -> dy [N*k, C] (y's dtype; written) = probs[n, j] * dout[n] at row_map[n, j],
// and dprobs [N, k] F32 (written) = <dout[n], y[row_map[n, j]]>.
void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs);

// Token dropping (Megatron's moe_expert_capacity_factor): each expert keeps at most `capacity`
// of the (token, choice) pairs routed to it and drops the rest.
enum class DropPolicy {
  Probs,     // the pairs of the highest probabilities (equal ones: the lower token first)
  Position,  // the first pairs in token order
};
// Megatron's get_capacity: ceil(tokens * topk / num_experts * capacity_factor).
int64_t moe_capacity(int64_t tokens, int64_t topk, int64_t num_experts, double capacity_factor);
// experts [N, k] I32 in [0, E) and probs [N, k] F32 -> dispatch [N, k] I32 (written): experts,
// with E (= num_experts) in place of every dropped pair, so that moe_permute(tokens, dispatch,
// E + 1, ...) places the dropped rows after every expert's; kept [E] I32 (written): the pairs
// each expert keeps, min(routed, capacity). capacity >= 0.
void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept);

// The CPU kernels: OpenMP over tokens, inner loops vectorized per instruction set and chosen at
// run time (OCTET_ISA lowers the choice). The functions above check that every tensor is on
// one device and dispatch there.
namespace cpu {
RouterLosses router_forward(const Tensor& logits, const RouterOptions& options, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts);
void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& options,
                     Tensor& dlogits);
void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map);
void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens);
void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out);
void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs);
void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept);
}  // namespace cpu

// The oracle: plain loops, FP64 sums, one thread.
namespace reference {
RouterLosses router_forward(const Tensor& logits, const RouterOptions& options, Tensor& scores,
                            Tensor& probs, Tensor& experts, Tensor& counts);
void router_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                     const Tensor& experts, const Tensor& counts, const RouterOptions& options,
                     Tensor& dlogits);
void moe_permute(const Tensor& tokens, const Tensor& experts, int64_t num_experts, Tensor& permuted,
                 Tensor& row_map);
void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_map, Tensor& dtokens);
void moe_unpermute(const Tensor& y, const Tensor& row_map, const Tensor& probs, Tensor& out);
void moe_unpermute_backward(const Tensor& dout, const Tensor& y, const Tensor& row_map,
                            const Tensor& probs, Tensor& dy, Tensor& dprobs);
void moe_capacity_drop(const Tensor& experts, const Tensor& probs, int64_t num_experts,
                       int64_t capacity, DropPolicy policy, Tensor& dispatch, Tensor& kept);
}  // namespace reference

}  // namespace octet::ops
