// The image captioner end to end: one FP32 step (loss, caption logits' effect, every parameter's
// gradient) against the same model in PyTorch 1.13 (float64, tests/reference/ops_captioner.py),
// with pixels and embeddings of large and tiny magnitude; BF16 and every FP8 recipe near FP32;
// padding after a caption changes nothing; greedy decoding writes back captions the model has
// learned, and evaluation counts the caption tokens it predicts; the trainer resumes bit for
// bit; a CLIP's vision tower loads into it (--pretrained-checkpoint) and stays frozen; configs
// and inputs that are clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "model_test_util.h"
#include "octet/captioner.h"
#include "octet/clip.h"
#include "octet/train.h"

namespace octet {
namespace {

using testing::error_of;

// Small enough for seconds: 8x8 images in 4x4 patches (5 prefix tokens); captions of up to 8.
nlohmann::json tiny_config() {
  return {{"model", "captioner"}, {"name", "captioner-test"}, {"image_size", 8},
          {"patch_size", 4},      {"vision_layers", 2},       {"vision_hidden", 32},
          {"vision_heads", 4},    {"vocab_size", 20},         {"max_text_len", 8},
          {"text_layers", 2},     {"text_hidden", 24},        {"text_heads", 2}};
}

// Captions: [SOS]=1, words in [3, vocab), [EOS]=2 at length - 1, then padding (0, or `pad`).
struct Captions {
  Tensor ids, lengths;
};
Captions random_captions(int64_t n, const CaptionerConfig& c, uint32_t seed, int32_t pad = 0) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> word(3, static_cast<int32_t>(c.vocab_size - 1));
  std::uniform_int_distribution<int32_t> length(2, static_cast<int32_t>(c.max_text_len));
  Captions out{Tensor::empty({n, c.max_text_len}, DType::I32), Tensor::empty({n}, DType::I32)};
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = length(rng);
    out.lengths.data<int32_t>()[i] = l;
    for (int64_t t = 0; t < c.max_text_len; ++t) {
      const int32_t id = t == 0 ? 1 : t == l - 1 ? 2 : t < l ? word(rng) : pad;
      out.ids.data<int32_t>()[i * c.max_text_len + t] = id;
    }
  }
  return out;
}

pipeline::MicroBatch random_batch(int64_t batch, const CaptionerConfig& c, uint32_t seed,
                                  float pixel_scale = 1.0f) {
  const Captions text = random_captions(batch, c, seed + 1);
  Tensor labels = Tensor::zeros({batch}, DType::I32);
  return {
      {"pixels", testing::random_tensor({batch, c.pixels()}, DType::F32, seed, 0.0f, pixel_scale)},
      {"labels", labels},
      {"text_ids", text.ids},
      {"text_lengths", text.lengths}};
}

// One FP32 step against PyTorch in float64.
void check_against_torch(float pixel_scale, float embedding_scale = 1.0f) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  ImageCaptioner model(config, 7);
  testing::perturb_vectors(model, embedding_scale, [](const Parameter& p) {
    return p.name.find("embed") != std::string::npos;
  });
  const pipeline::MicroBatch batch = random_batch(5, config, 3, pixel_scale);
  model.zero_grad();
  const float loss = model.train_step(batch, DType::F32, 1.0f);
  const TensorMap torch = testing::torch_step("captioner", tiny_config(), model,
                                              {{"pixels", batch.at("pixels")},
                                               {"text_ids", batch.at("text_ids")},
                                               {"text_lengths", batch.at("text_lengths")}});
  const double worst = testing::expect_step_matches(loss, model.parameters(), torch, 1e-4);
  EXPECT_EQ(torch.size(), model.parameters().size() + 2);
  const float torch_loss = torch.at("loss").to_floats()[0];
  std::printf("[ measured ] pixels x%g, embeddings x%g: loss %.2e, worst gradient %.2e\n",
              pixel_scale, embedding_scale, std::fabs(loss - torch_loss) / torch_loss, worst);
}

TEST(Captioner, Fp32StepMatchesTorch) {
  check_against_torch(1.0f);
}

// Pixels and embeddings of large and tiny magnitude go through the same LayerNorms.
TEST(Captioner, ExtremeMagnitudesMatchTorch) {
  check_against_torch(1e3f);
  check_against_torch(1e-3f);
  check_against_torch(1.0f, 1e3f);
  check_against_torch(1.0f, 1e-3f);
}

