// ViT end to end: one FP32 step (loss, logits, every parameter's gradient) against the same
// model in PyTorch 1.13 (float64, tests/reference/ops_vit.py) for grey and colour images, BF16
// and FP8 steps near FP32; the model cut into pipeline stages in one process equal to the
// whole; configs, data and the trainer (accuracy, resume bit for bit, clear errors).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <set>

#include "model_test_util.h"
#include "octet/data.h"
#include "octet/fp8.h"
#include "octet/model.h"
#include "octet/recipe.h"
#include "octet/train.h"
#include "octet/vit.h"
#include "train/batcher.h"
#include "train/model_family.h"

namespace octet {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::scaled_error;

// Small enough for seconds: 8x8 images in 4x4 patches (4 patches + the class token).
nlohmann::json tiny_config(int64_t channels = 1) {
  return {{"model", "vit"},  {"name", "vit-test"},   {"image_size", 8}, {"channels", channels},
          {"patch_size", 4}, {"num_classes", 5},     {"num_layers", 2}, {"hidden", 32},
          {"num_heads", 4},  {"layernorm_eps", 1e-5}};
}

Tensor random_pixels(int64_t batch, const ViTConfig& c, uint32_t seed, float scale = 1.0f) {
  return testing::random_tensor({batch, c.pixels()}, DType::F32, seed, 0.0f, scale);
}

Tensor random_labels(int64_t batch, int64_t classes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> label(0, static_cast<int32_t>(classes - 1));
  Tensor t = Tensor::empty({batch}, DType::I32);
  for (int64_t i = 0; i < batch; ++i) t.data<int32_t>()[i] = label(rng);
  return t;
}

// One FP32 step against PyTorch in float64. Measured: loss 1e-7, logits 1e-6, gradients
// below 2e-5 of each tensor's largest magnitude.
void check_against_torch(const nlohmann::json& config_json, float pixel_scale) {
  const ViTConfig config = ViTConfig::from_json(config_json);
  ViT model(config, 7);
  testing::perturb_vectors(model);
  const int64_t B = 6;
  const Tensor pixels = random_pixels(B, config, 3, pixel_scale);
  const Tensor labels = random_labels(B, config.num_classes, 4);
  const pipeline::MicroBatch batch = vit_micro_batch(pixels, labels);
  model.zero_grad();
  const float loss = model.train_step(batch, DType::F32, 1.0f);
  const Tensor logits = model.logits(pixels, DType::F32);
  const TensorMap torch = testing::torch_step("vit", config_json, model, batch);
  const float torch_loss = torch.at("loss").to_floats()[0];
  EXPECT_LE(scaled_error(logits, torch.at("logits")), 1e-5);
  const double worst = testing::expect_step_matches(loss, model.parameters(), torch, 1e-4);
  EXPECT_EQ(torch.size(), model.parameters().size() + 2);
  std::printf("[ measured ] pixels x%g: loss %.2e, logits %.2e, worst gradient %.2e\n", pixel_scale,
              std::fabs(loss - torch_loss) / torch_loss, scaled_error(logits, torch.at("logits")),
              worst);
}

TEST(ViT, Fp32StepMatchesTorch) {
  check_against_torch(tiny_config(), 1.0f);
}

// Three channels: the patch vector's (channel, row, column) order is a convolution's. Pixels
// of large and tiny magnitude go through the same LayerNorms.
TEST(ViT, ColourImagesAndExtremeMagnitudesMatchTorch) {
  check_against_torch(tiny_config(3), 1.0f);
  check_against_torch(tiny_config(), 1e3f);
  check_against_torch(tiny_config(), 1e-3f);
}

TEST(ViT, RmsnormSwigluMatchTorch) {
  nlohmann::json c = tiny_config();
  c["normalization"] = "rmsnorm";
  c["activation"] = "swiglu";
  c["ffn_hidden"] = 48;
  check_against_torch(c, 1.0f);
}

// BF16 and FP8 compute stay near FP32 (measured: BF16 loss 1e-3, gradients 1-3% RMS; FP8
// delayed scaling loss 1e-2, gradients within 15% RMS).
TEST(ViT, Bf16AndFp8StepsStayNearFp32) {
  const ViTConfig config = ViTConfig::from_json(tiny_config());
  ViT model(config, 7);
  testing::perturb_vectors(model);
  const auto batch = vit_micro_batch(random_pixels(8, config, 3), random_labels(8, 5, 4));
  const testing::PrecisionSteps s = testing::fp32_bf16_fp8_steps(model, batch);
  EXPECT_NEAR(s.bf16_loss, s.f32_loss, 0.01 * s.f32_loss);
  EXPECT_NEAR(s.fp8_loss, s.f32_loss, 0.05 * s.f32_loss);
  for (const auto& [name, grad] : s.f32) {
    SCOPED_TRACE(name);
    EXPECT_LE(testing::relative_rms(s.bf16.at(name), grad), 0.05);
    EXPECT_LE(testing::relative_rms(s.fp8.at(name), grad), 0.25);
  }
  EXPECT_FALSE(model.fp8_states().empty());
}

// Pipeline stages in one process: chunk 0 (patches, layer 0) then chunk 1 (layer 1, head)
// forward, backward in reverse: the whole model's loss and gradients, bit for bit.
TEST(ViT, TwoStagesInOneProcessEqualTheWholeModel) {
  const ViTConfig config = ViTConfig::from_json(tiny_config());
  testing::expect_two_stages_equal_the_whole<ViT>(
      config, vit_micro_batch(random_pixels(4, config, 3), random_labels(4, 5, 4)));
}

// Evaluation counts correct predictions; a constant model predicts one class.
TEST(ViT, EvaluationCountsCorrectPredictions) {
  const ViTConfig config = ViTConfig::from_json(tiny_config());
  ViT model(config, 7);
  const Tensor pixels = random_pixels(10, config, 3);
  const Tensor logits = model.logits(pixels, DType::F32);
  Tensor labels = Tensor::empty({10}, DType::I32);
  for (int64_t b = 0; b < 10; ++b) {
    const std::vector<float> row = logits.slice_rows(b, b + 1).to_floats();
    const int32_t best =
        static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    labels.data<int32_t>()[b] = b < 7 ? best : (best + 1) % 5;  // 7 right, 3 wrong
  }
  model.evaluate(vit_micro_batch(pixels, labels), DType::F32);
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{7, 10}));
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{0, 0}));  // taken
}

