// BERT: one FP32 step (both losses, the MLM and NSP logits, every gradient) against the same
// model in PyTorch 1.13 (float64, tests/reference/ops_bert.py), post-LN and pre-LN, with
// padding and embeddings of large and tiny magnitude; BF16 and FP8 steps near FP32; pipeline
// stages in one process equal to the whole model; padding that changes nothing; masked-token
// accuracy; Hugging Face names; clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "model_test_util.h"
#include "octet/bert.h"
#include "octet/fp4.h"
#include "octet/fp8.h"
#include "octet/recipe.h"
#include "octet/train.h"

namespace octet {
namespace {

using testing::error_of;
using testing::scaled_error;
using testing::step_gradients;

// Small enough for seconds: 40 ids (36 text + 4 special), 16 positions.
nlohmann::json tiny_config(bool post_layernorm = true) {
  return {{"model", "bert"},      {"name", "bert-test"}, {"vocab_size", 40},
          {"max_seq_len", 16},    {"num_layers", 2},     {"hidden", 32},
          {"num_heads", 4},       {"ffn_hidden", 48},    {"post_layernorm", post_layernorm},
          {"layernorm_eps", 1e-5}};
}

// B sequences of T tokens: [CLS], text ids, a [SEP] in the middle and at the end of each
// sequence's length, padding after; ~20% of the text positions masked (at least one).
pipeline::MicroBatch random_batch(const BertConfig& c, int64_t B, int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> text(0, static_cast<int32_t>(c.text_vocab() - 1));
  std::uniform_int_distribution<int32_t> length(5, static_cast<int32_t>(T));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Tensor ids = Tensor::empty({B, T}, DType::I32), types = Tensor::empty({B, T}, DType::I32);
  Tensor lengths = Tensor::empty({B}, DType::I32), targets = Tensor::empty({B, T}, DType::I32);
  Tensor nsp = Tensor::empty({B}, DType::I32);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t L = b == 0 ? static_cast<int32_t>(T) : length(rng);  // one unpadded
    const int32_t split = L / 2;
    lengths.data<int32_t>()[b] = L;
    nsp.data<int32_t>()[b] = static_cast<int32_t>(rng() % 2);
    bool masked = false;
    for (int64_t t = 0; t < T; ++t) {
      int32_t& id = ids.data<int32_t>()[b * T + t];
      int32_t& target = targets.data<int32_t>()[b * T + t];
      types.data<int32_t>()[b * T + t] = t > split && t < L ? 1 : 0;
      target = -100;
      if (t >= L) {
        id = static_cast<int32_t>(c.pad_id());
      } else if (t == 0) {
        id = static_cast<int32_t>(c.cls_id());
      } else if (t == split || t == L - 1) {
        id = static_cast<int32_t>(c.sep_id());
      } else {
        id = text(rng);
        if (u(rng) < 0.2f || (!masked && t == L - 2)) {
          target = id;
          id = u(rng) < 0.8f ? static_cast<int32_t>(c.mask_id()) : text(rng);
          masked = true;
        }
      }
    }
  }
  return bert_micro_batch(ids, types, lengths, targets, nsp);
}

// Norm weights and biases moved (testing::perturb_vectors); the embedding tables scaled by
// `embedding_scale`.
void perturb(Bert& model, float embedding_scale = 1.0f) {
  testing::perturb_vectors(model, embedding_scale, [](const Parameter& p) {
    return p.name.find("bert.embeddings.") == 0 && p.value.ndim() == 2;
  });
}

// One FP32 step against PyTorch in float64.
void check_against_torch(const nlohmann::json& config_json, float embedding_scale) {
  const BertConfig config = BertConfig::from_json(config_json);
  Bert model(config, 7);
  perturb(model, embedding_scale);
  const auto batch = random_batch(config, 5, 16, 3);
  model.zero_grad();
  const float loss = model.train_step(batch, DType::F32, 1.0f);
  const auto [mlm, nsp] = model.last_losses();
  const TensorMap torch = testing::torch_step("bert", config_json, model, batch);
  const float torch_loss = torch.at("loss").to_floats()[0];
  EXPECT_NEAR(mlm, torch.at("mlm_loss").to_floats()[0], 1e-5 * std::fabs(torch_loss));
  EXPECT_NEAR(nsp, torch.at("nsp_loss").to_floats()[0], 1e-5 * std::fabs(torch_loss));
  const double worst = testing::expect_step_matches(loss, model.parameters(), torch, 1e-4);
  std::printf("[ measured ] %s, embeddings x%g: loss %.2e, worst gradient %.2e\n",
              config.post_layernorm ? "post-LN" : "pre-LN", embedding_scale,
              std::fabs(loss - torch_loss) / torch_loss, worst);
}

TEST(Bert, PostLnFp32StepMatchesTorch) {
  check_against_torch(tiny_config(true), 1.0f);
}

TEST(Bert, PreLnFp32StepMatchesTorch) {
  check_against_torch(tiny_config(false), 1.0f);
}

// Embedding tables of large and tiny magnitude through the embedding LayerNorm (post-LN) and
// the first layer's norms (pre-LN).
TEST(Bert, ExtremeEmbeddingMagnitudesMatchTorch) {
  check_against_torch(tiny_config(true), 1e3f);
  check_against_torch(tiny_config(true), 1e-3f);
  check_against_torch(tiny_config(false), 1e3f);
}

// Padding tokens change nothing: other ids or token types after each sequence's length give
// the same loss and the same gradients (the padding mask hides them from every query).
TEST(Bert, PaddingChangesNothing) {
  const BertConfig config = BertConfig::from_json(tiny_config());
  Bert model(config, 7);
  perturb(model);
  pipeline::MicroBatch batch = random_batch(config, 4, 16, 5);
  float loss = 0, other_loss = 0;
  const TensorMap expected = step_gradients(model, batch, DType::F32, &loss);
  pipeline::MicroBatch other = batch;
  other["ids"] = batch.at("ids").clone();
  const int32_t* lengths = batch.at("lengths").data<int32_t>();
  int64_t changed = 0;
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t t = lengths[b]; t < 16; ++t, ++changed) {
      other["ids"].data<int32_t>()[b * 16 + t] = static_cast<int32_t>((b + t) % 30);
    }
  }
  ASSERT_GT(changed, 0);
  const TensorMap grads = step_gradients(model, other, DType::F32, &other_loss);
  EXPECT_EQ(loss, other_loss);
  for (const auto& [name, grad] : expected) {
    if (name == "bert.embeddings.word_embeddings.weight") continue;  // other rows looked up
    SCOPED_TRACE(name);
    EXPECT_LE(scaled_error(grads.at(name), grad), 1e-6);
  }
}

