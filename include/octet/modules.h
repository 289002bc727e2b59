// TransformerEngine-style modules: each owns its parameters, saves in a Context what its
// backward needs, and has a hand-written backward. Under fp8_autocast every GEMM input is
// quantized per the active recipe, and each module keeps its FP8 metadata per tensor role.
//
// Shapes: activations are [N, features] with N = tokens (leading dims flattened); dtypes F32
// or BF16 (the compute dtype follows the input). Parameters are FP32 masters; gradients are
// FP32 and accumulate across backward calls until zero_grad().
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "octet/comm.h"
#include "octet/gemm.h"
#include "octet/module.h"
#include "octet/ops/activation.h"
#include "octet/ops/moe.h"
#include "octet/recipe.h"
#include "octet/safetensors.h"
#include "octet/tensor.h"

namespace octet {

enum class ParallelMode { None, Column, Row };
enum class NormKind { LayerNorm, RMSNorm };

// FP8 health of one quantized tensor: what its latest quantize call did to it.
struct Fp8TensorStats {
  float amax = 0.0f;  // max |x| of the high-precision source
  // Per-tensor scaling: the scale applied. Block scaling: the smallest block scale.
  float scale = 1.0f;
  double underflow = 0.0;  // fraction of all values nonzero in x but zero in FP8
  // Fraction of all values whose |x| * scale rounds past the format's max (a non-saturating
  // cast would give NaN or Inf): clamped to +-max.
  double saturated = 0.0;
  int64_t numel = 0;
};
// Measures q (rowwise data required) against its source x [q.rows, q.cols] F32|BF16, with
// the scale each element was quantized with (per tensor, per block or E8M0 per 1x32 block).
Fp8TensorStats measure_fp8(const Tensor& x, const Float8Tensor& q);
// The same for FP4 (--precision fp4): scale is the smallest effective block scale
// (1 / (block scale * global scale_inv)); underflow counts nonzero x with a zero E2M1 code,
// saturation |x| * scale rounding past E2M1's 6 (>= 7, the midpoint to the next power 8).
Fp8TensorStats measure_fp4(const Tensor& x, const Float4Tensor& q);

// While a scope is on (thread-local, nested; the innermost decides), every GEMM input that a
// Linear, LayerNormLinear or GroupedLinear quantizes under fp8_autocast is measured with
// measure_fp8 and kept in its module's Fp8State. Off (the default), each quantize call costs
// one flag test.
class fp8_stats_scope {
 public:
  explicit fp8_stats_scope(bool enabled = true);
  ~fp8_stats_scope();
  fp8_stats_scope(const fp8_stats_scope&) = delete;
  fp8_stats_scope& operator=(const fp8_stats_scope&) = delete;

 private:
  bool previous_;
};
bool fp8_stats_enabled();

// FP8 bookkeeping of one module: a forward meta (input and weight of each GEMM) and a
// backward meta (output gradient of each GEMM), created for the active recipe and, under
// delayed scaling, updated from their amax histories once per forward / backward.
class Fp8State {
 public:
  explicit Fp8State(int num_gemms = 1) : num_gemms_(num_gemms) {}
  void begin_forward(const recipe::Recipe& recipe);
  void begin_backward(const recipe::Recipe& recipe);
  Quantizer input_quantizer(int gemm);
  Quantizer weight_quantizer(int gemm);
  Quantizer grad_output_quantizer(int gemm);
  // Delayed scaling only: the input scale of `gemm` is known before the tensor exists, so a
  // producer kernel (a norm) can write FP8 directly and report its amax here.
  bool input_scale_known() const;
  float input_scale(int gemm) const;
  void record_input_amax(int gemm, float amax);
  // The same for the output gradient (after begin_backward): a kernel producing it (an
  // activation's backward) can write its FP8 codes directly.
  float grad_output_scale(int gemm) const;
  void record_grad_output_amax(int gemm, float amax);
  // While recomputing a forward for activation checkpointing, begin_forward neither updates
  // the scales nor counts a step: the recomputation quantizes exactly as the forward did.
  void set_recomputing(bool recomputing) { recomputing_ = recomputing; }
  // Checkpointing (so a resumed FP8 run continues with the same scales and histories):
  // PREFIX{forward,backward}.{scale,scale_inv,amax_history} F32 and PREFIXcalls I64 [2].
  // Nothing is written before the first FP8 forward.
  void save_state(TensorMap& out, const std::string& prefix) const;
  // Recreates the metas for `recipe` and restores them; a missing entry is an error.
  void load_state(const TensorMap& in, const std::string& prefix, const recipe::Recipe& recipe);
  const FP8Meta& forward_meta() const { return forward_meta_; }
  const FP8Meta& backward_meta() const { return backward_meta_; }
  // For the amax reduction across tensor- and data-parallel ranks (reduce_fp8_amax).
  FP8Meta& mutable_forward_meta() { return forward_meta_; }
  FP8Meta& mutable_backward_meta() { return backward_meta_; }
  const recipe::Recipe& recipe() const { return recipe_; }
  // Under fp8_stats_enabled(): measures q against its source x and keeps the result as the
  // latest stats of tensor `module + "." + role` (role: input, weight, grad_output, with the
  // GEMM index appended in grouped modules). Otherwise does nothing.
  void record_stats(const std::string& module, const std::string& role, const Tensor& x,
                    const Float8Tensor& q);
  void record_stats(const std::string& module, const std::string& role, const Tensor& x,
                    const Float4Tensor& q);  // FP4 (measure_fp4)
  // Latest stats per tensor name, in the order the tensors were first measured.
  const std::vector<std::pair<std::string, Fp8TensorStats>>& stats() const { return stats_; }
  void clear_stats() { stats_.clear(); }

  // The weight [out, in] of `gemm` quantized by weight_quantizer(gemm) and packed as the
  // forward GEMM's B operand (used with trans). Quantized and packed once, then reused by
  // every forward until drop_weight_cache() (after an optimizer step) or until the quantizer
  // would quantize differently (another recipe, a new delayed-scaling scale). A reuse records
  // the weight's amax (and stats under fp8_stats_scope) as a fresh quantization would.
  struct QuantizedWeight {
    Float8Tensor weight;  // per-tensor: rowwise only; block scaling: both usages
    PackedWeight packed;
    std::string key;  // the scaling it was made with
  };
  const QuantizedWeight& quantized_weight(int gemm, const Tensor& weight, const std::string& name,
                                          const std::string& role = "weight");
  void drop_weight_cache() { weights_.clear(); }

