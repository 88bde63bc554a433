#include "runtime/kv_pages.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "core/error.h"
#include "core/splitmix64.h"
#include "core/thread_pool.h"

namespace mb {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_sliding(const ModelConfig& cfg, const LayerConfig& L, int64_t max_context) {
  return L.kind == AttnKind::Sliding && cfg.sliding_window > 0 && cfg.sliding_window < max_context;
}

// Bytes one page of each group takes.
std::array<size_t, 2> page_bytes(const ModelConfig& cfg, const KVPageOptions& o) {
  std::array<size_t, 2> b{0, 0};
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerConfig& L = cfg.layers[size_t(l)];
    if (L.kv_source != l) continue;
    b[is_sliding(cfg, L, o.max_context) ? 1 : 0] += size_t(2 * o.page_tokens * L.n_kv_heads * L.head_dim) * dtype_size(o.kv_dtype);
  }
  return b;
}

// Pages one sequence of max_context needs in each group.
std::array<int64_t, 2> pages_one_sequence(const ModelConfig& cfg, const KVPageOptions& o) {
  const int64_t all = ceil_div(o.max_context, o.page_tokens);
  const int64_t window = std::min(all, ceil_div(int64_t(cfg.sliding_window) - 1 + o.max_step, o.page_tokens) + 1);
  return {all, window};
}

uint64_t chain_hash(uint64_t prev, const int32_t* tokens, int64_t n) {
  uint64_t h = prev ^ 0x6d61726b62617365ull;  // "markbase"
  for (int64_t i = 0; i < n; ++i) {
    uint64_t x = h ^ uint64_t(uint32_t(tokens[i]));
    h = splitmix64_next(x);
  }
  return h ? h : 1;  // 0 marks "not registered"
}

}  // namespace

size_t KVPageManager::min_bytes(const ModelConfig& cfg, const KVPageOptions& opts) {
  const auto b = page_bytes(cfg, opts);
  const auto n = pages_one_sequence(cfg, opts);
  return size_t(n[0]) * b[0] + size_t(n[1]) * b[1];
}

KVPageManager::KVPageManager(const ModelConfig& cfg, Backend& backend, const KVPageOptions& opts)
    : opts_(opts), window_(cfg.sliding_window), pools_(2) {
  MB_CHECK(opts.page_tokens > 0 && (opts.page_tokens & (opts.page_tokens - 1)) == 0,
           "KV pages of {} tokens: a power of two is needed", opts.page_tokens);
  MB_CHECK(opts.max_context > 0 && opts.max_step > 0 && opts.max_seqs > 0, "invalid KV page options");
  const auto bp = page_bytes(cfg, opts);
  const auto need = pages_one_sequence(cfg, opts);
  const size_t min = min_bytes(cfg, opts);
  MB_CHECK(opts.bytes >= min,
           "KV memory of {} MiB cannot hold one sequence of {} tokens, which needs {} MiB: raise the KV memory "
           "or lower the context",
           opts.bytes >> 20, opts.max_context, (min + (1 << 20) - 1) >> 20);
  // The sliding pool holds every running sequence's window twice over (room for cached pages);
  // the full-attention pool gets the rest.
  int64_t n_sliding = 0, n_full = 0;
  if (bp[1] > 0) {
    const int64_t spare = int64_t((opts.bytes - size_t(need[0]) * bp[0]) / bp[1]);
    n_sliding = std::max(need[1], std::min(spare, 2 * int64_t(opts.max_seqs) * need[1]));
  }
  if (bp[0] > 0) n_full = int64_t((opts.bytes - size_t(n_sliding) * bp[1]) / bp[0]);
  pools_[0].n_pages = n_full;
  pools_[1].n_pages = n_sliding;
  pools_[1].sliding = true;
  group_of_.assign(size_t(cfg.n_layers), -1);
  index_in_group_.assign(size_t(cfg.n_layers), -1);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerConfig& L = cfg.layers[size_t(l)];
    if (L.kv_source != l) continue;
    const int g = is_sliding(cfg, L, opts.max_context) ? 1 : 0;
    Pool& p = pools_[size_t(g)];
    group_of_[size_t(l)] = g;
    index_in_group_[size_t(l)] = int(p.layers.size());
    p.layers.push_back(l);
    // Untouched pages cost no memory: large allocations are mapped lazily.
    const std::vector<int64_t> shape = {p.n_pages * opts.page_tokens, L.n_kv_heads, L.head_dim};
    p.k.push_back(backend.alloc(opts.kv_dtype, shape));
    p.v.push_back(backend.alloc(opts.kv_dtype, shape));
    bytes_ += p.k.back().nbytes() + p.v.back().nbytes();
  }
  if (opts.resident && backend.device() == Device::CPU)
    for (Pool& p : pools_)
      for (const std::vector<Tensor>* ts : {&p.k, &p.v})
        for (const Tensor& t : *ts) {
          uint8_t* data = static_cast<uint8_t*>(t.data);
          const int64_t n = int64_t(t.nbytes()), piece = int64_t(1) << 21;
          ThreadPool::global().parallel_for((n + piece - 1) / piece, 1, [&](int64_t b, int64_t e) {
            std::memset(data + b * piece, 0, size_t(std::min(n, e * piece) - b * piece));
          });
        }
  for (Pool& p : pools_) {
    p.refs.assign(size_t(p.n_pages), 0);
    p.hash.assign(size_t(p.n_pages), 0);
    p.page_tokens_of.resize(size_t(p.n_pages));
    p.lru_pos.resize(size_t(p.n_pages));
    for (int32_t i = 0; i < int32_t(p.n_pages); ++i) p.free.insert(p.free.end(), i);
  }
}

