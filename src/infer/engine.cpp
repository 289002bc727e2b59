// The inference engine: block manager (paged KV, prefix caching by reference count), scheduler
// (continuous batching, chunked prefill, preemption by recomputation) and the step that runs
// one packed forward over the paged cache and samples each finished row.
#include "octet/engine.h"
#include "octet/gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <list>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace octet {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Length:
      return "length";
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Cancelled:
      return "cancelled";
    case FinishReason::Error:
      return "error";
  }
  return "?";
}

namespace {

constexpr uint64_t kNoHash = 0;

// FNV-1a over the parent block's hash and this block's tokens; never kNoHash.
uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count) {
  uint64_t h = 1469598103934665603ull ^ parent;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(parent);
  for (int64_t i = 0; i < count; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h == kNoHash ? 1 : h;
}

// Fixed-size KV blocks with reference counts. A free block that holds a full block of some
// prefix stays findable by its hash until it is reused (least recently freed first).
class BlockManager {
 public:
  explicit BlockManager(int64_t blocks)
      : ref_(static_cast<size_t>(blocks), 0),
        hash_(static_cast<size_t>(blocks), kNoHash),
        parent_(static_cast<size_t>(blocks), kNoHash),
        tokens_(static_cast<size_t>(blocks)),
        where_(static_cast<size_t>(blocks)) {
    for (int32_t b = 0; b < static_cast<int32_t>(blocks); ++b) {
      where_[static_cast<size_t>(b)] = free_.insert(free_.end(), b);
    }
  }
  int64_t total() const { return static_cast<int64_t>(ref_.size()); }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t in_use() const { return total() - free(); }
  int64_t cached_free() const { return cached_free_; }

  int32_t allocate() {
    OCTET_CHECK(!free_.empty(), "engine: no free KV block (scheduler bug)");
    const int32_t b = free_.front();
    free_.pop_front();
    forget(b);
    ref_[static_cast<size_t>(b)] = 1;
    return b;
  }
  void release(int32_t b) {
    const size_t i = static_cast<size_t>(b);
    OCTET_CHECK(ref_[i] > 0, "engine: block ", b, " released twice (scheduler bug)");
    if (--ref_[i] == 0) {
      where_[i] = free_.insert(free_.end(), b);
      if (hash_[i] != kNoHash) ++cached_free_;
    }
  }
  // The block holding exactly `tokens` after the prefix `parent`, referenced once more; -1.
  int32_t lookup(uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t count) {
    auto it = cached_.find(hash);
    if (it == cached_.end()) return -1;
    const size_t i = static_cast<size_t>(it->second);
    if (parent_[i] != parent || !std::equal(tokens, tokens + count, tokens_[i].begin())) return -1;
    if (ref_[i]++ == 0) {
      free_.erase(where_[i]);
      --cached_free_;
    }
    return it->second;
  }
  // Makes a full block findable by its prefix (the first block with a given hash wins).
  void publish(int32_t b, uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t count) {
    const size_t i = static_cast<size_t>(b);
    if (hash_[i] != kNoHash || cached_.count(hash)) return;
    cached_.emplace(hash, b);
    hash_[i] = hash;
    parent_[i] = parent;
    tokens_[i].assign(tokens, tokens + count);
  }

 private:
  void forget(int32_t b) {
    const size_t i = static_cast<size_t>(b);
    if (hash_[i] == kNoHash) return;
    cached_.erase(hash_[i]);
    hash_[i] = kNoHash;
    tokens_[i].clear();
    --cached_free_;
  }
  std::vector<int32_t> ref_;
  std::vector<uint64_t> hash_, parent_;
  std::vector<std::vector<int32_t>> tokens_;
  std::list<int32_t> free_;  // front: freed longest ago
  std::vector<std::list<int32_t>::iterator> where_;
  std::unordered_map<uint64_t, int32_t> cached_;
  int64_t cached_free_ = 0;
};

struct Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  std::vector<int32_t> tokens;  // prompt, then the generated tokens
  int64_t prompt_len = 0;
  int64_t computed = 0;          // tokens whose keys and values are in the blocks
  std::vector<int32_t> blocks;   // the block table
  std::vector<uint64_t> hashes;  // of the full blocks published (prefix caching)
  int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

// log-softmax of logits[V] at `token`, and the k most likely (token, log-probability).
void fill_logprobs(const float* logits, int64_t vocab, int64_t k, TokenOutput& out) {
  float max = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) max = std::max(max, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  const float log_z = max + static_cast<float>(std::log(sum));
  out.logprob = logits[out.token] - log_z;
  if (k <= 0) return;
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i) order[static_cast<size_t>(i)] = i;
  const int64_t top = std::min(k, vocab);
  std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int64_t i = 0; i < top; ++i) {
    const int32_t id = order[static_cast<size_t>(i)];
    out.top_logprobs.emplace_back(id, logits[id] - log_z);
  }
}

}  // namespace

