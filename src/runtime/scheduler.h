// Which sequences run in the next step and how many positions each computes (iteration-level,
// "continuous" batching with chunked prefill, as in vLLM's scheduler).
//
// A step has a token budget. Running sequences come first, oldest first: a decoding one takes a
// single position, one still prefilling a chunk of what is left. Waiting sequences are admitted
// after them, oldest first, while the budget, the sequence limit and the KV pages allow, each
// starting after the longest prefix the page cache holds. A long prompt is thus cut into chunks
// that share steps with the running streams instead of stalling them. When a running sequence
// needs a page and none is free, the newest running sequence is preempted: its pages are released
// (kept in the prefix cache) and it waits again at its place in the queue, to be recomputed from
// its tokens, which the prefix cache mostly still holds.
#pragma once
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "runtime/kv_pages.h"
#include "runtime/request.h"

namespace mb {

enum class SeqStatus { Waiting, Running, Finished };

inline constexpr int32_t kMediaTokenBase = int32_t(1) << 30;
// The id Sequence::tokens holds at position i of a media span with content hash h.
inline int32_t media_token(uint64_t hash, int64_t i) {
  return kMediaTokenBase | int32_t((hash + uint64_t(i) * 0x9E3779B97F4A7C15ull) >> 34);
}

struct Sequence {
  int64_t id = 0;                 // arrival order: lower ids are served first
  // The prompt, then every generated token. Positions a media span covers hold ids derived from
  // the media's hash (>= kMediaTokenBase, never a vocabulary id), which is what the prefix cache keys.
  std::vector<int32_t> tokens;
  std::vector<MediaSpan> media;
  // Position ranges [first, second) a prompt chunk must take whole (images attended bidirectionally).
  std::vector<std::pair<int64_t, int64_t>> unsplit;
  int64_t n_prompt = 0;
  int64_t n_computed = 0;         // positions whose KV the pages hold
  int64_t n_prompt_cached = 0;    // prompt positions the prefix cache gave at first admission
  bool admitted_once = false;
  int64_t max_chunk = 0;          // > 0: at most this many positions a step
  bool prefix_cache = true;       // may start from cached pages (off when every prompt row's logits are wanted)
  const Sequence* after = nullptr;  // admitted only once this one has computed its prompt
  SeqPages pages;
  SeqStatus status = SeqStatus::Waiting;
  int preemptions = 0;
};

struct ScheduledChunk {
  Sequence* seq = nullptr;
  int64_t begin = 0, count = 0;   // positions [begin, begin + count)
  bool samples = false;           // reaches the last known token: its last row picks the next one
};

struct SchedulerOptions {
  int max_seqs = 16;
  int64_t step_tokens = 512;      // positions computed per step over all sequences
  int64_t max_step = 512;         // positions per sequence per step
};

class Scheduler {
 public:
  Scheduler(KVPageManager& pages, const SchedulerOptions& opts);

  void add(Sequence* s);
  std::vector<ScheduledChunk> schedule();
  // After the step's forward: advances each chunk's sequence and registers its full pages.
  void computed(const std::vector<ScheduledChunk>& chunks);
  // Takes `s` out of the queue or the running batch for good and releases its pages.
  void finish(Sequence* s);

  int64_t waiting() const { return int64_t(waiting_.size()); }
  int64_t running() const { return int64_t(running_.size()); }
  int64_t preempted_total() const { return preempted_total_; }
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }

 private:
  void preempt(Sequence* s);
  void enqueue_in_order(Sequence* s);

  KVPageManager& pages_;
  SchedulerOptions opts_;
  std::deque<Sequence*> waiting_;   // by id
  std::vector<Sequence*> running_;  // by id
  int64_t preempted_total_ = 0, prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0;
};

}  // namespace mb
