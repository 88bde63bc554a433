#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <exception>
#include <system_error>
#include <unordered_map>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "core/error.h"

namespace mb {

namespace {

// How long an idle thread spins before sleeping. Between two regions of a decode step the caller
// runs a few microseconds of serial work; much longer than that and the spin only burns a core
// another process could use.
constexpr auto kSpin = std::chrono::microseconds(60);

thread_local bool tls_in_region = false;

// A share counter's chunk index once a region failed: past any share's end, and far enough below
// 2^kChunkBits that the fetch_adds still in flight cannot carry into the seq bits.
constexpr uint64_t kStopped = uint64_t(1) << 22;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  word.wait(expected);
#endif
}

void futex_wake(std::atomic<uint32_t>& word, int count) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
#else
  if (count == 1) word.notify_one();
  else word.notify_all();
#endif
}

// Spins until pred() or kSpin has passed; returns pred().
template <class P> bool spin_until(P pred) {
  if (pred()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      cpu_relax();
      if (pred()) return true;
    }
    if (std::chrono::steady_clock::now() - t0 > kSpin) return pred();
  }
}

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = default_threads();
  // A region has at most 8 chunks a thread (parallel_for): with the overshoots and the stop
  // mark (kStopped) they fit a counter's low bits.
  n_threads = std::min(n_threads, 1 << 16);
  // The region tag is read here, not in the thread: a thread that starts late must still see the
  // regions (or the shutdown) posted before it ran.
  const uint32_t seen = ctl_.tag.load();
  slots_ = std::vector<Slot>(size_t(n_threads));
  workers_.reserve(size_t(n_threads - 1));
  try {
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i, seen] { worker_loop(i, seen); });
  } catch (const std::system_error& e) {
    // The system refused a thread (a process or memory limit): the ones started are told to stop
    // and joined, as a std::thread destroyed while joinable would terminate the process.
    const size_t started = workers_.size() + 1;  // the caller's thread is one of the n
    stop_.store(true);
    ctl_.tag.fetch_add(2);
    futex_wake(ctl_.tag, INT_MAX);
    for (auto& t : workers_) t.join();
    fail("cannot start {} threads: {} started, then the system refused another ({}); ask for fewer threads", n_threads,
         started, e.code().message());
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  ctl_.tag.fetch_add(2);  // a change the workers see, and still a closed tag
  futex_wake(ctl_.tag, INT_MAX);
  for (auto& t : workers_) t.join();
}

void ThreadPool::work_share(int64_t s) {
  constexpr uint64_t kIndex = (uint64_t(1) << kChunkBits) - 1;
  std::atomic<uint64_t>& next = slots_[size_t(s)].next;
  const uint64_t seq = ctl_.seq, first = uint64_t(Split::first_of(s, ctl_.q, ctl_.r)),
                 end = first + uint64_t(ctl_.q + (s < ctl_.r));
  auto run_chunk = [&](uint64_t c) { ctl_.fn(int64_t(c) * ctl_.step, std::min(ctl_.n, (int64_t(c) + 1) * ctl_.step)); };
  // The region's first claim on the share finds an older seq and takes the share's first chunk.
  for (uint64_t v = next.load(std::memory_order_relaxed); v >> kChunkBits != seq;) {
    if (first >= end) return;
    if (next.compare_exchange_weak(v, seq << kChunkBits | (first + 1), std::memory_order_relaxed)) {
      run_chunk(first);
      break;
    }
  }
  // Then one fetch_add a chunk; a share already used up is only read, so finished shares cost
  // the others no cache-line transfers. Each thread overshoots the end at most once a share,
  // far below the seq bits.
  while ((next.load(std::memory_order_relaxed) & kIndex) < end) {
    const uint64_t c = next.fetch_add(1, std::memory_order_relaxed) & kIndex;
    if (c >= end) break;
    run_chunk(c);
  }
}