 private:
  void ensure_metas(const recipe::Recipe& recipe);
  std::vector<std::pair<std::string, Fp8TensorStats>> stats_;
  std::vector<std::optional<QuantizedWeight>> weights_;  // per gemm
  int num_gemms_;
  recipe::Recipe recipe_;
  FP8Meta forward_meta_;
  FP8Meta backward_meta_;
  int forward_calls_ = 0;
  int backward_calls_ = 0;
  bool recomputing_ = false;
};

// Delayed scaling across ranks: the amaxes recorded since the last scale update (history
// row 0 of every meta) become their maximum over `group` (tensor x data parallel), so every
// rank derives the same scales. Collective; call after each micro-batch's backward (under
// pipeline parallelism, after each forward and backward of a chunk: every rank of the group
// runs the same stage's schedule).
void reduce_fp8_amax(const std::vector<Fp8State*>& states, Communicator& group);
// FP8 health (`octet train --fp8-stats`): {tensor name: {amax, scale, underflow, saturated}}
// (fractions in [0, 1]) of every tensor measured since the last call (keys sorted by name);
// clears the stats.
nlohmann::json take_fp8_stats(const std::vector<Fp8State*>& states);
// Every rank's take_fp8_stats() object merged into one, on every rank (a pipeline group's
// stages hold different tensors): collective over `group`.
nlohmann::json gather_fp8_stats(const nlohmann::json& mine, Communicator& group);

// What an FP8 Linear forward keeps of its input for backward.
enum class SavedInput {
  Fp8,   // the quantized codes the weight gradient needs (the default)
  None,  // nothing: the caller re-creates the input and calls restore_input() before backward
};

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  bool return_bias = false;  // forward leaves the bias out for the caller to fuse
  DType params_dtype = DType::F32;
  // Tensor parallelism (TransformerEngine's parallel_mode / sequence_parallel), in effect when
  // the Linear is given a tensor-parallel group (a group of one computes the same). Column:
  // W's rows (outputs) split; row: W's columns (inputs) split, b added once after the
  // reduction. sequence_parallel: the input (column) or output (row) is this rank's token
  // rows [N/TP, ...] (all-gathered before, reduce-scattered after).
  ParallelMode parallel_mode = ParallelMode::None;
  bool sequence_parallel = false;
  // Column: the output [N, out] is made of these column blocks (widths summing to out, each
  // divisible by TP; empty = one block). Rank r holds the r-th slice of every block, so a
  // fused [q | k | v] projection splits by heads: e.g. {H*D, Hkv*D, Hkv*D}.
  std::vector<int64_t> output_blocks;
  // Column: all-gather the output's columns so every rank gets [N, out] (not with SP).
  bool gather_output = false;
  // Row: the input arrives split by columns [N, in/TP] (the column layer's output); false
  // means it is whole [N, in] and each rank takes its columns.
  bool input_is_parallel = true;
  float init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "linear";
};

// y = x W^T + b, W [out, in]. Given a tensor-parallel group and parallel_mode column or row
// (Megatron's ColumnParallelLinear / RowParallelLinear, TransformerEngine's
// Linear(parallel_mode=..., tp_group=...)), it holds this rank's shard of the layer made with
// the same options and seed - so a TP run computes what a TP = 1 run does - and its forward
// and backward run the paired region mappings around the shard's GEMMs:
//   column: x [N, in] (or its token shard [N/TP, in] under SP) -> y [N, out/TP] ([N, out]
//           with gather_output); weight [out/TP, in], bias [out/TP].
//   row:    x [N, in/TP] (input_is_parallel) -> y [N, out] summed over the group (or this
//           rank's token shard [N/TP, out] under SP); weight [out, in/TP], bias [out]
//           replicated (a partial gradient under SP: marked in its TensorShard).
// options() are this rank's shard's sizes; whole_options() the layer's.
class Linear : public Module {
 public:
  struct Context {
    DType dtype = DType::F32;
    Tensor input;  // high-precision input (non-FP8 runs)
    // FP8 runs: the input codes the weight gradient needs. Per-tensor scaling keeps the
    // rowwise codes (the GEMMs read them transposed where they must); block scaling keeps the
    // columnwise copy, whose blocks lie along N. Empty with SavedInput::None until
    // restore_input().
    Float8Tensor input_fp8;
    std::optional<Quantizer> input_requantizer;  // SavedInput::None: the forward's scaling
    // FP8 runs: the quantized weight and its packed copy that the forward used (shared with
    // the module's cache, not copies).
    Float8Tensor weight_fp8;
    std::optional<PackedWeight> packed_weight_fp8;
    bool fp8 = false;
    // FP4 runs (fp4_autocast; `input` keeps the high-precision input): the quantized weight
    // the forward used (16x16 blocks under NVFP4, which serve the input gradient too; MXFP4
    // quantizes the transpose for it in backward) and the scope's options.
    std::optional<Float4Tensor> weight_fp4;
    std::optional<Fp4Options> fp4;
    int64_t rows = 0;
  };

  // tp: the tensor-parallel group for parallel_mode column / row (null: no parallelism).
  explicit Linear(const LinearOptions& options, Communicator* tp = nullptr);
  // x [N, in] -> y [N, out] in x's dtype (shapes of this rank's part under TP, above).
  // `saved` matters under fp8_autocast only (and not under TP: the shard keeps its FP8 input).
  Tensor forward(const Tensor& x, Context& ctx, SavedInput saved = SavedInput::Fp8);
  // forward(x) of an input still arriving (a sequence-parallel all-gather): rows [first,
  // first + part.rows()) of x are `part`, at hand now, and their GEMM runs first; then
  // `arrive()` waits for the whole x [rows, in] (part's rows included) and the other rows'
  // GEMMs run. Same result and context as forward(x). Not under fp8_autocast (per-tensor
  // scaling quantizes x whole): the caller gathers first there.
  Tensor forward_arriving(const Tensor& part, int64_t first, int64_t rows,
                          const std::function<Tensor()>& arrive, Context& ctx);
  // dy [N, out] -> dx [N, in] (shaped like forward's y and x); accumulates weight.grad and
  // bias.grad.
  Tensor backward(const Tensor& dy, Context& ctx);
  // FP8 contexts: backward from dy [N, out] already quantized by grad_output_quantizer(0)
  // (the caller ran begin_backward). Without bias, or with return_bias (the caller owns the
  // bias gradient): the codes alone cannot give it. -> dx [N, in] in the forward's dtype.
  Tensor backward_fp8_grad(const Float8Tensor& dyq, Context& ctx);
  // Parts of forward/backward that LayerNormLinear and LayerNormMLP reuse: the GEMM on an
  // input already quantized by `quantizer` (this module's input quantizer for this forward).
  Tensor forward_fp8_input(const Float8Tensor& x, const Quantizer& quantizer, DType out_dtype,
                           Context& ctx, SavedInput saved = SavedInput::Fp8);
  // After a forward with SavedInput::None: x [N, in], the tensor that forward quantized,
  // re-quantized with the forward's scaling (the same codes) into what backward needs.
  void restore_input(const Tensor& x, Context& ctx);
  // The same from codes a kernel wrote with the forward's scale (xq per-tensor, rowwise).
  void restore_input(Float8Tensor xq, Context& ctx);
  // FP8 contexts keeping rowwise input codes (per-tensor scaling): the forward's output
  // [N, out] computed again, bit for bit, from the kept codes and weight.
  bool can_replay(const Context& ctx) const { return ctx.fp8 && ctx.input_fp8.has_rowwise(); }
  Tensor replay_forward(const Context& ctx);

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  const LinearOptions& options() const { return options_; }
  const LinearOptions& whole_options() const { return whole_; }
  Fp8State& fp8_state() { return fp8_; }
  // Tensor parallelism: whether the layer is split across a group (then its parameters'
  // TensorShard says how; a row layer's bias is marked sequence_parallel under SP).
  bool parallel() const { return tp_ != nullptr; }
  // Sets this rank's shard from the whole layer's weight [out, in] and bias [out] (or null).
  void load_full(const Tensor& weight, const Tensor* bias);
  // Column layers under sequence parallelism (not FP8): the GEMM of this rank's own token
  // rows runs while the all-gather brings the other ranks' (forward_arriving); off: gather,
  // then GEMM.
  void set_overlap_gather(bool on) { overlap_gather_ = on; }
  // Inference with weight-only FP8 (gemm.h's Fp8WeightOnly: E4M3, one scale per output
  // channel or per 128 x 128 block), quantized here once from the current weight; outside
  // fp8_autocast / FP4 the forward then reads it instead of the weight, and backward is
  // refused. Off frees it.
  void set_inference_fp8_weight(bool on, Fp8WeightScaling scaling = Fp8WeightScaling::PerChannel);
  bool inference_fp8_weight() const { return weight_fp8_.has_value(); }
  size_t inference_weight_bytes() const;  // of the FP8 weight when on

