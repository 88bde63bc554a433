// KV memory for a set of sequence slots. Each layer that computes KV gets a store per slot:
// sliding layers a ring of (window - 1 + max_step) rows, full layers `max_context` rows; KV-shared
// layers alias their source layer's store and own nothing. So memory follows what the model
// needs, not layers x context.
#pragma once
#include <vector>

#include "backends/backend.h"
#include "formats/model_config.h"

namespace mb {

struct KVCacheOptions {
  int n_slots = 1;          // sequences held at once
  int64_t max_context = 0;  // tokens per sequence
  int64_t max_step = 512;   // most new tokens of one sequence in one forward call
};

class KVCache {
 public:
  KVCache(const ModelConfig& cfg, Backend& backend, const KVCacheOptions& opts);

  KVStore& store(int slot, int layer) { return stores_[size_t(slot) * n_layers_ + size_t(owner_[size_t(layer)])]; }
  int64_t max_context() const { return opts_.max_context; }
  int64_t max_step() const { return opts_.max_step; }
  int n_slots() const { return opts_.n_slots; }
  size_t bytes() const { return bytes_; }
  // Positions already stored for a slot; the runtime advances it after each step.
  int64_t& length(int slot) { return lengths_[size_t(slot)]; }
  void clear(int slot) { lengths_[size_t(slot)] = 0; }

 private:
  KVCacheOptions opts_;
  size_t n_layers_;
  std::vector<int> owner_;  // layer -> layer whose store it uses
  std::vector<KVStore> stores_;
  std::vector<int64_t> lengths_;
  size_t bytes_ = 0;
};

}  // namespace mb
