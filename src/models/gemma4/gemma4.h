// Gemma 4's parts that its architecture file (architecture.cpp) assembles, and that the Gemma 3
// folder reuses: Gemma 3 runs on this decoder with its differences switched on by config, and
// names its tensors with a prefix of this table.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "models/architecture.h"
#include "models/media_encoder.h"
#include "models/model_config.h"

namespace mb {
struct ModelLoadOptions;
}

namespace mb::gemma4 {

// The text decoder (models/gemma4/model.cpp) for a Gemma 4 or Gemma 3 config.
std::unique_ptr<Model> make_decoder(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                    const ModelLoadOptions& opts);

// Its image and audio front-ends (models/gemma4/media.cpp).
std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const Checkpoint> ck, Backend& backend);

// llama.cpp's mmproj GGUF of a Gemma 4 model into `ck` (models/gemma4/mmproj.cpp): see
// Architecture::attach_mmproj.
void attach_mmproj(Checkpoint& ck, const std::string& path);

// config.json's text part (Gemma4TextConfig / Gemma4UnifiedTextConfig) -> ModelConfig.
ModelConfig parse_hf_text(const nlohmann::json& text_config, bool unified, const std::string& source);
ModelConfig parse_gguf(const GgufFile& f);
void write_gguf_metadata(const ModelConfig& c, GgufWriter& w);
// rope_freqs.weight: llama.cpp's form of the full layers' proportional RoPE.
inline constexpr std::string_view kRopeFreqsTensor = "rope_freqs.weight";
void add_rope_freqs(const ModelConfig& c, GgufWriter& w);

// llama.cpp's GGUF names against HF's. The first kCommonGlobalNames / kCommonLayerNames entries
// are the plain decoder's (Gemma 3 has exactly those).
std::span<const TensorNamePair> global_names();
std::span<const TensorNamePair> layer_names();
inline constexpr size_t kCommonGlobalNames = 3, kCommonLayerNames = 13;

// Tensors of the vision and audio towers and their projectors (Gemma 3's towers use the same
// prefixes), which text-only runs never map.
bool is_multimodal_tensor(std::string_view hf_name);

}  // namespace mb::gemma4