  Parameter weight;
  Parameter bias;  // undefined value without bias

 private:
  // The shard's own forward and backward (the whole layer without TP).
  Tensor local_forward(const Tensor& x, Context& ctx, SavedInput saved);
  Tensor local_backward(const Tensor& dy, Context& ctx);
  Tensor parallel_forward(const Tensor& x, Context& ctx);
  Tensor parallel_backward(const Tensor& dy, Context& ctx);
  Epilogue forward_epilogue() const;
  void fp8_gradients(const Float8Tensor& dyq, const Context& ctx, Tensor& dx);
  Tensor fp4_forward(const Tensor& flat, Context& ctx);
  void fp4_gradients(const Tensor& dy, const Context& ctx, Tensor& dx);
  uint64_t fp4_backward_calls_ = 0;
  std::optional<Float4Tensor> fp4_weight_;    // until on_parameters_updated()  // stochastic
                                              // rounding: a fresh random stream per backward
  std::optional<Float4Tensor> fp4_weight_t_;  // MXFP4's dX operand (W^T, blocks along out),
                                              // also once per optimizer step
  PackedWeight& packed_weight(DType dtype);
  const Tensor& weight_as(DType dtype);
  LinearOptions whole_;    // the layer as given
  LinearOptions options_;  // this rank's shard (the whole layer without TP)
  Communicator* tp_ = nullptr;
  bool overlap_gather_ = false;
  Fp8State fp8_;
  Tensor weight_bf16_;
  std::optional<PackedWeight> packed_;
  DType packed_dtype_ = DType::F32;
  std::optional<Fp8WeightOnly> weight_fp8_;
};

struct NormOptions {
  int64_t hidden = 0;
  NormKind kind = NormKind::LayerNorm;
  float eps = 1e-5f;
  bool zero_centered_gamma = false;
  std::string name = "norm";
};

// LayerNorm (weight, bias) or RMSNorm (weight) over the last dimension.
class Norm : public Module {
 public:
  struct Context {
    Tensor input, mean, rstd;
  };
  explicit Norm(const NormOptions& options);
  Tensor forward(const Tensor& x, Context& ctx);
  Tensor backward(const Tensor& dy, Context& ctx);
  // Writes the normalized output as FP8 codes (per-tensor scale) in the same pass.
  void forward_fp8(const Tensor& x, Context& ctx, ops::Fp8Store& store);
  void collect_parameters(std::vector<Parameter*>& out) override;
  const NormOptions& options() const { return options_; }

  Parameter weight;
  Parameter bias;  // LayerNorm only

 private:
  NormOptions options_;
};

struct LayerNormLinearOptions {
  LinearOptions linear;
  NormOptions norm;
  bool return_layernorm_output = false;
};

// norm(x) then Linear, with the norm's output cast to FP8 in the norm kernel under per-tensor
// FP8 recipes (TransformerEngine's LayerNormLinear, e.g. the fused QKV projection). Given a
// tensor-parallel group, the Linear is parallel per linear.parallel_mode; under
// sequence_parallel the norm runs on this rank's token rows and a column Linear gathers its
// output (the FP8 codes are then made after the gather, not by the norm kernel).
class LayerNormLinear : public Module {
 public:
  struct Context {
    Norm::Context norm;
    Linear::Context linear;
    Tensor norm_output;  // kept when return_layernorm_output or the GEMM is not FP8
  };
  explicit LayerNormLinear(const LayerNormLinearOptions& options, Communicator* tp = nullptr);
  Tensor forward(const Tensor& x, Context& ctx);
  Tensor backward(const Tensor& dy, Context& ctx);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override { linear.on_parameters_updated(); }

  Norm norm;
  Linear linear;

 private:
  LayerNormLinearOptions options_;
};

struct LayerNormMLPOptions {
  int64_t hidden = 0;
  int64_t ffn_hidden = 0;
  ops::ActivationKind activation = ops::ActivationKind::GeluTanh;
  NormOptions norm;
  bool bias = true;
  bool checkpoint = false;  // recompute FC1 + activation in backward instead of saving them
  // With a tensor-parallel group: the input and output are this rank's token rows
  // [N/TP, hidden] (the norm runs on them; FC1 gathers, FC2 reduce-scatters).
  bool sequence_parallel = false;
  float init_std = 0.02f;
  float output_init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "mlp";
};

// norm -> FC1 (bias fused) -> activation -> FC2. Given a tensor-parallel group (Megatron's
// MLP): FC1 column-parallel (a gated activation's two halves split alike), the activation on
// this rank's ffn_hidden/TP columns, FC2 row-parallel; the parameters are the shards of the
// same options' single-process module. FP8 runs quantize each GEMM input after the gather.
class LayerNormMLP : public Module {
 public:
  struct Context {
    Tensor input;                              // kept for recomputation
    std::optional<recipe::Recipe> fp8_recipe;  // the forward's FP8 recipe, if it ran in FP8
    Norm::Context norm;
    Linear::Context fc1, fc2;
    Tensor fc1_output;  // pre-activation (absent with checkpoint)
    // FC2 input (absent with checkpoint). FP8 runs do not keep it: backward recomputes it
    // from fc1_output and re-quantizes it with the forward's scale (the same codes).
    Tensor activation;
    // Delayed scaling: the activation kernel wrote FC2's FP8 input itself with this scale
    // (0: it did not), and backward recomputes it the same way.
    float activation_fp8_scale = 0.0f;
  };
  explicit LayerNormMLP(const LayerNormMLPOptions& options, Communicator* tp = nullptr);
  // FC1's (first) or FC2's options: sizes, seeds, names. Tensor-parallel MLPs shard these.
  static LinearOptions fc_options(const LayerNormMLPOptions& options, bool first);
  Tensor forward(const Tensor& x, Context& ctx);
  Tensor backward(const Tensor& dy, Context& ctx);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;

  Norm norm;
  Linear fc1;
  Linear fc2;

 private:
  void run_forward(const Tensor& x, Context& ctx, Tensor& out);
  LayerNormMLPOptions options_;
  int64_t local_ffn_;  // ffn_hidden / TP
};

// ---------------------------------------------------------------------------------------------
// GroupedLinear (TransformerEngine's), the experts of a mixture of experts.

