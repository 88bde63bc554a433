// Mirrors transformers 5.17.0 models/gemma4/image_processing_gemma4.py (Gemma4ImageProcessor._preprocess)
// and models/gemma4_unified/image_processing_gemma4_unified.py (patches_merge); see preprocess.h.
#include "models/gemma4_vision/preprocess.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

namespace mb::gemma4_vision {

namespace {

bool supported_budget(int max_soft_tokens) {
  return std::find(kSupportedSoftTokens.begin(), kSupportedSoftTokens.end(), max_soft_tokens) !=
         kSupportedSoftTokens.end();
}

void check_budget(int max_soft_tokens) {
  MB_CHECK(supported_budget(max_soft_tokens), "image max_soft_tokens must be one of 70, 140, 280, 560, 1120, got {}",
           max_soft_tokens);
}

int int_key(const nlohmann::json& j, const char* key, int fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  MB_CHECK(j[key].is_number_integer(), "processor config: image_processor.{} must be an integer, got {}", key,
           j[key].dump());
  const int64_t v = j[key].get<int64_t>();
  MB_CHECK(v > 0 && v <= 4096, "processor config: image_processor.{} = {} is out of range", key, v);
  return int(v);
}

// Settings this preprocessing hard-wires; a config asking for something else is refused rather
// than silently processed differently from HF.
void check_fixed_setting(const nlohmann::json& j, const char* key, const nlohmann::json& expected) {
  if (!j.contains(key) || j[key].is_null()) return;
  const bool same = expected.is_number_float() ? j[key].is_number() && std::abs(j[key].get<double>() -
                                                                                 expected.get<double>()) < 1e-12
                                               : j[key] == expected;
  MB_CHECK(same, "processor config: image_processor.{} = {} is not supported (only {})", key, j[key].dump(),
           expected.dump());
}

// The float32 HF multiplies by: torch computes `uint8 tensor * (1/255)` in float32, the Python
// scalar rounded to float32 first.
const float kRescale = static_cast<float>(1.0 / 255.0);

}  // namespace

ImageProcessorConfig parse_image_processor_config(const nlohmann::json& processor_config) {
  MB_CHECK(processor_config.is_object(), "processor config: expected a JSON object");
  const nlohmann::json* ip = &processor_config;
  if (processor_config.contains("image_processor")) {
    ip = &processor_config["image_processor"];
    MB_CHECK(ip->is_object(), "processor config: image_processor must be an object");
  }
  ImageProcessorConfig cfg;
  cfg.patch_size = int_key(*ip, "patch_size", cfg.patch_size);
  cfg.pooling_kernel_size = int_key(*ip, "pooling_kernel_size", cfg.pooling_kernel_size);
  cfg.max_soft_tokens = int_key(*ip, "max_soft_tokens", cfg.max_soft_tokens);
  check_budget(cfg.max_soft_tokens);  // Gemma4ImageProcessor.__init__ raises the same
  check_fixed_setting(*ip, "do_resize", true);
  check_fixed_setting(*ip, "do_rescale", true);
  check_fixed_setting(*ip, "do_normalize", false);
  check_fixed_setting(*ip, "do_convert_rgb", true);
  check_fixed_setting(*ip, "resample", 3);  // PILImageResampling.BICUBIC
  check_fixed_setting(*ip, "rescale_factor", 1.0 / 255.0);
  return cfg;
}

VideoProcessorConfig parse_video_processor_config(const nlohmann::json& processor_config) {
  MB_CHECK(processor_config.is_object(), "processor config: expected a JSON object");
  VideoProcessorConfig cfg;
  if (!processor_config.contains("video_processor")) return cfg;
  const nlohmann::json& vp = processor_config["video_processor"];
  MB_CHECK(vp.is_object(), "processor config: video_processor must be an object");
  cfg.frame.patch_size = int_key(vp, "patch_size", cfg.frame.patch_size);
  cfg.frame.pooling_kernel_size = int_key(vp, "pooling_kernel_size", cfg.frame.pooling_kernel_size);
  cfg.frame.max_soft_tokens = int_key(vp, "max_soft_tokens", cfg.frame.max_soft_tokens);
  check_budget(cfg.frame.max_soft_tokens);
  cfg.num_frames = int_key(vp, "num_frames", cfg.num_frames);
  check_fixed_setting(vp, "do_resize", true);
  check_fixed_setting(vp, "do_rescale", true);
  check_fixed_setting(vp, "do_normalize", true);
  check_fixed_setting(vp, "do_convert_rgb", true);
  check_fixed_setting(vp, "do_sample_frames", true);
  check_fixed_setting(vp, "resample", 3);
  check_fixed_setting(vp, "rescale_factor", 1.0 / 255.0);
  check_fixed_setting(vp, "image_mean", nlohmann::json::array({0.0, 0.0, 0.0}));
  check_fixed_setting(vp, "image_std", nlohmann::json::array({1.0, 1.0, 1.0}));
  return cfg;
}

std::vector<int64_t> sample_frame_indices(int64_t total_frames, int num_frames) {
  MB_CHECK(total_frames > 0 && num_frames > 0, "cannot sample {} of {} frames", num_frames, total_frames);
  std::vector<int64_t> out;
  if (total_frames <= num_frames) {
    for (int64_t i = 0; i < total_frames; ++i) out.push_back(i);
    return out;
  }
  for (int64_t i = 0; i < num_frames; ++i) out.push_back(i * total_frames / num_frames);
  return out;
}

std::string frame_timestamp(int64_t index, double fps) {
  if (!(fps > 0)) fps = 24;
  const float t = float(index) / float(fps);
  // torch's float floor_divide and remainder (c10 div_floor_floating / `a - b * floor(a / b)`), in float32.
  const float b = 60.0f;
  float mod = std::fmod(t, b);
  float div = (t - mod) / b;
  if (mod != 0.0f && ((b < 0) != (mod < 0))) {
    mod += b;
    div -= 1.0f;
  }
  float floordiv = 0;
  if (div != 0.0f) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5f) floordiv += 1.0f;
  } else {
    floordiv = std::copysign(0.0f, t / b);
  }
  return fmt::format("{:02d}:{:02d}", int64_t(floordiv), int64_t(mod));
}

