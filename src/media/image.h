// Image files in, 8-bit RGB out, and the antialiased bicubic resize that vision preprocessors run.
// Decoding follows what transformers' `load_image` (image_utils.py, 5.17.0) does with a file: Pillow's
// `Image.open`, `ImageOps.exif_transpose`, `convert("RGB")`. The resize reproduces
// `torchvision.transforms.v2.functional.resize(uint8, BICUBIC, antialias=True)` on CPU bit for bit.
// No model knowledge here: the Gemma 4 patch rules live in models/gemma4_vision/preprocess.h.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mb {

struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // height × width × 3, row-major, channels interleaved
};

// Larger files are refused before any pixel memory is allocated (a header can claim anything).
inline constexpr int kMaxImageSide = 16384;
inline constexpr int64_t kMaxImagePixels = int64_t(1) << 28;

// PNG, JPEG, GIF (first frame), BMP and WebP (first frame if animated), told apart by their magic
// bytes.
// As Pillow's convert("RGB"): grey is replicated, alpha is dropped without compositing (a fully
// transparent pixel keeps its colour), palettes are expanded, 16-bit channels keep their high byte
// except 16-bit grey, which is clipped to 255 (Pillow's "I;16" -> "RGB"). An EXIF orientation tag
// (JPEG APP1, PNG eXIf, WebP EXIF) is applied as `ImageOps.exif_transpose` does.
// Throws mb::Error naming `what` (typically the file path) for empty, truncated, corrupt,
// unsupported or oversized input.
RgbImage decode_image(std::span<const uint8_t> bytes, const std::string& what);

// Reads `path` and decodes it with decode_image.
RgbImage read_image_file(const std::string& path);

// `src` resized to out_w × out_h like torchvision's resize(uint8 CHW tensor, [out_h, out_w],
// InterpolationMode.BICUBIC, antialias=True) on an x86 CPU: uint8 in, uint8 out, the same integers.
// Returns a copy when the size is unchanged. Output sides >= 1, at most kMaxImagePixels pixels.
RgbImage resize_bicubic_antialias(const RgbImage& src, int out_w, int out_h);

}  // namespace mb
