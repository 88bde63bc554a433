// What the runtime sees of an architecture: one forward call over a ragged batch. A prefill is a
// sequence with many new tokens, a decode step a sequence with one; both go through forward().
#pragma once
#include <memory>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"
#include "models/model_config.h"

namespace mb {

// The KV memory a forward call writes each sequence's new keys and values to and attends over.
// The runtime owns it (runtime/kv_cache.h); a model sees only this.
class KVMemory {
 public:
  virtual ~KVMemory() = default;
  // The store a layer reads for the sequence in `slot` (KV-shared layers get their source's).
  virtual KVStore& store(int slot, int layer) = 0;
  virtual int64_t max_context() const = 0;  // positions a sequence may reach
  virtual int64_t max_step() const = 0;     // most new tokens of one sequence in one call
};

struct BatchSequence {
  int kv_slot = 0;     // which KV slot holds this sequence's past
  int64_t begin = 0;   // its tokens are batch.tokens[begin, begin + count)
  int64_t count = 0;
};

// Rows of a batch whose input embedding is given rather than looked up: media soft tokens, which
// replace their placeholders' embeddings. data [count, hidden] f32 on the host, valid through the
// forward call. The rows' tokens should be the pad id: transformers looks placeholders up as pad for
// the per-layer embeddings.
struct EmbeddingRows {
  int64_t row = 0, count = 0;
  const float* data = nullptr;
};

struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;  // absolute position of each token in its sequence
  std::vector<BatchSequence> seqs;
  std::vector<int32_t> logit_rows;  // token rows whose logits are wanted, in output order
  std::vector<EmbeddingRows> embeddings;
  // Empty, or for each token the last key position its sliding-window attention sees: its own
  // position, or an image's last for the image's tokens (ModelConfig::bidirectional_images).
  std::vector<int32_t> last_keys;
};

struct ModelLoadOptions {
  DType weight_dtype = DType::F32;  // dtype of the large matrices
  bool keep_checkpoint_dtype = true;  // "auto": use the checkpoint's own dtype
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  // Runs the batch, writing its K/V into `kv`; logits [batch.logit_rows.size(), vocab] f32 on the host.
  virtual void forward(const Batch& batch, KVMemory& kv, std::vector<float>& logits) = 0;
  // forward, but each logit row's token instead of the row: picks[i] chooses row i's
  // (Backend::sample_rows; no picks: every row's first maximum), -1 for a row with a non-finite
  // logit. Decoding on a GPU then copies 4 bytes a row instead of the vocabulary.
  virtual void forward_pick(const Batch& batch, KVMemory& kv, std::span<const TokenPick> picks,
                            std::vector<int32_t>& ids);
  virtual size_t weight_bytes() const = 0;
  // Weight bytes one decode step streams: every matrix once (the tied LM head included), only
  // the routed share of MoE experts, no embedding-table rows.
  virtual size_t decode_weight_bytes() const = 0;
};

// What a forward call hands the backend before its ops: the step's host arrays for
// Backend::stage (ids, positions, logit rows, then each sequence's page tables in the order the
// layers first use them, each with room for a max_context sequence so the layout does not move as
// it grows), and the key a decode step may be recorded under (0: not recorded - a step that
// prefills, or a backend that cannot record). The key covers everything the ops take but the
// staged data: the batch's shape, each sequence's KV stores, and the longest context to within 256
// positions (a backend may size work by it; Backend::attention_batch's doc says how).
struct StepInputs {
  std::vector<HostArray> arrays;
  uint64_t record_key = 0;
};
StepInputs step_inputs(const Batch& batch, KVMemory& kv, const ModelConfig& cfg, const Backend& backend);

// The forward pass of the checkpoint's architecture (models/architecture.h).
std::unique_ptr<Model> load_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                  const ModelLoadOptions& opts);

}  // namespace mb
