// Gemma 4's image encoder: the ViT of E2B/E4B (16 layers, 768 wide, clipped linears) and of
// 26B-A4B/31B (27 layers, 1152 wide, standardised output), its 3x3 pooling and the projector into
// the language model's embedding space, against backend ops. It turns one image's patches
// (preprocess.h) into the soft tokens that replace the image's placeholder run.
// Reference: transformers 5.17.0 modeling_gemma4.py (Gemma4VisionModel, Gemma4MultimodalEmbedder);
// ../shared/docs/gemma4-multimodal.md §1.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"

namespace mb::gemma4_vision {

struct VisionConfig {
  int hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  int patch_size = 16, pooling_kernel = 3, position_table = 10240;
  float rope_theta = 100.f, eps = 1e-6f;
  bool standardize = false, clipped_linears = false;
  int text_hidden = 0;  // width of the soft tokens (the language model's hidden size)
};

// config.json's vision_config (plus text_config's hidden_size); `source` names the file in errors.
VisionConfig parse_vision_config(const nlohmann::json& config, const std::string& source);

class VisionEncoder {
 public:
  // Reads model.vision_tower.* and model.embed_vision.* of a checkpoint opened with its
  // multimodal tensors; a clear error when it has none.
  VisionEncoder(std::shared_ptr<const Checkpoint> ck, Backend& backend);
  ~VisionEncoder();
  const VisionConfig& config() const { return cfg_; }

  // One image's n real patches: pixels [n, patch² · 3] in [0, 1], (pos_x, pos_y) each patch's column
  // and row on the patch grid, whose sides are multiples of the pooling kernel k.
  struct Patches {
    std::span<const float> pixels;
    std::span<const int32_t> pos_x, pos_y;
  };

  // Soft tokens [n / k², text_hidden] of one image, in raster order of the pooled grid.
  std::vector<float> encode(std::span<const float> pixels, std::span<const int32_t> pos_x,
                            std::span<const int32_t> pos_y);
  // The same for several images (a video's frames) in one pass: their patches are stacked, so each
  // matmul runs over all of them, and each image attends over its own keys only.
  std::vector<std::vector<float>> encode_batch(std::span<const Patches> images);

 private:
  struct Weights;
  std::shared_ptr<const Checkpoint> ck_;
  Backend& be_;
  VisionConfig cfg_;
  std::unique_ptr<Weights> w_;
};

}  // namespace mb::gemma4_vision
