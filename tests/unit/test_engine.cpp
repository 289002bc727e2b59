// The inference engine: a paged forward equals recomputing each sequence; greedy and seeded
// outputs equal the contiguous-cache generator's whatever else shares the batch (requests
// joining and leaving, chunked prefill or not, prefix caching or not, preemption); no block
// leaks after many random requests with cancellations; bad requests refused before queuing.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "octet/engine.h"
#include "test_util.h"
#include "tiny_gpt.h"  // also reports the instruction-set paths run

namespace octet {
namespace {

using testing::GptVariant;

GPTConfig tiny_config(const GptVariant& variant) {
  return testing::tiny_gpt_config(variant, 48);
}

std::vector<int32_t> random_prompt(int64_t length, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(length));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return ids;
}

class Engines : public ::testing::TestWithParam<GptVariant> {
 protected:
  Engines() : model_(tiny_config(GetParam()), 5) {}
  int64_t vocab() const { return model_.config().vocab_size; }
  GPT model_;
};

TEST_P(Engines, PagedForwardEqualsRecomputingEachSequence) {
  // Three sequences packed in one forward after different cached lengths, in scattered blocks.
  const int64_t block = 4;
  for (DType dtype : {DType::F32, DType::BF16}) {
    InferenceParams cache = model_.make_paged_inference_params(32, block);
    const std::vector<std::vector<int32_t>> seqs = {
        random_prompt(9, vocab(), 1), random_prompt(14, vocab(), 2), random_prompt(5, vocab(), 3)};
    const std::vector<int64_t> first = {9, 6, 4};  // step 1 prefills these, step 2 the rest
    const std::vector<std::vector<int32_t>> tables = {{7, 2, 30}, {0, 31, 5, 11}, {19, 3}};
    for (int step = 0; step < 2; ++step) {
      InferenceParams::PagedBatch batch;
      batch.row_offsets = {0};
      std::vector<int32_t> packed;
      std::vector<size_t> members;
      for (size_t s = 0; s < seqs.size(); ++s) {
        const int64_t begin = step == 0 ? 0 : first[s];
        const int64_t end = step == 0 ? first[s] : static_cast<int64_t>(seqs[s].size());
        if (end == begin) continue;
        members.push_back(s);
        packed.insert(packed.end(), seqs[s].begin() + begin, seqs[s].begin() + end);
        batch.row_offsets.push_back(static_cast<int64_t>(packed.size()));
        batch.cached_lengths.push_back(begin);
        batch.block_tables.push_back(tables[s]);
      }
      Tensor ids = Tensor::empty({1, static_cast<int64_t>(packed.size())}, DType::I32);
      std::copy(packed.begin(), packed.end(), ids.data<int32_t>());
      cache.set_paged_batch(batch);
      Tensor logits = model_.forward_paged(ids, cache, dtype);
      ASSERT_EQ(logits.shape(), (Shape{static_cast<int64_t>(members.size()), vocab()}));
      for (size_t r = 0; r < members.size(); ++r) {
        const std::vector<int32_t>& seq = seqs[members[r]];
        const int64_t length = step == 0 ? first[members[r]] : static_cast<int64_t>(seq.size());
        Tensor whole = Tensor::empty({1, length}, DType::I32);
        std::copy(seq.begin(), seq.begin() + length, whole.data<int32_t>());
        std::vector<float> expected = model_.last_logits(whole, dtype).to_floats();
        std::vector<float> got =
            logits.slice_rows(static_cast<int64_t>(r), static_cast<int64_t>(r) + 1).to_floats();
        float worst = 0.0f;
        for (size_t i = 0; i < got.size(); ++i)
          worst = std::max(worst, std::fabs(got[i] - expected[i]));
        // F32: summation order only; BF16: the activations' rounding (as the contiguous cache).
        EXPECT_LE(worst, dtype == DType::F32 ? 1e-4f : 0.15f)
            << dtype_name(dtype) << " step " << step << " sequence " << members[r];
      }
    }
  }
}

struct Scenario {
  const char* name;
  EngineOptions options;
};

std::vector<Scenario> scenarios() {
  std::vector<Scenario> out;
  EngineOptions base;
  base.block_size = 4;
  base.num_blocks = 256;
  base.max_num_batched_tokens = 16;
  out.push_back({"chunked_prefix", base});
  EngineOptions whole = base;
  whole.enable_chunked_prefill = false;
  whole.enable_prefix_caching = false;
  out.push_back({"whole_prefill_no_prefix", whole});
  EngineOptions one = base;
  one.block_size = 1;
  one.max_num_batched_tokens = 5;
  out.push_back({"block1_budget5", one});
  EngineOptions tight = base;  // too few blocks for all at once: preemption
  tight.num_blocks = 24;
  out.push_back({"preempting", tight});
  EngineOptions few = base;
  few.max_num_seqs = 2;
  out.push_back({"two_at_a_time", few});
  return out;
}

TEST_P(Engines, GreedyOutputEqualsTheContiguousGeneratorInAnyBatch) {
  // Prompts of different lengths sharing a prefix, with different lengths to generate, added
  // while others run.
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<int32_t> shared = random_prompt(9, vocab(), 40);
  for (int i = 0; i < 7; ++i) {
    std::vector<int32_t> p = random_prompt(2 + 3 * i, vocab(), 50 + static_cast<uint32_t>(i));
    if (i % 2 == 0) p.insert(p.begin(), shared.begin(), shared.end());
    prompts.push_back(p);
  }
  const std::vector<int64_t> lengths = {12, 3, 20, 7, 1, 15, 9};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  std::vector<std::vector<int32_t>> expected;
  for (size_t i = 0; i < prompts.size(); ++i) {
    expected.push_back(generate(model_, prompts[i], lengths[i], greedy));
  }
  for (const Scenario& scenario : scenarios()) {
    Engine engine(model_, scenario.options);
    std::vector<std::vector<int32_t>> got(prompts.size());
    std::vector<int> finished(prompts.size(), 0);
    auto add = [&](size_t i) {
      GenerationRequest request;
      request.prompt = prompts[i];
      request.max_tokens = lengths[i];
      request.sampling = greedy;
      request.on_token = [&got, i](const TokenOutput& t) {
        EXPECT_EQ(t.index, static_cast<int64_t>(got[i].size()));
        got[i].push_back(t.token);
        return true;
      };
      request.on_finish = [&finished, i](FinishReason reason, const std::string& error) {
        EXPECT_EQ(reason, FinishReason::Length) << error;
        ++finished[i];
      };
      engine.add_request(std::move(request));
    };
    add(0);
    add(1);
    engine.step();
    add(2);
    engine.step();
    engine.step();
    for (size_t i = 3; i < prompts.size(); ++i) {
      add(i);
      engine.step();
    }
    engine.run_until_idle();
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(finished[i], 1) << scenario.name << " request " << i;
      EXPECT_EQ(got[i], expected[i]) << scenario.name << " request " << i;
    }
    const EngineStats stats = engine.stats();
    EXPECT_EQ(stats.blocks_in_use, 0) << scenario.name;
    EXPECT_EQ(stats.running + stats.waiting, 0) << scenario.name;
    if (std::string(scenario.name) == "preempting") {
      EXPECT_GT(stats.preemptions, 0u);
    }
    if (scenario.options.enable_prefix_caching) {
      EXPECT_GT(stats.prefix_cache_hit_tokens, 0u) << scenario.name;
    } else {
      EXPECT_EQ(stats.prefix_cache_hit_tokens, 0u) << scenario.name;
    }
  }
}