struct Engine::Impl {
  Impl(GPT& m, const EngineOptions& o) : model(m), options(o) {}

  GPT& model;
  EngineOptions options;
  InferenceParams cache = InferenceParams(1, 1);
  std::unique_ptr<BlockManager> blocks;
  size_t kv_bytes_per_token = 0, weight_bytes = 0;
  size_t read_weight_bytes = 0;  // what the decode GEMMs read per step (BF16 copies, FP8 codes)

  // Shared with other threads, under `mutex`.
  mutable std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::unique_ptr<Sequence>> incoming;
  std::unordered_set<uint64_t> to_cancel;
  bool cancel_all = false, accepting = true, stop_thread = false;
  uint64_t next_id = 1;
  int64_t waiting_count = 0;  // incoming + waiting, for the queue bound
  EngineStats snapshot;
  std::thread thread;

  // The stepping thread's own.
  std::deque<std::unique_ptr<Sequence>> waiting;   // by arrival; preempted ones go first
  std::vector<std::unique_ptr<Sequence>> running;  // by arrival
  EngineStats counters;

  int64_t blocks_for(int64_t tokens) const {
    return (tokens + options.block_size - 1) / options.block_size;
  }

  void free_blocks(Sequence& seq) {
    for (int32_t b : seq.blocks) blocks->release(b);
    seq.blocks.clear();
    seq.hashes.clear();
    seq.computed = 0;
  }

  void finish(std::unique_ptr<Sequence> seq, FinishReason reason, const std::string& error = {}) {
    free_blocks(*seq);
    ++counters.requests_finished;
    if (reason == FinishReason::Cancelled) ++counters.requests_cancelled;
    if (seq->request.on_finish) {
      try {
        seq->request.on_finish(reason, error);
      } catch (...) {  // a callback's failure must not stop the engine
      }
    }
  }

  // Full blocks of seq's computed tokens not yet published.
  void publish_full_blocks(Sequence& seq) {
    if (!options.enable_prefix_caching) return;
    const int64_t bs = options.block_size;
    const int64_t full = seq.computed / bs;
    while (static_cast<int64_t>(seq.hashes.size()) < full) {
      const int64_t b = static_cast<int64_t>(seq.hashes.size());
      const uint64_t parent = b ? seq.hashes.back() : kNoHash;
      const int32_t* tokens = seq.tokens.data() + b * bs;
      const uint64_t h = block_hash(parent, tokens, bs);
      blocks->publish(seq.blocks[static_cast<size_t>(b)], h, parent, tokens, bs);
      seq.hashes.push_back(h);
    }
  }

  // A sequence admitted with no blocks: reuse cached full blocks of its prefix (all but its
  // last token, whose logits are needed).
  void match_prefix(Sequence& seq) {
    if (!options.enable_prefix_caching) return;
    const int64_t bs = options.block_size;
    const int64_t full = (static_cast<int64_t>(seq.tokens.size()) - 1) / bs;
    uint64_t parent = kNoHash;
    for (int64_t b = 0; b < full; ++b) {
      const int32_t* tokens = seq.tokens.data() + b * bs;
      const uint64_t h = block_hash(parent, tokens, bs);
      const int32_t block = blocks->lookup(h, parent, tokens, bs);
      if (block < 0) break;
      seq.blocks.push_back(block);
      seq.hashes.push_back(h);
      parent = h;
    }
    seq.computed = static_cast<int64_t>(seq.blocks.size()) * bs;
    counters.prefix_cache_hit_tokens += static_cast<uint64_t>(seq.computed);
  }

  // Blocks so that seq holds `tokens` tokens; false (nothing taken) when too few are free.
  bool grow(Sequence& seq, int64_t tokens) {
    const int64_t need = blocks_for(tokens) - static_cast<int64_t>(seq.blocks.size());
    if (need > blocks->free()) return false;
    for (int64_t i = 0; i < need; ++i) seq.blocks.push_back(blocks->allocate());
    return true;
  }

