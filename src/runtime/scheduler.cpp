#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace mb {

namespace {
bool by_id(const Sequence* a, const Sequence* b) { return a->id < b->id; }
}  // namespace

Scheduler::Scheduler(KVPageManager& pages, const SchedulerOptions& opts) : pages_(pages), opts_(opts) {
  MB_CHECK(opts.max_seqs > 0 && opts.step_tokens > 0 && opts.max_step > 0, "invalid scheduler options");
}

void Scheduler::enqueue_in_order(Sequence* s) {
  s->status = SeqStatus::Waiting;
  waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), s, by_id), s);
}

void Scheduler::add(Sequence* s) { enqueue_in_order(s); }

void Scheduler::preempt(Sequence* s) {
  pages_.release(s->pages);
  s->n_computed = 0;
  ++s->preemptions;
  ++preempted_total_;
  running_.erase(std::find(running_.begin(), running_.end(), s));
  enqueue_in_order(s);
}

void Scheduler::finish(Sequence* s) {
  if (s->status == SeqStatus::Running) running_.erase(std::find(running_.begin(), running_.end(), s));
  else if (s->status == SeqStatus::Waiting)
    if (auto it = std::find(waiting_.begin(), waiting_.end(), s); it != waiting_.end()) waiting_.erase(it);
  pages_.release(s->pages);
  s->status = SeqStatus::Finished;
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> out;
  int64_t budget = opts_.step_tokens;
  auto chunk_of = [&](const Sequence* s) {
    int64_t n = std::min({int64_t(s->tokens.size()) - s->n_computed, budget, opts_.max_step});
    if (s->max_chunk > 0) n = std::min(n, s->max_chunk);
    // A chunk ending inside an unsplit range stops before it, or, when it starts in the range,
    // takes the range whole (beyond the budget: the model's step limit allows for it).
    const int64_t b = s->n_computed;
    for (const auto& [first, end] : s->unsplit)
      if (first < b + n && b + n < end && b < end) n = first > b ? first - b : end - b;
    return n;
  };
  // Running sequences, oldest first; the newest give their pages up when one runs short.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* s = running_[i];
    const int64_t n = chunk_of(s);
    if (n <= 0) continue;
    bool preempted_self = false;
    while (!pages_.reserve(s->pages, s->n_computed, s->n_computed + n)) {
      Sequence* victim = running_.back();
      preempt(victim);
      if (victim == s) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;
    out.push_back({s, s->n_computed, n, s->n_computed + n == int64_t(s->tokens.size())});
    budget -= n;
  }
  // Then waiting ones, in order, while they fit.
  for (size_t i = 0; i < waiting_.size() && budget > 0 && int64_t(running_.size()) < opts_.max_seqs;) {
    Sequence* s = waiting_[i];
    if (s->after && s->after->status != SeqStatus::Finished && s->after->n_computed < s->after->n_prompt) {
      ++i;  // a sibling choice waits for the first to fill the prefix cache with their prompt
      continue;
    }
    const int64_t hit = s->prefix_cache ? pages_.match_prefix(s->tokens, s->pages) : 0;
    s->n_computed = hit;
    const int64_t n = chunk_of(s);
    if (!pages_.reserve(s->pages, s->n_computed, s->n_computed + n)) {
      pages_.release(s->pages);
      s->n_computed = 0;
      break;  // first come, first served: nobody overtakes the head of the queue for memory
    }
    if (!s->admitted_once) {
      s->admitted_once = true;
      s->n_prompt_cached = std::min(hit, s->n_prompt);
      prefix_query_tokens_ += s->n_prompt;
      prefix_hit_tokens_ += s->n_prompt_cached;
    }
    waiting_.erase(waiting_.begin() + int64_t(i));
    s->status = SeqStatus::Running;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), s, by_id), s);
    out.push_back({s, s->n_computed, n, s->n_computed + n == int64_t(s->tokens.size())});
    budget -= n;
  }
  return out;
}

void Scheduler::computed(const std::vector<ScheduledChunk>& chunks) {
  for (const ScheduledChunk& c : chunks) {
    c.seq->n_computed = c.begin + c.count;
    pages_.commit(c.seq->pages, c.seq->tokens, c.seq->n_computed);
  }
}

}  // namespace mb
