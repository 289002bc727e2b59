// Helpers the model tests (ViT, BERT, T5) and their data tests share: error measures against a
// reference, a step's gradients by name, perturbed parameters, low-precision steps against
// FP32, pipeline stages against the whole model, the trainer's fixture and resume check, and
// synthetic token shards.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "octet/data.h"
#include "octet/error.h"
#include "octet/fp8.h"
#include "octet/recipe.h"
#include "octet/train.h"
#include "octet/trainable_model.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet::testing {

// Largest |a - b| as a fraction of the reference b's largest magnitude.
inline double scaled_error(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  if (x.size() != y.size()) return 1e9;
  double error = 0, scale = 1e-30;
  for (size_t i = 0; i < x.size(); ++i) {
    error = std::max(error, std::fabs(double(x[i]) - y[i]));
    scale = std::max(scale, std::fabs(double(y[i])));
  }
  return error / scale;
}

// A config that `key` = `value` makes invalid, and what its error says.
struct ConfigCase {
  std::string key;
  nlohmann::json value;
  std::string message;
};

// Each case, applied to `base` alone, makes Config::from_json fail with its message.
template <class Config>
void expect_config_errors(const nlohmann::json& base, const std::vector<ConfigCase>& cases) {
  for (const ConfigCase& c : cases) {
    nlohmann::json json = base;
    json[c.key] = c.value;
    const std::string error = error_of([&] { Config::from_json(json); });
    EXPECT_NE(error.find(c.message), std::string::npos)
        << c.key << " = " << c.value.dump() << ": " << error;
  }
}

// The same names, and each tensor's values bit for bit (e.g. a checkpoint-name round trip).
inline void expect_same_tensors(const TensorMap& actual, const TensorMap& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(actual.count(name));
    EXPECT_EQ(actual.at(name).to_floats(), tensor.to_floats());
  }
}

// The gradients of one step (zeroed first), by name; the step's loss in *loss.
template <class Model>
TensorMap step_gradients(Model& model, const pipeline::MicroBatch& batch, DType dtype,
                         float* loss) {
  model.zero_grad();
  *loss = model.train_step(batch, dtype, 1.0f);
  TensorMap grads;
  for (Parameter* p : model.parameters()) grads[p->name] = p->grad.clone();
  return grads;
}

// The same, with FP8 GEMMs under `r`.
template <class Model>
TensorMap fp8_step_gradients(Model& model, const pipeline::MicroBatch& batch,
                             const recipe::Recipe& r, float* loss) {
  fp8_autocast scope(true, r);
  return step_gradients(model, batch, DType::BF16, loss);
}

// Every FP8 recipe by name: delayed, current, MXFP8 1x32, DeepSeek-style blocks.
inline std::vector<std::pair<std::string, recipe::Recipe>> fp8_recipes() {
  return {{"delayed", recipe::DelayedScaling{}},
          {"current", recipe::Float8CurrentScaling{}},
          {"mxfp8", recipe::MXFP8BlockScaling{}},
          {"block", recipe::Float8BlockScaling{}}};
}

// Norm weights start at 1 and biases at 0: every 1-D parameter moved by Normal(0, 0.1) noise
// (seed 11), so that their gradients and their effect on the forward are both exercised; then
// the parameters that `scaled` picks multiplied by `scale`.
template <class Model>
void perturb_vectors(Model& model, float scale = 1.0f,
                     const std::function<bool(const Parameter&)>& scaled = nullptr) {
  std::mt19937 rng(11);
  std::normal_distribution<float> noise(0.0f, 0.1f);
  for (Parameter* p : model.parameters()) {
    if (p->value.ndim() != 1) continue;
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += noise(rng);
  }
  if (scaled) {
    for (Parameter* p : model.parameters()) {
      if (!scaled(*p)) continue;
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] *= scale;
    }
  }
  model.on_parameters_updated();
}