  // Running sequence at `index` back to the front of the waiting queue, its blocks freed
  // (recomputed from its tokens when it runs again).
  void preempt(size_t index) {
    std::unique_ptr<Sequence> seq = std::move(running[index]);
    running.erase(running.begin() + static_cast<int64_t>(index));
    free_blocks(*seq);
    ++counters.preemptions;
    // Keep the waiting queue in arrival order: preempted ones arrived before any waiting.
    auto at = std::find_if(waiting.begin(), waiting.end(),
                           [&](const std::unique_ptr<Sequence>& w) { return w->id > seq->id; });
    waiting.insert(at, std::move(seq));
  }

  void take_incoming() {
    std::vector<std::unique_ptr<Sequence>> added;
    std::unordered_set<uint64_t> cancels;
    bool all = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      added.swap(incoming);
      cancels.swap(to_cancel);
      all = cancel_all;
    }
    for (auto& seq : added) waiting.push_back(std::move(seq));
    if (!all && cancels.empty()) return;
    auto cancelled = [&](const Sequence& s) { return all || cancels.count(s.id) > 0; };
    for (size_t i = running.size(); i-- > 0;) {
      if (!cancelled(*running[i])) continue;
      std::unique_ptr<Sequence> seq = std::move(running[i]);
      running.erase(running.begin() + static_cast<int64_t>(i));
      finish(std::move(seq), FinishReason::Cancelled);
    }
    for (size_t i = waiting.size(); i-- > 0;) {
      if (!cancelled(*waiting[i])) continue;
      std::unique_ptr<Sequence> seq = std::move(waiting[i]);
      waiting.erase(waiting.begin() + static_cast<int64_t>(i));
      finish(std::move(seq), FinishReason::Cancelled);
    }
  }

  void publish_stats() {
    EngineStats s = counters;
    s.num_blocks = blocks->total();
    s.block_size = options.block_size;
    s.blocks_in_use = blocks->in_use();
    s.cached_blocks = blocks->cached_free();
    s.running = static_cast<int64_t>(running.size());
    s.weight_bytes = weight_bytes;
    s.kv_bytes_per_token = kv_bytes_per_token;
    s.kv_cache_bytes =
        static_cast<size_t>(blocks->total() * options.block_size) * kv_bytes_per_token;
    int64_t held = 0, capacity = 0;
    for (const auto& seq : running) {
      held += seq->computed;
      capacity += static_cast<int64_t>(seq->blocks.size()) * options.block_size;
    }
    s.kv_utilization = capacity ? static_cast<double>(held) / static_cast<double>(capacity) : 1.0;
    std::lock_guard<std::mutex> lock(mutex);
    s.waiting = static_cast<int64_t>(waiting.size() + incoming.size());
    waiting_count = s.waiting;
    s.requests_added = snapshot.requests_added;
    snapshot = s;
  }

  bool step();
};