// BF16 and FP8 compute stay near FP32.
TEST(Bert, Bf16AndFp8StepsStayNearFp32) {
  const BertConfig config = BertConfig::from_json(tiny_config());
  Bert model(config, 7);
  perturb(model);
  const auto batch = random_batch(config, 8, 16, 3);
  const testing::PrecisionSteps s = testing::fp32_bf16_fp8_steps(model, batch);
  EXPECT_NEAR(s.bf16_loss, s.f32_loss, 0.01 * s.f32_loss);
  EXPECT_NEAR(s.fp8_loss, s.f32_loss, 0.05 * s.f32_loss);
  double worst_bf16 = 0, worst_fp8 = 0;
  std::string worst_bf16_name, worst_fp8_name;
  for (const auto& [name, grad] : s.f32) {
    SCOPED_TRACE(name);
    const double b = testing::relative_rms(s.bf16.at(name), grad);
    const double f = testing::relative_rms(s.fp8.at(name), grad);
    if (b > worst_bf16) worst_bf16 = b, worst_bf16_name = name;
    if (f > worst_fp8) worst_fp8 = f, worst_fp8_name = name;
    EXPECT_LE(b, 0.1);
    EXPECT_LE(f, 0.25);
  }
  std::printf(
      "[ measured ] loss f32 %.5f bf16 %.5f fp8 %.5f; worst gradient RMS bf16 %.3f (%s) "
      "fp8 %.3f (%s)\n",
      s.f32_loss, s.bf16_loss, s.fp8_loss, worst_bf16, worst_bf16_name.c_str(), worst_fp8,
      worst_fp8_name.c_str());
  EXPECT_FALSE(model.fp8_states().empty());
}