// BF16 and every FP8 recipe stay near FP32: the encoder's and decoder's layers quantized, the
// patch GEMM, projector and output layer in the step's dtype.
TEST(Captioner, Bf16AndFp8StepsStayNearFp32) {
  nlohmann::json c = tiny_config();
  c["init_std"] = 0.2;
  const CaptionerConfig config = CaptionerConfig::from_json(c);
  ImageCaptioner model(config, 7);
  testing::perturb_vectors(model);
  const pipeline::MicroBatch batch = random_batch(8, config, 3);
  testing::expect_bf16_and_fp8_near_fp32(model, batch, 0.05, 0.05, 0.45);
}

// Rows after a caption's [EOS] are neither attended to by the caption (causal) nor targets:
// whatever the padding holds, the loss and every gradient are the same bits.
TEST(Captioner, PaddingChangesNothing) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  ImageCaptioner model(config, 7);
  testing::perturb_vectors(model);
  const Captions zero = random_captions(6, config, 4), seven = random_captions(6, config, 4, 7);
  ASSERT_NE(zero.ids.to_floats(), seven.ids.to_floats());
  pipeline::MicroBatch a = random_batch(6, config, 3), b = a;
  a["text_ids"] = zero.ids;
  b["text_ids"] = seven.ids;
  a["text_lengths"] = b["text_lengths"] = zero.lengths;
  testing::expect_same_step(model, a, b);
}

// LLaVA's first stage: the vision encoder frozen (--freeze vision_model.) runs no backward; the
// projector's and the decoder's gradients as before.
TEST(Captioner, FrozenVisionEncoderSkipsItsBackward) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  ImageCaptioner model(config, 7);
  testing::perturb_vectors(model);
  testing::expect_frozen_part_skipped(model, random_batch(6, config, 3), "vision_model.");
}

// Three images, three captions of different lengths: after training on them alone, greedy
// decoding writes each image's own caption (so it reads the image: the captions start alike),
// and evaluation counts every caption token right.
TEST(Captioner, GreedyDecodingWritesLearnedCaptions) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  ImageCaptioner model(config, 7);
  const std::vector<std::vector<int32_t>> captions = {
      {1, 5, 9, 7, 2}, {1, 5, 9, 11, 4, 6, 2}, {1, 5, 13, 2}};
  const auto n = static_cast<int64_t>(captions.size());
  pipeline::MicroBatch batch = random_batch(n, config, 3);
  Tensor ids = Tensor::zeros({n, config.max_text_len}, DType::I32);
  Tensor lengths = Tensor::empty({n}, DType::I32);
  int64_t targets = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& caption = captions[static_cast<size_t>(i)];
    lengths.data<int32_t>()[i] = static_cast<int32_t>(caption.size());
    targets += static_cast<int64_t>(caption.size()) - 1;
    for (size_t t = 0; t < caption.size(); ++t) {
      ids.data<int32_t>()[i * config.max_text_len + static_cast<int64_t>(t)] = caption[t];
    }
  }
  batch["text_ids"] = ids;
  batch["text_lengths"] = lengths;
  AdamW adam(model.parameters(), AdamWOptions{0.9f, 0.95f, 1e-8f, 0.0f, 1.0f});
  float loss = 0;
  for (int step = 0; step < 60; ++step) {
    model.zero_grad();
    loss = model.train_step(batch, DType::F32, 1.0f);
    adam.step(1e-2f);
    model.on_parameters_updated();
  }
  EXPECT_LT(loss, 0.05f);
  EXPECT_EQ(model.generate(batch.at("pixels"), DType::F32), captions);
  model.evaluate(batch, DType::F32);
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{targets, targets}));
  // A caption never runs past max_text_len tokens.
  for (const auto& caption : model.generate(batch.at("pixels"), DType::BF16)) {
    EXPECT_LE(static_cast<int64_t>(caption.size()), config.max_text_len);
    EXPECT_EQ(caption.front(), 1);
  }
}