TEST_P(Engines, SeededSamplingIsTheSameAloneAndInABatch) {
  SamplingOptions sampled;
  sampled.temperature = 0.9f;
  sampled.top_k = 20;
  sampled.top_p = 0.95f;
  sampled.repetition_penalty = 1.2f;
  sampled.frequency_penalty = 0.3f;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i)
    prompts.push_back(random_prompt(3 + 4 * i, vocab(), 70 + static_cast<uint32_t>(i)));
  std::vector<std::vector<int32_t>> expected;
  for (size_t i = 0; i < prompts.size(); ++i) {
    sampled.seed = 1000 + i;
    expected.push_back(generate(model_, prompts[i], 10, sampled));
  }
  EngineOptions options;
  options.block_size = 8;
  options.num_blocks = 64;
  options.max_num_batched_tokens = 12;
  Engine engine(model_, options);
  std::vector<std::vector<int32_t>> got(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt = prompts[i];
    request.max_tokens = 10;
    request.sampling = sampled;
    request.sampling.seed = 1000 + i;
    request.on_token = [&got, i](const TokenOutput& t) {
      got[i].push_back(t.token);
      return true;
    };
    engine.add_request(std::move(request));
  }
  engine.run_until_idle();
  EXPECT_EQ(got, expected);
}

