// T5: one FP32 step (loss, logits, every gradient) against the same model in PyTorch 1.13
// (float64, tests/reference/ops_t5.py) with padded inputs and targets; embeddings of large and
// tiny magnitude; BF16 and every FP8 recipe near FP32; padding that changes nothing; target
// accuracy; Hugging Face names; clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "octet/fp8.h"
#include "octet/recipe.h"
#include "octet/t5.h"
#include "octet/train.h"

namespace octet {
namespace {

using testing::error_of;
using testing::scaled_error;
using testing::step_gradients;

// Small enough for seconds: 48 ids (36 text, [PAD], [EOS], 10 sentinels).
nlohmann::json tiny_config() {
  return {{"model", "t5"},
          {"name", "t5-test"},
          {"vocab_size", 48},
          {"num_sentinels", 10},
          {"max_seq_len", 16},
          {"max_target_len", 8},
          {"num_layers", 2},
          {"num_decoder_layers", 2},
          {"hidden", 32},
          {"num_heads", 4},
          {"kv_channels", 8},
          {"ffn_hidden", 24},
          {"relative_attention_num_buckets", 8},
          {"relative_attention_max_distance", 12}};
}

// B pairs: encoder inputs of random lengths ending in [EOS], targets of random lengths.
pipeline::MicroBatch random_batch(const T5Config& c, int64_t B, int64_t S, int64_t T,
                                  uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> text(0, static_cast<int32_t>(c.text_vocab() - 1));
  Tensor enc = Tensor::empty({B, S}, DType::I32), dec = Tensor::empty({B, T}, DType::I32);
  Tensor enc_len = Tensor::empty({B}, DType::I32), dec_len = Tensor::empty({B}, DType::I32);
  Tensor targets = Tensor::empty({B, T}, DType::I32);
  const auto pad = static_cast<int32_t>(c.pad_id()), eos = static_cast<int32_t>(c.eos_id());
  for (int64_t b = 0; b < B; ++b) {
    const auto ls = static_cast<int32_t>(b == 0 ? S : 2 + rng() % (S - 1));
    const auto lt = static_cast<int32_t>(b == 0 ? T : 1 + rng() % T);
    enc_len.data<int32_t>()[b] = ls;
    dec_len.data<int32_t>()[b] = lt;
    for (int64_t s = 0; s < S; ++s) {
      int32_t id = s < ls - 1 ? text(rng) : (s == ls - 1 ? eos : pad);
      if (s == 1) id = static_cast<int32_t>(c.sentinel_id(0));
      enc.data<int32_t>()[b * S + s] = id;
    }
    for (int64_t t = 0; t < T; ++t) {
      const int32_t target = t < lt - 1 ? text(rng) : (t == lt - 1 ? eos : -100);
      targets.data<int32_t>()[b * T + t] = target;
    }
    for (int64_t t = 0; t < T; ++t) {
      const int32_t previous = t == 0 ? -100 : targets.data<int32_t>()[b * T + t - 1];
      dec.data<int32_t>()[b * T + t] = t == 0 || previous == -100 ? pad : previous;
    }
  }
  return t5_micro_batch(enc, enc_len, dec, dec_len, targets);
}

// Norm weights moved (testing::perturb_vectors); the shared embedding scaled.
void perturb(T5& model, float embedding_scale = 1.0f) {
  testing::perturb_vectors(model, embedding_scale,
                           [&](const Parameter& p) { return &p == &model.shared; });
}

void check_against_torch(const nlohmann::json& json, float embedding_scale) {
  const T5Config config = T5Config::from_json(json);
  T5 model(config, 7);
  perturb(model, embedding_scale);
  const auto batch = random_batch(config, 4, 16, 8, 3);
  model.zero_grad();
  const float loss = model.train_step(batch, DType::F32, 1.0f);
  const TensorMap torch = testing::torch_step("t5", json, model, batch);
  const float torch_loss = torch.at("loss").to_floats()[0];
  const double worst = testing::expect_step_matches(loss, model.parameters(), torch, 1e-4);
  std::printf("[ measured ] embeddings x%g: loss %.2e, worst gradient %.2e\n", embedding_scale,
              std::fabs(loss - torch_loss) / torch_loss, worst);
}

TEST(T5, Fp32StepMatchesTorch) {
  check_against_torch(tiny_config(), 1.0f);
}

TEST(T5, ExtremeEmbeddingMagnitudesMatchTorch) {
  check_against_torch(tiny_config(), 1e3f);
  check_against_torch(tiny_config(), 1e-3f);
}

// Unequal stacks and more buckets than distances.
TEST(T5, DeeperDecoderMatchesTorch) {
  nlohmann::json json = tiny_config();
  json["num_decoder_layers"] = 3;
  json["relative_attention_num_buckets"] = 32;
  json["relative_attention_max_distance"] = 128;
  check_against_torch(json, 1.0f);
}

// Padding changes nothing: other ids past each input's and each target's length.
// Pipeline stages in one process (testing::expect_stages_equal_the_whole: both streams packed
// across each boundary), the relative bias tables summed per stage. Cuts: the border between
// two stages (2 + 2 layers over 2 stages), one layer per stage with both tables tied over two
// stages each (2 + 2 over 4), and the border inside a stage (3 + 3 over 3: stage 1 holds
// encoder layer 2, the encoder's final norm and decoder layer 0).
TEST(T5, PipelineStagesInOneProcessEqualTheWholeModel) {
  struct Cut {
    int64_t layers;
    int stages;
  };
  for (const Cut cut : {Cut{2, 2}, Cut{2, 4}, Cut{3, 3}}) {
    SCOPED_TRACE(std::to_string(cut.layers) + " + " + std::to_string(cut.layers) + " layers");
    nlohmann::json json = tiny_config();
    json["num_layers"] = cut.layers;
    json["num_decoder_layers"] = cut.layers;
    const T5Config config = T5Config::from_json(json);
    testing::expect_stages_equal_the_whole<T5>(config, random_batch(config, 3, 10, 6, 5),
                                               cut.stages, "relative_attention_bias",
                                               [](T5& whole) { perturb(whole); });
  }
}

// One stage per rank: what each holds, and the tied tables' stages (3 + 3 layers over 3 stages).
TEST(T5, EachStageHoldsItsPartAndTiesTheBiasTables) {
  nlohmann::json json = tiny_config();
  json["num_layers"] = 3;
  json["num_decoder_layers"] = 3;
  const T5Config config = T5Config::from_json(json);
  auto names = [&](int stage) {
    ModelLayout layout;
    layout.stages = 3;
    layout.stage_of_chunk = {stage};
    T5 part(config, 7, layout);
    std::set<std::string> held;
    for (Parameter* p : part.parameters()) {
      if (p->name.find(".layer.") == std::string::npos) held.insert(p->name);
    }
    const std::vector<pipeline::TiedParameters> tied = part.tied_parameters();
    EXPECT_EQ(tied.size(), 2u);
    EXPECT_EQ(tied.at(0).stages, (std::vector<int>{0, 1}));  // the encoder's layers
    EXPECT_EQ(tied.at(1).stages, (std::vector<int>{1, 2}));  // the decoder's
    EXPECT_EQ(part.fp8_state_indices().size(), part.fp8_states().size());
    return held;
  };
  EXPECT_EQ(names(0),
            (std::set<std::string>{"shared.weight", "encoder.relative_attention_bias.weight"}));
  EXPECT_EQ(names(1), (std::set<std::string>{"encoder.relative_attention_bias.weight",
                                             "encoder.final_layer_norm.weight",
                                             "decoder.relative_attention_bias.weight"}));
  EXPECT_EQ(names(2), (std::set<std::string>{"decoder.relative_attention_bias.weight",
                                             "decoder.final_layer_norm.weight", "lm_head.weight"}));
  // Each FP8 state's whole-model index: the stages' lists together are the whole model's.
  T5 whole(config, 7);
  std::vector<int64_t> all;
  for (int stage = 0; stage < 3; ++stage) {
    ModelLayout layout;
    layout.stages = 3;
    layout.stage_of_chunk = {stage};
    T5 part(config, 7, layout);
    for (int64_t index : part.fp8_state_indices()) all.push_back(index);
  }
  EXPECT_EQ(all, whole.fp8_state_indices());
}

TEST(T5, PaddingChangesNothing) {
  const T5Config config = T5Config::from_json(tiny_config());
  T5 model(config, 7);
  perturb(model);
  const pipeline::MicroBatch batch = random_batch(config, 4, 16, 8, 5);
  float loss = 0, other_loss = 0;
  const TensorMap expected = step_gradients(model, batch, DType::F32, &loss);
  pipeline::MicroBatch other = batch;
  for (const char* key : {"enc_ids", "dec_ids"}) {
    other[key] = batch.at(key).clone();
    const int32_t* lengths =
        batch.at(std::string(key) == "enc_ids" ? "enc_lengths" : "dec_lengths").data<int32_t>();
    const int64_t L = other[key].dim(1);
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t t = lengths[b]; t < L; ++t) {
        other[key].data<int32_t>()[b * L + t] = static_cast<int32_t>((b + t) % 30);
      }
    }
  }
  const TensorMap grads = step_gradients(model, other, DType::F32, &other_loss);
  EXPECT_EQ(loss, other_loss);
  for (const auto& [name, grad] : expected) {
    if (name == "shared.weight") continue;  // other rows looked up (with zero gradients)
    SCOPED_TRACE(name);
    EXPECT_LE(scaled_error(grads.at(name), grad), 1e-6);
  }
}

