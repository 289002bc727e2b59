// CLIP end to end: one FP32 step (loss, both towers' unit features, every parameter's
// gradient) against the same model in PyTorch 1.13 (float64, tests/reference/ops_clip.py),
// with pixels and embeddings of large and tiny magnitude and a clamped temperature; BF16 and
// every FP8 recipe near FP32; padding after a caption changes nothing; zero-shot counting;
// configs and inputs that are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "model_test_util.h"
#include "octet/clip.h"
#include "octet/fp8.h"
#include "octet/recipe.h"
#include "octet/train.h"

namespace octet {
namespace {

using testing::error_of;
using testing::scaled_error;

// Small enough for seconds: 8x8 images in 4x4 patches; captions of up to 8 tokens.
nlohmann::json tiny_config() {
  return {{"model", "clip"},    {"name", "clip-test"}, {"image_size", 8},   {"patch_size", 4},
          {"vision_layers", 2}, {"vision_hidden", 32}, {"vision_heads", 4}, {"vocab_size", 20},
          {"max_text_len", 8},  {"text_layers", 2},    {"text_hidden", 24}, {"text_heads", 2},
          {"embed_dim", 16},    {"num_classes", 3}};
}

Tensor random_pixels(int64_t batch, const CLIPConfig& c, uint32_t seed, float scale = 1.0f) {
  return testing::random_tensor({batch, c.pixels()}, DType::F32, seed, 0.0f, scale);
}

// Captions: [SOS]=1, words in [3, vocab), [EOS]=2 at length - 1, then padding (0, or `pad`).
struct Captions {
  Tensor ids, lengths;
};
Captions random_captions(int64_t n, const CLIPConfig& c, uint32_t seed, int32_t pad = 0) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> word(3, static_cast<int32_t>(c.vocab_size - 1));
  std::uniform_int_distribution<int32_t> length(3, static_cast<int32_t>(c.max_text_len));
  Captions out{Tensor::empty({n, c.max_text_len}, DType::I32), Tensor::empty({n}, DType::I32)};
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = length(rng);
    out.lengths.data<int32_t>()[i] = l;
    for (int64_t t = 0; t < c.max_text_len; ++t) {
      int32_t id = t == 0 ? 1 : t == l - 1 ? 2 : t < l ? word(rng) : pad;
      out.ids.data<int32_t>()[i * c.max_text_len + t] = id;
    }
  }
  return out;
}

pipeline::MicroBatch random_batch(int64_t batch, const CLIPConfig& c, uint32_t seed,
                                  float pixel_scale = 1.0f) {
  const Captions text = random_captions(batch, c, seed + 1);
  const Captions prompts = random_captions(c.num_classes * 2, c, seed + 2);
  Tensor labels = Tensor::empty({batch}, DType::I32);
  for (int64_t b = 0; b < batch; ++b) labels.data<int32_t>()[b] = int32_t(b % c.num_classes);
  return clip_micro_batch(random_pixels(batch, c, seed, pixel_scale), labels, text.ids,
                          text.lengths, prompts.ids, prompts.lengths);
}

// One FP32 step against PyTorch in float64.
void check_against_torch(const nlohmann::json& config_json, float pixel_scale,
                         float embedding_scale = 1.0f) {
  const CLIPConfig config = CLIPConfig::from_json(config_json);
  CLIP model(config, 7);
  testing::perturb_vectors(model, embedding_scale, [](const Parameter& p) {
    return p.name.find("embedding") != std::string::npos;
  });
  const pipeline::MicroBatch batch = random_batch(6, config, 3, pixel_scale);
  model.zero_grad();
  const float loss = model.train_step(batch, DType::F32, 1.0f);
  const Tensor image = model.image_features(batch.at("pixels"), DType::F32);
  const Tensor text =
      model.text_features(batch.at("text_ids"), batch.at("text_lengths"), DType::F32);
  const TensorMap torch = testing::torch_step("clip", config_json, model,
                                              {{"pixels", batch.at("pixels")},
                                               {"text_ids", batch.at("text_ids")},
                                               {"text_lengths", batch.at("text_lengths")}});
  const double image_error = scaled_error(image, torch.at("image_features"));
  const double text_error = scaled_error(text, torch.at("text_features"));
  EXPECT_LE(image_error, 1e-5);
  EXPECT_LE(text_error, 1e-5);
  const double worst = testing::expect_step_matches(loss, model.parameters(), torch, 1e-4);
  EXPECT_EQ(torch.size(), model.parameters().size() + 3);
  const float torch_loss = torch.at("loss").to_floats()[0];
  std::printf(
      "[ measured ] pixels x%g, embeddings x%g: loss %.2e, features %.2e / %.2e, worst "
      "gradient %.2e\n",
      pixel_scale, embedding_scale, std::fabs(loss - torch_loss) / torch_loss, image_error,
      text_error, worst);
}