// One step of the same model in PyTorch (tests/reference/ops_<op>.py): the model's parameters
// and the batch in, the reference's loss, logits and gradients out.
template <class Model>
TensorMap torch_step(const std::string& op, const nlohmann::json& config, Model& model,
                     const pipeline::MicroBatch& batch) {
  TensorMap inputs = model.state_dict();
  for (const auto& [name, tensor] : batch) inputs[name] = tensor;
  const nlohmann::json args = {{"config", config}};
  return run_torch(op, inputs, args.dump());
}

// A step's loss within 1e-5 of the reference's "loss" (relative), and every parameter's
// gradient within `tolerance` of its "<name>.grad" by scaled_error; returns the worst
// gradient's error.
inline double expect_step_matches(float loss, const std::vector<Parameter*>& parameters,
                                  const TensorMap& reference, double tolerance) {
  const float reference_loss = reference.at("loss").to_floats()[0];
  EXPECT_NEAR(loss, reference_loss, 1e-5 * std::fabs(reference_loss));
  double worst = 0;
  for (Parameter* p : parameters) {
    SCOPED_TRACE(p->name);
    const auto it = reference.find(p->name + ".grad");
    EXPECT_TRUE(it != reference.end()) << "no reference gradient";
    if (it == reference.end()) continue;
    const double error = scaled_error(p->grad, it->second);
    worst = std::max(worst, error);
    EXPECT_LE(error, tolerance);
  }
  return worst;
}

// A low-precision step against FP32's: the loss within `loss_tolerance` (relative), every
// gradient finite and within `tolerance` relative RMS. Prints the worst gradient (and, when
// `verbose`, each one).
inline void expect_near_fp32(const std::string& name, const TensorMap& grads, float loss,
                             const TensorMap& f32, float f32_loss, double loss_tolerance,
                             double tolerance, bool verbose = false) {
  SCOPED_TRACE(name);
  EXPECT_NEAR(loss, f32_loss, loss_tolerance * f32_loss);
  double worst = 0;
  for (const auto& [param, grad] : f32) {
    SCOPED_TRACE(param);
    for (float g : grads.at(param).to_floats()) ASSERT_TRUE(std::isfinite(g));
    const double error = relative_rms(grads.at(param), grad);
    worst = std::max(worst, error);
    EXPECT_LE(error, tolerance);
    if (verbose) std::printf("  %s %s %.3f\n", name.c_str(), param.c_str(), error);
  }
  std::printf("[ measured ] %s: loss %.5f (fp32 %.5f), worst gradient RMS %.3f\n", name.c_str(),
              loss, f32_loss, worst);
}

// BF16 (loss within 1%, gradients within `bf16_tolerance` relative RMS) and every FP8 recipe
// (delayed scaling after one step of amax history; loss within `fp8_loss_tolerance`, gradients
// within `fp8_tolerance`) near the same step in FP32.
template <class Model>
void expect_bf16_and_fp8_near_fp32(Model& model, const pipeline::MicroBatch& batch,
                                   double bf16_tolerance, double fp8_loss_tolerance,
                                   double fp8_tolerance) {
  float f32_loss = 0, bf16_loss = 0;
  const TensorMap f32 = step_gradients(model, batch, DType::F32, &f32_loss);
  const TensorMap bf16 = step_gradients(model, batch, DType::BF16, &bf16_loss);
  expect_near_fp32("bf16", bf16, bf16_loss, f32, f32_loss, 0.01, bf16_tolerance);
  for (const auto& [name, r] : fp8_recipes()) {
    float loss = 0;
    if (name == "delayed") fp8_step_gradients(model, batch, r, &loss);
    const TensorMap fp8 = fp8_step_gradients(model, batch, r, &loss);
    expect_near_fp32("fp8 " + name, fp8, loss, f32, f32_loss, fp8_loss_tolerance, fp8_tolerance);
  }
  EXPECT_FALSE(model.fp8_states().empty());
}

