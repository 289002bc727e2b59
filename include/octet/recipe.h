// FP8 scaling recipes (TransformerEngine's semantics), the per-module FP8 metadata that
// delayed scaling keeps, quantizers, and the fp8_autocast scope.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "octet/fp8.h"

namespace octet {
namespace recipe {

// E4M3: every tensor E4M3. HYBRID: E4M3 forward (inputs, weights), E5M2 for gradients.
enum class Format { E4M3, HYBRID };
enum class AmaxComputeAlgo { Max, MostRecent };

// scale = (fp8_max / amax) / 2^margin from an amax history that rolls every step.
struct DelayedScaling {
  int margin = 0;
  Format fp8_format = Format::HYBRID;
  int amax_history_len = 1024;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::Max;
  // FP8 attention (TransformerEngine's fp8_dpa): DotProductAttention quantizes Q, K, V (E4M3)
  // and dO (E5M2 under HYBRID) with their own delayed scales, and its kernels round the
  // probabilities and the score gradients to FP8 for the attention GEMMs; outputs stay BF16.
  bool fp8_dpa = false;
};
// scale from the amax of the tensor being quantized, computed just before the cast.
struct Float8CurrentScaling {
  Format fp8_format = Format::HYBRID;
  bool power_2_scale = false;
  float amax_epsilon = 0.0f;
};
// 1x32 blocks along the GEMM's reduction dimension, E8M0 power-of-two scales.
struct MXFP8BlockScaling {
  Format fp8_format = Format::E4M3;
};
// DeepSeek-V3 style: 1x128 blocks for activations and gradients, 128x128 for weights.
struct Float8BlockScaling {
  Format fp8_format = Format::E4M3;
  bool power_2_scale = true;
  float amax_epsilon = 0.0f;
  int activation_block = 128;  // 1 x activation_block
  int weight_block = 128;      // weight_block x weight_block
};

using Recipe =
    std::variant<DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling>;
std::string describe(const Recipe& recipe);  // one line, for logs

}  // namespace recipe

// What a quantized tensor is to the GEMM that consumes it.
enum class TensorRole { Input, Weight, Output, GradOutput, GradInput };
bool is_gradient(TensorRole role);
// E4M3 everywhere, except gradients under HYBRID, which are E5M2.
DType fp8_dtype(recipe::Format format, TensorRole role);

// TransformerEngine's compute_scale_from_amax (current and block scaling):
// amax is clamped below by amax_epsilon; amax 0 or Inf gives scale 1; an infinite quotient
// gives FLT_MAX; power_2_scale rounds the scale down to a power of two.
float compute_scale_from_amax(float amax, float fp8_max_value, bool power_2_scale,
                              float amax_epsilon);

// Delayed-scaling state for a group of tensors (e.g. a module's forward GEMM inputs).
// amax_history is [history_len][num_tensors]; row 0 collects the current step's amax.
class FP8Meta {
 public:
  FP8Meta() = default;
  FP8Meta(std::vector<TensorRole> roles, int amax_history_len);

  int num_tensors() const { return static_cast<int>(roles_.size()); }
  int history_len() const { return history_len_; }
  TensorRole role(int index) const { return roles_.at(index); }
  float scale(int index) const { return scale_.at(index); }
  float scale_inv(int index) const { return scale_inv_.at(index); }
  float amax_history(int row, int index) const;
  const std::vector<float>& amax_history_data() const { return amax_history_; }

  // history[0][index] = max(history[0][index], amax); NaN is kept so update() can see it.
  void record_amax(int index, float amax);
  // Once per step, after the step's amaxes were recorded:
  //   amax = max over the window (Max) or history[0] (MostRecent);
  //   scale = (fp8_max / amax) / 2^margin, kept when amax is zero or not finite, FLT_MAX if
  //   the quotient overflows; scale_inv = 1 / scale;
  //   then the history rolls by one (history[i] = history[i+1], the current row moves to the
  //   end) and row 0 is cleared for the next step.
  void update(const recipe::DelayedScaling& recipe);

  // Checkpointing: the whole state, and its restoration (sizes must match this meta's).
  const std::vector<float>& scales() const { return scale_; }
  const std::vector<float>& scale_invs() const { return scale_inv_; }
  void restore(const std::vector<float>& scale, const std::vector<float>& scale_inv,
               const std::vector<float>& amax_history);

 private:
  std::vector<TensorRole> roles_;
  int history_len_ = 0;
  std::vector<float> scale_;
  std::vector<float> scale_inv_;
  std::vector<float> amax_history_;
};

// Turns F32 / BF16 tensors into Float8Tensors under one scaling scheme.
class Quantizer {
 public:
  // Per-tensor with the meta's current scale; the amax is recorded into the meta.
  static Quantizer delayed(DType format, FP8Meta* meta, int index);
  // Per-tensor with a fixed scale (tests, and the fp8 GEMM benchmark).
  static Quantizer fixed(DType format, float scale);
  // Per-tensor with the scale computed from this tensor's amax.
  static Quantizer current(DType format, bool power_2_scale = false, float amax_epsilon = 0.0f);
  // FP32 scale per block_rows x block_cols block.
  static Quantizer block(DType format, int block_rows, int block_cols, bool power_2_scale = true,
                         float amax_epsilon = 0.0f);
  // E8M0 scale per 1x32 block.
  static Quantizer mxfp8(DType format);

  // x: F32 or BF16, seen as [rows, cols]. rowwise fills data, columnwise fills data_t (the
  // per-tensor transposed copy comes from the fused cast+transpose kernel in the same pass).
  Float8Tensor quantize(const Tensor& x, bool rowwise = true, bool columnwise = false) const;

  DType format() const { return format_; }
  ScalingMode mode() const { return mode_; }

 private:
  enum class ScaleSource { Fixed, Delayed, Current, PerBlock };
  DType format_ = DType::E4M3;
  ScalingMode mode_ = ScalingMode::PerTensor;
  ScaleSource source_ = ScaleSource::Fixed;
  float fixed_scale_ = 1.0f;
  FP8Meta* meta_ = nullptr;
  int meta_index_ = 0;
  int block_rows_ = 0;
  int block_cols_ = 0;
  bool power_2_scale_ = false;
  float amax_epsilon_ = 0.0f;
};

// The quantizer a recipe prescribes for a tensor role. Delayed scaling needs the meta
// holding that tensor's scale (meta, index); other recipes ignore them.
Quantizer make_quantizer(const recipe::Recipe& recipe, TensorRole role, FP8Meta* meta = nullptr,
                         int index = 0);

// RAII scope turning FP8 on (or off) for the modules run inside it. Scopes nest; the
// innermost one decides. Thread-local.
class fp8_autocast {
 public:
  explicit fp8_autocast(bool enabled = true, recipe::Recipe fp8_recipe = recipe::DelayedScaling{});
  ~fp8_autocast();
  fp8_autocast(const fp8_autocast&) = delete;
  fp8_autocast& operator=(const fp8_autocast&) = delete;
};
bool fp8_enabled();
const recipe::Recipe& fp8_recipe();  // the innermost scope's recipe (DelayedScaling outside)
int fp8_autocast_depth();

}  // namespace octet
