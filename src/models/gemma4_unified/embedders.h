// The 12B "unified" Gemma 4's encoder-free media inputs: 48×48-pixel patches through LayerNorm,
// a dense layer, LayerNorm, factorised 2-D position embeddings and LayerNorm; raw 640-sample audio
// frames as they are; both then through an RMS norm without weight and a projection into the
// language model's width. Reference: transformers 5.17.0 modeling_gemma4_unified.py
// (Gemma4UnifiedVisionEmbedder, Gemma4UnifiedMultimodalEmbedder); ../shared/docs/gemma4-multimodal.md §4.
#pragma once
#include <memory>
#include <span>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"

namespace mb::gemma4_unified {

class UnifiedEmbedders {
 public:
  // Reads model.vision_embedder.*, model.embed_vision.* and model.embed_audio.* (what the
  // checkpoint has of them); clear errors when a part is missing.
  UnifiedEmbedders(std::shared_ptr<const Checkpoint> ck, Backend& backend);
  ~UnifiedEmbedders();
  bool has_vision() const;
  bool has_audio() const;
  int patch_pixels() const;  // a model patch's side (patch_size × pooling_kernel_size)
  int audio_samples_per_token() const;

  // Soft tokens [n, hidden] of one image's n merged patches: pixels [n, side² · 3] in [0, 1], positions
  // on the merged grid.
  std::vector<float> encode_image(std::span<const float> pixels, std::span<const int32_t> pos_x,
                                  std::span<const int32_t> pos_y);
  // Soft tokens [n, hidden] of n raw audio frames [n, audio_samples_per_token()].
  std::vector<float> encode_audio(std::span<const float> frames);

 private:
  struct Weights;
  std::shared_ptr<const Checkpoint> ck_;
  Backend& be_;
  std::unique_ptr<Weights> w_;
};

}  // namespace mb::gemma4_unified