TEST(ViT, BadConfigsAndInputsAreClearErrors) {
  testing::expect_config_errors<ViTConfig>(tiny_config(),
                                           {{"patch_size", 3, "multiple of patch_size"},
                                            {"vocab_size", 10, "unknown key 'vocab_size'"},
                                            {"hidden", 30, "multiple of num_heads"},
                                            {"num_classes", 1, "num_classes"},
                                            {"image_size", 1e30, "expected an integer"}});
  // A ViT config is not a GPT's, and the reverse.
  EXPECT_NE(error_of([] { GPTConfig::from_json(tiny_config()); }).find("'model'"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              ViTConfig::from_json(nlohmann::json{{"model", "gpt"}});
            }).find("expected \"vit\""),
            std::string::npos);

  const ViTConfig config = ViTConfig::from_json(tiny_config());
  ViT model(config, 7);
  const Tensor labels = random_labels(2, 5, 1);
  EXPECT_NE(error_of([&] {
              model.train_step(vit_micro_batch(Tensor::zeros({2, 60}, DType::F32), labels),
                               DType::F32, 1.0f);
            }).find("pixels expected [B, 64]"),
            std::string::npos);
  Tensor bad = labels.clone();
  bad.data<int32_t>()[1] = 5;
  EXPECT_NE(error_of([&] {
              model.train_step(vit_micro_batch(random_pixels(2, config, 1), bad), DType::F32, 1.0f);
            }),
            "no error");
  EXPECT_NE(error_of([&] {
              model.train_step({{"pixels", random_pixels(2, config, 1)}}, DType::F32, 1.0f);
            }).find("labels"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The trainer on ViT configs: data, accuracy, resume, errors.

// Saved at iteration 3 and resumed to 6: the uninterrupted run's losses exactly (parameters,
// AdamW state, the data position), and the validation accuracy is reported.
TEST(ViT, TrainerResumesBitForBitAndReportsAccuracy) {
  testing::TrainerFixture fixture(tiny_config());
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    testing::expect_resume_bit_for_bit(fixture.options(precision),
                                       fixture.path("ckpt-" + precision));
  }
}

TEST(ViT, TrainerRefusesLanguageModelOptions) {
  testing::TrainerFixture fixture(tiny_config());
  TrainOptions o = fixture.options("bf16");
  o.seq_length = 10;
  EXPECT_THROW(train_gpt(o), Error);
  o = fixture.options("bf16");
  o.vocab_size = 100;
  EXPECT_THROW(train_gpt(o), Error);
  o = fixture.options("bf16");
  o.mock_data = false;
  o.train_data = fixture.path("missing");
  try {
    train_gpt(o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
}

// Fashion-MNIST through the image batcher: one training epoch shows every image once (6000
// per class), normalized to mean 0 and standard deviation 1; evaluation walks in order.
TEST(ViT, FashionMnistEpochVisitsEveryImageOnce) {
  if (!fs::exists(default_fashion_mnist_dir())) {
    GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
  }
  ImageDataset train = load_fashion_mnist(default_fashion_mnist_dir(), true);
  const std::vector<uint8_t> labels = train.labels;
  train_detail::ImageBatcher batcher(std::move(train), /*shuffle=*/true, 5, 1);
  std::vector<int64_t> per_class(10, 0);
  double sum = 0, squares = 0;
  const int64_t batch = 2000;
  for (int64_t k = 0; k < 60000 / batch; ++k) {
    const pipeline::MicroBatch b = batcher.batch(k, batch);
    for (int64_t i = 0; i < batch; ++i) ++per_class[b.at("labels").data<int32_t>()[i]];
    for (float p : b.at("pixels").to_floats()) {
      sum += p;
      squares += double(p) * p;
    }
  }
  for (int64_t c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], 6000) << "class " << c;
  const double n = 60000.0 * 784.0;
  EXPECT_NEAR(sum / n, 0.0, 1e-3);
  EXPECT_NEAR(squares / n, 1.0, 1e-3);
  // The next epoch is another order; evaluation is the file's order.
  const pipeline::MicroBatch e0 = batcher.batch(0, 64), e1 = batcher.batch(60000 / 64, 64);
  EXPECT_NE(e0.at("labels").to_floats(), e1.at("labels").to_floats());
  train_detail::ImageBatcher in_order(load_fashion_mnist(default_fashion_mnist_dir(), true),
                                      /*shuffle=*/false, 5, 2);
  const pipeline::MicroBatch first = in_order.batch(0, 64);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(first.at("labels").data<int32_t>()[i], labels[static_cast<size_t>(i)]);
  }
  // Augmented: each image is the plain one flipped or not and shifted by at most 2 pixels
  // (zero pixels filling the gap), and the 50 transforms are all drawn.
  train_detail::ImageBatcher augmented(load_fashion_mnist(default_fashion_mnist_dir(), true),
                                       /*shuffle=*/false, 5, 2, /*augment=*/true);
  const pipeline::MicroBatch changed = augmented.batch(0, 64);
  const Tensor plain = first.at("pixels"), moved = changed.at("pixels");
  const float zero = plain.data<float>()[0];  // the top-left pixel of image 0 is black
  std::set<int64_t> transforms;
  for (int64_t i = 0; i < 64; ++i) {
    const float* a = plain.data<float>() + i * 784;
    const float* b = moved.data<float>() + i * 784;
    int64_t found = -1;
    for (int64_t t = 0; t < 50 && found < 0; ++t) {
      const bool flip = t >= 25;
      const int64_t dy = (t % 25) / 5 - 2, dx = t % 5 - 2;
      bool same = true;
      for (int64_t r = 0; r < 28 && same; ++r) {
        for (int64_t c = 0; c < 28 && same; ++c) {
          const int64_t sr = r + dy, sc0 = c + dx, sc = flip ? 27 - sc0 : sc0;
          const bool inside = sr >= 0 && sr < 28 && sc0 >= 0 && sc0 < 28;
          same = b[r * 28 + c] == (inside ? a[sr * 28 + sc] : zero);
        }
      }
      if (same) found = t;
    }
    EXPECT_GE(found, 0) << "image " << i << " is no flip + shift of the plain one";
    transforms.insert(found);
  }
  EXPECT_GE(transforms.size(), 20u);  // 64 draws from 50 transforms
}

// The test split is normalized with the training split's statistics (as training saw its
// images), not its own: pixel values equal (p / 255 - train mean) / train std.
TEST(ViT, ValidationImagesUseTheTrainingStatistics) {
  if (!fs::exists(default_fashion_mnist_dir())) {
    GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
  }
  const ImageDataset train = load_fashion_mnist(default_fashion_mnist_dir(), true);
  ImageDataset test = load_fashion_mnist(default_fashion_mnist_dir(), false);
  const auto stats = train_detail::ImageBatcher::pixel_stats(train);
  const auto own = train_detail::ImageBatcher::pixel_stats(test);
  EXPECT_NEAR(stats.mean, 0.286, 1e-3);
  EXPECT_NEAR(stats.std, 0.353, 1e-3);
  EXPECT_GT(std::abs(own.mean - stats.mean), 1e-4);  // the splits differ
  const std::vector<uint8_t> raw(test.pixels.begin(), test.pixels.begin() + 784);
  train_detail::ImageBatcher batcher(std::move(test), false, 5, 2, false, stats);
  const Tensor pixels = batcher.batch(0, 1).at("pixels");
  for (int64_t i = 0; i < 784; ++i) {
    const double expected = (raw[static_cast<size_t>(i)] / 255.0 - stats.mean) / stats.std;
    EXPECT_NEAR(pixels.data<float>()[i], expected, 1e-5) << "pixel " << i;
  }
  // Through the trainer's family: --valid-data is normalized with --train-data's statistics.
  TrainOptions o;
  o.config_path = std::string(OCTET_SOURCE_DIR) + "/configs/vit-tiny.json";
  o.train_data = o.valid_data = default_fashion_mnist_dir();
  const auto family = train_detail::ModelFamily::from_options(o);
  const Tensor valid = family->open_data(o, false, 0)->batch(0, 1).at("pixels");
  for (int64_t i = 0; i < 784; ++i) {
    EXPECT_FLOAT_EQ(valid.data<float>()[i], pixels.data<float>()[i]) << "pixel " << i;
  }
}

}  // namespace
}  // namespace octet
