#include "core/thread_pool.h"

#include <algorithm>
#include <immintrin.h>
#include <memory>

namespace mb {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < 20000; ++spin) {
      _mm_pause();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return generation_.load() != seen || stop_; });
      gen = generation_.load();
    }
    if (stop_) return;
    seen = gen;
    (*job_)(index, size());
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run_on_all(const std::function<void(int, int)>& fn) {
  if (workers_.empty()) {
    fn(0, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    pending_.store(int(workers_.size()));
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0, size());
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = (n + grain - 1) / grain;
  if (workers_.empty() || max_chunks <= 1) {
    fn(0, n);
    return;
  }
  // Dynamic chunking: uneven per-row costs (attention over growing contexts) balance themselves.
  int64_t chunks = std::min<int64_t>(max_chunks, int64_t(size()) * 4);
  int64_t step = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  run_on_all([&](int, int) {
    for (;;) {
      int64_t begin = next.fetch_add(step, std::memory_order_relaxed);
      if (begin >= n) break;
      fn(begin, std::min(n, begin + step));
    }
  });
}

namespace {
std::unique_ptr<ThreadPool>& global_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
}  // namespace

ThreadPool& ThreadPool::global() {
  auto& p = global_slot();
  if (!p) p = std::make_unique<ThreadPool>(0);
  return *p;
}

void ThreadPool::set_global_threads(int n) { global_slot() = std::make_unique<ThreadPool>(n); }

}  // namespace mb