TEST(Clip, Fp32StepMatchesTorch) {
  check_against_torch(tiny_config(), 1.0f);
}

// Pixels and embeddings of large and tiny magnitude go through the same LayerNorms.
TEST(Clip, ExtremeMagnitudesMatchTorch) {
  check_against_torch(tiny_config(), 1e3f);
  check_against_torch(tiny_config(), 1e-3f);
  check_against_torch(tiny_config(), 1.0f, 1e3f);
  check_against_torch(tiny_config(), 1.0f, 1e-3f);
}

// exp(logit_scale) above 100 is clamped: no gradient reaches logit_scale, as in PyTorch.
TEST(Clip, ClampedTemperatureMatchesTorch) {
  nlohmann::json c = tiny_config();
  c["logit_scale_init"] = 5.0;
  check_against_torch(c, 1.0f);
  CLIP model(CLIPConfig::from_json(c), 7);
  model.zero_grad();
  model.train_step(random_batch(4, model.config(), 5), DType::F32, 1.0f);
  EXPECT_EQ(model.logit_scale.grad.to_floats()[0], 0.0f);
}

// BF16 and every FP8 recipe stay near FP32 (init_std 0.2: features that differ between samples,
// so that the contrastive gradients are not all cancellation). Measured: BF16 loss 2e-3,
// gradients within 2.3% RMS; FP8 (delayed after one step of history, current, MXFP8, blocks)
// loss within 1.2%, gradients within 30% RMS: E4M3's steps of 1/16 on unit features whose
// cosines are scaled by 14.3.
TEST(Clip, Bf16AndFp8StepsStayNearFp32) {
  nlohmann::json c = tiny_config();
  c["init_std"] = 0.2;
  const CLIPConfig config = CLIPConfig::from_json(c);
  CLIP model(config, 7);
  testing::perturb_vectors(model);
  const pipeline::MicroBatch batch = random_batch(8, config, 3);
  testing::expect_bf16_and_fp8_near_fp32(model, batch, 0.05, 0.03, 0.45);
}

// The [EOS] row sees only its caption (causal attention): whatever the padding holds, the
// loss and every gradient are the same bits.
TEST(Clip, PaddingChangesNothing) {
  const CLIPConfig config = CLIPConfig::from_json(tiny_config());
  CLIP model(config, 7);
  testing::perturb_vectors(model);
  // The same captions (seed 4: the same words and lengths), padded with 0 and with 7.
  const Captions zero = random_captions(6, config, 4), seven = random_captions(6, config, 4, 7);
  ASSERT_NE(zero.ids.to_floats(), seven.ids.to_floats());
  pipeline::MicroBatch a = random_batch(6, config, 3), b = a;
  a["text_ids"] = zero.ids;
  b["text_ids"] = seven.ids;
  a["text_lengths"] = b["text_lengths"] = zero.lengths;
  testing::expect_same_step(model, a, b);
}

// Pipeline stages in one process (testing::expect_stages_equal_the_whole: the image, caption
// and class-prompt streams packed across each boundary), zero-shot counts included: 2 vision + 2
// text layers over 2 stages (one tower each) and over 4 (one layer each).
TEST(Clip, PipelineStagesInOneProcessEqualTheWholeModel) {
  const CLIPConfig config = CLIPConfig::from_json(tiny_config());
  for (int stages : {2, 4}) {
    testing::expect_stages_equal_the_whole<CLIP>(
        config, random_batch(6, config, 3), stages, "",
        [](CLIP& whole) { testing::perturb_vectors(whole); });
  }
}

// A frozen image encoder (LLaVA-style, --freeze vision_model.) runs no backward: the text
// tower's and the projections' gradients as before, the encoder's untouched.
TEST(Clip, FrozenImageEncoderSkipsItsBackward) {
  const CLIPConfig config = CLIPConfig::from_json(tiny_config());
  CLIP model(config, 7);
  testing::perturb_vectors(model);
  testing::expect_frozen_part_skipped(model, random_batch(6, config, 3), "vision_model.");
}