// BF16 and every FP8 recipe near FP32 (hidden 128, FFN 128: the block recipes' sizes).
// Measured: BF16 gradients within 3% RMS; FP8 within 27-36% RMS at worst, in the tensors
// farthest from the loss (the encoder's first layer and relative bias table: E5M2 gradients
// through two stacks of a tiny model), the loss within 0.3%.
TEST(T5, Bf16AndFp8StepsStayNearFp32) {
  nlohmann::json json = tiny_config();
  json["hidden"] = 128;
  json["ffn_hidden"] = 128;
  json["kv_channels"] = 32;
  const T5Config config = T5Config::from_json(json);
  T5 model(config, 7);
  perturb(model);
  const auto batch = random_batch(config, 8, 16, 8, 3);
  float f32_loss = 0;
  const TensorMap f32 = step_gradients(model, batch, DType::F32, &f32_loss);
  const bool verbose = std::getenv("T5_DEBUG") != nullptr;  // every gradient's error
  auto check = [&](const std::string& name, const TensorMap& grads, float loss, double tolerance) {
    testing::expect_near_fp32(name, grads, loss, f32, f32_loss, 0.03, tolerance, verbose);
  };
  float loss = 0;
  const TensorMap bf16 = step_gradients(model, batch, DType::BF16, &loss);
  check("bf16", bf16, loss, 0.1);
  for (const auto& [name, r] : testing::fp8_recipes()) {
    check(name, testing::fp8_step_gradients(model, batch, r, &loss), loss, 0.5);
  }
}