void ThreadPool::work_chunks(int64_t slot) {
  const int64_t shares = ctl_.shares.load(std::memory_order_relaxed);
  for (int64_t k = 0, s = slot; k < shares; ++k, s = s + 1 == shares ? 0 : s + 1) work_share(s);
}

// Joining is a store-then-load handshake with the caller's closing (both sequentially
// consistent): the worker publishes `joined = tag`, then checks that the region is still open;
// the caller closes it, then reads each `joined`. One of the two sees the other's write, so
// either the caller waits for this worker, or the worker sees the region closed and stays out.
// A worker that published its tag and then stayed out still marks itself done: the caller may
// have seen the tag and be waiting.
void ThreadPool::worker_loop(int64_t slot, uint32_t seen) {
  tls_in_region = true;  // nested regions from inside a chunk run inline
  Slot& me = slots_[size_t(slot)];
  for (;;) {
    if (!spin_until([&] { return ctl_.tag.load(std::memory_order_acquire) != seen; })) {
      sleepers_.fetch_add(1);
      if (ctl_.tag.load() == seen) futex_wait(ctl_.tag, seen);
      sleepers_.fetch_sub(1);
      continue;
    }
    const uint32_t tag = ctl_.tag.load(std::memory_order_acquire);
    seen = tag;
    // After taking the tag: the destructor sets stop_ before its change of the tag, so a worker that
    // has seen that change sees stop_ too (checked before the load, the change could be taken as an
    // ordinary one and the worker would sleep through the join).
    if (stop_.load(std::memory_order_relaxed)) return;
    if (!(tag & 1u)) continue;
    if (slot < ctl_.shares.load(std::memory_order_relaxed)) {
      me.joined.store(tag);
      if (ctl_.tag.load() == tag) work_chunks(slot);
      me.done.store(tag);
      if (me.caller_waits.load()) futex_wake(me.done, 1);
    }
    fetch_ahead(slot, tag);
  }
}

ThreadPool::Split ThreadPool::split(int64_t n, int64_t grain) const {
  Split sp;
  sp.n = n;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  if (workers_.empty() || max_chunks <= 1) return sp;
  // Several chunks per thread: uneven costs (attention over growing contexts) and a thread that
  // loses its core for a while balance themselves, and the last chunk leaves little idle time.
  const int64_t wanted = std::min<int64_t>(max_chunks, int64_t(size()) * 8);
  sp.step = (n + wanted - 1) / wanted;
  const int64_t chunks = (n + sp.step - 1) / sp.step;
  sp.shares = std::min<int64_t>(chunks, size());
  sp.q = int32_t(chunks / sp.shares);
  sp.r = int32_t(chunks % sp.shares);
  return sp;
}

void ThreadPool::post_ahead(const Ahead* ahead, uint32_t tag) {
  if (!ahead || ahead->streams <= 0 || ahead->budget == 0 || ahead->n <= 0) {
    if (ahead_.region.load(std::memory_order_relaxed) != 0) ahead_.region.store(0, std::memory_order_release);
    return;
  }
  ahead_.region.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  const int streams = std::min(ahead->streams, Ahead::kStreams);
  const Split sp = split(ahead->n, ahead->grain);
  ahead_.w[0].store(uint64_t(sp.n), std::memory_order_relaxed);
  ahead_.w[1].store(uint64_t(sp.step), std::memory_order_relaxed);
  ahead_.w[2].store(uint64_t(uint32_t(sp.q)) | uint64_t(uint32_t(sp.r)) << 32, std::memory_order_relaxed);
  ahead_.w[3].store(uint64_t(sp.shares), std::memory_order_relaxed);
  ahead_.w[4].store(uint64_t(ahead->budget), std::memory_order_relaxed);
  ahead_.w[5].store(uint64_t(streams), std::memory_order_relaxed);
  for (int i = 0; i < streams; ++i) {
    const Ahead::Stream& st = ahead->s[i];
    ahead_.w[6 + 4 * i].store(uint64_t(reinterpret_cast<uintptr_t>(st.base)), std::memory_order_relaxed);
    ahead_.w[7 + 4 * i].store(uint64_t(uint32_t(st.lo)) | uint64_t(uint32_t(st.hi)) << 32, std::memory_order_relaxed);
    ahead_.w[8 + 4 * i].store(uint64_t(st.stride), std::memory_order_relaxed);
    ahead_.w[9 + 4 * i].store(uint64_t(uint32_t(std::max(st.period, 0))), std::memory_order_relaxed);
  }
  ahead_.region.store(tag, std::memory_order_release);
}