// Two batches that must train alike (e.g. differing only in padding): the same loss and every
// gradient, bit for bit.
template <class Model>
void expect_same_step(Model& model, const pipeline::MicroBatch& a, const pipeline::MicroBatch& b) {
  float a_loss = 0, b_loss = 0;
  const TensorMap a_grads = step_gradients(model, a, DType::F32, &a_loss);
  const TensorMap b_grads = step_gradients(model, b, DType::F32, &b_loss);
  EXPECT_EQ(a_loss, b_loss);
  for (const auto& [name, grad] : a_grads) {
    EXPECT_EQ(grad.to_floats(), b_grads.at(name).to_floats()) << name;
  }
}

// The parameters whose names start with `prefix` frozen (requires_grad false, as --freeze sets):
// the same loss and every other gradient bit for bit, and theirs untouched (their backward
// skipped).
template <class Model>
void expect_frozen_part_skipped(Model& model, const pipeline::MicroBatch& batch,
                                const std::string& prefix) {
  float loss = 0, frozen_loss = 0;
  const TensorMap all = step_gradients(model, batch, DType::F32, &loss);
  int64_t frozen = 0;
  for (Parameter* p : model.parameters()) {
    p->requires_grad = p->name.rfind(prefix, 0) != 0;
    frozen += !p->requires_grad;
  }
  EXPECT_GT(frozen, 0) << prefix;
  const TensorMap some = step_gradients(model, batch, DType::F32, &frozen_loss);
  EXPECT_EQ(frozen_loss, loss);
  for (Parameter* p : model.parameters()) {
    SCOPED_TRACE(p->name);
    const std::vector<float> grad = some.at(p->name).to_floats();
    if (p->requires_grad) {
      EXPECT_EQ(grad, all.at(p->name).to_floats());
    } else {
      EXPECT_EQ(grad, std::vector<float>(grad.size(), 0.0f));
    }
    p->requires_grad = true;
  }
}

// One batch's losses and gradients in FP32, BF16 and FP8 (current scaling, BF16 around it).
struct PrecisionSteps {
  float f32_loss = 0, bf16_loss = 0, fp8_loss = 0;
  TensorMap f32, bf16, fp8;
};

template <class Model>
PrecisionSteps fp32_bf16_fp8_steps(Model& model, const pipeline::MicroBatch& batch) {
  PrecisionSteps s;
  s.f32 = step_gradients(model, batch, DType::F32, &s.f32_loss);
  s.bf16 = step_gradients(model, batch, DType::BF16, &s.bf16_loss);
  s.fp8 = fp8_step_gradients(model, batch, recipe::Float8CurrentScaling{}, &s.fp8_loss);
  return s;
}