struct GroupedLinearOptions {
  int num_gemms = 1;
  // The global index of GEMM 0: this module holds GEMMs [first_gemm, first_gemm + num_gemms)
  // of a larger one (a rank's experts under expert parallelism), named and initialized as
  // that module's.
  int first_gemm = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  bool return_bias = false;  // forward leaves the biases out; the caller owns their gradients
  // Tensor parallelism (as Linear's), in effect when a group is given. Column: every weight{i}
  // split by output rows, the input [M, in] whole on every rank, the output [M, out/TP] this
  // rank's columns. Row: split by input columns, the input [M, in/TP] this rank's columns, the
  // output [M, out] summed over the group with the biases added once after the sum.
  ParallelMode parallel_mode = ParallelMode::None;
  float init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "grouped_linear";
};

// num_gemms Linear layers over consecutive row groups of one input: rows
// [sum(m_splits[:i]), sum(m_splits[:i+1])) go through weight{i} [out,in] and bias{i} [out]
// (mixture-of-experts FFNs). Under fp8_autocast each GEMM has its own quantizers.
class GroupedLinear : public Module {
 public:
  struct Context {
    DType dtype = DType::F32;
    std::vector<int64_t> m_splits;
    Tensor input;                          // high-precision input (non-FP8 runs)
    std::vector<Float8Tensor> input_fp8;   // FP8 runs: per group, columnwise
    std::vector<Float8Tensor> weight_fp8;  // FP8 runs: per group, columnwise
    bool fp8 = false;
    int64_t rows = 0;
  };
  // tp: the tensor-parallel group for parallel_mode column / row (null: no parallelism); the
  // weights are then the shards of the same options' single-process module.
  explicit GroupedLinear(const GroupedLinearOptions& options, Communicator* tp = nullptr);
  // x [M, in] with M = sum(m_splits) (entries >= 0, any may be 0) -> y [M, out] (this rank's
  // part under tensor parallelism, above).
  Tensor forward(const Tensor& x, const std::vector<int64_t>& m_splits, Context& ctx);
  // dy [M, out] -> dx [M, in]; accumulates every weight{i}.grad and bias{i}.grad.
  Tensor backward(const Tensor& dy, Context& ctx);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  const GroupedLinearOptions& options() const { return options_; }  // this rank's shard
  const GroupedLinearOptions& whole_options() const { return whole_; }
  Fp8State& fp8_state() { return fp8_; }

  std::vector<Parameter> weights;  // weight{i} [out, in]
  std::vector<Parameter> biases;   // bias{i} [out] (empty without bias)

 private:
  PackedWeight& packed_weight(int gemm, DType dtype);
  Tensor local_forward(const Tensor& x, const std::vector<int64_t>& m_splits, Context& ctx);
  Tensor local_backward(const Tensor& dy, Context& ctx);
  GroupedLinearOptions whole_;    // the module as given
  GroupedLinearOptions options_;  // this rank's shard (the whole module without a group)
  Communicator* tp_ = nullptr;
  Fp8State fp8_;
  std::vector<std::optional<PackedWeight>> packed_;
  std::vector<DType> packed_dtype_;
};

// ---------------------------------------------------------------------------------------------
// Mixture of experts (Megatron-Core's MoELayer: TopKRouter, the experts as TEGroupedMLP, shared
// experts), in the place of a TransformerLayer's LayerNormMLP.

// Expert parallelism's token exchange (Megatron's MoEAlltoAllTokenDispatcher on DeepEP's
// contract): a layout pass (how many rows each rank sends to each expert), the dispatch of the
// rows to their experts' ranks and the combine of the experts' outputs back. Rank r of the group
// holds experts [r * L, (r + 1) * L), L = E / EP. The exchange is an all-to-all-v made of one
// non-blocking message per (rank, expert) chunk, each received straight into its place in the
// expert-grouped order (as DeepEP writes into the expert's buffer): no reordering pass. FP8
// dispatch (codes with block scales) is an option.
class ExpertDispatcher {
 public:
  // Process-wide: the threads running model work (the trainer's; DualPipe's overlapped F&B adds
  // a second while a pair runs). A dispatcher's wait is exposed only while every such thread
  // waits: while another computes, it is hidden. leave() / enter() bracket a thread's pause
  // (waits call them; the executor calls enter() for the thread it starts and leave() at its
  // end, and leave() / enter() around joining it). take_exposed_seconds(): the seconds every
  // such thread spent waiting at once since the last call.
  static void leave_compute();
  static void enter_compute();
  static double take_exposed_seconds();

  struct Layout {
    std::vector<int64_t> send_counts;           // [E] this rank's rows for each global expert
    std::vector<int64_t> per_source;            // [EP * L]: rows source s sends local expert l
    std::vector<int64_t> send_rows, recv_rows;  // [EP] rows to and from each rank
    std::vector<int64_t> expert_rows() const;   // [L] rows each local expert receives
  };
  // An exchange in flight: its tensors stay alive until it is finished.
  struct Pending {
    std::vector<Work> works;
    Tensor sent, sent_scales, received, received_scales;
    DType dtype = DType::F32;  // the rows' dtype before FP8
  };
  struct Stats {  // wall time in flight, the part waited for (not hidden), bytes sent
    double transfer_seconds = 0.0, waited_seconds = 0.0;
    int64_t bytes = 0, exchanges = 0;
  };

  ExpertDispatcher(Communicator& ep, int64_t num_experts);
  int64_t local_experts() const { return local_; }
  // rows_per_expert [E] I32: this rank's rows for each global expert. Collective (the counts'
  // all-to-all).
  Layout layout(const Tensor& rows_per_expert);
  // rows [R, C] grouped by global expert (R = sum of the layout's send_rows) to their experts'
  // ranks. fp8: as E4M3 codes with a power-of-2 scale per 1x128 block (DeepEP's FP8 dispatch).
  Pending start_dispatch(const Tensor& rows, const Layout& layout, bool fp8 = false);
  // Waits: the rows received, grouped by local expert ([l][s]: expert l's rows from each source
  // in rank order), in the dtype given to start_dispatch.
  Tensor finish_dispatch(Pending& pending, const Layout& layout);
  // Expert rows ([l][s], as finish_dispatch gives them) back to the ranks they came from.
  Pending start_combine(const Tensor& expert_rows, const Layout& layout);
  // Waits: this rank's rows, in the order they were dispatched.
  Tensor finish_combine(Pending& pending);
  Stats take_stats() { return std::exchange(stats_, {}); }

 private:
  // Chunk by chunk: to each expert's rank (dispatch), or back to each source (combine).
  void post(const Tensor& rows, const Layout& layout, bool dispatch, int tag, Tensor& out,
            std::vector<Work>& works);
  void wait(std::vector<Work>& works);
  Communicator& ep_;
  int64_t experts_, local_;
  Stats stats_;
};

