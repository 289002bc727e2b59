// The inference engine: a paged KV cache (vLLM's PagedAttention) in fixed-size blocks with a
// block table per sequence, prefix caching (full blocks of identical token prefixes shared by
// reference count), and a scheduler that runs continuous batching: requests join and leave the
// running batch between steps, each step packs the decode tokens of running sequences and
// chunks of waiting prompts (chunked prefill) into one forward, and when blocks run out the
// newest sequence is preempted (its blocks freed, recomputed later) instead of failing.
//
// Threading: add_request / cancel / stats may be called from any thread; step() from one
// thread at a time (or start() runs it on the engine's own thread). Callbacks run on the
// stepping thread and must not call step().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "octet/infer.h"

namespace octet {

struct EngineOptions {
  // Tokens per KV block. A sequence wastes half a block on average (its last one): 8 keeps that
  // under 4% from ~100-token contexts (16: 4.5% at the benchmark's 129-192), at the same speed.
  int64_t block_size = 8;
  int64_t num_blocks = 0;                    // 0: as many as kv_cache_bytes holds
  size_t kv_cache_bytes = size_t{64} << 20;  // used when num_blocks is 0
  int64_t max_num_seqs = 64;                 // sequences in the running batch at most
  int64_t max_num_batched_tokens = 256;      // tokens per step: decodes + prefill chunks
  int64_t max_waiting = 256;                 // add_request throws QueueFullError past this
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;  // off: a prompt is prefilled in one step, whole
  DType dtype = DType::F32;            // compute and KV-cache dtype: F32 | BF16
  bool fp8_kv = false;  // KV cache in E4M3 with one scale per (token, head): ~half of BF16's bytes
};

enum class FinishReason { Length, Stop, Cancelled, Error };
const char* finish_reason_name(FinishReason reason);  // "length", "stop", "cancelled", "error"

// One generated token, as the request's on_token callback sees it.
struct TokenOutput {
  int32_t token = 0;
  int64_t index = 0;     // 0 for the first generated token
  float logprob = 0.0f;  // log-softmax of the model's logits (before penalties), when asked
  std::vector<std::pair<int32_t, float>> top_logprobs;  // the k most likely, when asked
};

struct GenerationRequest {
  std::vector<int32_t> prompt;  // non-empty, ids < vocab; prompt + max_tokens <= max_seq_len
  int64_t max_tokens = 16;      // >= 1
  SamplingOptions sampling;     // seed: the same seed gives the same tokens in any batch
  std::vector<int32_t> stop_token_ids;  // finishing with "stop" (the token is reported)
  int64_t logprobs = -1;                // -1: none; 0: the chosen token's; k: also top k (<= 20)
  // Each new token; return false to finish the request now with FinishReason::Stop (e.g. a
  // stop string seen in the text, or a client gone: the caller then says so with cancel()).
  std::function<bool(const TokenOutput&)> on_token;
  // Exactly once per accepted request, last; `error` is empty unless reason is Error.
  std::function<void(FinishReason reason, const std::string& error)> on_finish;
};

// add_request when max_waiting requests already wait (a server answers 503).
class QueueFullError : public Error {
 public:
  using Error::Error;
};

struct EngineStats {
  int64_t num_blocks = 0, block_size = 0;
  int64_t blocks_in_use = 0;  // referenced by a running sequence
  int64_t cached_blocks = 0;  // free, but keeping a prefix for reuse (evicted LRU)
  int64_t running = 0, waiting = 0;
  uint64_t requests_added = 0, requests_finished = 0, requests_cancelled = 0;
  uint64_t prompt_tokens = 0, generation_tokens = 0;
  uint64_t prefix_cache_hit_tokens = 0;  // prompt tokens not recomputed thanks to the cache
  uint64_t preemptions = 0, steps = 0;
  size_t weight_bytes = 0, kv_cache_bytes = 0, kv_bytes_per_token = 0;
  // KV tokens held by running sequences / tokens their blocks could hold (1 - waste).
  double kv_utilization = 1.0;
};

class Engine {
 public:
  // The model must be whole (one stage, no tensor parallelism); it is only read.
  Engine(GPT& model, const EngineOptions& options);
  ~Engine();  // shutdown(false)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Checks the request (octet::Error naming the field: empty prompt, id out of the vocabulary,
  // prompt + max_tokens over max_seq_len or over the whole cache, bad sampling options) and
  // queues it; QueueFullError when max_waiting already wait; Error after shutdown. Returns
  // the request's id.
  uint64_t add_request(GenerationRequest request);
  // Finishes the request with FinishReason::Cancelled at the next step (its blocks freed);
  // unknown or finished ids are ignored.
  void cancel(uint64_t id);

  // One scheduling step on the calling thread; false when nothing runs or waits.
  bool step();
  void run_until_idle();  // step() until it returns false

  // Steps on a background thread while there is work, sleeping otherwise.
  void start();
  // No new requests; drain = true lets running and waiting requests finish, false cancels
  // them. Joins the background thread. Idempotent.
  void shutdown(bool drain);
  bool accepting() const;

  EngineStats stats() const;
  const EngineOptions& options() const;
  const GPTConfig& model_config() const;
  // One line per part: weights, KV blocks (count x bytes), workspaces.
  std::string memory_report() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Runs prompts through an engine stepping on the calling thread (the engine must not be
// started): the generated ids of each, in order.
std::vector<std::vector<int32_t>> generate_batch(Engine& engine,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 int64_t max_tokens, const SamplingOptions& options,
                                                 const std::vector<int32_t>& stop_token_ids = {});

}  // namespace octet
