// KV-cache inference: prefill logits equal the full forward's, every cached decode step equals
// recomputing the whole context, cached generation equals uncached generation token for token
// (greedy and sampled, past max_seq_len too), and sampling is reproducible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "octet/infer.h"
#include "test_util.h"
#include "tiny_gpt.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

using testing::GptVariant;

GPTConfig tiny_config(const GptVariant& variant) {
  return testing::tiny_gpt_config(variant, 24);
}

class Inference : public ::testing::TestWithParam<GptVariant> {
 protected:
  Inference() : model_(tiny_config(GetParam()), 3) {}
  GPT model_;
};

Tensor id_tensor(const std::vector<std::vector<int32_t>>& rows, size_t length) {
  Tensor ids =
      Tensor::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(length)}, DType::I32);
  for (size_t b = 0; b < rows.size(); ++b) {
    std::copy(rows[b].begin(), rows[b].begin() + static_cast<int64_t>(length),
              ids.data<int32_t>() + b * length);
  }
  return ids;
}

std::vector<std::vector<int32_t>> random_tokens(int64_t batch, int64_t length, int64_t vocab,
                                                uint32_t seed) {
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(batch));
  uint32_t state = seed;
  for (auto& row : rows) {
    for (int64_t t = 0; t < length; ++t) {
      state = state * 1664525u + 1013904223u;
      row.push_back(static_cast<int32_t>((state >> 8) % static_cast<uint32_t>(vocab)));
    }
  }
  return rows;
}

float max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  float worst = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
  return worst;
}

TEST_P(Inference, PrefillLogitsEqualLastLogits) {
  auto rows = random_tokens(2, 13, model_.config().vocab_size, 11);
  Tensor ids = id_tensor(rows, 13);
  for (DType dtype : {DType::F32, DType::BF16}) {
    InferenceParams cache = model_.make_inference_params(2);
    Tensor cached = model_.forward_inference(ids, cache, dtype);
    EXPECT_EQ(cache.sequence_len_offset, 13);
    EXPECT_LE(max_abs_diff(cached, model_.last_logits(ids, dtype)), 1e-5f) << dtype_name(dtype);
  }
}

TEST_P(Inference, EveryDecodeStepEqualsRecomputingTheContext) {
  const int64_t max_len = model_.config().max_seq_len;
  auto rows = random_tokens(2, max_len, model_.config().vocab_size, 5);
  InferenceParams cache = model_.make_inference_params(3);  // room for more sequences
  Tensor logits = model_.forward_inference(id_tensor(rows, 6), cache, DType::F32);
  EXPECT_LE(max_abs_diff(logits, model_.last_logits(id_tensor(rows, 6), DType::F32)), 1e-5f);
  for (int64_t n = 7; n <= max_len; ++n) {
    Tensor step = Tensor::empty({2, 1}, DType::I32);
    for (int64_t b = 0; b < 2; ++b) step.data<int32_t>()[b] = rows[b][n - 1];
    logits = model_.forward_inference(step, cache, DType::F32);
    EXPECT_LE(max_abs_diff(logits, model_.last_logits(id_tensor(rows, n), DType::F32)), 2e-5f)
        << "context " << n;
  }
  EXPECT_EQ(cache.sequence_len_offset, max_len);
  EXPECT_EQ(cache.key_value_memory.size(), 2u);
  // The cache is full: one more token is an error, as is a batch past max_batch_size.
  EXPECT_THROW(model_.forward_inference(Tensor::zeros({2, 1}, DType::I32), cache, DType::F32),
               Error);
  cache.reset();
  EXPECT_THROW(model_.forward_inference(Tensor::zeros({4, 1}, DType::I32), cache, DType::F32),
               Error);
  // After reset the same buffers serve a new prompt.
  logits = model_.forward_inference(id_tensor(rows, 9), cache, DType::F32);
  EXPECT_LE(max_abs_diff(logits, model_.last_logits(id_tensor(rows, 9), DType::F32)), 1e-5f);
}