ImageSize aspect_ratio_preserving_size(ImageSize image, const ImageProcessorConfig& cfg, int max_soft_tokens) {
  const int64_t height = image.height, width = image.width;
  MB_CHECK(height > 0 && width > 0, "cannot resize a {}x{} image", width, height);
  MB_CHECK(cfg.patch_size > 0 && cfg.pooling_kernel_size > 0 && max_soft_tokens > 0,
           "image processor: patch_size, pooling_kernel_size and max_soft_tokens must be positive");
  const int64_t k2 = int64_t(cfg.pooling_kernel_size) * cfg.pooling_kernel_size;
  const int64_t max_patches = int64_t(max_soft_tokens) * k2;
  // Python: ints are exact, `/` is a correctly rounded double division, math.sqrt and `*` are IEEE
  // double; every integer here is far below 2^53, so the C++ doubles are the same numbers.
  const int64_t total_px = height * width;
  const int64_t target_px = max_patches * cfg.patch_size * cfg.patch_size;
  const double factor = std::sqrt(double(target_px) / double(total_px));
  const double ideal_height = factor * double(height);
  const double ideal_width = factor * double(width);
  const int64_t side_mult = int64_t(cfg.pooling_kernel_size) * cfg.patch_size;

  int64_t target_height = int64_t(std::floor(ideal_height / double(side_mult))) * side_mult;
  int64_t target_width = int64_t(std::floor(ideal_width / double(side_mult))) * side_mult;
  MB_CHECK(!(target_height == 0 && target_width == 0),
           "Attempting to resize to a 0 x 0 image. Resized height should be divisible by "
           "`pooling_kernel_size * patch_size`={}.",
           side_mult);

  const int64_t max_side_length = (max_patches / k2) * side_mult;
  if (target_height == 0) {
    target_height = side_mult;
    target_width = std::min(int64_t(std::floor(double(width) / double(height))) * side_mult, max_side_length);
  } else if (target_width == 0) {
    target_width = side_mult;
    target_height = std::min(int64_t(std::floor(double(height) / double(width))) * side_mult, max_side_length);
  }
  MB_CHECK(target_height * target_width <= target_px,
           "Resizing [{}x{}] to [{}x{}] but this exceeds {} patches with patch_size {}", height, width, target_height,
           target_width, max_patches, cfg.patch_size);
  return {int(target_width), int(target_height)};
}