// Evaluation counts target tokens whose argmax is the target (the reference's logits decide).
TEST(T5, EvaluationCountsTargetAccuracy) {
  const nlohmann::json json = tiny_config();
  const T5Config config = T5Config::from_json(json);
  T5 model(config, 7);
  perturb(model);
  pipeline::MicroBatch batch = random_batch(config, 4, 16, 8, 9);
  const TensorMap torch = testing::torch_step("t5", json, model, batch);
  const Tensor logits = torch.at("logits");  // [B, T, V]
  const int64_t V = logits.dim(2);
  batch["targets"] = batch.at("targets").clone();
  int32_t* targets = batch["targets"].data<int32_t>();
  int64_t right = 0, seen = 0;
  const std::vector<float> l = logits.to_floats();
  for (int64_t r = 0; r < batch.at("targets").numel(); ++r) {
    if (targets[r] == -100) continue;
    const auto row = l.begin() + r * V;
    const auto best = static_cast<int32_t>(std::max_element(row, row + V) - row);
    targets[r] = seen % 3 == 0 ? (best + 1) % static_cast<int32_t>(V) : best;
    right += seen % 3 != 0;
    ++seen;
  }
  model.evaluate(batch, DType::F32);
  EXPECT_EQ(model.take_eval_counts(), (std::pair<int64_t, int64_t>{right, seen}));
}