TEST_P(Inference, CachedGreedyGenerationEqualsUncached) {
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  // 30 new tokens on a 24-token window: 19 cached decode steps, then the sliding window.
  for (DType dtype : {DType::F32, DType::BF16}) {
    std::vector<int32_t> streamed;
    std::vector<int32_t> cached =
        generate(model_, prompt, 30, greedy, dtype, [&](int32_t id) { streamed.push_back(id); });
    std::vector<int32_t> uncached = generate_uncached(model_, prompt, 30, greedy, dtype);
    EXPECT_EQ(cached, uncached) << dtype_name(dtype);
    EXPECT_EQ(streamed, cached);
    ASSERT_EQ(cached.size(), 30u);
  }
  // A prompt longer than the window never touches the cache.
  std::vector<int32_t> long_prompt = random_tokens(1, 30, model_.config().vocab_size, 9)[0];
  EXPECT_EQ(generate(model_, long_prompt, 4, greedy),
            generate_uncached(model_, long_prompt, 4, greedy));
}

TEST_P(Inference, TemperatureZeroIsDeterministicAndIgnoresTheSeed) {
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  std::vector<int32_t> first = generate(model_, prompt, 12, greedy);
  greedy.seed = 12345;
  EXPECT_EQ(generate(model_, prompt, 12, greedy), first);
  EXPECT_EQ(generate(model_, prompt, 12, greedy), first);
}

TEST_P(Inference, SameSeedSameSample) {
  const std::vector<int32_t> prompt = {7, 7, 7, 7};
  SamplingOptions sampling;
  sampling.temperature = 1.0f;
  sampling.top_p = 0.95f;
  sampling.seed = 42;
  std::vector<int32_t> first = generate(model_, prompt, 20, sampling);
  EXPECT_EQ(generate(model_, prompt, 20, sampling), first);
  EXPECT_EQ(generate_uncached(model_, prompt, 20, sampling), first);
  sampling.seed = 43;
  EXPECT_NE(generate(model_, prompt, 20, sampling), first);
}

// Greedy with penalties: cached equals uncached; on this model greedy decoding repeats tokens,
// and strong penalties make it pick a new token at every step.
TEST_P(Inference, PenaltiesApplyAlikeCachedAndUncached) {
  const std::vector<int32_t> prompt = {5, 9, 5};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  greedy.repetition_penalty = 1.3f;
  greedy.frequency_penalty = 0.5f;
  greedy.presence_penalty = 0.2f;
  EXPECT_EQ(generate(model_, prompt, 10, greedy), generate_uncached(model_, prompt, 10, greedy));
  SamplingOptions distinct;
  distinct.temperature = 0.0f;
  distinct.presence_penalty = 2.0f;
  distinct.repetition_penalty = 1e4f;
  SamplingOptions plain;
  plain.temperature = 0.0f;
  const std::vector<int32_t> unpenalized = generate(model_, prompt, 20, plain);
  std::vector<int32_t> sorted = unpenalized;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(std::unique(sorted.begin(), sorted.end()), sorted.end()) << "no repeats to remove";
  const std::vector<int32_t> out = generate(model_, prompt, 20, distinct);
  std::vector<int32_t> all = prompt;
  for (const int32_t id : out) {
    EXPECT_EQ(std::count(all.begin(), all.end(), id), 0) << "token " << id << " repeated";
    all.push_back(id);
  }
}

INSTANTIATE_TEST_SUITE_P(Gpt, Inference, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         testing::gpt_variant_name);

TEST(InferenceParams, AllocatesEachLayerOnceWithItsShapeAndDtype) {
  InferenceParams cache(2, 16);
  InferenceParams::KeyValue& kv = cache.key_value(1, 2, 8, DType::BF16);
  EXPECT_EQ(kv.key.shape(), (Shape{2, 16, 2, 8}));
  EXPECT_EQ(kv.value.dtype(), DType::BF16);
  EXPECT_EQ(cache.bytes(), 2u * 2 * 16 * 2 * 8 * 2);
  EXPECT_EQ(&cache.key_value(1, 2, 8, DType::BF16), &cache.key_value_memory[1]);
  EXPECT_THROW(cache.key_value(1, 2, 8, DType::F32), Error);
  EXPECT_THROW(InferenceParams(0, 16), Error);
}

}  // namespace
}  // namespace octet