// Evaluation classifies each image by the nearest class (mean of its prompts' features), the
// same answer as the features give, and counts it.
TEST(Clip, ZeroShotCountsTheNearestClass) {
  const CLIPConfig config = CLIPConfig::from_json(tiny_config());
  CLIP model(config, 7);
  testing::perturb_vectors(model);
  pipeline::MicroBatch batch = random_batch(12, config, 3);
  const std::vector<int64_t> predicted = model.zero_shot(batch.at("pixels"), batch.at("class_ids"),
                                                         batch.at("class_lengths"), DType::F32);
  // By hand: unit image features against each class's two prompts' mean.
  const Tensor image = model.image_features(batch.at("pixels"), DType::F32);
  const Tensor prompts =
      model.text_features(batch.at("class_ids"), batch.at("class_lengths"), DType::F32);
  const int64_t D = config.embed_dim;
  Tensor labels = Tensor::empty({12}, DType::I32);
  for (int64_t b = 0; b < 12; ++b) {
    double best = -1e300;
    int64_t best_class = -1;
    for (int64_t k = 0; k < config.num_classes; ++k) {
      double dot = 0, norm = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double mean = 0.5 * (prompts.data<float>()[(2 * k) * D + d] +
                                   prompts.data<float>()[(2 * k + 1) * D + d]);
        dot += image.data<float>()[b * D + d] * mean;
        norm += mean * mean;
      }
      if (dot / std::sqrt(norm) > best) best = dot / std::sqrt(norm), best_class = k;
    }
    EXPECT_EQ(predicted[static_cast<size_t>(b)], best_class) << b;
    // 8 right, 4 wrong.
    labels.data<int32_t>()[b] = int32_t(b < 8 ? best_class : (best_class + 1) % 3);
  }
  batch["labels"] = labels;
  model.evaluate(batch, DType::F32);
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{8, 12}));
}