int64_t KVPageManager::first_needed(int g, int64_t pos) const {
  return g == 1 ? std::max<int64_t>(0, pos - window_ + 1) : 0;
}

int32_t KVPageManager::lookup(const Pool& p, uint64_t hash, const int32_t* tokens) const {
  const auto it = p.by_hash.find(hash);
  if (it == p.by_hash.end()) return -1;
  const std::vector<int32_t>& t = p.page_tokens_of[size_t(it->second)];
  return std::equal(t.begin(), t.end(), tokens) ? it->second : -1;
}

void KVPageManager::add_ref(Pool& p, int32_t page) {
  if (p.refs[size_t(page)]++ == 0) {
    ++p.used;
    if (p.hash[size_t(page)]) p.lru.erase(p.lru_pos[size_t(page)]);
    else p.free.erase(page);
  }
}

void KVPageManager::drop_ref(Pool& p, int32_t page) {
  MB_CHECK(p.refs[size_t(page)] > 0, "KV page {} released more often than taken", page);
  if (--p.refs[size_t(page)] > 0) return;
  --p.used;
  if (p.hash[size_t(page)]) p.lru_pos[size_t(page)] = p.lru.insert(p.lru.end(), page);
  else p.free.insert(page);
}

int32_t KVPageManager::take_page(Pool& p) {
  int32_t page;
  if (!p.free.empty()) {
    page = *p.free.begin();
    p.free.erase(p.free.begin());
  } else {
    MB_CHECK(!p.lru.empty(), "no KV page left");
    page = p.lru.front();
    p.lru.pop_front();
    const uint64_t h = p.hash[size_t(page)];
    const auto it = p.by_hash.find(h);
    if (it != p.by_hash.end() && it->second == page) p.by_hash.erase(it);
    p.hash[size_t(page)] = 0;
    p.page_tokens_of[size_t(page)].clear();
  }
  p.refs[size_t(page)] = 1;
  ++p.used;
  return page;
}

int64_t KVPageManager::match_prefix(const std::vector<int32_t>& tokens, SeqPages& s) {
  const int64_t P = opts_.page_tokens;
  const int64_t table = ceil_div(opts_.max_context, P);
  for (auto& t : s.table) t.assign(size_t(table), -1);
  s.hashes.clear();
  if (!opts_.prefix_cache || tokens.empty()) return 0;
  const int64_t max_pages = std::min<int64_t>((int64_t(tokens.size()) - 1) / P, table);
  std::vector<uint64_t> h;
  std::vector<int32_t> found[2];
  for (int64_t i = 0; i < max_pages; ++i) {
    h.push_back(chain_hash(i ? h.back() : 0, tokens.data() + i * P, P));
    for (int g = 0; g < 2; ++g)
      found[g].push_back(pools_[size_t(g)].layers.empty() ? 0 : lookup(pools_[size_t(g)], h.back(), tokens.data() + i * P));
  }
  // Full layers need every page before the prefix's end; sliding ones those of its last window.
  int64_t k = 0;
  while (k < max_pages && found[0][size_t(k)] >= 0) ++k;
  for (; k > 0; --k) {
    bool ok = true;
    for (int64_t i = first_needed(1, k * P) / P; i < k && ok; ++i) ok = found[1][size_t(i)] >= 0;
    if (ok) break;
  }
  for (int g = 0; g < 2; ++g) {
    Pool& p = pools_[size_t(g)];
    if (p.layers.empty()) continue;
    for (int64_t i = first_needed(g, k * P) / P; i < k; ++i) {
      s.table[g][size_t(i)] = found[g][size_t(i)];
      add_ref(p, found[g][size_t(i)]);
    }
  }
  s.hashes.assign(h.begin(), h.begin() + k);
  return k * P;
}