// Every FP8 recipe (delayed, current, MXFP8 1x32, DeepSeek-style blocks 1x128 / 128x128) and
// NVFP4 on a BERT whose GEMMs fit their blocks (hidden 128, FFN 256): the loss near FP32's, every
// gradient finite and near. The heads and embeddings stay in BF16 (outside the autocast).
TEST(Bert, EveryLowPrecisionRecipeStaysNearFp32) {
  nlohmann::json json = tiny_config();
  json["hidden"] = 128;
  json["ffn_hidden"] = 256;
  const BertConfig config = BertConfig::from_json(json);
  Bert model(config, 7);
  perturb(model);
  const auto batch = random_batch(config, 8, 16, 3);
  float f32_loss = 0;
  const TensorMap f32 = step_gradients(model, batch, DType::F32, &f32_loss);
  auto check = [&](const std::string& name, const TensorMap& grads, float loss, double tolerance) {
    testing::expect_near_fp32(name, grads, loss, f32, f32_loss, 0.05, tolerance);
  };
  for (const auto& [name, r] : testing::fp8_recipes()) {
    float loss = 0;
    const TensorMap grads = testing::fp8_step_gradients(model, batch, r, &loss);
    check(name, grads, loss, 0.3);
  }
  float loss = 0;
  TensorMap grads;
  {
    fp4_autocast scope(true);
    grads = step_gradients(model, batch, DType::BF16, &loss);
  }
  check("nvfp4", grads, loss, 0.6);
}

// Pipeline stages in one process: chunk 0 (embeddings, layer 0) then chunk 1 (layer 1, heads)
// forward, backward in reverse: the whole model's loss and gradients, bit for bit (the word
// embedding's two halves summed, as the executor's tied-parameter reduction does).
TEST(Bert, TwoStagesInOneProcessEqualTheWholeModel) {
  for (bool post : {true, false}) {
    SCOPED_TRACE(post ? "post-LN" : "pre-LN");
    const BertConfig config = BertConfig::from_json(tiny_config(post));
    testing::expect_two_stages_equal_the_whole<Bert>(config, random_batch(config, 4, 16, 3));
  }
}

// Evaluation counts masked tokens whose argmax is the target (the reference's logits decide).
TEST(Bert, EvaluationCountsMaskedTokenAccuracy) {
  const nlohmann::json json = tiny_config();
  const BertConfig config = BertConfig::from_json(json);
  Bert model(config, 7);
  perturb(model);
  pipeline::MicroBatch batch = random_batch(config, 6, 16, 9);
  const TensorMap torch = testing::torch_step("bert", json, model, batch);
  const Tensor logits = torch.at("mlm_logits");
  const int64_t M = logits.dim(0), V = logits.dim(1);
  batch["targets"] = batch.at("targets").clone();
  int32_t* targets = batch["targets"].data<int32_t>();
  int64_t row = 0, right = 0;
  for (int64_t i = 0; i < batch.at("targets").numel(); ++i) {
    if (targets[i] == -100) continue;
    const std::vector<float> l = logits.slice_rows(row, row + 1).to_floats();
    const int32_t best = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    targets[i] = row % 3 == 0 ? (best + 1) % static_cast<int32_t>(V) : best;
    right += row % 3 != 0;
    ++row;
  }
  ASSERT_EQ(row, M);
  model.evaluate(batch, DType::F32);
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{right, M}));
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{0, 0}));  // taken
}

// Hugging Face's names: query / key / value split from the fused projection and back, the
// tied decoder accepted and dropped, unknown names refused.
TEST(Bert, HuggingFaceNamesRoundTrip) {
  for (bool post : {true, false}) {
    SCOPED_TRACE(post ? "post-LN" : "pre-LN");
    const BertConfig config = BertConfig::from_json(tiny_config(post));
    Bert model(config, 7);
    perturb(model);
    const TensorMap ours = model.state_dict();
    TensorMap theirs = model.to_checkpoint_names(ours);
    const std::string layer = "bert.encoder.layer.1.";
    for (const char* name :
         {"attention.self.query.weight", "attention.self.key.bias", "attention.output.dense.weight",
          "intermediate.dense.weight", "output.dense.bias"}) {
      EXPECT_TRUE(theirs.count(layer + name)) << name;
    }
    EXPECT_EQ(theirs.at(layer + "attention.self.value.weight").shape(), (Shape{32, 32}));
    EXPECT_TRUE(theirs.count(post ? layer + "output.LayerNorm.weight" : layer + "ln.weight"));
    EXPECT_TRUE(theirs.count(post ? "bert.embeddings.LayerNorm.bias" : "bert.encoder.ln.bias"));
    EXPECT_TRUE(theirs.count("cls.predictions.transform.dense.weight"));
    EXPECT_EQ(theirs.size(), ours.size() + 2 * 2 * config.num_layers);  // 1 fused -> 3, twice
    theirs["cls.predictions.decoder.weight"] = ours.at("bert.embeddings.word_embeddings.weight");
    testing::expect_same_tensors(model.from_checkpoint_names(theirs), ours);
    theirs["bert.encoder.layer.0.attention.self.extra"] = Tensor::zeros({2}, DType::F32);
    EXPECT_THROW(model.from_checkpoint_names(theirs), Error);
  }
}

