// Gemma 4's image preprocessing: the aspect-ratio-preserving resize to a soft-token budget, the
// rescale to [0, 1] and the cut into patches, exactly as transformers 5.17.0 does it
// (models/gemma4/image_processing_gemma4.py: Gemma4ImageProcessor, the torchvision backend that
// AutoImageProcessor picks; get_aspect_ratio_preserving_size, convert_image_to_patches), and the 12B
// "unified" model's merge of k×k patches into one token (models/gemma4_unified/
// image_processing_gemma4_unified.py: patches_merge). ../shared/docs/gemma4-multimodal.md §2.1, §2.3.
#pragma once
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "media/image.h"

namespace mb::gemma4_vision {

// The soft-token budgets HF accepts (`_SUPPORTED_SOFT_TOKENS`), whatever the patch size.
inline constexpr std::array<int, 5> kSupportedSoftTokens = {70, 140, 280, 560, 1120};

struct ImageProcessorConfig {
  int patch_size = 16;
  int pooling_kernel_size = 3;
  int max_soft_tokens = 280;
  // The video processor's rescale: its do_rescale and do_normalize (mean 0, std 1) fuse into one normalize by
  // std 255, a float32 division, which differs from the image path's x · float32(1/255) by an ulp for 126 of
  // the 256 byte values.
  bool rescale_by_division = false;
};

// Gemma4VideoProcessor (models/gemma4/video_processing_gemma4.py): each sampled frame through the image
// steps at its own (smaller) budget. ../shared/docs/gemma4-multimodal.md §2.2.
struct VideoProcessorConfig {
  ImageProcessorConfig frame{16, 3, 70, true};
  int num_frames = 32;  // frames sampled uniformly (BaseVideoProcessor.sample_frames)
};

// The `video_processor` object of processor_config.json; HF's class defaults for absent keys (or no object).
VideoProcessorConfig parse_video_processor_config(const nlohmann::json& processor_config);

// BaseVideoProcessor.sample_frames with num_frames: floor(i · total / num_frames) for i < num_frames (HF's
// float arange, whose step total/num_frames and products are exact for these sizes). Where HF raises
// (fewer frames than num_frames) every frame is kept, as a user of a short clip expects.
std::vector<int64_t> sample_frame_indices(int64_t total_frames, int num_frames);

// A sampled frame's timestamp as the processor writes it into the prompt: `MM:SS` of index / fps, with
// HF's float32 arithmetic (the index is a torch int tensor, so the division, // and % run in float32).
// fps <= 0 (unknown: a list of frames) counts as 24, as Gemma4Processor.replace_video_token assumes.
std::string frame_timestamp(int64_t index, double fps);

// The `image_processor` object of processor_config.json (or a flat preprocessor_config.json);
// HF's class defaults for absent keys. Throws mb::Error for values HF would reject.
ImageProcessorConfig parse_image_processor_config(const nlohmann::json& processor_config);

struct ImageSize {
  int width = 0, height = 0;
  bool operator==(const ImageSize&) const = default;
};

// get_aspect_ratio_preserving_size: the largest size with both sides multiples of
// patch_size × pooling_kernel_size and at most max_soft_tokens × pooling_kernel_size² patches, with
// HF's float arithmetic (so the same rounding) and its errors (as mb::Error). `max_soft_tokens` is
// not checked against kSupportedSoftTokens here.
ImageSize aspect_ratio_preserving_size(ImageSize image, const ImageProcessorConfig& cfg, int max_soft_tokens);

// One image's real patches (HF pads to a fixed count; the padding rows are left out here).
struct ImagePatches {
  int n_patches = 0;
  int grid_w = 0, grid_h = 0;  // the patch grid: n_patches == grid_w * grid_h
  int patch_size = 0;          // pixels on a patch's side
  int n_soft_tokens = 0;       // the image's placeholder count in the prompt
  std::vector<float> pixels;   // [n_patches, patch_size² · 3] in [0, 1]; inside a patch rows, then
                               // columns, then RGB; patches in raster order of the grid
  std::vector<int32_t> pos_x, pos_y;  // each patch's column and row on the grid
  int resized_w = 0, resized_h = 0;   // the image size the patches were cut from
};

// Gemma4ImageProcessor on one decoded image: resize (skipped when the size does not change),
// x · float32(1/255), patchify. `max_soft_tokens_override` > 0 replaces cfg.max_soft_tokens (HF's
// `max_soft_tokens` call argument); either must be one of kSupportedSoftTokens, as HF requires.
ImagePatches preprocess_image(const RgbImage& img, const ImageProcessorConfig& cfg, int max_soft_tokens_override = 0);

// The 12B unified processor's patches_merge: each k×k block of patches becomes one patch of side
// patch_size · k (the same vector as patchifying the resized image directly at that size), at
// position (x / k, y / k), in raster order of the coarse grid. One merged patch is one soft token.
ImagePatches merge_patches_unified(const ImagePatches& patches, int pooling_kernel_size);

}  // namespace mb::gemma4_vision
