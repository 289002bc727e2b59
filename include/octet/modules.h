// TransformerEngine-style modules: each owns its parameters, saves in a Context what its
// backward needs, and has a hand-written backward. Under fp8_autocast every GEMM input is
// quantized per the active recipe, and each module keeps its FP8 metadata per tensor role.
//
// Shapes: activations are [N, features] with N = tokens (leading dims flattened); dtypes F32
// or BF16 (the compute dtype follows the input). Parameters are FP32 masters; gradients are
// FP32 and accumulate across backward calls until zero_grad().
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "octet/gemm.h"
#include "octet/ops/activation.h"
#include "octet/recipe.h"
#include "octet/tensor.h"

namespace octet {

enum class ParallelMode { None, Column, Row };
enum class NormKind { LayerNorm, RMSNorm };

struct Parameter {
  std::string name;
  Tensor value;  // F32 master
  Tensor grad;   // F32, same shape
};

class Module {
 public:
  virtual ~Module() = default;
  virtual void collect_parameters(std::vector<Parameter*>& out) = 0;
  std::vector<Parameter*> parameters();
  void zero_grad();
  // After the optimizer changed parameter values: drop cached BF16 / packed / FP8 copies.
  virtual void on_parameters_updated() {}
};

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
  // While recomputing a forward for activation checkpointing, begin_forward neither updates
  // the scales nor counts a step: the recomputation quantizes exactly as the forward did.
  void set_recomputing(bool recomputing) { recomputing_ = recomputing; }
  const FP8Meta& forward_meta() const { return forward_meta_; }
  const FP8Meta& backward_meta() const { return backward_meta_; }
  const recipe::Recipe& recipe() const { return recipe_; }

 private:
  void ensure_metas(const recipe::Recipe& recipe);
  int num_gemms_;
  recipe::Recipe recipe_;
  FP8Meta forward_meta_;
  FP8Meta backward_meta_;
  int forward_calls_ = 0;
  int backward_calls_ = 0;
  bool recomputing_ = false;
};

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  bool return_bias = false;  // forward leaves the bias out for the caller to fuse
  DType params_dtype = DType::F32;
  ParallelMode parallel_mode = ParallelMode::None;
  bool sequence_parallel = false;
  float init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "linear";
};

// y = x W^T + b, W [out, in].
class Linear : public Module {
 public:
  struct Context {
    DType dtype = DType::F32;
    Tensor input;             // high-precision input (non-FP8 runs)
    Float8Tensor input_fp8;   // FP8 runs: the input's columnwise copy, for the weight gradient
    Float8Tensor weight_fp8;  // FP8 runs: the weight's columnwise copy, for the input gradient
    bool fp8 = false;
    int64_t rows = 0;
  };

  explicit Linear(const LinearOptions& options);
  // x [N, in] -> y [N, out] in x's dtype.
  Tensor forward(const Tensor& x, Context& ctx);
  // dy [N, out] -> dx [N, in]; accumulates weight.grad and bias.grad.
  Tensor backward(const Tensor& dy, Context& ctx);
  // Parts of forward/backward that LayerNormLinear and LayerNormMLP reuse.
  Tensor forward_fp8_input(const Float8Tensor& x, DType out_dtype, Context& ctx);

  void collect_parameters(std::vector<Parameter*>& out) override;
  void on_parameters_updated() override;
  const LinearOptions& options() const { return options_; }
  Fp8State& fp8_state() { return fp8_; }

  Parameter weight;
  Parameter bias;  // undefined value without bias

 private:
  PackedWeight& packed_weight(DType dtype);
  const Tensor& weight_as(DType dtype);
  LinearOptions options_;
  Fp8State fp8_;
  Tensor weight_bf16_;
  std::optional<PackedWeight> packed_;
  DType packed_dtype_ = DType::F32;
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
// FP8 recipes (TransformerEngine's LayerNormLinear, e.g. the fused QKV projection).
class LayerNormLinear : public Module {
 public:
  struct Context {
    Norm::Context norm;
    Linear::Context linear;
    Tensor norm_output;  // kept when return_layernorm_output or the GEMM is not FP8
  };
  explicit LayerNormLinear(const LayerNormLinearOptions& options);
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
  float init_std = 0.02f;
  float output_init_std = 0.02f;
  uint64_t seed = 0;
  std::string name = "mlp";
};

// norm -> FC1 (bias fused) -> activation -> FC2.
class LayerNormMLP : public Module {
 public:
  struct Context {
    Tensor input;                              // kept for recomputation
    std::optional<recipe::Recipe> fp8_recipe;  // the forward's FP8 recipe, if it ran in FP8
    Norm::Context norm;
    Linear::Context fc1, fc2;
    Tensor fc1_output;  // pre-activation (absent with checkpoint)
    Tensor activation;  // FC2 input (absent with checkpoint)
  };
  explicit LayerNormMLP(const LayerNormMLPOptions& options);
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
};

}  // namespace octet
