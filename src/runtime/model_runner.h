// Runs one scheduled step on the model: the chunks of every scheduled sequence go into one ragged
// Batch whose attention reads each sequence's KV through its page tables.
#pragma once
#include <vector>

#include "models/model.h"
#include "runtime/kv_pages.h"
#include "runtime/scheduler.h"

namespace mb {

class ModelRunner {
 public:
  ModelRunner(Model& model, const KVPageManager& pages, int64_t max_context, int64_t max_step);

  struct Output {
    std::vector<float> logits;      // [rows, vocab]
    std::vector<int32_t> ids;        // pick: [rows], each row's token (-1: a non-finite logit)
    std::vector<int64_t> first_row;  // per chunk: its first row in `logits` or `ids` (-1: none)
    std::vector<int64_t> n_rows;     // per chunk: rows it has (every position when all_rows[i])
  };
  // all_rows[i]: every position of chunk i gets a row; otherwise only a sampling chunk's last.
  // pick: the rows' tokens into out.ids instead of the rows into out.logits, chunk i's row picked
  // by picks[i] (no picks: each row's first maximum; Model::forward_pick).
  void run(const std::vector<ScheduledChunk>& chunks, const std::vector<bool>& all_rows, Output& out,
           bool pick = false, std::span<const TokenPick> picks = {});

 private:
  Model& model_;
  PagedKVView view_;
  Batch batch_;
  std::vector<TokenPick> row_picks_;
};

}  // namespace mb
