// Random-weight models with the real shapes of each Gemma 4 size, built in memory at the dtype
// asked for: what `markbase bench --synthetic` measures when no checkpoint is at hand.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/checkpoint.h"

namespace mb {

// e2b, e4b, 12b, 26b-a4b, 31b, and tiny: an E2B-like model (PLE, KV sharing, double-wide MLP, the
// full 262144-token vocabulary) with hidden size 64 and 4 layers, a few MB, for tests.
const std::vector<std::string>& synthetic_model_names();
// The released text_config of that size (../shared/docs/gemma4-text.md §1.1) as config.json text.
nlohmann::json synthetic_config_json(const std::string& name);
// Matrices (the embedding and PLE tables included) in `dtype`, norms and scalars in f32; values
// drawn so activations stay O(1). `dtype` may be F32, BF16, F16 or a block type (Q8_0, Q4_0,
// Q4_K, ...): block-type rows are drawn in f32 and quantized row by row (mb::quantize_row), and a
// matrix whose rows are not whole blocks stays BF16, as llama.cpp leaves it. Only the final
// weights are held. The values do not depend on the thread count. Uses all cores.
std::shared_ptr<Checkpoint> make_synthetic_checkpoint(const std::string& name, DType dtype, uint64_t seed = 1);
// The dtype make_synthetic_checkpoint gives a matrix whose rows have `cols` elements.
DType synthetic_matrix_dtype(DType dtype, int64_t cols);

}  // namespace mb