TEST(Captioner, BadConfigsAndInputsAreClearErrors) {
  testing::expect_config_errors<CaptionerConfig>(
      tiny_config(), {{"patch_size", 3, "multiple of patch_size"},
                      {"embed_dim", 16, "unknown key 'embed_dim'"},
                      {"vision_hidden", 30, "multiple of vision_heads"},
                      {"text_hidden", 25, "multiple of text_heads"},
                      {"eos_id", 20, "eos_id expected in [0, vocab_size = 20)"},
                      {"sos_id", 2, "sos_id and eos_id expected different"},
                      {"max_text_len", 1, "max_text_len expected at least 2"}});
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  ImageCaptioner model(config, 7);
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
  ids = good.at("text_ids").clone();
  ids.data<int32_t>()[8] = 3;
  EXPECT_NE(step_error("text_ids", ids).find("caption 1 expected to start with [SOS] (1), got 3"),
            std::string::npos);
  Tensor lengths = good.at("text_lengths").clone();
  lengths.data<int32_t>()[1] = 1;
  EXPECT_NE(step_error("text_lengths", lengths).find("text length 1 of caption 1"),
            std::string::npos);
  EXPECT_NE(step_error("text_ids", Tensor::zeros({3, 8}, DType::I32)).find("one caption per image"),
            std::string::npos);
  EXPECT_NE(step_error("text_ids", Tensor::zeros({4, 9}, DType::I32)).find("max_text_len = 8"),
            std::string::npos);
}

// Stages in one process, chunk by chunk (two: the bridge is the last stage; four: the bridge is
// stage 2, and the token embedding serves it and the output layer of stage 3): the whole
// model's loss, gradients and evaluation exactly. The boundaries' shapes differ: image tokens
// before the bridge, prefix and caption tokens after it.
TEST(Captioner, PipelineStagesInOneProcessEqualTheWholeModel) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  const pipeline::MicroBatch batch = random_batch(5, config, 3);
  for (int stages : {2, 4}) {
    testing::expect_stages_equal_the_whole<ImageCaptioner>(
        config, batch, stages, "", [](ImageCaptioner& whole) { testing::perturb_vectors(whole); });
  }
  ModelLayout four;
  four.stages = 4;
  four.stage_of_chunk = {0, 1, 2, 3};
  const ImageCaptioner staged(config, 7, four);
  EXPECT_EQ(staged.boundary_shape(batch, 1), (Shape{5, 5, 32}));
  EXPECT_EQ(staged.boundary_shape(batch, 2), (Shape{5, 5, 32}));
  EXPECT_EQ(staged.boundary_shape(batch, 3), (Shape{5, 5 + 8, 24}));
}