TEST_P(Engines, StopTokensLogprobsAndEarlyStop) {
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  const std::vector<int32_t> prompt = random_prompt(6, vocab(), 90);
  const std::vector<int32_t> full = generate(model_, prompt, 12, greedy);
  EngineOptions options;
  options.block_size = 4;
  options.num_blocks = 32;
  Engine engine(model_, options);
  // Stop at the 5th token's id: finishes with "stop" at its first occurrence, reported.
  const int32_t stop = full[4];
  const size_t first =
      static_cast<size_t>(std::find(full.begin(), full.end(), stop) - full.begin());
  std::vector<TokenOutput> outs;
  FinishReason reason = FinishReason::Error;
  GenerationRequest request;
  request.prompt = prompt;
  request.max_tokens = 12;
  request.sampling = greedy;
  request.stop_token_ids = {stop};
  request.logprobs = 3;
  request.on_token = [&](const TokenOutput& t) {
    outs.push_back(t);
    return true;
  };
  request.on_finish = [&](FinishReason r, const std::string&) { reason = r; };
  engine.add_request(request);
  engine.run_until_idle();
  EXPECT_EQ(reason, FinishReason::Stop);
  ASSERT_EQ(outs.size(), first + 1);
  for (size_t i = 0; i < outs.size(); ++i) {
    EXPECT_EQ(outs[i].token, full[i]);
    ASSERT_EQ(outs[i].top_logprobs.size(), 3u);
    // Greedy picks the most likely token: its log-probability is the top one, below 0.
    EXPECT_EQ(outs[i].top_logprobs[0].first, outs[i].token);
    EXPECT_FLOAT_EQ(outs[i].top_logprobs[0].second, outs[i].logprob);
    EXPECT_LT(outs[i].logprob, 0.0f);
    EXPECT_GE(outs[i].top_logprobs[0].second, outs[i].top_logprobs[1].second);
  }
  // on_token returning false finishes the request with "stop" after that token.
  int count = 0;
  request.stop_token_ids.clear();
  request.on_token = [&](const TokenOutput&) { return ++count < 3; };
  engine.add_request(request);
  engine.run_until_idle();
  EXPECT_EQ(count, 3);
  EXPECT_EQ(reason, FinishReason::Stop);
  EXPECT_EQ(engine.stats().blocks_in_use, 0);
}

INSTANTIATE_TEST_SUITE_P(Gpt, Engines, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         testing::gpt_variant_name);

GPT& small_model() {
  static GPT model(tiny_config({"small", nlohmann::json::object()}), 9);
  return model;
}

TEST(Engine, NoBlockLeaksAfterAThousandRandomRequestsWithCancellations) {
  GPT& model = small_model();
  EngineOptions options;
  options.block_size = 4;
  options.num_blocks = 40;  // tight: preemptions happen
  options.max_num_batched_tokens = 24;
  options.max_num_seqs = 12;
  options.max_waiting = 2000;
  Engine engine(model, options);
  std::mt19937 rng(123);
  // A thousand requests; 250 under AddressSanitizer, where the thousand take ten times as long
  // (52 s) and a quarter of them already run every path: preemptions, cancellations, early stops.
#if defined(__SANITIZE_ADDRESS__)
  const int total = 250;
#else
  const int total = 1000;
#endif
  std::vector<int> finishes(total, 0), tokens(total, 0);
  std::vector<int64_t> limits(total);
  std::vector<uint64_t> ids;
  int cancelled = 0, stopped_early = 0;
  for (int r = 0; r < total; ++r) {
    GenerationRequest request;
    request.prompt = random_prompt(1 + static_cast<int64_t>(rng() % 30), 97, rng());
    request.max_tokens = 1 + static_cast<int64_t>(rng() % 16);
    limits[static_cast<size_t>(r)] = request.max_tokens;
    request.sampling.temperature = (rng() % 2) ? 0.0f : 1.0f;
    request.sampling.seed = rng();
    const bool stop_early = rng() % 10 == 0;
    stopped_early += stop_early;
    request.on_token = [&tokens, r, stop_early](const TokenOutput&) {
      return ++tokens[static_cast<size_t>(r)] < 2 || !stop_early;
    };
    request.on_finish = [&finishes, r](FinishReason, const std::string&) {
      ++finishes[static_cast<size_t>(r)];
    };
    ids.push_back(engine.add_request(std::move(request)));
    if (rng() % 7 == 0) {  // cancel a random earlier request (maybe finished: ignored)
      engine.cancel(ids[rng() % ids.size()]);
      ++cancelled;
    }
    if (r % 3 == 0) engine.step();
  }
  engine.run_until_idle();
  for (int r = 0; r < total; ++r) {
    EXPECT_EQ(finishes[static_cast<size_t>(r)], 1) << "request " << r;
    EXPECT_LE(tokens[static_cast<size_t>(r)], limits[static_cast<size_t>(r)]);
  }
  const EngineStats stats = engine.stats();
  EXPECT_EQ(stats.blocks_in_use, 0);
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
  EXPECT_EQ(stats.requests_finished, static_cast<uint64_t>(total));
  EXPECT_GT(stats.preemptions, 0u);
  EXPECT_GT(stats.requests_cancelled, 0u);
  EXPECT_LE(stats.cached_blocks, stats.num_blocks);
  std::printf("%d requests: %llu steps, %llu preemptions, %llu cancelled, %llu prefix-hit tokens\n",
              total, static_cast<unsigned long long>(stats.steps),
              static_cast<unsigned long long>(stats.preemptions),
              static_cast<unsigned long long>(stats.requests_cancelled),
              static_cast<unsigned long long>(stats.prefix_cache_hit_tokens));
}