// Pipeline stages in one process, one model holding every stage as a chunk (both built with
// seed 7, `prepare` applied to the whole one, its state loaded into the cut one): each stage's
// forward in order with its boundary handed on, the backwards in reverse, give the whole
// model's loss and every gradient bit for bit - except parameters whose names contain `summed`
// (tied copies, to which each stage adds its own sum: within float32 rounding of the tensor's
// largest entry); evaluation through the stages gives the same loss; the cut model refuses
// train_step, which needs the whole model.
template <class Model, class Config>
void expect_stages_equal_the_whole(const Config& config, const pipeline::MicroBatch& batch,
                                   int stages, const std::string& summed = "",
                                   const std::function<void(Model&)>& prepare = nullptr) {
  SCOPED_TRACE(std::to_string(stages) + " stages");
  Model whole(config, 7);
  if (prepare) prepare(whole);
  ModelLayout layout;
  layout.stages = stages;
  layout.stage_of_chunk.clear();
  for (int s = 0; s < stages; ++s) layout.stage_of_chunk.push_back(s);
  Model staged(config, 7, layout);
  EXPECT_EQ(whole.state_dict().size(), staged.state_dict().size());
  staged.load_state_dict(whole.state_dict());
  float loss = 0;
  const TensorMap expected = step_gradients(whole, batch, DType::F32, &loss);
  staged.zero_grad();
  std::vector<std::unique_ptr<pipeline::StagedModel::Context>> contexts;
  Tensor boundary;
  for (int s = 0; s < stages; ++s) {
    contexts.push_back(staged.make_context());
    boundary = staged.forward(s, boundary, batch, DType::F32, 1.0f, *contexts.back());
    if (s + 1 < stages) {
      EXPECT_EQ(boundary.shape(), staged.boundary_shape(batch, s + 1));
    }
  }
  EXPECT_EQ(contexts.back()->loss, loss);
  Tensor dboundary;
  for (int s = stages; s-- > 0;) {
    dboundary = staged.backward(s, dboundary, *contexts[static_cast<size_t>(s)]);
  }
  EXPECT_FALSE(dboundary.defined());
  EXPECT_EQ(staged.parameters().size(), whole.parameters().size());
  for (Parameter* p : staged.parameters()) {
    SCOPED_TRACE(p->name);
    const std::vector<float> want = expected.at(p->name).to_floats(), got = p->grad.to_floats();
    if (summed.empty() || p->name.find(summed) == std::string::npos) {
      EXPECT_EQ(got, want);
      continue;
    }
    float largest = 0;
    for (float w : want) largest = std::max(largest, std::abs(w));
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5f * largest);
  }
  boundary = Tensor();
  float eval_loss = 0;
  for (int s = 0; s < stages; ++s) {
    boundary = staged.evaluate(s, boundary, batch, DType::F32, &eval_loss);
  }
  EXPECT_EQ(eval_loss, whole.evaluate(batch, DType::F32));
  const std::pair<int64_t, int64_t> counts = whole.take_eval_counts();
  EXPECT_GT(counts.second, 0);  // what evaluation counted (predictions, classes): the same
  EXPECT_EQ(staged.take_eval_counts(), counts);
  EXPECT_THROW(staged.train_step(batch, DType::F32, 1.0f), Error);
}

// Chunk 0 then chunk 1 (BERT, ViT): the same.
template <class Model, class Config>
void expect_two_stages_equal_the_whole(const Config& config, const pipeline::MicroBatch& batch) {
  expect_stages_equal_the_whole<Model>(config, batch, 2);
}

// The trainer on a model config: a temporary directory holding the config, and options for
// short runs on mock data.
class TrainerFixture {
 public:
  explicit TrainerFixture(const nlohmann::json& config) : dir_(temp_dir()) {
    std::ofstream(config_path()) << config.dump(2) << "\n";
  }
  ~TrainerFixture() { std::filesystem::remove_all(dir_); }
  TrainerFixture(const TrainerFixture&) = delete;
  TrainerFixture& operator=(const TrainerFixture&) = delete;

  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string config_path() const { return path("config.json"); }
  TrainOptions options(const std::string& precision) const {
    TrainOptions o;
    o.config_path = config_path();
    o.mock_data = true;
    o.micro_batch_size = 4;
    o.global_batch_size = 8;
    o.precision = precision;
    o.lr = 3e-3f;
    o.min_lr = 3e-4f;
    o.eval_iters = 2;
    o.eval_interval = 0;
    o.peak_gflops = 1000;
    o.quiet = true;
    return o;
  }

 private:
  std::string dir_;
};