int64_t KVPageManager::pages_for(int g, int64_t begin, int64_t end, const SeqPages& s) const {
  int64_t n = 0;
  for (int64_t i = first_needed(g, begin) / opts_.page_tokens; i <= (end - 1) / opts_.page_tokens; ++i)
    n += s.table[g][size_t(i)] < 0;
  return n;
}

bool KVPageManager::reserve(SeqPages& s, int64_t begin, int64_t end) {
  const int64_t P = opts_.page_tokens;
  MB_CHECK(begin >= 0 && end > begin && end <= opts_.max_context, "KV positions [{}, {}) are out of range", begin,
           end);
  if (s.table[0].empty())
    for (auto& t : s.table) t.assign(size_t(ceil_div(opts_.max_context, P)), -1);
  for (int g = 0; g < 2; ++g) {
    Pool& p = pools_[size_t(g)];
    if (p.layers.empty()) continue;
    for (int64_t i = 0; i < first_needed(g, begin) / P; ++i)
      if (int32_t& page = s.table[g][size_t(i)]; page >= 0) {
        drop_ref(p, page);
        page = -1;
      }
  }
  for (int g = 0; g < 2; ++g) {
    const Pool& p = pools_[size_t(g)];
    if (!p.layers.empty() && pages_for(g, begin, end, s) > int64_t(p.free.size() + p.lru.size())) return false;
  }
  for (int g = 0; g < 2; ++g) {
    Pool& p = pools_[size_t(g)];
    if (p.layers.empty()) continue;
    for (int64_t i = first_needed(g, begin) / P; i <= (end - 1) / P; ++i)
      if (s.table[g][size_t(i)] < 0) s.table[g][size_t(i)] = take_page(p);
  }
  return true;
}

void KVPageManager::commit(SeqPages& s, const std::vector<int32_t>& tokens, int64_t computed) {
  if (!opts_.prefix_cache) return;
  const int64_t P = opts_.page_tokens;
  for (int64_t i = int64_t(s.hashes.size()); i < computed / P; ++i) {
    const int32_t* t = tokens.data() + i * P;
    s.hashes.push_back(chain_hash(i ? s.hashes.back() : 0, t, P));
    for (int g = 0; g < 2; ++g) {
      Pool& p = pools_[size_t(g)];
      const int32_t page = p.layers.empty() ? -1 : s.table[g][size_t(i)];
      if (page < 0 || p.hash[size_t(page)] || p.by_hash.count(s.hashes.back())) continue;
      p.hash[size_t(page)] = s.hashes.back();
      p.by_hash[s.hashes.back()] = page;
      p.page_tokens_of[size_t(page)].assign(t, t + P);
    }
  }
}

void KVPageManager::release(SeqPages& s) {
  for (int g = 0; g < 2; ++g) {
    for (int32_t& page : s.table[g])
      if (page >= 0) {
        drop_ref(pools_[size_t(g)], page);
        page = -1;
      }
  }
  s.hashes.clear();
}

KVStore KVPageManager::store(const SeqPages& s, int layer) const {
  const int g = group_of_[size_t(layer)];
  MB_CHECK(g >= 0, "layer {} owns no KV", layer);
  const Pool& p = pools_[size_t(g)];
  const size_t i = size_t(index_in_group_[size_t(layer)]);
  KVStore st;
  st.k = p.k[i];
  st.v = p.v[i];
  st.capacity = p.n_pages * opts_.page_tokens;
  st.pages = s.table[g].data();
  st.page_size = opts_.page_tokens;
  st.n_pages = int64_t(s.table[g].size());
  return st;
}

int64_t KVPageManager::pages_total() const { return pools_[0].n_pages + pools_[1].n_pages; }
int64_t KVPageManager::pages_used() const { return pools_[0].used + pools_[1].used; }
int64_t KVPageManager::pages_cached() const { return int64_t(pools_[0].lru.size() + pools_[1].lru.size()); }

PagedKVView::PagedKVView(const KVPageManager& pages, const ModelConfig& cfg, int64_t max_context, int64_t max_step)
    : pages_(pages), n_layers_(size_t(cfg.n_layers)), max_context_(max_context), max_step_(max_step) {
  for (const LayerConfig& L : cfg.layers) owner_.push_back(L.kv_source);
}

void PagedKVView::set(const std::vector<const SeqPages*>& seqs) {
  stores_.assign(seqs.size() * n_layers_, KVStore{});
  for (size_t s = 0; s < seqs.size(); ++s)
    for (size_t l = 0; l < n_layers_; ++l)
      if (owner_[l] == int(l)) stores_[s * n_layers_ + l] = pages_.store(*seqs[s], int(l));
}

KVStore& PagedKVView::store(int slot, int layer) {
  return stores_[size_t(slot) * n_layers_ + size_t(owner_[size_t(layer)])];
}

}  // namespace mb
