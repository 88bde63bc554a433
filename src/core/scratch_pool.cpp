#include "core/scratch_pool.h"

#include <cstdlib>
#include <cstring>

#include "core/env_flag.h"
#include "core/error.h"
#include "core/mmap.h"

namespace mb {

namespace {

EnvFlag g_poison("MARKBASE_POISON_SCRATCH", "1");

constexpr size_t kHuge = size_t(2) << 20;

// Sizes are rounded so that near-equal requests (a prompt's last, shorter chunk) share blocks;
// from 2 MB up to whole 2 MB pages.
size_t capacity_for(size_t bytes) {
  constexpr size_t kSmall = 64, kPage = 4096;
  if (bytes <= kPage) return std::max(kSmall, (bytes + kSmall - 1) / kSmall * kSmall);
  if (bytes >= kHuge) return (bytes + kHuge - 1) / kHuge * kHuge;
  return (bytes + kPage - 1) / kPage * kPage;
}

// Blocks of 2 MB and more are 2 MB aligned and marked for transparent huge pages (where the
// kernel's mode is "madvise"): a media encoder's first activations (a 30 s clip's first
// convolution writes 49 MB) otherwise take a page fault every 4 KB, ~5% of the encode.
void* allocate(size_t cap) {
  if (cap < kHuge) return std::aligned_alloc(64, cap);
  void* p = std::aligned_alloc(kHuge, cap);
  if (p) advise_huge_pages(p, cap);
  return p;
}

}  // namespace

bool ScratchPool::poison() { return g_poison.get(); }

void ScratchPool::set_poison(bool on) { g_poison.set(on); }

ScratchPool::ScratchPool(size_t max_cached_bytes) : state_(std::make_shared<State>()) {
  state_->max_cached = max_cached_bytes;
}

ScratchPool::State::~State() {
  for (auto& [cap, p] : free) std::free(p);
}

void ScratchPool::State::put(void* p, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (cached + capacity <= max_cached) {
      free.emplace(capacity, p);
      cached += capacity;
      return;
    }
  }
  std::free(p);
}

std::shared_ptr<void> ScratchPool::get(size_t bytes) {
  const size_t want = capacity_for(bytes);
  void* p = nullptr;
  size_t cap = want;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    // Best fit, but never a block more than twice the size: a small request must not pin a large
    // block that a later large request would then have to allocate again.
    auto it = state_->free.lower_bound(want);
    if (it != state_->free.end() && it->first <= 2 * want) {
      cap = it->first;
      p = it->second;
      state_->free.erase(it);
      state_->cached -= cap;
    }
  }
  if (!p) {
    p = allocate(cap);
    MB_CHECK(p != nullptr, "out of memory allocating {} bytes of activations", bytes);
  }
  if (poison()) std::memset(p, 0xFF, cap);
  std::shared_ptr<State> st = state_;
  return std::shared_ptr<void>(p, [st, cap](void* q) { st->put(q, cap); });
}

size_t ScratchPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->cached;
}

}  // namespace mb
