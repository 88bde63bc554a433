#include "models/model.h"

#include <algorithm>

#include "core/splitmix64.h"
#include "models/architecture.h"

namespace mb {

namespace {
void mix(uint64_t& h, uint64_t v) {
  uint64_t x = h ^ (v + 0x9e3779b97f4a7c15ull);
  h = splitmix64_next(x);
}
}  // namespace

StepInputs step_inputs(const Batch& batch, KVMemory& kv, const ModelConfig& cfg, const Backend& backend) {
  StepInputs in;
  auto add = [&](const std::vector<int32_t>& v) {
    in.arrays.push_back({v.data(), v.size() * sizeof(int32_t), v.size() * sizeof(int32_t)});
  };
  add(batch.tokens);
  add(batch.positions);
  add(batch.logit_rows);
  bool decode = backend.can_record_steps();
  uint64_t key = 0x5354455000000000ull;  // "STEP"
  mix(key, batch.tokens.size());
  // The context to within 256 positions: backends may size their work by it (key splits).
  int32_t max_pos = 0;
  for (int32_t p : batch.positions) max_pos = std::max(max_pos, p);
  mix(key, uint64_t(max_pos) >> 8);
  for (int32_t r : batch.logit_rows) mix(key, uint64_t(r));
  for (const BatchSequence& s : batch.seqs) {
    decode = decode && s.count == 1;
    mix(key, uint64_t(s.kv_slot));
    mix(key, uint64_t(s.begin));
    mix(key, uint64_t(s.count));
    const size_t first_table = in.arrays.size();  // this sequence's tables start here
    for (int l = 0; l < cfg.n_layers; ++l) {
      if (cfg.layers[size_t(l)].kv_source != l) continue;
      const KVStore& st = kv.store(s.kv_slot, l);
      mix(key, uint64_t(reinterpret_cast<uintptr_t>(st.k.data)));
      mix(key, uint64_t(reinterpret_cast<uintptr_t>(st.v.data)));
      mix(key, uint64_t(st.capacity) << 1 | uint64_t(st.ring));
      mix(key, uint64_t(st.page_size));
      if (st.pages) {
        // Layers of one group share a table: stage it once (a sequence has one per group).
        bool seen = false;
        for (size_t i = first_table; i < in.arrays.size(); ++i) seen = seen || in.arrays[i].data == st.pages;
        if (!seen) {
          const int64_t room = (kv.max_context() + st.page_size - 1) / st.page_size;
          in.arrays.push_back({st.pages, size_t(st.n_pages) * sizeof(int32_t),
                               size_t(std::max(room, st.n_pages)) * sizeof(int32_t)});
        }
      }
      mix(key, st.pages ? 1 : 0);
    }
  }
  in.record_key = decode ? (key ? key : 1) : 0;
  return in;
}

void Model::forward_pick(const Batch& batch, KVMemory& kv, std::span<const TokenPick> picks, std::vector<int32_t>& ids) {
  std::vector<float> logits;
  forward(batch, kv, logits);
  const int64_t r = int64_t(batch.logit_rows.size()), V = config().vocab_size;
  MB_CHECK(picks.empty() || int64_t(picks.size()) == r, "forward_pick: {} picks for {} rows", picks.size(), r);
  ids.resize(size_t(r));
  std::vector<PickCandidate> scratch;
  for (int64_t i = 0; i < r; ++i) {
    const float* row = logits.data() + i * V;
    ids[size_t(i)] = picks.empty() ? Backend::first_max_or_nonfinite(row, V)
                                   : pick_row({row, size_t(V)}, picks[size_t(i)], scratch);
  }
}

std::unique_ptr<Model> load_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                  const ModelLoadOptions& opts) {
  const Architecture& arch = ck->architecture();
  return arch.make_model(std::move(ck), backend, opts);
}

}  // namespace mb