void ThreadPool::fetch_ahead(int64_t slot, uint32_t tag) {
  if (ahead_.region.load(std::memory_order_acquire) != tag) return;
  uint64_t w[kAheadWords];
  for (int i = 0; i < kAheadWords; ++i) w[i] = ahead_.w[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (ahead_.region.load(std::memory_order_relaxed) != tag) return;  // rewritten meanwhile
  Split sp;
  sp.n = int64_t(w[0]);
  sp.step = int64_t(w[1]);
  sp.q = int32_t(uint32_t(w[2]));
  sp.r = int32_t(uint32_t(w[2] >> 32));
  sp.shares = int64_t(w[3]);
  const int streams = int(std::min<uint64_t>(w[5], Ahead::kStreams));
  // A successor of one chunk runs on the caller alone; otherwise this slot's share, if it has one.
  if (sp.step == 0 || slot >= sp.shares) return;
  const int64_t j0 = sp.first(slot) * sp.step, j1 = std::min(sp.n, sp.end(slot) * sp.step);
  // Addresses as integers: a plan may point past its buffer (or at nothing), which a prefetch
  // may do and pointer arithmetic may not.
  struct Range {
    uintptr_t p;
    size_t len;
  } ranges[2 * Ahead::kStreams];
  int m = 0;
  for (int i = 0; i < streams; ++i) {
    const int64_t lo = int64_t(uint32_t(w[7 + 4 * i])), hi = int64_t(w[7 + 4 * i] >> 32);
    const int64_t a = std::max(j0, lo), b = std::min(j1, hi);
    const uintptr_t base = uintptr_t(w[6 + 4 * i]);
    const size_t stride = size_t(w[8 + 4 * i]);
    const int64_t period = int64_t(w[9 + 4 * i]);
    if (base == 0 || a >= b) continue;
    if (period <= 0) {
      ranges[m++] = {base + size_t(a - lo) * stride, size_t(b - a) * stride};
      continue;
    }
    // Items a..b-1 read blocks (a - lo) % period onwards, wrapping round at most once.
    const int64_t first = (a - lo) % period, count = std::min(b - a, period);
    const int64_t head = std::min(count, period - first);
    ranges[m++] = {base + size_t(first) * stride, size_t(head) * stride};
    if (count > head) ranges[m++] = {base, size_t(count - head) * stride};
  }
  if (m == 0) return;
  const size_t per = size_t(w[4]) / size_t(m);
  for (int i = 0; i < m; ++i)
    for (size_t off = 0, len = std::min(per, ranges[i].len); off < len; off += 64) {
      // A prefetch waits for a free fill buffer, so this loop runs at memory speed: leave it as
      // soon as the next region opens (this thread's share there starts where it stopped).
      if (off % 1024 == 0) {
        const uint32_t now = ctl_.tag.load(std::memory_order_relaxed);
        if (now != tag && now != tag + 1) return;
      }
      __builtin_prefetch(reinterpret_cast<const void*>(ranges[i].p + off), 0, 2);
    }
}

const ThreadPool::Ahead* ThreadPool::ahead_after(const void* key, const Ahead& self) {
  struct Trace {
    const void* last = nullptr;
    std::unordered_map<const void*, Ahead> next;
  };
  thread_local Trace t;
  if (self.budget == 0) return nullptr;
  // The predecessor's address with the top bit set, which no user-space address has.
  if (!key) key = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(t.last) | uintptr_t(1) << 63);
  if (t.last) {
    if (t.next.size() >= 4096) t.next.clear();  // regions of models long gone
    t.next[t.last] = self;
  }
  t.last = key;
  const auto it = t.next.find(key);
  return it == t.next.end() ? nullptr : &it->second;
}