namespace octet {
namespace {

TEST(Sampling, PenaltiesFollowTheirDefinitions) {
  // logits of tokens 0..5; prompt {0, 1}, generated {1, 2, 2}.
  const std::vector<float> base = {2.0f, -1.0f, 4.0f, -3.0f, 1.0f, 0.5f};
  const std::vector<int32_t> prompt = {0, 1}, generated = {1, 2, 2};
  SamplingOptions o;
  o.repetition_penalty = 2.0f;
  std::vector<float> logits = base;
  apply_penalties(logits.data(), 6, prompt, generated, o);
  EXPECT_EQ(logits, (std::vector<float>{1.0f, -2.0f, 2.0f, -3.0f, 1.0f, 0.5f}));
  o = SamplingOptions{};
  o.frequency_penalty = 0.5f;
  o.presence_penalty = 0.25f;
  logits = base;
  apply_penalties(logits.data(), 6, prompt, generated, o);
  // Only generated tokens: 1 once (-0.75), 2 twice (-1.25); the prompt's 0 is untouched.
  EXPECT_EQ(logits, (std::vector<float>{2.0f, -1.75f, 2.75f, -3.0f, 1.0f, 0.5f}));
  // Off by default: nothing changes.
  logits = base;
  apply_penalties(logits.data(), 6, prompt, generated, SamplingOptions{});
  EXPECT_EQ(logits, base);
  EXPECT_FALSE(has_penalties(SamplingOptions{}));
  for (int which = 0; which < 3; ++which) {  // each penalty alone turns them on
    SamplingOptions on;
    (which == 0   ? on.repetition_penalty
     : which == 1 ? on.frequency_penalty
                  : on.presence_penalty) = which == 0 ? 1.1f : 0.5f;
    EXPECT_TRUE(has_penalties(on)) << which;
  }
}

TEST(Sampling, BadPenaltiesAndIdsThrow) {
  std::vector<float> logits(4, 0.0f);
  const std::vector<int32_t> none, bad = {7};
  SamplingOptions o;
  o.repetition_penalty = 0.0f;
  EXPECT_THROW(apply_penalties(logits.data(), 4, none, none, o), Error);
  o = SamplingOptions{};
  o.frequency_penalty = 3.0f;
  EXPECT_THROW(sample_token(logits.data(), 4, o, 0), Error);
  o = SamplingOptions{};
  o.presence_penalty = -2.5f;
  EXPECT_THROW(apply_penalties(logits.data(), 4, none, none, o), Error);
  o = SamplingOptions{};
  o.repetition_penalty = 1.5f;
  EXPECT_THROW(apply_penalties(logits.data(), 4, bad, none, o), Error);
}

// Greedy takes the first largest logit (std::max_element's choice) wherever it lies: in the
// blocks of 16 the maximum is found in or in the tail past them; ties, signed zeros and an
// all -inf row; a NaN anywhere is an error naming its index.
TEST(Sampling, GreedyTakesTheFirstLargestAndRefusesNaN) {
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  for (int64_t vocab : {1, 5, 16, 37, 50257}) {
    std::mt19937 rng(static_cast<uint32_t>(vocab));
    std::normal_distribution<float> normal;
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (float& x : logits) x = normal(rng);
    for (int64_t at : {int64_t{0}, vocab / 2, vocab - 1}) {
      std::vector<float> l = logits;
      l[static_cast<size_t>(at)] = 100.0f;
      EXPECT_EQ(sample_token(l.data(), vocab, greedy, 0),
                static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()))
          << "vocab " << vocab << " max at " << at;
      if (at + 1 < vocab) {  // a tie later: the first wins
        l[static_cast<size_t>(vocab - 1)] = 100.0f;
        EXPECT_EQ(sample_token(l.data(), vocab, greedy, 0), static_cast<int32_t>(at));
      }
      l[static_cast<size_t>(at)] = std::nanf("");
      try {
        sample_token(l.data(), vocab, greedy, 0);
        ADD_FAILURE() << "a NaN at " << at << " did not throw";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("logit " + std::to_string(at) + " is NaN"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  std::vector<float> zeros = {-1.0f, -0.0f, 0.0f, -0.0f};
  EXPECT_EQ(sample_token(zeros.data(), 4, greedy, 0), 1);
  std::vector<float> lowest(20, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(sample_token(lowest.data(), 20, greedy, 0), 0);
}

}  // namespace
}  // namespace octet
