// Fork-join pool for data-parallel kernels. Workers spin briefly before sleeping because decode
// issues hundreds of small parallel regions per token and a futex wake per region costs more than
// the work in it.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mb {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads = 0);  // 0 = all hardware threads
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) over [0, n) split into chunks of at least `grain` items. The caller's
  // thread takes part; returns when all chunks are done.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // Calls fn(thread_index, n_threads) once on each thread.
  void run_on_all(const std::function<void(int, int)>& fn);

  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace mb
