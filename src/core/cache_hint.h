// Where a cache line should live next, for data one core writes and other cores read right after
// (a decode step's matmul outputs, which the caller's norms read; the FFN's middle activations,
// which every worker of the down projection reads). Read from the writer's private cache, each line
// is a transfer between two cores; moved to the shared L3 first, it is an L3 hit.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mb {

// Up to this many tokens a step (decode, small batches) the kernels demote what they write for
// the next op: a row's few KB are read once, by another core. A prefill's outputs are read by the
// many threads of the next region, and demoting them would be work for no gain.
constexpr int64_t kDemoteTokens = 16;

// CLDEMOTE: a hint, executed as a NOP by CPUs without it (which is why no dispatch guards it), and
// ordered after this core's stores to the same line.
inline void demote_to_shared_cache(const void* p, size_t bytes) {
#if defined(__x86_64__)
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); a < end; a += 64)
    asm volatile("cldemote %0" : : "m"(*reinterpret_cast<const volatile char*>(a)));
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace mb
