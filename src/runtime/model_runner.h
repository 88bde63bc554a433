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
    std::vector<int32_t> ids;        // greedy: [rows], each row's first maximum (-1: a non-finite logit)
    std::vector<int64_t> first_row;  // per chunk: its first row in `logits` or `ids` (-1: none)
    std::vector<int64_t> n_rows;     // per chunk: rows it has (every position when all_rows[i])
  };
  // all_rows[i]: every position of chunk i gets a row; otherwise only a sampling chunk's last.
  // greedy: the rows' first maxima into out.ids instead of the rows into out.logits.
  void run(const std::vector<ScheduledChunk>& chunks, const std::vector<bool>& all_rows, Output& out,
           bool greedy = false);

 private:
  Model& model_;
  PagedKVView view_;
  Batch batch_;
};

}  // namespace mb