struct MoELayerOptions {
  int64_t hidden = 0;
  int64_t num_experts = 0;  // --num-experts
  int64_t ffn_hidden = 0;   // each expert's (--moe-ffn-hidden-size)
  // One shared expert of this width sees every token (--moe-shared-expert-intermediate-size);
  // 0: none.
  int64_t shared_expert_ffn_hidden = 0;
  ops::ActivationKind activation = ops::ActivationKind::GeluTanh;
  NormOptions norm;
  bool bias = true;  // the experts' and the shared expert's biases
  // topk, score function, normalization, scaling, aux-loss and z-loss coefficients
  // (expert_bias is the layer's own, below; the pointer here is ignored).
  ops::RouterOptions router;
  // DeepSeek-V3's auxiliary-loss-free balancing (--moe-router-enable-expert-bias): after each
  // optimizer step, expert_bias[e] += rate * sign(mean load - load[e]).
  bool enable_expert_bias = false;
  float expert_bias_update_rate = 1e-3f;
  // Token dropping (--moe-expert-capacity-factor; 0: dropless): each expert computes at most
  // ceil(N * k / E * factor) of the N tokens' pairs routed to it, chosen by drop_policy; a
  // dropped pair adds nothing to its token's output (the shared expert still sees every token).
  double capacity_factor = 0.0;
  ops::DropPolicy drop_policy = ops::DropPolicy::Probs;
  // With a tensor-parallel group: the input and output are this rank's token rows [N/TP, C]
  // (the norm runs on them, the tokens are gathered before the router).
  bool sequence_parallel = false;
  float init_std = 0.02f;
  float output_init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "moe";
};

// norm -> router (a linear gate without bias, in FP32 and never quantized) -> top-k choice ->
// the tokens permuted by expert -> experts FC1 (GroupedLinear, one GEMM per expert with its
// rows) -> activation -> experts FC2 -> unpermuted and weighted by the router's probabilities,
// plus the shared expert's output on the same normalized tokens. Dropless by default (every
// token reaches its k experts), or with an expert capacity. Backward adds the auxiliary losses'
// gradients (the switch loss, the z-loss) scaled like the main loss's (set_loss_scale).
class MoELayer : public Module {
 public:
  struct Context {
    Norm::Context norm;
    Linear::Context router;
    Tensor logits, scores, probs, experts, counts, row_map;  // the router's and the permutation's
    int64_t kept_rows = 0;  // the permuted rows the experts computed (all of them, dropless)
    int64_t dropped = 0;    // pairs dropped by the capacity
    GroupedLinear::Context fc1, fc2;
    Tensor fc1_output;     // [N*k, F(x2 gated)]: pre-activation
    Tensor expert_output;  // [N*k, C]: FC2's, in permuted order
    Linear::Context shared_fc1, shared_fc2;
    Tensor shared_fc1_output;
    ExpertDispatcher::Layout layout;  // expert parallelism's exchange
    ops::RouterLosses losses;
    float loss_scale = 1.0f;
    Shape shape;  // the input's
  };
  // What the training micro-batches routed since the last take_load().
  struct Load {
    std::vector<double> tokens;           // [E] tokens routed to each expert (copies: k per token)
    double aux_loss = 0.0, z_loss = 0.0;  // summed over micro-batches
    double dropped = 0.0;                 // (token, choice) pairs dropped by the capacity
    int64_t micro_batches = 0;
  };
  // tp: expert tensor parallelism (ETP = TP). ep: the expert-parallel group; this rank holds
  // experts [r * E / EP, (r + 1) * E / EP) (rank r of ep) under their global names, sends each
  // routed token row to its expert's rank (all-to-all-v) and gets the outputs back.
  explicit MoELayer(const MoELayerOptions& options, Communicator* tp = nullptr,
                    Communicator* ep = nullptr);
  // x [..., C] F32|BF16 (N tokens) -> [..., C] in x's dtype.
  Tensor forward(const Tensor& x, Context& ctx);
  // dy shaped like forward's output -> dx; gradients accumulate. Counts the micro-batch's load.
  Tensor backward(const Tensor& dy, Context& ctx);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  // The experts' FC1 and FC2, then the shared expert's FC1 and FC2 (the router is not FP8).
  std::vector<Fp8State*> fp8_states();
  // The factor of the auxiliary losses' gradients for the forwards that follow (the main
  // loss's grad_scale: 1 / micro-batches per step).
  void set_loss_scale(float scale) { loss_scale_ = scale; }
  Load take_load();
  // Expert parallelism's token exchanges (dispatch and combine, forward and backward) since the
  // last take (empty without expert parallelism).
  ExpertDispatcher::Stats take_exchange_stats() {
    return dispatcher_ ? dispatcher_->take_stats() : ExpertDispatcher::Stats{};
  }
  // On: under fp8_autocast the forward dispatch sends E4M3 codes with a scale per 1x128 block
  // (DeepEP's FP8 dispatch; power-of-2 scales, so Float8BlockScaling's GEMM quantizes the
  // received values to the same codes). Off (the default): the activation dtype travels. On one
  // host the software FP8 conversions cost more than the halved bytes save (octet bench moe:
  // 0.18x of raw BF16's time); it pays where the link is slower than the conversion.
  void set_fp8_dispatch(bool on) { fp8_dispatch_ = on; }
  // DeepSeek-V3's update from tokens [E], the load summed over every rank sharing this layer's
  // bias (data-parallel ranks): expert_bias[e] += rate * sign(mean - tokens[e]). Without
  // enable_expert_bias, nothing.
  void update_expert_bias(const std::vector<double>& tokens);
  const MoELayerOptions& options() const { return options_; }

  Norm norm;
  Linear router;      // weight [E, C]
  GroupedLinear fc1;  // E x [F (2F gated), C] (E / EP of them under expert parallelism)
  GroupedLinear fc2;  // E x [C, F]
  std::optional<Linear> shared_fc1, shared_fc2;
  // [E] F32, a buffer (not a parameter: no gradient, no optimizer), checkpointed by the model
  // as NAME.router.expert_bias. Zeros unless enable_expert_bias.
  Tensor expert_bias;

 private:
  MoELayerOptions options_;
  Communicator* tp_ = nullptr;                  // a group of more than one rank, or null
  std::optional<ExpertDispatcher> dispatcher_;  // expert parallelism (a group of > 1 rank)
  float loss_scale_ = 1.0f;
  Load load_;
  bool fp8_dispatch_ = false;
};

// ---------------------------------------------------------------------------------------------
// Attention and TransformerLayer (TransformerEngine's names and options).

// Which keys a query sees. Masks are bottom-right aligned (flash-attn): with T queries and S
// keys, query i sits on key diagonal i + S - T. Padding masks take per-sequence lengths.
enum class AttnMaskType { NoMask, Causal, Padding, PaddingCausal };
enum class AttentionType { Self, Cross };
enum class LayerType { Encoder, Decoder };
struct InferenceParams;  // the KV cache, declared at the end

// Context parallelism's exchange inside attention (TransformerEngine's cp_comm_type): P2P is
// ring attention (K/V blocks passed around the group under each block's attention, merged by
// log-sum-exp); A2A is Ulysses (all-to-all from token shards to head shards and back).
enum class CpCommType { P2P, A2A };
// "p2p" | "a2a"; anything else is an error naming the choices.
CpCommType parse_cp_comm_type(const std::string& name);
// Under context parallelism rank r of CP holds two of each sequence's 2CP equal chunks, r and
// 2CP-1-r (the causal load balance): the chunk that half `half` (0 or 1) of its tokens is.
inline int64_t context_parallel_chunk(int rank, int size, int half) {
  return half == 0 ? rank : 2 * static_cast<int64_t>(size) - 1 - rank;
}

