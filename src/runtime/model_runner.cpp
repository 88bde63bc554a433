#include "runtime/model_runner.h"

#include <algorithm>

#include "core/error.h"

namespace mb {

ModelRunner::ModelRunner(Model& model, const KVPageManager& pages, int64_t max_context, int64_t max_step)
    : model_(model), view_(pages, model.config(), max_context, max_step) {}

void ModelRunner::run(const std::vector<ScheduledChunk>& chunks, const std::vector<bool>& all_rows, Output& out,
                      bool pick, std::span<const TokenPick> picks) {
  MB_CHECK(chunks.size() == all_rows.size(), "model runner: {} chunks but {} row flags", chunks.size(),
           all_rows.size());
  batch_.tokens.clear();
  batch_.positions.clear();
  batch_.seqs.clear();
  batch_.logit_rows.clear();
  batch_.embeddings.clear();
  batch_.last_keys.clear();
  const int32_t pad = model_.config().pad_id;
  MB_CHECK(picks.empty() || picks.size() == chunks.size(), "model runner: {} picks for {} chunks", picks.size(),
           chunks.size());
  row_picks_.clear();
  out.first_row.assign(chunks.size(), -1);
  out.n_rows.assign(chunks.size(), 0);
  std::vector<const SeqPages*> pages;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ScheduledChunk& c = chunks[i];
    const int64_t begin = int64_t(batch_.tokens.size());
    for (int64_t p = c.begin; p < c.begin + c.count; ++p) {
      const int32_t t = c.seq->tokens[size_t(p)];
      batch_.tokens.push_back(t >= kMediaTokenBase ? pad : t);  // looked up as pad, as transformers does
      batch_.positions.push_back(int32_t(p));
    }
    bool sees_ahead = false;
    for (const auto& [first, end] : c.seq->unsplit) sees_ahead |= first < c.begin + c.count && c.begin < end;
    if (sees_ahead) {  // an image's tokens see up to its last, the others up to themselves
      if (batch_.last_keys.empty()) batch_.last_keys.assign(batch_.positions.begin(), batch_.positions.begin() + begin);
      for (int64_t p = c.begin; p < c.begin + c.count; ++p) {
        int32_t last = int32_t(p);
        for (const auto& [first, end] : c.seq->unsplit)
          if (p >= first && p < end) last = int32_t(end - 1);
        batch_.last_keys.push_back(last);
      }
    } else if (!batch_.last_keys.empty()) {
      for (int64_t p = c.begin; p < c.begin + c.count; ++p) batch_.last_keys.push_back(int32_t(p));
    }
    for (const MediaSpan& m : c.seq->media) {  // the part of each media span this chunk computes
      const int64_t b = std::max(m.pos, c.begin), e = std::min(m.pos + m.count, c.begin + c.count);
      if (b < e) batch_.embeddings.push_back({begin + b - c.begin, e - b, m.embeddings->data() + (b - m.pos) * model_.config().hidden_size});
    }
    batch_.seqs.push_back({int(i), begin, c.count});
    pages.push_back(&c.seq->pages);
    const int64_t rows = all_rows[i] ? c.count : c.samples ? 1 : 0;
    if (rows > 0) {
      out.first_row[i] = int64_t(batch_.logit_rows.size());
      out.n_rows[i] = rows;
      for (int64_t r = c.count - rows; r < c.count; ++r) {
        batch_.logit_rows.push_back(int32_t(begin + r));
        if (!picks.empty()) row_picks_.push_back(picks[i]);
      }
    }
  }
  view_.set(pages);
  if (pick) {
    out.logits.clear();
    model_.forward_pick(batch_, view_, row_picks_, out.ids);
  } else {
    out.ids.clear();
    model_.forward(batch_, view_, out.logits);
  }
}

}  // namespace mb