// Each stage holds its part: the image embedding on the first, the projector and the caption
// embedding on the bridge, the final norm on the last; the token embedding is tied between the
// bridge and the last stage where they differ.
TEST(Captioner, EachStageHoldsItsPartAndTiesTheTokenEmbedding) {
  const CaptionerConfig config = CaptionerConfig::from_json(tiny_config());
  auto names = [&](int stages, int stage) {
    ModelLayout layout;
    layout.stages = stages;
    layout.stage_of_chunk = {stage};
    ImageCaptioner part(config, 7, layout);
    std::vector<std::string> out;
    for (const auto& [name, tensor] : part.state_dict()) out.push_back(name);
    return std::make_pair(out, part.tied_parameters());
  };
  auto holds = [](const std::vector<std::string>& held, const std::string& prefix) {
    return std::any_of(held.begin(), held.end(),
                       [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
  };
  const auto [first, first_ties] = names(4, 0);
  EXPECT_TRUE(holds(first, "vision_model.embeddings."));
  EXPECT_FALSE(holds(first, "multi_modal_projector."));
  EXPECT_FALSE(holds(first, "language_model.embed_tokens"));
  ASSERT_EQ(first_ties.size(), 1u);
  EXPECT_EQ(first_ties[0].stages, (std::vector<int>{2, 3}));
  EXPECT_TRUE(first_ties[0].parameters.empty());
  const auto [bridge, bridge_ties] = names(4, 2);
  EXPECT_TRUE(holds(bridge, "vision_model.post_layernorm"));
  EXPECT_TRUE(holds(bridge, "multi_modal_projector.linear_1"));
  EXPECT_TRUE(holds(bridge, "language_model.embed_positions"));
  EXPECT_FALSE(holds(bridge, "language_model.norm"));
  ASSERT_EQ(bridge_ties.size(), 1u);
  EXPECT_EQ(bridge_ties[0].parameters.size(), 1u);
  const auto [last, last_ties] = names(4, 3);
  EXPECT_TRUE(holds(last, "language_model.embed_tokens"));
  EXPECT_TRUE(holds(last, "language_model.norm"));
  EXPECT_FALSE(holds(last, "multi_modal_projector."));
  EXPECT_TRUE(names(2, 1).second.empty());  // the bridge is the last stage: nothing tied
}

// ---------------------------------------------------------------------------------------------
// The trainer on captioner configs: captions of the ten Fashion-MNIST classes (mock images).

nlohmann::json trainer_config() {
  nlohmann::json c = tiny_config();
  c["vocab_size"] = 128;
  c["max_text_len"] = 16;
  return c;
}

// Saved at iteration 3 and resumed to 6: the uninterrupted run's losses exactly, and the
// caption token accuracy is reported.
TEST(Captioner, TrainerResumesBitForBitAndReportsTokenAccuracy) {
  testing::TrainerFixture fixture(trainer_config());
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    testing::expect_resume_bit_for_bit(fixture.options(precision),
                                       fixture.path("ckpt-" + precision));
  }
}

// LLaVA's recipe: a CLIP trained first, its vision tower loaded into the captioner
// (--pretrained-checkpoint, by name) and frozen (--freeze vision_model.) while the projector and
// the decoder train. Tensors that do not match in shape, and a checkpoint sharing no name, are
// clear errors.
TEST(Captioner, LoadsAndFreezesAClipVisionTower) {
  nlohmann::json clip_config = trainer_config();
  clip_config["model"] = "clip";
  clip_config["name"] = "clip-test";
  clip_config["embed_dim"] = 16;
  testing::TrainerFixture clip_fixture(clip_config);
  TrainOptions clip = clip_fixture.options("fp32");
  clip.train_iters = 2;
  clip.save = clip_fixture.path("clip");
  train_gpt(clip);
  const TensorMap clip_weights = load_checkpoint(clip.save).model;

  testing::TrainerFixture fixture(trainer_config());
  TrainOptions o = fixture.options("fp32");
  o.train_iters = 3;
  o.pretrained_checkpoint = clip.save;
  o.freeze = {"vision_model."};
  o.save = fixture.path("captioner");
  train_gpt(o);
  const Checkpoint trained = load_checkpoint(o.save);
  ImageCaptioner fresh(CaptionerConfig::from_json(trainer_config()), o.seed);
  int64_t loaded = 0, moved = 0;
  for (const auto& [name, initial] : fresh.state_dict()) {
    SCOPED_TRACE(name);
    const std::vector<float> now = trained.model.at(name).to_floats();
    if (name.rfind("vision_model.", 0) == 0) {
      ASSERT_EQ(clip_weights.count(name), 1u);
      EXPECT_EQ(now, clip_weights.at(name).to_floats());
      EXPECT_NE(now, initial.to_floats());  // CLIP's, not the captioner's initialization
      EXPECT_EQ(trained.optimizer.count(name + ".exp_avg"), 0u);
      ++loaded;
    } else {
      moved += now != initial.to_floats();
    }
  }
  EXPECT_GT(loaded, 10);
  EXPECT_GT(moved, 5);

  TrainOptions bad = o;
  bad.save.clear();
  nlohmann::json wider = clip_config;
  wider["vision_hidden"] = 64;
  testing::TrainerFixture wide_fixture(wider);
  TrainOptions wide = wide_fixture.options("fp32");
  wide.train_iters = 1;
  wide.save = wide_fixture.path("clip");
  train_gpt(wide);
  bad.pretrained_checkpoint = wide.save;
  EXPECT_NE(error_of([&] { train_gpt(bad); })
                .find("tensor 'vision_model.embeddings.class_embedding' is [1,64] f32; this "
                      "model's is [1,32] f32"),
            std::string::npos);
  bad.pretrained_checkpoint = fixture.path("nothing-shared");
  save_checkpoint(
      fixture.path("nothing-shared"),
      Checkpoint{{{"other.weight", Tensor::zeros({2}, DType::F32)}}, {}, {{"iteration", 0}}, {}});
  EXPECT_NE(error_of([&] { train_gpt(bad); }).find("no tensor of its has a name of this model's"),
            std::string::npos);
}

}  // namespace
}  // namespace octet
