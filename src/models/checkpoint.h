// A model on disk, whatever its format: its parsed config, the registry of its mapped tensors,
// and the architecture that reads it.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/tensor_registry.h"
#include "models/model_config.h"

namespace mb {

class Architecture;
class GgufFile;

struct Checkpoint {
  std::string path;  // folder or file the user named
  ModelConfig config;
  TensorRegistry tensors;
  // Set for GGUF files: the metadata, tokenizer.ggml.* included (export copies it). Runtimes drop
  // it once the model is loaded; tensors stay valid (the registry keeps the mapping).
  std::shared_ptr<const GgufFile> gguf;
  // config.json as read (Hugging Face folders): the vision/audio towers read their parts of it.
  nlohmann::json hf_config;

  const Architecture& architecture() const;
};

struct CheckpointOptions {
  // Text-only runs never map the vision/audio towers' tensors.
  bool load_multimodal = false;
};

// `path`: a Hugging Face checkpoint folder (config.json + model.safetensors or a sharded index)
// or a GGUF file, told apart by content.
std::unique_ptr<Checkpoint> open_checkpoint(const std::string& path, const CheckpointOptions& opts = {});

// The architecture of the model at `path`, reading only its config (config.json or the GGUF
// header): what a tokenizer needs to know about its model's conventions.
const Architecture& model_architecture(const std::string& path);

}  // namespace mb
