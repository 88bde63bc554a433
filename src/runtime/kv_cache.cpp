#include "runtime/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace mb {

KVCache::KVCache(const ModelConfig& cfg, Backend& backend, const KVCacheOptions& opts)
    : opts_(opts), n_layers_(size_t(cfg.n_layers)) {
  MB_CHECK(opts.n_slots > 0 && opts.max_context > 0 && opts.max_step > 0, "invalid KV cache options");
  owner_.resize(n_layers_);
  for (size_t l = 0; l < n_layers_; ++l) owner_[l] = cfg.layers[l].kv_source;
  stores_.resize(size_t(opts.n_slots) * n_layers_);
  // Each slot's stores are views of one allocation: a decode step reads every layer's keys and
  // values, and one block of >= 2 MB gets the backend's large pages (on the CPU, transparent huge
  // pages: no TLB walk and no prefetcher restart every 4 KB, where a store per layer of a short
  // context was ~100 KB of small pages each). Stores start on 64-byte boundaries. The layout of
  // a slot (each owning layer's ring flag and capacity) is the same for all slots.
  struct Layout {
    bool ring;
    int64_t capacity, floats, padded;  // padded: floats rounded up to 64 bytes
  };
  std::vector<Layout> layout(n_layers_);
  int64_t slot_floats = 0;
  for (size_t l = 0; l < n_layers_; ++l) {
    const LayerConfig& L = cfg.layers[l];
    if (L.kv_source != int(l)) continue;
    const int64_t ring = int64_t(cfg.sliding_window) - 1 + opts.max_step;
    Layout& y = layout[l];
    y.ring = L.kind == AttnKind::Sliding && ring < opts.max_context;
    y.capacity = y.ring ? ring : opts.max_context;
    y.floats = y.capacity * L.n_kv_heads * L.head_dim;
    y.padded = (y.floats + 15) / 16 * 16;
    slot_floats += 2 * y.padded;
  }
  for (int s = 0; s < opts.n_slots && slot_floats > 0; ++s) {
    const Tensor block = backend.alloc(backend.kv_dtype(), {slot_floats});
    int64_t off = 0;
    for (size_t l = 0; l < n_layers_; ++l) {
      const LayerConfig& L = cfg.layers[l];
      if (L.kv_source != int(l)) continue;
      const Layout& y = layout[l];
      auto carve = [&] {
        Tensor t = block.slice_rows(off, y.floats).reshaped({y.capacity, L.n_kv_heads, L.head_dim});
        off += y.padded;
        return t;
      };
      KVStore& st = stores_[size_t(s) * n_layers_ + l];
      st.ring = y.ring;
      st.capacity = y.capacity;
      st.k = carve();
      st.v = carve();
      bytes_ += st.k.nbytes() + st.v.nbytes();
    }
  }
}

}  // namespace mb
