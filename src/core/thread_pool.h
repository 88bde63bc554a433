// Fork-join pool for data-parallel kernels. Decode issues hundreds of parallel regions per token,
// so a region must cost little: workers spin for a short while after each one (the next region
// usually follows within microseconds), then sleep on a futex so an oversubscribed machine gets
// its cores back. Regions too small to be worth a hand-off run on the calling thread, and workers
// that are late to a region (descheduled, asleep) are not waited for: the caller takes their
// chunks and only waits for workers that actually started one.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace mb {

// Non-owning reference to a callable; cheaper than std::function (no allocation, no copy).
template <class Sig> class FnRef;
template <class R, class... A> class FnRef<R(A...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FnRef> && std::is_invocable_r_v<R, F&, A...>)
  FnRef(F&& f)  // NOLINT: implicit, like std::function
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, A... a) -> R { return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<A>(a)...); }) {}
  R operator()(A... a) const { return call_(obj_, std::forward<A>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads = 0);  // 0 = the CPUs this process may run on
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) over [0, n) split into chunks of at least `grain` items. The caller's
  // thread takes part; returns when all chunks are done. Runs inline when there is a single
  // chunk, when called from inside a region, or when another thread holds the pool.
  void parallel_for(int64_t n, int64_t grain, FnRef<void(int64_t, int64_t)> fn);

  // Calls fn(i, size()) once for each i in [0, size()), normally each on its own thread (a late
  // worker's index is run by whichever thread is free).
  void run_on_all(FnRef<void(int, int)> fn);

  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker_loop(int64_t slot, uint32_t seen);
  void run(int64_t n, int64_t step, FnRef<void(int64_t, int64_t)> fn);
  // Runs chunks of `slot`'s share, then takes what is left of the others' shares.
  void work_chunks(int64_t slot);
  void run_chunk(int64_t chunk) { (*fn_)(chunk * step_, std::min(n_, (chunk + 1) * step_)); }
  // Waits until worker `slot`, which joined the region `tag`, has left it.
  void wait_for_worker(int64_t slot, uint32_t tag);

  std::vector<std::thread> workers_;
  std::mutex submit_;  // one region at a time; a second caller runs inline
  // The current region. Written by the caller before it opens the region, read by workers only
  // after they have joined it (so it cannot change under them).
  const FnRef<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, step_ = 1;
  // Workers 1..max_join_ take part: one per share beyond the caller's. A region of 4 chunks on
  // 16 cores then wakes 3 workers into it, not 15 that the caller must wait out.
  std::atomic<int64_t> max_join_{0};  // written before the region opens; read by workers joining
  // The region's chunks in contiguous shares, one per thread taking part (the caller's is share
  // 0, worker k's share k), each with its own counter on its own cache line: a thread takes its
  // own chunks without contention and only then helps with the others' (a thread that is late or
  // slow is covered). One shared counter cost ~90 ns a chunk on 16 cores, every thread's
  // fetch_add queueing on one line: an empty region of 128 chunks took 12 us.
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::vector<Share> shares_;
  int64_t n_shares_ = 0;
  // Each worker's own line: the tag of the region it joined, the tag again once it has left, and
  // whether the caller sleeps on `done`. Joining and leaving write only the worker's line, so 15
  // workers do not queue on one shared counter twice a region (the caller reads their lines).
  struct alignas(64) Slot {
    std::atomic<uint32_t> joined{0}, done{0}, caller_waits{0};
  };
  std::vector<Slot> slots_;
  // The region's tag: odd while it is open, even once closed; +1 at each opening and closing.
  // Idle workers spin on it, then sleep on it as a futex word.
  alignas(64) std::atomic<uint32_t> region_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace mb