TEST(T5, HuggingFaceNamesRoundTrip) {
  const T5Config config = T5Config::from_json(tiny_config());
  T5 model(config, 7);
  perturb(model);
  const TensorMap ours = model.state_dict();
  TensorMap theirs = model.to_checkpoint_names(ours);
  for (const char* name : {"shared.weight", "lm_head.weight", "encoder.final_layer_norm.weight",
                           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                           "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                           "encoder.block.1.layer.0.SelfAttention.q.weight",
                           "encoder.block.1.layer.1.DenseReluDense.wi_1.weight",
                           "decoder.block.1.layer.1.EncDecAttention.v.weight",
                           "decoder.block.0.layer.2.DenseReluDense.wo.weight",
                           "decoder.block.0.layer.2.layer_norm.weight"}) {
    EXPECT_TRUE(theirs.count(name)) << name;
  }
  EXPECT_EQ(theirs.at("encoder.block.0.layer.0.SelfAttention.k.weight").shape(), (Shape{32, 32}));
  EXPECT_EQ(theirs.at("decoder.block.0.layer.2.DenseReluDense.wi_0.weight").shape(),
            (Shape{24, 32}));
  theirs["encoder.embed_tokens.weight"] = ours.at("shared.weight");
  testing::expect_same_tensors(model.from_checkpoint_names(theirs), ours);
  theirs.erase("decoder.block.1.layer.1.EncDecAttention.k.weight");
  EXPECT_THROW(model.from_checkpoint_names(theirs), Error);
}

TEST(T5, BadConfigsAndInputsAreClearErrors) {
  testing::expect_config_errors<T5Config>(
      tiny_config(), {{"vocab_size", 12, "num_sentinels + 2"},
                      {"kv_channels", 300, "kv_channels"},
                      {"post_layernorm", true, "unknown key 'post_layernorm'"}});
  const T5Config config = T5Config::from_json(tiny_config());
  // 2 + 2 layers do not cut into 3 equal stages.
  ModelLayout three_stages;
  three_stages.stages = 3;
  three_stages.stage_of_chunk = {0};
  EXPECT_NE(
      error_of([&] { T5 staged(config, 7, three_stages); }).find("multiple of the pipeline stages"),
      std::string::npos);
  T5 model(config, 7);
  const auto good = random_batch(config, 2, 16, 8, 3);
  auto step_error = [&](const std::string& key, int64_t index, int32_t value) {
    pipeline::MicroBatch b = good;
    b[key] = good.at(key).clone();
    b[key].data<int32_t>()[index] = value;
    return error_of([&] { model.train_step(b, DType::F32, 1.0f); });
  };
  EXPECT_NE(step_error("enc_ids", 3, 48).find("enc_ids[0,3] = 48 expected in [0, 48)"),
            std::string::npos);
  EXPECT_NE(step_error("dec_lengths", 1, 9).find("dec_lengths[1] = 9"), std::string::npos);
  EXPECT_NE(step_error("enc_lengths", 0, 0).find("enc_lengths[0] = 0"), std::string::npos);
  EXPECT_NE(step_error("targets", 2, 99).find("99"), std::string::npos);
  pipeline::MicroBatch missing = good;
  missing.erase("dec_ids");
  EXPECT_NE(error_of([&] { model.train_step(missing, DType::F32, 1.0f); }).find("dec_ids"),
            std::string::npos);
}

// Saved at iteration 3 and resumed to 6 through the trainer (mock span corruption): the
// uninterrupted run's losses exactly, and the target-token accuracy reported.
TEST(T5, TrainerResumesBitForBitAndReportsAccuracy) {
  testing::TrainerFixture fixture(tiny_config());
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    TrainOptions o = fixture.options(precision);
    o.micro_batch_size = 2;
    o.global_batch_size = 4;
    testing::expect_resume_bit_for_bit(o, fixture.path("ckpt-" + precision));
    o.seq_length = 17;
    EXPECT_NE(error_of([&] { train_gpt(o); }).find("--seq-length 17 expected in [2, 16]"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace octet