struct DotProductAttentionOptions {
  int64_t num_attention_heads = 0;  // H
  int64_t kv_channels = 0;          // D, the head size
  int64_t num_gqa_groups = 0;       // Hkv (kv heads); 0 means H. H % Hkv == 0.
  AttnMaskType attn_mask_type = AttnMaskType::Causal;
  // Sliding window (left, right) in keys around the diagonal, -1 = unbounded; with a causal
  // mask right is 0, so {w, 0} is Mistral's sliding window of w + 1 keys.
  std::pair<int64_t, int64_t> window_size = {-1, -1};
  float attention_dropout = 0.0f;
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(D)
  uint64_t seed = 0;
  std::string name = "core_attention";
};

// softmax(q k^T * scale + mask) v over the fused flash-attention kernels (the T x S scores
// are never stored). No parameters.
// FP8 attention: under fp8_autocast with DelayedScaling{.fp8_dpa = true}, q and k are the
// inputs of GEMM 0 (S = q k^T) and P and v those of GEMM 1 (O = P v) in the module's Fp8State:
// q, k, v are quantized to E4M3 with their delayed scales (forward meta 0, 1, 3) and kept as
// FP8 for backward; P is rounded in the kernel with scale 2 (its amax recorded there), dO is
// quantized as GEMM 1's output gradient (backward meta 1, E5M2 under HYBRID) and dS rounded
// in the kernel as GEMM 0's (backward meta 0). The kernels then run in F32 on the FP8 values
// (see ops::AttentionFp8); out and the gradients come back in the inputs' dtype.
class DotProductAttention : public Module {
 public:
  struct Context {
    Tensor q, k, v, out;
    Tensor lse;                    // [B,H,T] F32
    Tensor q_lengths, kv_lengths;  // [B] I32, padding masks only
    Tensor bias;                   // [H,T,S] F32: the scores' additive bias, when given
    uint64_t rng_offset = 0;       // the dropout mask's offset, regenerated in backward
    bool fp8 = false;              // FP8 attention: q8, k8, v8 instead of q, k, v
    Float8Tensor q8, k8, v8;       // [B*T, H*D], [B*S, Hkv*D]
    Shape q_shape, kv_shape;
    DType dtype = DType::F32;
  };
  explicit DotProductAttention(const DotProductAttentionOptions& options);
  // q [B,T,H,D], k and v [B,S,Hkv,D], F32|BF16 -> out [B,T,H,D]. q_lengths / kv_lengths [B]
  // I32 are required by the padding mask types (and ignored by the others). bias [H,T,S] F32
  // is added to the scaled scores before the mask (TransformerEngine's post_scale_bias: T5's
  // relative position bias), the same for every sequence of the batch.
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, Context& ctx,
                 const Tensor* q_lengths = nullptr, const Tensor* kv_lengths = nullptr,
                 const Tensor* bias = nullptr);
  // dout [B,T,H,D] -> dq, dk, dv (written, shapes and dtypes of q, k, v); with a bias in
  // forward and dbias given, *dbias = its gradient [H,T,S] F32 (summed over the batch).
  void backward(const Tensor& dout, Context& ctx, Tensor& dq, Tensor& dk, Tensor& dv,
                Tensor* dbias = nullptr);
  void collect_parameters(std::vector<Parameter*>&) override {}
  const DotProductAttentionOptions& options() const { return options_; }
  // The dropout offset the next forward uses (each forward advances it by one). Activation
  // recomputation sets it back to replay a forward's masks.
  uint64_t rng_offset() const { return rng_offset_; }
  void set_rng_offset(uint64_t offset) { rng_offset_ = offset; }
  // FP8 attention's scales and amax histories (unused unless the recipe asks for fp8_dpa).
  Fp8State& fp8_state() { return fp8_; }
  // Context parallelism (TransformerEngine's set_context_parallel_group): with a group of CP
  // ranks, q, k and v hold this rank's T / CP tokens of each sequence - chunks r and 2CP-1-r of
  // its 2CP equal chunks, the causal load balance - and out is their attention over the whole
  // sequence, exchanged as `type` says. Causal or no mask; a window, padding, a bias, dropout
  // and FP8 attention are refused. A2A needs H and Hkv divisible by CP. null: none.
  void set_context_parallel(Communicator* group, CpCommType type = CpCommType::P2P);
  Communicator* context_parallel_group() const { return cp_; }

 private:
  bool context_parallel() const;
  Tensor forward_fp8(const Tensor& q, const Tensor& k, const Tensor& v, Context& ctx);
  void backward_fp8(const Tensor& dout, Context& ctx, Tensor& dq, Tensor& dk, Tensor& dv);
  DotProductAttentionOptions options_;
  uint64_t rng_offset_ = 0;
  Fp8State fp8_{2};
  Communicator* cp_ = nullptr;
  CpCommType cp_type_ = CpCommType::P2P;
};

struct MultiheadAttentionOptions {
  int64_t hidden_size = 0;          // C
  int64_t num_attention_heads = 0;  // H
  int64_t kv_channels = 0;          // D; 0 means C / H
  int64_t num_gqa_groups = 0;       // Hkv; 0 means H
  float attention_dropout = 0.0f;
  float layernorm_epsilon = 1e-5f;
  NormKind normalization = NormKind::LayerNorm;
  bool zero_centered_gamma = false;
  bool input_layernorm = false;  // norm fused before the input projection (LayerNormLinear)
  AttentionType attention_type = AttentionType::Self;
  AttnMaskType attn_mask_type = AttnMaskType::Causal;
  std::pair<int64_t, int64_t> window_size = {-1, -1};
  float softmax_scale = 0.0f;
  bool bias = true;
  bool return_bias = false;  // forward leaves out the projection bias; see output_bias()
  // RoPE on q and k (rotate-half pairs unless rotary_interleaved); rotary_dim 0 means
  // kv_channels * rotary_percent, rounded down to even.
  bool rope = false;
  float rope_theta = 10000.0f;
  float rotary_percent = 1.0f;
  int64_t rotary_dim = 0;
  bool rotary_interleaved = false;
  // QK-norm: a norm over D of every q and k head (separate weights for q and k).
  bool qk_norm = false;
  NormKind qk_norm_type = NormKind::RMSNorm;
  float qk_norm_eps = 1e-6f;
  bool qk_norm_before_rope = false;
  // With a tensor-parallel group: x and the output are this rank's token rows (below).
  bool sequence_parallel = false;
  float init_std = 0.02f;
  float output_init_std = 0.02f;
  DType params_dtype = DType::F32;
  uint64_t seed = 0;
  std::string name = "attention";
};

