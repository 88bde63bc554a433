// A GGUF model (general.architecture gemma3 or gemma4) seen as the Hugging Face checkpoint it was
// converted from: a ModelConfig resolved from the `<arch>.*` keys as llama.cpp reads them, and
// tensors registered under HF names (prefix "model.", so model code never knows the format).
// Reference: llama.cpp convert_hf_to_gguf.py (Gemma3Model, Gemma4Model), gguf-py constants,
// src/llama-model.cpp hparams; ../shared/docs/gemma4-text.md §3.2.
#pragma once
#include <memory>
#include <string>

#include "formats/gguf.h"
#include "formats/model_config.h"

namespace mb {

ModelConfig gguf_model_config(const GgufFile& f);

// HF name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight",
// "output.weight" -> "lm_head.weight"); "" for tensors no HF checkpoint has (rope_freqs.weight,
// folded into the config); unknown names are returned unchanged.
std::string gguf_to_hf_name(const std::string& gguf_name);
// The inverse for the names above, "" for an HF name with no GGUF counterpart.
std::string hf_to_gguf_name(const std::string& hf_name);

// Opens `path`, fills `config` and registers its tensors under HF names.
std::shared_ptr<GgufFile> load_gguf_model(const std::string& path, ModelConfig& config, TensorRegistry& reg);

}  // namespace mb