TEST(Bert, BadConfigsAndInputsAreClearErrors) {
  testing::expect_config_errors<BertConfig>(tiny_config(),
                                            {{"vocab_size", 4, "four special tokens"},
                                             {"hidden", 30, "multiple of num_heads"},
                                             {"activation", "swiglu", "activation"},
                                             {"patch_size", 4, "unknown key 'patch_size'"}});
  EXPECT_NE(error_of([] { GPTConfig::from_json(tiny_config()); }).find("'model'"),
            std::string::npos);

  const BertConfig config = BertConfig::from_json(tiny_config());
  Bert model(config, 7);
  const auto good = random_batch(config, 2, 16, 3);
  auto step_error = [&](const std::string& key, int64_t index, int32_t value) {
    pipeline::MicroBatch b = good;
    b[key] = good.at(key).clone();
    b[key].data<int32_t>()[index] = value;
    return error_of([&] { model.train_step(b, DType::F32, 1.0f); });
  };
  EXPECT_NE(step_error("ids", 3, 40).find("ids[0,3] = 40 expected in [0, 40)"), std::string::npos);
  EXPECT_NE(step_error("token_types", 1, 2).find("token_types[0,1]"), std::string::npos);
  EXPECT_NE(step_error("lengths", 1, 17).find("lengths[1] = 17"), std::string::npos);
  EXPECT_NE(step_error("lengths", 0, 0).find("lengths[0] = 0"), std::string::npos);
  EXPECT_NE(step_error("targets", 2, 99).find("target 99"), std::string::npos);
  pipeline::MicroBatch none = good;
  none["targets"] = Tensor::empty({2, 16}, DType::I32);
  for (int64_t i = 0; i < 32; ++i) none["targets"].data<int32_t>()[i] = -100;
  EXPECT_NE(error_of([&] { model.train_step(none, DType::F32, 1.0f); }).find("no masked token"),
            std::string::npos);
  pipeline::MicroBatch missing = good;
  missing.erase("nsp_labels");
  EXPECT_NE(error_of([&] { model.train_step(missing, DType::F32, 1.0f); }).find("nsp_labels"),
            std::string::npos);
  Tensor long_ids = Tensor::zeros({1, 17}, DType::I32);
  EXPECT_NE(error_of([&] {
              model.train_step(bert_micro_batch(long_ids, long_ids, Tensor::zeros({1}, DType::I32),
                                                long_ids, Tensor::zeros({1}, DType::I32)),
                               DType::F32, 1.0f);
            }).find("exceeds max_seq_len"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The trainer on BERT configs: resume, masked-token accuracy, errors.

// Saved at iteration 3 and resumed to 6: the uninterrupted run's losses exactly (parameters,
// AdamW state, the data position), and the masked-token accuracy is reported.
TEST(Bert, TrainerResumesBitForBitAndReportsAccuracy) {
  testing::TrainerFixture fixture(tiny_config());
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    testing::expect_resume_bit_for_bit(fixture.options(precision),
                                       fixture.path("ckpt-" + precision));
  }
}

TEST(Bert, TrainerRefusesWrongOptions) {
  testing::TrainerFixture fixture(tiny_config());
  TrainOptions o = fixture.options("bf16");
  o.seq_length = 17;  // the config's max_seq_len is 16
  EXPECT_NE(error_of([&] { train_gpt(o); }).find("--seq-length 17 expected in [5, 16]"),
            std::string::npos);
  o = fixture.options("bf16");
  o.seq_length = 4;
  EXPECT_NE(error_of([&] { train_gpt(o); }).find("[CLS] A [SEP] B [SEP]"), std::string::npos);
  o = fixture.options("bf16");
  o.image_augment = true;
  EXPECT_NE(error_of([&] { train_gpt(o); }).find("is a BERT"), std::string::npos);
  o = fixture.options("bf16");
  o.vocab_size = 4;
  EXPECT_NE(error_of([&] { train_gpt(o); }).find("at least 5"), std::string::npos);
}

}  // namespace
}  // namespace octet