bool Engine::Impl::step() {
  take_incoming();
  if (running.empty() && waiting.empty()) {
    publish_stats();
    return false;
  }
  // Schedule: running sequences first (arrival order), then waiting ones while the token
  // budget, the batch size and the blocks allow.
  struct Entry {
    Sequence* seq;
    int64_t count;
  };
  std::vector<Entry> entries;
  int64_t budget = options.max_num_batched_tokens;
  bool preempted = false;
  for (size_t i = 0; i < running.size() && budget > 0;) {
    Sequence& seq = *running[i];
    int64_t count = static_cast<int64_t>(seq.tokens.size()) - seq.computed;
    if (options.enable_chunked_prefill) count = std::min(count, budget);
    if (count > budget && !entries.empty()) break;  // a whole prompt waits for an empty step
    bool fits = grow(seq, seq.computed + count);
    while (!fits && running.size() - 1 > i) {  // the newest goes, until this one fits
      preempt(running.size() - 1);
      preempted = true;
      fits = grow(seq, seq.computed + count);
    }
    if (!fits) {  // this one is the newest: it waits
      preempt(i);
      preempted = true;
      break;
    }
    entries.push_back({&seq, count});
    budget -= count;
    ++i;
  }
  while (!preempted && !waiting.empty() && budget > 0 &&
         static_cast<int64_t>(running.size()) < options.max_num_seqs) {
    Sequence& seq = *waiting.front();
    if (seq.blocks.empty()) match_prefix(seq);
    int64_t count = static_cast<int64_t>(seq.tokens.size()) - seq.computed;
    if (options.enable_chunked_prefill) count = std::min(count, budget);
    if (count > budget && !entries.empty()) break;
    if (!grow(seq, seq.computed + count)) {
      // Hold no cached blocks while waiting: the running sequences may need them.
      counters.prefix_cache_hit_tokens -= static_cast<uint64_t>(seq.computed);
      free_blocks(seq);
      break;
    }
    running.push_back(std::move(waiting.front()));
    waiting.pop_front();
    entries.push_back({&seq, count});
    budget -= count;
  }
  if (entries.empty()) {
    publish_stats();
    return !running.empty() || !waiting.empty();
  }

  // One packed forward.
  InferenceParams::PagedBatch batch;
  batch.row_offsets.push_back(0);
  int64_t rows = 0;
  for (const Entry& e : entries) {
    rows += e.count;
    batch.row_offsets.push_back(rows);
    batch.cached_lengths.push_back(e.seq->computed);
    batch.block_tables.push_back(e.seq->blocks);
  }
  Tensor ids = Tensor::empty({1, rows}, DType::I32);
  int32_t* id = ids.data<int32_t>();
  for (const Entry& e : entries) {
    id = std::copy_n(e.seq->tokens.begin() + e.seq->computed, e.count, id);
  }
  Tensor logits;
  try {
    cache.set_paged_batch(std::move(batch));
    logits = model.forward_paged(ids, cache, options.dtype);
  } catch (const std::exception& error) {
    // The batch's sequences fail; the engine goes on.
    std::unordered_set<const Sequence*> failed;
    for (const Entry& e : entries) failed.insert(e.seq);
    for (size_t i = running.size(); i-- > 0;) {
      if (!failed.count(running[i].get())) continue;
      std::unique_ptr<Sequence> seq = std::move(running[i]);
      running.erase(running.begin() + static_cast<int64_t>(i));
      finish(std::move(seq), FinishReason::Error, error.what());
    }
    publish_stats();
    return true;
  }
  ++counters.steps;

  // Sample each sequence whose tokens are all computed now.
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> row;  // a sequence's penalized logits
  std::unordered_map<const Sequence*, FinishReason> done;
  for (size_t r = 0; r < entries.size(); ++r) {
    Sequence& seq = *entries[r].seq;
    seq.computed += entries[r].count;
    publish_full_blocks(seq);
    if (seq.computed < static_cast<int64_t>(seq.tokens.size())) continue;  // a prefill chunk
    if (seq.generated() == 0) counters.prompt_tokens += static_cast<uint64_t>(seq.prompt_len);
    const float* raw = logits.data<float>() + static_cast<int64_t>(r) * vocab;
    const GenerationRequest& req = seq.request;
    const SamplingOptions& sampling = req.sampling;
    const float* scores = raw;  // penalized in a copy, when any penalty is on
    if (has_penalties(sampling)) {
      row.assign(raw, raw + vocab);
      const std::span<const int32_t> all(seq.tokens);
      apply_penalties(row.data(), vocab, all.first(static_cast<size_t>(seq.prompt_len)),
                      all.subspan(static_cast<size_t>(seq.prompt_len)), sampling);
      scores = row.data();
    }
    TokenOutput out;
    out.index = seq.generated();
    out.token = sample_token(scores, vocab, sampling, static_cast<uint64_t>(seq.generated()));
    if (req.logprobs >= 0) fill_logprobs(raw, vocab, req.logprobs, out);
    seq.tokens.push_back(out.token);
    ++counters.generation_tokens;
    bool go_on = true;
    if (req.on_token) {
      try {
        go_on = req.on_token(out);
      } catch (...) {
        go_on = false;
      }
    }
    if (!go_on || std::find(req.stop_token_ids.begin(), req.stop_token_ids.end(), out.token) !=
                      req.stop_token_ids.end()) {
      done[&seq] = FinishReason::Stop;
    } else if (seq.generated() >= req.max_tokens) {
      done[&seq] = FinishReason::Length;
    }
  }
  for (size_t i = running.size(); i-- > 0;) {
    auto it = done.find(running[i].get());
    if (it == done.end()) continue;
    std::unique_ptr<Sequence> seq = std::move(running[i]);
    running.erase(running.begin() + static_cast<int64_t>(i));
    finish(std::move(seq), it->second);
  }
  publish_stats();
  return true;
}

