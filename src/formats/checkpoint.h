// A model on disk, whatever its format: parsed config + registry of mapped tensors.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/model_config.h"
#include "formats/tensor_registry.h"

namespace mb {

class GgufFile;

struct Checkpoint {
  std::string path;  // folder or file the user named
  ModelConfig config;
  TensorRegistry tensors;
  // Set for .gguf files: the metadata, tokenizer.ggml.* included (export copies it). Runtimes drop
  // it once the model is loaded; tensors stay valid (the registry keeps the mapping).
  std::shared_ptr<const GgufFile> gguf;
};

struct CheckpointOptions {
  // Text-only runs never map the vision/audio towers' tensors.
  bool load_multimodal = false;
};

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& path, const CheckpointOptions& opts = {});

}  // namespace mb
