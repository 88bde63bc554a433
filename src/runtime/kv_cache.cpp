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
  lengths_.assign(size_t(opts.n_slots), 0);
  for (int s = 0; s < opts.n_slots; ++s)
    for (size_t l = 0; l < n_layers_; ++l) {
      const LayerConfig& L = cfg.layers[l];
      if (L.kv_source != int(l)) continue;
      KVStore& st = stores_[size_t(s) * n_layers_ + l];
      const int64_t ring = int64_t(cfg.sliding_window) - 1 + opts.max_step;
      st.ring = L.kind == AttnKind::Sliding && ring < opts.max_context;
      st.capacity = st.ring ? ring : opts.max_context;
      st.k = backend.alloc(DType::F32, {st.capacity, L.n_kv_heads, L.head_dim});
      st.v = backend.alloc(DType::F32, {st.capacity, L.n_kv_heads, L.head_dim});
      bytes_ += st.k.nbytes() + st.v.nbytes();
    }
}

}  // namespace mb