Engine::Engine(GPT& model, const EngineOptions& options)
    : impl_(std::make_unique<Impl>(model, options)) {
  const EngineOptions& o = options;
  OCTET_CHECK(o.block_size > 0 && o.block_size <= 4096,
              "engine: block_size expected in [1, 4096], got ", o.block_size);
  OCTET_CHECK(o.max_num_seqs > 0, "engine: max_num_seqs must be positive, got ", o.max_num_seqs);
  OCTET_CHECK(o.max_num_batched_tokens > 0, "engine: max_num_batched_tokens must be positive, got ",
              o.max_num_batched_tokens);
  OCTET_CHECK(o.max_waiting > 0, "engine: max_waiting must be positive, got ", o.max_waiting);
  OCTET_CHECK(o.dtype == DType::F32 || o.dtype == DType::BF16,
              "engine: dtype expected f32 or bf16, got ", dtype_name(o.dtype));
  Impl& m = *impl_;
  m.kv_bytes_per_token = model.kv_bytes_per_token(o.fp8_kv ? DType::E4M3 : o.dtype);
  int64_t blocks = o.num_blocks;
  if (blocks == 0) {
    blocks = static_cast<int64_t>(o.kv_cache_bytes /
                                  (static_cast<size_t>(o.block_size) * m.kv_bytes_per_token));
  }
  OCTET_CHECK(blocks > 0, "engine: the KV cache holds no block (", o.kv_cache_bytes, " bytes, ",
              o.block_size * static_cast<int64_t>(m.kv_bytes_per_token), " per block)");
  m.options.num_blocks = blocks;
  m.cache = model.make_paged_inference_params(blocks, o.block_size);
  m.cache.fp8_kv = o.fp8_kv;
  m.blocks = std::make_unique<BlockManager>(blocks);
  for (Parameter* p : model.parameters()) m.weight_bytes += p->value.nbytes();
  m.read_weight_bytes = model.inference_weight_bytes(o.dtype);
  m.publish_stats();
}

Engine::~Engine() {
  shutdown(false);
}

uint64_t Engine::add_request(GenerationRequest request) {
  Impl& m = *impl_;
  const GPTConfig& config = m.model.config();
  OCTET_CHECK(!request.prompt.empty(), "engine: prompt has no tokens");
  for (const int32_t id : request.prompt) {
    OCTET_CHECK(id >= 0 && id < config.vocab_size, "engine: prompt token ", id, " outside [0, ",
                config.vocab_size, ")");
  }
  OCTET_CHECK(request.max_tokens >= 1, "engine: max_tokens must be >= 1, got ", request.max_tokens);
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  OCTET_CHECK(total <= config.max_seq_len, "engine: prompt (", request.prompt.size(),
              " tokens) + max_tokens (", request.max_tokens, ") exceeds the model's max_seq_len ",
              config.max_seq_len);
  OCTET_CHECK(m.blocks_for(total) <= m.options.num_blocks, "engine: prompt + max_tokens = ", total,
              " tokens need ", m.blocks_for(total), " KV blocks, the cache has ",
              m.options.num_blocks);
  OCTET_CHECK(request.logprobs >= -1 && request.logprobs <= 20,
              "engine: logprobs expected in [-1, 20], got ", request.logprobs);
  check_sampling_options(request.sampling);
  auto seq = std::make_unique<Sequence>();
  seq->prompt_len = static_cast<int64_t>(request.prompt.size());
  seq->tokens = request.prompt;
  seq->request = std::move(request);
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (!m.accepting) throw Error("engine: shutting down, no new requests");
    if (m.waiting_count >= m.options.max_waiting) {
      throw QueueFullError("engine: " + std::to_string(m.waiting_count) +
                           " requests already wait (max_waiting)");
    }
    id = m.next_id++;
    seq->id = id;
    m.incoming.push_back(std::move(seq));
    ++m.waiting_count;
    ++m.snapshot.requests_added;
    ++m.snapshot.waiting;
  }
  m.wake.notify_all();
  return id;
}

void Engine::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->to_cancel.insert(id);
  }
  impl_->wake.notify_all();
}

bool Engine::step() {
  return impl_->step();
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

void Engine::start() {
  Impl& m = *impl_;
  OCTET_CHECK(!m.thread.joinable(), "engine: already started");
  m.thread = std::thread([&m] {
    for (;;) {
      if (m.step()) continue;
      std::unique_lock<std::mutex> lock(m.mutex);
      if (m.stop_thread) return;
      m.wake.wait(lock, [&m] {
        return m.stop_thread || !m.incoming.empty() || !m.to_cancel.empty() || m.cancel_all;
      });
      if (m.stop_thread && m.incoming.empty()) return;
    }
  });
}

void Engine::shutdown(bool drain) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.accepting = false;
    if (!drain) m.cancel_all = true;
    m.stop_thread = true;
  }
  m.wake.notify_all();
  if (m.thread.joinable()) {
    m.thread.join();  // it steps until idle, then sees stop_thread
  } else {
    while (m.step()) {
    }
  }
}

