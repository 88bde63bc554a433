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

  // What the region after this one will read, for the workers to fetch into their caches once
  // they are done with this one. Memory is idle while the caller runs the serial work between
  // two regions and while the workers hand a region over; a caller that knows what comes next
  // (a decode step's matmuls come in the same order every step) can have those bytes on their
  // way meanwhile. The successor is parallel_for(n, grain) over items [0, n); item j of stream i
  // (lo <= j < hi) is the `stride` bytes at base + (j - lo)·stride. Each worker fetches up to
  // `budget` bytes from the start of its own share of the successor (its share is the one it
  // runs first), into L2, and stops as soon as another region opens. Only a hint: stale or wrong
  // addresses cost bandwidth, never a fault (prefetches do not fault).
  // With `period` > 0, items lo + i, lo + i + period, ... all read the same bytes, at
  // base + i·stride (attention's tasks: every head slice of a key split reads that split's keys).
  struct Ahead {
    static constexpr int kStreams = 3;
    struct Stream {
      const void* base = nullptr;
      int32_t lo = 0, hi = 0;
      size_t stride = 0;
      int32_t period = 0;
    };
    int64_t n = 0, grain = 1;
    size_t budget = 0;
    int streams = 0;
    Stream s[kStreams];
  };
  void parallel_for(int64_t n, int64_t grain, FnRef<void(int64_t, int64_t)> fn, const Ahead* ahead);

  // The regions of a decode step come in the same order every step (a layer's Q/K/V, attention,
  // the output projection, gate/up, down, ...). A region that reads big inputs names itself by
  // `key` (its weights, its KV store) and passes its own plan `self`; it gets back the plan of
  // the region that followed it last time on this thread, to launch with, so the workers fetch
  // the start of their next share while the caller runs the serial work in between. A wrong
  // guess (the first step, a new model) only costs bandwidth. Null when there is no such plan or
  // `self.budget` is 0. A region with nothing of its own to be named by (key null: attention, whose
  // KV store several layers share) is named after the region before it.
  static const Ahead* ahead_after(const void* key, const Ahead& self);
  // Bytes each worker fetches ahead of a region: MARKBASE_AHEAD_KB, default 128; 0 turns the
  // fetching off.
  static size_t ahead_budget();

  // Calls fn(i, size()) once for each i in [0, size()), normally each on its own thread (a late
  // worker's index is run by whichever thread is free).
  void run_on_all(FnRef<void(int, int)> fn);

  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker_loop(int64_t slot, uint32_t seen);
  // How parallel_for(n, grain) cuts [0, n): chunks of `step` items (0: a single chunk, run
  // inline), one share per thread taking part, share s holding chunks [first(s), end(s)). A
  // region and the workers' fetches ahead of it both take their split from here.
  struct Split {
    int64_t n = 0, step = 0, shares = 0;
    int32_t q = 0, r = 0;
    static int64_t first_of(int64_t s, int64_t q, int64_t r) { return s * q + (s < r ? s : r); }
    int64_t first(int64_t s) const { return first_of(s, q, r); }
    int64_t end(int64_t s) const { return first(s) + q + (s < r); }
  };
  Split split(int64_t n, int64_t grain) const;
  void run(const Split& split, FnRef<void(int64_t, int64_t)> fn, const Ahead* ahead);
  // Publishes `ahead` (null: none) as the plan of the region about to open with `tag`.
  void post_ahead(const Ahead* ahead, uint32_t tag);
  // Prefetches slot's part of region `tag`'s plan, if it still has that plan.
  void fetch_ahead(int64_t slot, uint32_t tag);
  // Runs the chunks of `slot`'s share, then takes what is left of the others' shares.
  void work_chunks(int64_t slot);
  // Runs the chunks left of share s.
  void work_share(int64_t s);
  // Waits until worker `slot`, which joined the region `tag`, has left it.
  void wait_for_worker(int64_t slot, uint32_t tag);

  std::vector<std::thread> workers_;
  std::mutex submit_;  // one region at a time; a second caller runs inline
  // Everything a worker reads to join and run a region, on one cache line the caller writes
  // once per region: each line the caller writes and every worker then reads costs each of them
  // a transfer from the caller's core, and on many cores those transfers were most of a region's
  // cost.
  // The fields after `tag` are written before the region opens and read by workers only after
  // they joined it (so they cannot change under them), except `shares`, read before joining.
  struct alignas(64) Control {
    // Odd while a region is open, even once closed; +1 at each opening and closing. Idle
    // workers spin on it, then sleep on it as a futex word.
    std::atomic<uint32_t> tag{0};
    // Threads taking part: the caller (share 0) and workers 1..shares-1, one per share. A
    // region of 4 chunks on 16 cores then wakes 3 workers into it, not 15 the caller must wait out.
    std::atomic<int32_t> shares{0};
    // Share s holds chunks [s·q + min(s, r), +q + (s < r)): no thread divides to find its share.
    int32_t q = 0, r = 0;
    uint64_t seq = 0;  // regions opened so far: the tag of the share counters (see Slot)
    int64_t n = 0, step = 1;
    static constexpr auto kNoChunks = [](int64_t, int64_t) {};
    // The caller's FnRef copied here: the workers need not read it off the caller's stack.
    FnRef<void(int64_t, int64_t)> fn{kNoChunks};
  };
  static_assert(sizeof(Control) == 64, "a region's state must stay on one cache line");
  Control ctl_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  // Per thread (index 0 the caller's): the worker's handshake with the caller, and its share's
  // chunk counter, each on its own line. Joining and leaving write only the worker's line, so
  // the workers do not queue on one shared counter twice a region (the caller reads their lines).
  // A share's chunks are contiguous; its owner takes them first without contention, and a
  // thread done with its own helps with the others' (a thread that is late or slow is covered).
  // The counter holds the region's seq in its high bits and the next chunk in the low
  // kChunkBits: the first claim of a region finds an old seq and starts from the share's first
  // chunk, so the caller never writes the counters (which would cost each owner a transfer).
  static constexpr int kChunkBits = 24, kSeqBits = 64 - kChunkBits;
  struct alignas(64) Slot {
    std::atomic<uint32_t> joined{0}, done{0}, caller_waits{0};
    alignas(64) std::atomic<uint64_t> next{0};
  };
  std::vector<Slot> slots_;
  // The Ahead of the open region, as a seqlock: `region` is the region's tag while the words
  // are valid and 0 while the caller rewrites them, so a worker still reading the previous
  // region's copy can tell that it changed under it. Words: the successor's Split (n, step,
  // q | r << 32, shares), the budget and the number of streams, then per stream base,
  // lo | hi << 32, stride, period.
  static constexpr int kAheadWords = 6 + 4 * Ahead::kStreams;
  struct alignas(64) AheadWords {
    std::atomic<uint32_t> region{0};
    std::atomic<uint64_t> w[kAheadWords];
  };
  AheadWords ahead_;
};

}  // namespace mb
