#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "formats/model_config.h"

namespace mb {

// config.json (+ optional generation_config.json) -> ModelConfig, applying the defaults that
// transformers 5.17.0 applies for the same architecture. `source` names the file in errors.
ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& source,
                            const nlohmann::json* generation_config = nullptr);

}  // namespace mb