bool Engine::accepting() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->accepting;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->snapshot;
}

const EngineOptions& Engine::options() const {
  return impl_->options;
}
const GPTConfig& Engine::model_config() const {
  return impl_->model.config();
}

std::string Engine::memory_report() const {
  const Impl& m = *impl_;
  const GPTConfig& c = m.model.config();
  const EngineOptions& o = m.options;
  auto mib = [](double bytes) { return bytes / (1024.0 * 1024.0); };
  const double kv_block =
      static_cast<double>(o.block_size) * static_cast<double>(m.kv_bytes_per_token);
  // Per step: the packed activations (residual, QKV, attention out, MLP hidden) and the
  // logits of every sequence.
  const double act_bytes = static_cast<double>(dtype_bytes(o.dtype)) *
                           static_cast<double>(o.max_num_batched_tokens) *
                           static_cast<double>(6 * c.hidden + c.ffn());
  const double logit_bytes = 4.0 * static_cast<double>(o.max_num_seqs * c.vocab_size);
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(1);
  // The F32 master weights stay; the GEMMs read FP8 codes made from them, or the copies packed
  // for oneDNN (made at the first step; BF16 ones from BF16 copies of the master), which the
  // decode kernel reads too.
  const bool fp8 = m.model.inference_fp8_weights();
  const double master = static_cast<double>(m.weight_bytes);
  const double read = static_cast<double>(m.read_weight_bytes);
  out << "memory: weights " << mib(master) << " MiB (F32 master)";
  double resident = master + read;  // the codes, or the packed copies (adjusted below)
  if (fp8) {
    out << " + " << mib(read) << " MiB e4m3 codes + scales ("
        << fp8_weight_scaling_name(m.model.inference_fp8_scaling()) << ")";
  } else {
    if (o.dtype != DType::F32) {
      out << " + " << mib(read) << " MiB " << dtype_name(o.dtype) << " copies";
      resident += read;
    }
    // Where BF16 GEMMs run widened to F32 (gemm_bf16_native() false), the packed copies are
    // F32: twice the bytes.
    const double packed = o.dtype == DType::BF16 && !gemm_bf16_native() ? 2.0 * read : read;
    out << " + ~" << mib(packed) << " MiB packed for the GEMMs (at the first step)";
    resident += packed - read;
  }
  out << " = ~" << mib(resident) << " MiB; each decode step reads " << mib(read) << " MiB ("
      << (fp8 ? "the codes" : "the packed copies") << ")\n"
      << "memory: KV cache " << o.num_blocks << " blocks x " << o.block_size << " tokens x "
      << m.kv_bytes_per_token << " B/token = " << mib(kv_block * static_cast<double>(o.num_blocks))
      << " MiB (" << o.num_blocks * o.block_size << " tokens, "
      << (o.fp8_kv ? "e4m3 + scales" : std::string(dtype_name(o.dtype))) << ")\n"
      << "memory: workspaces ~" << mib(act_bytes + logit_bytes) << " MiB ("
      << o.max_num_batched_tokens << " tokens per step, logits of " << o.max_num_seqs
      << " sequences)\n";
  return out.str();
}

std::vector<std::vector<int32_t>> generate_batch(Engine& engine,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 int64_t max_tokens, const SamplingOptions& options,
                                                 const std::vector<int32_t>& stop_token_ids) {
  std::vector<std::vector<int32_t>> outputs(prompts.size());
  std::vector<std::string> errors(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt = prompts[i];
    request.max_tokens = max_tokens;
    request.sampling = options;
    request.stop_token_ids = stop_token_ids;
    request.on_token = [&outputs, i](const TokenOutput& t) {
      outputs[i].push_back(t.token);
      return true;
    };
    request.on_finish = [&errors, i](FinishReason reason, const std::string& error) {
      if (reason == FinishReason::Error) errors[i] = error;
    };
    engine.add_request(std::move(request));
  }
  engine.run_until_idle();
  for (size_t i = 0; i < prompts.size(); ++i) {
    OCTET_CHECK(errors[i].empty(), "generate_batch: prompt ", i, ": ", errors[i]);
  }
  return outputs;
}

}  // namespace octet
