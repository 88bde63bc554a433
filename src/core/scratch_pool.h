// Reusable host memory for activations. A forward pass allocates the same few dozen sizes layer
// after layer and step after step. Taken fresh from the C heap, each large block is a new
// mapping: a page fault and a kernel-zeroed page per 4 KB on first touch, then an munmap. That
// was 46% of a 512-token E2B prefill on a 16-core Xeon (the faults serialise on the process's
// memory map) and 6% on 2 cores. Blocks freed here are kept and handed out again instead, so a
// steady forward pass allocates nothing from the system.
//
// Contents of a block are undefined (whatever its last user wrote). With poisoning on
// (MARKBASE_POISON_SCRATCH=1, or set_poison), every block handed out is filled with 0xFF bytes,
// a NaN in every float format: an op that reads memory it was meant to overwrite first shows up
// as NaN logits in the tests (the sanitizer build runs the whole suite this way).
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

namespace mb {

class ScratchPool {
 public:
  // Free blocks beyond max_cached_bytes go back to the system.
  explicit ScratchPool(size_t max_cached_bytes = size_t(1) << 30);

  // A block of at least `bytes`, 64-byte aligned; it returns to the pool when the last copy of
  // the pointer is dropped (the pool's bookkeeping outlives the pool object if blocks do).
  std::shared_ptr<void> get(size_t bytes);
  size_t cached_bytes() const;

  static bool poison();
  static void set_poison(bool on);

 private:
  struct State {
    std::mutex mu;
    std::multimap<size_t, void*> free;  // capacity -> block
    size_t cached = 0, max_cached = 0;
    ~State();
    void put(void* p, size_t capacity);
  };
  std::shared_ptr<State> state_;
};

}  // namespace mb