ImagePatches preprocess_image(const RgbImage& img, const ImageProcessorConfig& cfg, int max_soft_tokens_override) {
  MB_CHECK(img.width > 0 && img.height > 0 && img.rgb.size() == size_t(img.width) * size_t(img.height) * 3,
           "preprocess: malformed {}x{} image with {} bytes", img.width, img.height, img.rgb.size());
  const int budget = max_soft_tokens_override > 0 ? max_soft_tokens_override : cfg.max_soft_tokens;
  check_budget(budget);
  const ImageSize target = aspect_ratio_preserving_size({img.width, img.height}, cfg, budget);
  const bool same_size = target == ImageSize{img.width, img.height};
  const RgbImage resized_copy = same_size ? RgbImage{} : resize_bicubic_antialias(img, target.width, target.height);
  const RgbImage& resized = same_size ? img : resized_copy;

  const int p = cfg.patch_size, k = cfg.pooling_kernel_size;
  ImagePatches out;
  out.patch_size = p;
  out.resized_w = resized.width;
  out.resized_h = resized.height;
  out.grid_w = resized.width / p;
  out.grid_h = resized.height / p;
  out.n_patches = out.grid_w * out.grid_h;
  out.n_soft_tokens = out.n_patches / (k * k);
  const size_t patch_len = size_t(p) * size_t(p) * 3;
  out.pixels.resize(size_t(out.n_patches) * patch_len);
  out.pos_x.resize(size_t(out.n_patches));
  out.pos_y.resize(size_t(out.n_patches));
  const size_t row_bytes = size_t(resized.width) * 3;
  for (int r = 0; r < out.grid_h; ++r) {
    for (int c = 0; c < out.grid_w; ++c) {
      const size_t n = size_t(r) * size_t(out.grid_w) + size_t(c);
      float* dst = &out.pixels[n * patch_len];
      for (int i = 0; i < p; ++i) {
        const uint8_t* src = &resized.rgb[(size_t(r) * size_t(p) + size_t(i)) * row_bytes + size_t(c) * size_t(p) * 3];
        if (cfg.rescale_by_division)
          for (size_t j = 0; j < size_t(p) * 3; ++j) *dst++ = float(src[j]) / 255.0f;
        else
          for (size_t j = 0; j < size_t(p) * 3; ++j) *dst++ = float(src[j]) * kRescale;
      }
      out.pos_x[n] = c;
      out.pos_y[n] = r;
    }
  }
  return out;
}

ImagePatches merge_patches_unified(const ImagePatches& in, int k) {
  const int p = in.patch_size;
  MB_CHECK(k > 0 && p > 0, "patch merge: kernel {} and patch size {} must be positive", k, p);
  MB_CHECK(in.grid_w % k == 0 && in.grid_h % k == 0 && in.n_patches == in.grid_w * in.grid_h &&
               in.pixels.size() == size_t(in.n_patches) * size_t(p) * size_t(p) * 3,
           "Cannot merge a {}x{} patch grid by {}x{}", in.grid_w, in.grid_h, k, k);
  ImagePatches out;
  out.patch_size = p * k;
  out.grid_w = in.grid_w / k;
  out.grid_h = in.grid_h / k;
  out.n_patches = out.grid_w * out.grid_h;
  out.n_soft_tokens = out.n_patches;
  out.resized_w = in.resized_w;
  out.resized_h = in.resized_h;
  out.pixels.resize(in.pixels.size());
  out.pos_x.resize(size_t(out.n_patches));
  out.pos_y.resize(size_t(out.n_patches));
  const size_t small_row = size_t(p) * 3, big_row = size_t(p) * size_t(k) * 3;
  const size_t small_len = small_row * size_t(p), big_len = big_row * size_t(p) * size_t(k);
  for (int R = 0; R < out.grid_h; ++R) {
    for (int C = 0; C < out.grid_w; ++C) {
      const size_t m = size_t(R) * size_t(out.grid_w) + size_t(C);
      float* dst = &out.pixels[m * big_len];
      // Row i of the merged patch is row i % p of the small patches in block row i / p, side by side.
      for (int i = 0; i < p * k; ++i) {
        const size_t block_row = size_t(R) * size_t(k) + size_t(i / p);
        for (int b = 0; b < k; ++b) {
          const size_t n = block_row * size_t(in.grid_w) + size_t(C) * size_t(k) + size_t(b);
          std::memcpy(dst + size_t(i) * big_row + size_t(b) * small_row,
                      &in.pixels[n * small_len + size_t(i % p) * small_row], small_row * sizeof(float));
        }
      }
      out.pos_x[m] = C;
      out.pos_y[m] = R;
    }
  }
  return out;
}

}  // namespace mb::gemma4_vision
