// Random-weight models with the real shapes of each Gemma 4 size, built in memory at the dtype
// asked for: what `markbase bench --synthetic` measures when no checkpoint is at hand.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "formats/checkpoint.h"

namespace mb {

// e2b, e4b, 12b, 26b-a4b, 31b
const std::vector<std::string>& synthetic_model_names();
// The released text_config of that size (../shared/docs/gemma4-text.md §1.1) as config.json text.
nlohmann::json synthetic_config_json(const std::string& name);
// Matrices in `dtype`, norms in f32; values drawn so activations stay O(1). Uses all cores.
std::shared_ptr<Checkpoint> make_synthetic_checkpoint(const std::string& name, DType dtype, uint64_t seed = 1);

}  // namespace mb
