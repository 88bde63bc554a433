// What the runtime sees of an architecture: one forward call over a ragged batch. A prefill is a
// sequence with many new tokens, a decode step a sequence with one; both go through forward().
#pragma once
#include <memory>
#include <vector>

#include "backends/backend.h"
#include "formats/checkpoint.h"
#include "formats/model_config.h"
#include "runtime/kv_cache.h"

namespace mb {

struct BatchSequence {
  int kv_slot = 0;     // which KV slot holds this sequence's past
  int64_t begin = 0;   // its tokens are batch.tokens[begin, begin + count)
  int64_t count = 0;
};

struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;  // absolute position of each token in its sequence
  std::vector<BatchSequence> seqs;
  std::vector<int32_t> logit_rows;  // token rows whose logits are wanted, in output order
};

struct ModelLoadOptions {
  DType weight_dtype = DType::F32;  // dtype of the large matrices
  bool keep_checkpoint_dtype = true;  // "auto": use the checkpoint's own dtype
  int64_t max_step = 512;            // most tokens in one forward call
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  // Runs the batch, writing its K/V into `kv`; logits [batch.logit_rows.size(), vocab] f32 on the host.
  virtual void forward(const Batch& batch, KVCache& kv, std::vector<float>& logits) = 0;
  virtual size_t weight_bytes() const = 0;
  // Weight bytes one decode step streams: every matrix once (the tied LM head included), only
  // the routed share of MoE experts, no embedding-table rows.
  virtual size_t decode_weight_bytes() const = 0;
};

// One factory per architecture file; load_model picks by config.family.
std::unique_ptr<Model> make_gemma_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                         const ModelLoadOptions& opts);

std::unique_ptr<Model> load_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                  const ModelLoadOptions& opts);

}  // namespace mb