// Self-attention: x -> [norm ->] fused QKV projection [N, (H + 2 Hkv) D] laid out as
// [q (H D) | k (Hkv D) | v (Hkv D)] -> split -> [QK-norm, RoPE] -> DotProductAttention -> proj.
// Cross-attention: q from x (query projection), k and v from encoder_output (key_value
// projection, [k | v]). Parameters (TE's names): layernorm_qkv | qkv, or layernorm_query |
// query and key_value; q_norm, k_norm; proj.
// Given a tensor-parallel group (self-attention; Megatron's attention with TP): the QKV
// projection column-parallel by heads (rank r holds the r-th H/TP query and Hkv/TP kv heads of
// each block), attention on those heads, the output projection row-parallel; the parameters
// are the shards of the same options' single-process module. Under sequence_parallel, x is
// this rank's token rows [B*T/TP, C] of the flattened [B*T, C] and forward needs seq_len = T;
// the output is the same rows.
class MultiheadAttention : public Module {
 public:
  struct Context {
    LayerNormLinear::Context layernorm_input;  // layernorm_qkv / layernorm_query
    Linear::Context input;                     // qkv / query
    Linear::Context key_value;
    Norm::Context q_norm, k_norm;
    DotProductAttention::Context core;
    Linear::Context proj;
    Shape x_shape;  // [B, T, C] (the whole sequence under sequence parallelism)
    Shape input_shape, encoder_shape;
    // FP8 self-attention with per-tensor scaling: q, k, v (and the QK-norm inputs) are not
    // kept; backward recomputes them from the QKV projection's kept FP8 input, bit for bit.
    bool replay_qkv = false;
  };
  explicit MultiheadAttention(const MultiheadAttentionOptions& options, Communicator* tp = nullptr);
  // The sub-modules' options (sizes, seeds, names), which tensor-parallel attention shards:
  // the core attention, the fused self-attention QKV projection with its input norm, and
  // the output projection.
  static DotProductAttentionOptions core_options(const MultiheadAttentionOptions& options);
  static LayerNormLinearOptions qkv_options(const MultiheadAttentionOptions& options);
  static LinearOptions proj_options(const MultiheadAttentionOptions& options);
  // x [B,T,C], encoder_output [B,S,C] (cross-attention only), F32|BF16 -> [B,T,C].
  // q_lengths [B] / kv_lengths [B] I32 for padding masks. Sequence parallelism: x [B*T/TP, C]
  // with seq_len = T -> [B*T/TP, C].
  // bias [H,T,S] F32 (all H heads; under TP this rank's heads are used): added to the scores
  // (DotProductAttention).
  Tensor forward(const Tensor& x, Context& ctx, const Tensor* encoder_output = nullptr,
                 const Tensor* q_lengths = nullptr, const Tensor* kv_lengths = nullptr,
                 int64_t seq_len = 0, const Tensor* bias = nullptr);
  // dy [B,T,C] -> dx; cross-attention writes d_encoder_output [B,S,C] (required there). With a
  // bias in forward and dbias given, the bias's gradient is added into *dbias [H,T,S] F32
  // (this rank's heads' rows under TP).
  Tensor backward(const Tensor& dy, Context& ctx, Tensor* d_encoder_output = nullptr,
                  Tensor* dbias = nullptr);
  // With return_bias: the projection bias the caller adds (and whose gradient it accumulates
  // into proj.bias.grad); null without bias or return_bias.
  const Tensor* output_bias() const;
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  // Every FP8 state of the module, e.g. to freeze them while recomputing a forward.
  std::vector<Fp8State*> fp8_states();
  const MultiheadAttentionOptions& options() const { return options_; }
  // Inference with a KV cache (self-attention, no padding mask, no dropout): x [B,T,C] holds
  // the T new tokens of each sequence, at positions [offset, offset + T) with offset =
  // params.sequence_len_offset (RoPE rotates by those positions). Their k and v are written
  // into the cache of `layer_number`, and the new queries attend to cache[:, :offset + T]
  // (the causal mask bottom-right aligned). -> [B,T,C] like forward (bias left out with
  // return_bias). Does not advance the offset: the model does, once every layer has run.
  Tensor forward_inference(const Tensor& x, InferenceParams& params, int64_t layer_number);

  std::optional<LayerNormLinear> layernorm_qkv, layernorm_query;
  std::optional<Linear> qkv, query, key_value;
  std::optional<Norm> q_norm, k_norm;
  DotProductAttention core_attention;
  Linear proj;

 private:
  // fused [B*T, (H + 2 Hkv) D] -> q [B,T,H,D], k and v [B,T,Hkv,D], QK-norm and RoPE applied.
  void split_qkv(const Tensor& fused, Context& ctx, Tensor& q, Tensor& k, Tensor& v);
  void position_qk(Context& ctx, Tensor& q, Tensor& k);  // QK-norm and RoPE, in their order
  bool qkv_projection_can_replay(const Context& ctx) const;
  // x's [B, T] (checked; under sequence parallelism x holds B*T/TP rows and seq_len is T).
  std::pair<int64_t, int64_t> batch_and_seq(const Tensor& x, int64_t seq_len) const;
  MultiheadAttentionOptions options_;
  int64_t heads_, kv_heads_, head_dim_;  // this rank's heads under TP
  int tp_size_ = 1;
  int tp_rank_ = 0;
};

struct TransformerLayerOptions {
  int64_t hidden_size = 0;
  int64_t ffn_hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_gqa_groups = 0;  // 0 means num_attention_heads
  int64_t kv_channels = 0;     // 0 means hidden_size / num_attention_heads
  float layernorm_epsilon = 1e-5f;
  float hidden_dropout = 0.1f;
  float attention_dropout = 0.1f;
  NormKind normalization = NormKind::LayerNorm;
  bool zero_centered_gamma = false;
  ops::ActivationKind activation = ops::ActivationKind::GeluTanh;
  LayerType layer_type = LayerType::Encoder;
  // Residuals taken after the norms (the norm output, not the sub-block input).
  bool apply_residual_connection_post_layernorm = false;
  // Post-norm (BERT): no norm before self-attention, a norm on the layer's output.
  bool output_layernorm = false;
  AttnMaskType self_attn_mask_type = AttnMaskType::Causal;
  AttnMaskType enc_dec_attn_mask_type = AttnMaskType::NoMask;
  std::pair<int64_t, int64_t> window_size = {-1, -1};
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(kv_channels); T5 uses 1
  // x + attention(norm1(x)) + mlp(norm2(x)) (GPT-J, PaLM); encoder layers only.
  bool parallel_attention_mlp = false;
  bool rope = false;  // on self-attention's q and k
  float rope_theta = 10000.0f;
  float rotary_percent = 1.0f;
  int64_t rotary_dim = 0;
  bool rotary_interleaved = false;
  bool qk_norm = false;
  NormKind qk_norm_type = NormKind::RMSNorm;
  float qk_norm_eps = 1e-6f;
  bool qk_norm_before_rope = false;
  bool bias = true;
  float init_std = 0.02f;
  float output_init_std = 0.02f;
  DType params_dtype = DType::F32;
  // moe.num_experts > 0: a mixture of experts in the place of the MLP. The layer sets its
  // hidden size, norm, activation, bias, init, seed and name (moe_options); the rest (experts,
  // their width, the shared expert, the router) is taken from here.
  MoELayerOptions moe;
  // Keep only the layer's inputs; backward recomputes the forward (same FP8 scales, same
  // dropout masks) before running its own backward.
  bool checkpoint = false;
  // With a tensor-parallel group: the residual stream is this rank's token rows (see
  // MultiheadAttention); the norms and residual adds run on them.
  bool sequence_parallel = false;
  uint64_t seed = 0;
  std::string name = "layer";
};