// The default budget covers the start of a worker's next share of the large matrices; decode
// runs with budgets from half of it up all beat no fetching, and larger ones gained nothing
// (measured: see docs/benchmarks.md).
size_t ThreadPool::ahead_budget() {
  static const size_t kb = [] {
    const char* e = std::getenv("MARKBASE_AHEAD_KB");
    return e && *e ? size_t(std::strtoull(e, nullptr, 10)) : size_t(128);
  }();
  return kb << 10;
}

void ThreadPool::wait_for_worker(int64_t slot, uint32_t tag) {
  Slot& s = slots_[size_t(slot)];
  if (spin_until([&] { return s.done.load(std::memory_order_acquire) == tag; })) return;
  // The worker lost its core (an oversubscribed machine): sleep until it is done. The flag and
  // the done tag are the same handshake as joining, so the worker's wake cannot be missed.
  s.caller_waits.store(1);
  for (uint32_t d; (d = s.done.load()) != tag;) futex_wait(s.done, d);
  s.caller_waits.store(0, std::memory_order_relaxed);
}

void ThreadPool::run(const Split& sp, FnRef<void(int64_t, int64_t)> fn, const Ahead* ahead) {
  const int64_t shares = sp.shares;
  ctl_.fn = fn;
  ctl_.n = sp.n;
  ctl_.step = sp.step;
  ctl_.q = sp.q;
  ctl_.r = sp.r;
  ctl_.shares.store(int32_t(shares), std::memory_order_relaxed);
  if (++ctl_.seq == uint64_t(1) << kSeqBits) {
    // After 2^40 regions the seq would come round to a counter's old one: start the counters
    // afresh (no worker is inside a region now).
    ctl_.seq = 1;
    for (Slot& sl : slots_) sl.next.store(0, std::memory_order_relaxed);
  }
  const uint32_t tag = ctl_.tag.load(std::memory_order_relaxed) + 1;  // odd: open
  post_ahead(ahead, tag);
  ctl_.tag.store(tag);  // publishes the region's state to the workers that load this tag
  if (sleepers_.load() > 0) futex_wake(ctl_.tag, INT_MAX);
  tls_in_region = true;
  std::exception_ptr error;
  try {
    work_chunks(0);
  } catch (...) {
    // Workers may still be inside the region and read its state: stop handing out chunks, wait
    // for them below, then rethrow.
    error = std::current_exception();
    for (int64_t s = 0; s < shares; ++s) slots_[size_t(s)].next.store(ctl_.seq << kChunkBits | kStopped);
  }
  tls_in_region = false;
  // Close the region: workers that have not joined yet never will. Wait for those inside.
  ctl_.tag.store(tag + 1);
  for (int64_t k = 1; k < shares; ++k)
    if (slots_[size_t(k)].joined.load() == tag) wait_for_worker(k, tag);
  if (error) std::rethrow_exception(error);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, FnRef<void(int64_t, int64_t)> fn) {
  parallel_for(n, grain, fn, nullptr);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, FnRef<void(int64_t, int64_t)> fn, const Ahead* ahead) {
  if (n <= 0) return;
  const Split sp = split(n, grain);
  if (sp.step == 0 || tls_in_region) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(submit_, std::try_to_lock);
  if (!lock.owns_lock()) {
    fn(0, n);
    return;
  }
  run(sp, fn, ahead);
}

void ThreadPool::run_on_all(FnRef<void(int, int)> fn) {
  const int nt = size();
  if (workers_.empty() || tls_in_region) {
    for (int i = 0; i < nt; ++i) fn(i, nt);
    return;
  }
  std::lock_guard<std::mutex> lock(submit_);
  auto each = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(int(i), nt);
  };
  run(split(nt, 1), each, nullptr);
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