TEST(Clip, BadConfigsAndInputsAreClearErrors) {
  testing::expect_config_errors<CLIPConfig>(tiny_config(),
                                            {{"patch_size", 3, "multiple of patch_size"},
                                             {"hidden", 30, "unknown key 'hidden'"},
                                             {"vision_hidden", 30, "multiple of vision_heads"},
                                             {"text_hidden", 25, "multiple of text_heads"},
                                             {"vocab_size", 2, "vocab_size expected at least 3"},
                                             {"logit_scale_init", 20.0, "logit_scale_init"},
                                             {"embed_dim", 0, "embed_dim expected in [1"}});
  const CLIPConfig config = CLIPConfig::from_json(tiny_config());
  CLIP model(config, 7);
  const pipeline::MicroBatch good = random_batch(4, config, 3);
  auto step_error = [&](const std::string& key, const Tensor& value) {
    pipeline::MicroBatch bad = good;
    bad[key] = value;
    return error_of([&] { model.train_step(bad, DType::F32, 1.0f); });
  };
  EXPECT_NE(
      step_error("pixels", Tensor::zeros({4, 60}, DType::F32)).find("pixels expected [B, 64]"),
      std::string::npos);
  Tensor ids = good.at("text_ids").clone();
  ids.data<int32_t>()[3] = 20;
  EXPECT_NE(step_error("text_ids", ids).find("token id 20 expected in [0, vocab_size = 20)"),
            std::string::npos);
  Tensor lengths = good.at("text_lengths").clone();
  lengths.data<int32_t>()[1] = 0;
  EXPECT_NE(step_error("text_lengths", lengths).find("text length 0 of sequence 1"),
            std::string::npos);
  EXPECT_NE(step_error("text_ids", Tensor::zeros({3, 8}, DType::I32)).find("one caption per image"),
            std::string::npos);
  pipeline::MicroBatch bad = good;
  bad["class_ids"] = Tensor::zeros({4, 8}, DType::I32);
  bad["class_lengths"] = Tensor::zeros({4}, DType::I32);
  EXPECT_NE(error_of([&] { model.evaluate(bad, DType::F32); }).find("num_classes = 3"),
            std::string::npos);
  // 2 + 2 layers do not cut into 3 equal stages: refused before any work.
  ModelLayout three_stages;
  three_stages.stages = 3;
  EXPECT_NE(
      error_of([&] { CLIP(config, 7, three_stages); }).find("multiple of the pipeline stages"),
      std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The trainer on CLIP configs: captions of the ten Fashion-MNIST classes (mock images here).

nlohmann::json trainer_config() {
  nlohmann::json c = tiny_config();
  c["vocab_size"] = 128;
  c["max_text_len"] = 16;
  c["num_classes"] = 10;
  return c;
}

// Saved at iteration 3 and resumed to 6: the uninterrupted run's losses exactly, and the
// zero-shot accuracy is reported.
TEST(Clip, TrainerResumesBitForBitAndReportsZeroShotAccuracy) {
  testing::TrainerFixture fixture(trainer_config());
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    testing::expect_resume_bit_for_bit(fixture.options(precision),
                                       fixture.path("ckpt-" + precision));
  }
}

// --freeze: the vision tower and its projection keep their initial weights bit for bit, the
// optimizer holds no state for them, the text tower trains; the run resumes from its
// checkpoint; prefixes that name nothing, and ZeRO-1, are clear errors.
TEST(Clip, FrozenTowerKeepsItsWeightsAndHasNoOptimizerState) {
  testing::TrainerFixture fixture(trainer_config());
  TrainOptions o = fixture.options("fp32");
  o.freeze = {"vision_model.", "visual_projection"};
  o.train_iters = 3;
  o.save = fixture.path("ckpt");
  train_gpt(o);
  const Checkpoint checkpoint = load_checkpoint(o.save);
  CLIP fresh(CLIPConfig::from_json(trainer_config()), o.seed);
  int64_t frozen = 0, moved = 0;
  for (const auto& [name, initial] : fresh.state_dict()) {
    SCOPED_TRACE(name);
    const bool is_frozen =
        name.rfind("vision_model.", 0) == 0 || name == "visual_projection.weight";
    const bool same = checkpoint.model.at(name).to_floats() == initial.to_floats();
    if (is_frozen) {
      EXPECT_TRUE(same);
      EXPECT_EQ(checkpoint.optimizer.count(name + ".exp_avg"), 0u);
      ++frozen;
    } else {
      EXPECT_EQ(checkpoint.optimizer.count(name + ".exp_avg"), 1u);
      moved += !same;
    }
  }
  EXPECT_GT(frozen, 10);
  EXPECT_GT(moved, 10);
  TrainOptions resumed = o;
  resumed.load = o.save;
  resumed.save.clear();
  resumed.train_iters = 5;
  EXPECT_EQ(train_gpt(resumed).losses.size(), 2u);
  TrainOptions bad = o;
  bad.save.clear();
  bad.freeze = {"vision_tower."};
  EXPECT_NE(error_of([&] { train_gpt(bad); }).find("--freeze 'vision_tower.' names no parameter"),
            std::string::npos);
}

// The same under ZeRO-1 (the distributed optimizer, here over one data-parallel rank): frozen
// parameters stay out of the gradient buckets and the optimizer's shards, and the run takes the
// same steps as AdamW's.
TEST(Clip, FrozenTowerUnderTheDistributedOptimizer) {
  testing::TrainerFixture fixture(trainer_config());
  TrainOptions o = fixture.options("fp32");
  o.freeze = {"vision_model.", "visual_projection"};
  o.train_iters = 3;
  const std::vector<float> plain = train_gpt(o).losses;
  o.use_distributed_optimizer = true;
  o.save = fixture.path("ckpt");
  const std::vector<float> sharded = train_gpt(o).losses;
  ASSERT_EQ(sharded.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(sharded[i], plain[i], 1e-5f) << i;
  const Checkpoint checkpoint = load_checkpoint(o.save);
  CLIP fresh(CLIPConfig::from_json(trainer_config()), o.seed);
  int64_t frozen = 0;
  for (const auto& [name, initial] : fresh.state_dict()) {
    if (name.rfind("vision_model.", 0) != 0) continue;
    SCOPED_TRACE(name);
    EXPECT_EQ(checkpoint.model.at(name).to_floats(), initial.to_floats());
    EXPECT_EQ(checkpoint.optimizer.count(name + ".exp_avg"), 0u);
    ++frozen;
  }
  EXPECT_GT(frozen, 10);
}

}  // namespace
}  // namespace octet