// One Transformer block: self-attention, cross-attention (decoder), MLP, each added to its
// residual by bias_dropout_add (the attention projection's bias fused there). Given a
// tensor-parallel group, its attention and MLP are split across it (Megatron's
// TransformerLayer with TP); hidden dropout is then not supported yet.
class TransformerLayer : public Module {
 public:
  struct Context {
    Tensor input, encoder_output;  // kept for recomputation with checkpoint
    Tensor lengths, encoder_lengths;
    Tensor self_bias;  // [H,T,T] F32, when given
    std::optional<recipe::Recipe> fp8_recipe;
    uint64_t dropout_offset = 0;  // this forward's first hidden-dropout offset
    int64_t seq_len = 0;          // sequence parallelism: T
    uint64_t self_attention_rng = 0, inter_attention_rng = 0;
    bool recompute = false;  // backward must recompute the forward first
    // Each FP8 state's forward meta as the forward left it: the recomputation quantizes with
    // these, not with scales a later micro-batch's forward (pipeline schedules) moved on to,
    // and records nothing into the live amax histories.
    std::vector<FP8Meta> fp8_forward_metas;
    MultiheadAttention::Context self_attention, inter_attention;
    LayerNormMLP::Context mlp;
    MoELayer::Context moe;
    // Post-layernorm residuals: the norm re-applied (its output is the residual).
    Norm::Context self_residual_norm, inter_residual_norm, mlp_residual_norm;
    Norm::Context output_norm;
    uint64_t attention_dropout_offset = 0, inter_dropout_offset = 0, mlp_dropout_offset = 0;
  };
  // ep: the expert-parallel group of a mixture of experts (MoELayer); ignored otherwise.
  explicit TransformerLayer(const TransformerLayerOptions& options, Communicator* tp = nullptr,
                            Communicator* ep = nullptr);
  // The options (sizes, seeds, names) the layer gives its self- or cross-attention and its
  // MLP: a tensor-parallel layer derives its shards from the same ones.
  static MultiheadAttentionOptions attention_options(const TransformerLayerOptions& options,
                                                     bool cross);
  static LayerNormMLPOptions mlp_options(const TransformerLayerOptions& options);
  static MoELayerOptions moe_options(const TransformerLayerOptions& options);
  // x [B,T,C] F32|BF16 -> [B,T,C]. encoder_output [B,S,C] for decoder layers. lengths /
  // encoder_lengths [B] I32 for padding masks (self: lengths; cross: lengths, encoder_lengths).
  // Sequence parallelism: x [B*T/TP, C] with seq_len = T -> [B*T/TP, C].
  // self_bias [H,T,T] F32: the self-attention scores' additive bias (T5's relative position
  // bias, computed by the model once per stack and shared by its layers).
  Tensor forward(const Tensor& x, Context& ctx, const Tensor* encoder_output = nullptr,
                 const Tensor* lengths = nullptr, const Tensor* encoder_lengths = nullptr,
                 int64_t seq_len = 0, const Tensor* self_bias = nullptr);
  // dy [B,T,C] -> dx; decoder layers also write d_encoder_output [B,S,C] (if given). With a
  // self_bias in forward and dself_bias given, its gradient is added into *dself_bias.
  Tensor backward(const Tensor& dy, Context& ctx, Tensor* d_encoder_output = nullptr,
                  Tensor* dself_bias = nullptr);
  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  const TransformerLayerOptions& options() const { return options_; }
  // Inference over T new tokens with the KV cache (encoder layers; dropout off, no contexts
  // kept): x [B,T,C] -> [B,T,C]. See MultiheadAttention::forward_inference.
  Tensor forward_inference(const Tensor& x, InferenceParams& params, int64_t layer_number);
  // Every FP8 state: self-attention's, cross-attention's, then FC1 and FC2 (a mixture of
  // experts: MoELayer::fp8_states()).
  std::vector<Fp8State*> fp8_states();
  // The column-parallel GEMMs' sequence-parallel all-gathers overlapped with the GEMM of this
  // rank's own rows (Linear::set_overlap_gather; TransformerEngine's ub overlap).
  void set_overlap_gather(bool on);

  MultiheadAttention self_attention;
  std::optional<MultiheadAttention> inter_attention;
  // The MLP: a LayerNormMLP, or a mixture of experts (options.moe.num_experts > 0).
  std::optional<LayerNormMLP> layernorm_mlp;
  std::optional<MoELayer> moe;
  std::optional<Norm> layernorm;  // output_layernorm

 private:
  void run_forward(const Tensor& x, const Tensor* encoder_output, Context& ctx, Tensor& out);
  Norm& mlp_norm();  // the MLP's (or the experts') input norm
  Tensor mlp_forward(const Tensor& x, Context& ctx);
  Tensor mlp_backward(const Tensor& dy, Context& ctx);
  TransformerLayerOptions options_;
  uint64_t dropout_offset_ = 0;
};

// ---------------------------------------------------------------------------------------------
// KV cache (TransformerEngine's InferenceParams).

// The keys and values of every self-attention layer, for up to max_batch_size sequences of up
// to max_sequence_length tokens. The sequences advance together: positions
// [0, sequence_len_offset) of each hold the tokens seen so far. A forward over T new tokens
// writes positions [offset, offset + T) of every layer, then the model adds T to the offset.
struct InferenceParams {
  struct KeyValue {
    Tensor key, value;  // [max_batch_size, max_sequence_length, Hkv, D] F32|BF16
    // FP8 paged cache (fp8_kv): key and value hold E4M3 codes, and these the scale of each
    // (token, kv head): real = e4m3(code) * scale, scale = amax over D / 448.
    Tensor key_scale, value_scale;  // [num_blocks, block_size, Hkv] F32
  };
  InferenceParams(int64_t max_batch_size, int64_t max_sequence_length);
  // The cache of layer `layer_number`, allocated on first use with that layer's heads and
  // the compute dtype; later calls must ask for the same.
  KeyValue& key_value(int64_t layer_number, int64_t kv_heads, int64_t head_dim, DType dtype);
  // Forget every cached token (the buffers stay allocated for the next sequence).
  void reset() { sequence_len_offset = 0; }
  size_t bytes() const;  // of the allocated caches

  int64_t max_batch_size = 0;
  int64_t max_sequence_length = 0;
  int64_t sequence_len_offset = 0;
  std::vector<KeyValue> key_value_memory;  // indexed by layer number

  // Paged mode (vLLM's PagedAttention; TransformerEngine's is_paged): each layer's keys and
  // values live in a pool of num_blocks blocks [num_blocks, block_size, Hkv, D], and a forward
  // packs the new tokens of several sequences into one [1, N] input ("thd"): sequence s owns
  // rows [row_offsets[s], row_offsets[s + 1]) at positions cached_lengths[s] + t, its token at
  // position p lives in block block_tables[s][p / block_size], slot p % block_size.
  // sequence_len_offset and max_batch_size are unused there.
  struct PagedBatch {
    std::vector<int64_t> row_offsets;                // S + 1 entries, row_offsets[0] = 0
    std::vector<int64_t> cached_lengths;             // S
    std::vector<std::vector<int32_t>> block_tables;  // S, each covering the new tokens too
    int64_t sequences() const { return static_cast<int64_t>(cached_lengths.size()); }
  };
  // num_blocks blocks of block_size tokens, sequences of up to max_sequence_length tokens.
  static InferenceParams paged(int64_t num_blocks, int64_t block_size, int64_t max_sequence_length);
  // The batch of the next forward, checked against the pool (octet::Error naming the entry).
  void set_paged_batch(PagedBatch batch);
  bool is_paged = false;
  int64_t num_blocks = 0, block_size = 0;
  bool fp8_kv = false;  // paged only: E4M3 keys and values with per-(token, head) scales
  PagedBatch batch;
};

}  // namespace octet