TEST(Engine, BackgroundThreadServesConcurrentClients) {
  GPT& model = small_model();
  EngineOptions options;
  options.block_size = 8;
  options.num_blocks = 128;
  Engine engine(model, options);
  engine.start();
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  const int clients = 8;
  std::vector<std::vector<int32_t>> got(clients), prompts(clients);
  for (int c = 0; c < clients; ++c)
    prompts[static_cast<size_t>(c)] = random_prompt(3 + c, 97, 200 + static_cast<uint32_t>(c));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      std::mutex m;
      std::condition_variable cv;
      bool done = false;
      GenerationRequest request;
      request.prompt = prompts[static_cast<size_t>(c)];
      request.max_tokens = 8;
      request.sampling = greedy;
      request.on_token = [&got, c](const TokenOutput& t) {
        got[static_cast<size_t>(c)].push_back(t.token);
        return true;
      };
      request.on_finish = [&](FinishReason, const std::string&) {
        std::lock_guard<std::mutex> lock(m);
        done = true;
        cv.notify_all();
      };
      engine.add_request(std::move(request));
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return done; });
    });
  }
  for (std::thread& t : threads) t.join();
  engine.shutdown(true);
  for (int c = 0; c < clients; ++c) {
    EXPECT_EQ(got[static_cast<size_t>(c)],
              generate(model, prompts[static_cast<size_t>(c)], 8, greedy))
        << "client " << c;
  }
  EXPECT_THROW(engine.add_request(GenerationRequest{{1, 2}, 1, greedy, {}, -1, nullptr, nullptr}),
               Error);
}

TEST(Engine, BadRequestsAreRefusedBeforeQueuing) {
  GPT& model = small_model();
  EngineOptions options;
  options.block_size = 4;
  options.num_blocks = 8;  // 32 tokens
  options.max_waiting = 2;
  Engine engine(model, options);
  auto refused = [&](GenerationRequest request, const std::string& words) {
    try {
      engine.add_request(std::move(request));
      ADD_FAILURE() << "accepted, expected an error naming " << words;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(words), std::string::npos) << error.what();
    }
  };
  GenerationRequest ok;
  ok.prompt = {1, 2, 3};
  ok.max_tokens = 4;
  GenerationRequest r = ok;
  r.prompt.clear();
  refused(r, "prompt has no tokens");
  r = ok;
  r.prompt = {1, 97};
  refused(r, "outside [0, 97)");
  r = ok;
  r.max_tokens = 0;
  refused(r, "max_tokens");
  r = ok;
  r.max_tokens = 46;
  refused(r, "max_seq_len 48");
  r = ok;
  r.max_tokens = 30;
  refused(r, "KV blocks");
  r = ok;
  r.sampling.top_p = 0.0f;
  refused(r, "top_p");
  r = ok;
  r.logprobs = 21;
  refused(r, "logprobs");
  EXPECT_EQ(engine.stats().waiting, 0);
  engine.add_request(ok);
  engine.add_request(ok);
  EXPECT_THROW(engine.add_request(ok), QueueFullError);
  engine.run_until_idle();
  engine.add_request(ok);  // room again
  engine.run_until_idle();
  EXPECT_THROW(Engine(model, EngineOptions{.block_size = 0}), Error);
  EngineOptions no_room;
  no_room.kv_cache_bytes = 16;
  EXPECT_THROW(Engine(model, no_room), Error);
  EXPECT_NE(engine.memory_report().find("KV cache 8 blocks x 4 tokens"), std::string::npos)
      << engine.memory_report();
  char reads[64];
  std::snprintf(reads, sizeof reads, "each decode step reads %.1f MiB",
                static_cast<double>(model.inference_weight_bytes(options.dtype)) / 1048576.0);
  EXPECT_NE(engine.memory_report().find(reads), std::string::npos) << engine.memory_report();
  // The copies the GEMMs read are resident beside the F32 master.
  EXPECT_NE(engine.memory_report().find("packed for the GEMMs"), std::string::npos)
      << engine.memory_report();
}

}  // namespace
}  // namespace octet
