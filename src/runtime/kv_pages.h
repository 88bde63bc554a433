// Paged KV memory for many sequences, with prefix caching (the block manager of vLLM, for a
// model whose layers differ in what they keep).
//
// The layers that own KV fall in up to two groups: full-attention layers, which keep every
// position, and sliding-window layers, which need only the last `window` positions. Each group
// has its own pool of pages (a page holds `page_tokens` positions of every layer of the group);
// a sequence has one page table per group. KV-shared layers read their source layer's pages and
// own none. A sliding layer's pages that fall out of the window are released as the sequence
// advances, so a long sequence holds window-many positions there, not its length.
//
// Prefix caching: a page whose positions are all computed is registered under the hash of the
// sequence's tokens up to its end (a chain: each page's hash covers the one before). A released
// page keeps its contents and its registration while it sits in an LRU list of cached pages; it is
// only reused for other data when no free page is left. A new sequence looks up its prompt's pages
// and takes the longest prefix for which every group has what the next position reads: all pages
// for full layers, the pages of the last `window` positions for sliding ones (sliding pages that
// fell out of a window stay cached too, and the LRU evicts them first as they were released
// first). Entries keep the page's own tokens and a hit must match them too, so handing out wrong
// KV would take a 64-bit collision of the hash of everything before the page as well.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "backends/backend.h"
#include "models/model.h"
#include "models/model_config.h"

namespace mb {

struct KVPageOptions {
  int64_t page_tokens = 64;   // a multiple of the CPU attention's key split keeps decode prefetch
  int64_t max_context = 0;    // positions a sequence may reach
  int64_t max_step = 0;       // most positions one sequence computes in one step
  int max_seqs = 1;           // sequences running at once (sizes the sliding pool)
  size_t bytes = 0;           // page memory of both pools; must hold one sequence of max_context
  bool prefix_cache = true;
  bool resident = false;      // write every page once at start (host memory backends)
  DType kv_dtype = DType::F32;  // the backend's Backend::kv_dtype()
};

// One sequence's pages: a table per group, entries -1 where it holds none.
struct SeqPages {
  std::vector<int32_t> table[2];
  std::vector<uint64_t> hashes;  // chain hash of each full page of the tokens, as far as computed
};

class KVPageManager {
 public:
  KVPageManager(const ModelConfig& cfg, Backend& backend, const KVPageOptions& opts);

  // Bytes one page of all groups takes, and the smallest budget that runs one full-context
  // sequence (what `bytes` must at least be).
  static size_t min_bytes(const ModelConfig& cfg, const KVPageOptions& opts);

  // Finds the longest cached prefix of `tokens` that leaves at least the last token to compute,
  // takes references on its pages into `s` (which must hold none) and returns its length (a
  // multiple of page_tokens; 0 without a hit or with caching off).
  int64_t match_prefix(const std::vector<int32_t>& tokens, SeqPages& s);
  // Makes `s` hold pages for positions [begin, end), releasing its sliding pages below
  // begin - window + 1. False (and nothing taken) when there are not enough free pages.
  bool reserve(SeqPages& s, int64_t begin, int64_t end);
  // Registers the pages that [0, computed) fills completely, for later prefix matches.
  void commit(SeqPages& s, const std::vector<int32_t>& tokens, int64_t computed);
  // Releases every page of `s` (registered ones stay cached).
  void release(SeqPages& s);

  // The KV store of `layer` (an owning layer) as sequence `s` sees it. Valid until `s` changes.
  KVStore store(const SeqPages& s, int layer) const;

  int64_t page_tokens() const { return opts_.page_tokens; }
  int64_t pages_total() const;
  int64_t pages_used() const;    // referenced by a sequence
  int64_t pages_cached() const;  // unreferenced, holding registered KV
  size_t bytes() const { return bytes_; }

 private:
  struct Pool {
    bool sliding = false;
    int64_t n_pages = 0;
    std::vector<int> layers;                 // owning layers of this group
    std::vector<Tensor> k, v;                // per layer of `layers`: [n_pages * page_tokens, nkv, hd]
    std::vector<int32_t> refs;               // per page
    std::vector<uint64_t> hash;              // per page: its registration (0: none)
    std::vector<std::vector<int32_t>> page_tokens_of;  // per registered page: the tokens it covers
    std::set<int32_t> free;                  // unregistered and unreferenced, lowest first
    std::list<int32_t> lru;                  // registered and unreferenced, oldest release first
    std::vector<std::list<int32_t>::iterator> lru_pos;
    std::unordered_map<uint64_t, int32_t> by_hash;
    int64_t used = 0;
  };

  int64_t pages_for(int g, int64_t begin, int64_t end, const SeqPages& s) const;
  int32_t take_page(Pool& p);
  void drop_ref(Pool& p, int32_t page);
  void add_ref(Pool& p, int32_t page);
  int64_t first_needed(int g, int64_t pos) const;  // lowest position a query at pos reads
  int32_t lookup(const Pool& p, uint64_t hash, const int32_t* tokens) const;

  KVPageOptions opts_;
  int window_ = 0;
  std::vector<int> group_of_;     // owning layer -> group (-1: owns no KV)
  std::vector<int> index_in_group_;
  std::vector<Pool> pools_;
  size_t bytes_ = 0;
};

// The KVMemory one forward call sees: the step's sequences (by batch slot) over the paged pools.
class PagedKVView final : public KVMemory {
 public:
  PagedKVView(const KVPageManager& pages, const ModelConfig& cfg, int64_t max_context, int64_t max_step);
  void set(const std::vector<const SeqPages*>& seqs);  // batch slot i -> seqs[i]
  KVStore& store(int slot, int layer) override;
  int64_t max_context() const override { return max_context_; }
  int64_t max_step() const override { return max_step_; }

 private:
  const KVPageManager& pages_;
  std::vector<int> owner_;
  size_t n_layers_;
  int64_t max_context_, max_step_;
  std::vector<KVStore> stores_;  // [slot][layer], filled for owning layers
};

}  // namespace mb