// Saved at iteration 3 (into `save_dir`) and resumed to 6: the uninterrupted run's losses
// exactly (parameters, AdamW state, the data position), and the validation accuracy reported,
// in [0, 1]. The warmup spans every iteration: the learning rate changes at each one.
inline void expect_resume_bit_for_bit(TrainOptions o, const std::string& save_dir) {
  o.lr_warmup_iters = 100;
  o.train_iters = 6;
  const TrainResult whole = train_gpt(o);
  ASSERT_EQ(whole.losses.size(), 6u);
  EXPECT_TRUE(std::isfinite(whole.last_val_accuracy));
  EXPECT_GE(whole.last_val_accuracy, 0.0f);
  EXPECT_LE(whole.last_val_accuracy, 1.0f);
  TrainOptions first = o;
  first.train_iters = 3;
  first.save = save_dir;
  train_gpt(first);
  TrainOptions second = o;
  second.load = save_dir;
  const TrainResult tail = train_gpt(second);
  ASSERT_EQ(tail.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(tail.losses[i], whole.losses[3 + i]) << i;
}

// A temporary directory of token shards holding ids i % text_vocab, so that a window's ids
// count up by one (mod text_vocab): a continuation, or a window put back together, is
// recognizable.
class TokenShardDir {
 public:
  explicit TokenShardDir(int64_t text_vocab) : dir_(temp_dir()), text_vocab_(text_vocab) {}
  ~TokenShardDir() { std::filesystem::remove_all(dir_); }
  TokenShardDir(const TokenShardDir&) = delete;
  TokenShardDir& operator=(const TokenShardDir&) = delete;

  // A shard of `tokens` ids whose header declares the vocabulary `vocab`; returns its path.
  std::string write(const std::string& name, int64_t tokens, int64_t vocab) const {
    std::vector<int32_t> ids(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) ids[static_cast<size_t>(i)] = int32_t(i % text_vocab_);
    const std::string path = dir_ + "/" + name;
    write_token_shard(path, ids, static_cast<int32_t>(vocab));
    return path;
  }
  // The same, declaring the text vocabulary.
  std::string write(const std::string& name, int64_t tokens) const {
    return write(name, tokens, text_vocab_);
  }

 private:
  std::string dir_;
  int64_t text_vocab_;
};

// Opening a shard that is not there (`open` given its path): an error that says so and names
// the path.
inline void expect_missing_shard_error(const TokenShardDir& dir,
                                       const std::function<void(const std::string&)>& open) {
  const std::string path = dir.write("x", 1) + ".missing";
  const std::string missing = error_of([&] { open(path); });
  EXPECT_NE(missing.find("cannot open"), std::string::npos) << missing;
  EXPECT_NE(missing.find("x.missing"), std::string::npos) << missing;
}

// The mean wall time of `call(i)` for i = 0 .. repeats - 1, in milliseconds.
inline double ms_per_call(int repeats, const std::function<void(int)>& call) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) call(i);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         repeats;
}

// Whether the I32 tensors `names` of two micro-batches are equal (shapes and values).
inline bool same_i32(const pipeline::MicroBatch& x, const pipeline::MicroBatch& y,
                     const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    const Tensor &a = x.at(name), &b = y.at(name);
    if (a.shape() != b.shape()) return false;
    for (int64_t i = 0; i < a.numel(); ++i) {
      if (a.data<int32_t>()[i] != b.data<int32_t>()[i]) return false;
    }
  }
  return true;
}

// Batch 7 of 8 again, and from a batcher built alike, is the same; batch 8, and batch 7 with
// another seed or stream, are not (by the I32 tensors `names`).
template <class Batcher>
void expect_batches_deterministic(const Batcher& batcher, const Batcher& again,
                                  const Batcher& other_seed, const Batcher& other_stream,
                                  const std::vector<std::string>& names) {
  const pipeline::MicroBatch first = batcher.batch(7, 8);
  EXPECT_TRUE(same_i32(first, batcher.batch(7, 8), names));
  EXPECT_TRUE(same_i32(first, again.batch(7, 8), names));
  EXPECT_FALSE(same_i32(first, batcher.batch(8, 8), names));
  EXPECT_FALSE(same_i32(first, other_seed.batch(7, 8), names));
  EXPECT_FALSE(same_i32(first, other_stream.batch(7, 8), names));
}

}  // namespace octet::testing
