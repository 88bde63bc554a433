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
  // For a GGUF model with an mmproj file (CheckpointOptions::mmproj), made from that file.
  nlohmann::json hf_config;
  // The media preprocessors' settings when they do not come from the folder's
  // processor_config.json (an mmproj's); null otherwise.
  nlohmann::json processor_config;
  int image_tokens = 0;  // CheckpointOptions::image_tokens
  bool exact_media = false;  // CheckpointOptions::exact_media

  const Architecture& architecture() const;
};

struct CheckpointOptions {
  // Text-only runs never map the vision/audio towers' tensors.
  bool load_multimodal = false;
  // With load_multimodal and a GGUF model: llama.cpp's mmproj GGUF that holds its vision/audio
  // towers (their tensors join the registry under Hugging Face names).
  std::string mmproj = {};
  // Soft tokens an image may become (70, 140, 280, 560 or 1120); 0: the processor's setting.
  int image_tokens = 0;
  // The towers' bf16 matrices prepared for f32-accurate products instead of
  // Backend::WeightUse::MatmulRoundedInputs.
  bool exact_media = false;
};

// `path`: a Hugging Face checkpoint folder (config.json + model.safetensors or a sharded index)
// or a GGUF file, told apart by content.
std::unique_ptr<Checkpoint> open_checkpoint(const std::string& path, const CheckpointOptions& opts = {});

// Throws unless `n` is 0 or an image soft-token budget Gemma 4's processor takes (70 ... 1120).
void check_image_tokens(int n);

// Throws unless `mmproj` is an mmproj file that goes with `model` (a GGUF model of an architecture
// that reads one): the file is opened with the model's multimodal parts, as media input will.
void check_mmproj(const Checkpoint& model, const std::string& mmproj);

// The architecture of the model at `path`, reading only its config (config.json or the GGUF
// header): what a tokenizer needs to know about its model's conventions.
const Architecture& model_architecture(const std::string& path);

}  // namespace mb
