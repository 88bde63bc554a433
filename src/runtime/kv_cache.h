// KV memory for a set of sequence slots. Each layer that computes KV gets a store per slot:
// sliding layers a ring of (window - 1 + max_step) rows, full layers `max_context` rows; KV-shared
// layers alias their source layer's store and own nothing. So memory follows what the model
// needs, not layers x context.
#pragma once
#include <vector>

#include "backends/backend.h"
#include "models/model.h"

namespace mb {

// Prompts are prefilled in steps of at most this many tokens: a step's activations stay a few MB
// per thousand of hidden size, and the sliding layers' rings hold window - 1 + this many rows.
inline constexpr int64_t kMaxStepTokens = 512;
// The step limit of models that attend to images bidirectionally: the largest image whole.
inline constexpr int64_t kMaxMediaStepTokens = 1152;

struct KVCacheOptions {
  int n_slots = 1;          // sequences held at once
  int64_t max_context = 0;  // tokens per sequence
  int64_t max_step = kMaxStepTokens;  // most new tokens of one sequence in one forward call
};

class KVCache final : public KVMemory {
 public:
  KVCache(const ModelConfig& cfg, Backend& backend, const KVCacheOptions& opts);

  KVStore& store(int slot, int layer) override {
    return stores_[size_t(slot) * n_layers_ + size_t(owner_[size_t(layer)])];
  }
  int64_t max_context() const override { return opts_.max_context; }
  int64_t max_step() const override { return opts_.max_step; }
  int n_slots() const { return opts_.n_slots; }
  size_t bytes() const { return bytes_; }

 private:
  KVCacheOptions opts_;
  size_t n_layers_;
  std::vector<int> owner_;  // layer -> layer whose store it uses
  std::vector<KVStore> stores_;
  size_t bytes_ = 0;
};

}  // namespace mb
