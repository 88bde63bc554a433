// The host-side half of a media item, which the GPU path runs on one thread before any kernel (the
// media_vs_transformers.py figures include it):
//   Media/decode_png            a 1024x768 photo-like PNG (bench/media_vs_transformers.py's input size) to RGB
//   Media/resize                its resize alone (bicubic, antialias), to 864x624
//   Media/image_preprocess      its resize to the 280-token size and the cut into patches
//   Media/audio_features        30 s of 16 kHz audio to log-mel features
//   ./build/bench/markbase_bench --benchmark_filter=Media
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "media/image.h"
#include "models/gemma4_audio/features.h"
#include "models/gemma4_vision/preprocess.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb/stb_image_write.h>

namespace {

// Smooth gradients with noise, so the PNG compresses as a photo does (not as flat colour).
mb::RgbImage photo_like(int w, int h) {
  mb::RgbImage img{w, h, std::vector<uint8_t>(size_t(w) * size_t(h) * 3)};
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> noise(-12, 12);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        const double v = 128 + 90 * std::sin(0.011 * x * (c + 1) + 0.007 * y) * std::cos(0.005 * y * (3 - c));
        img.rgb[(size_t(y) * size_t(w) + size_t(x)) * 3 + size_t(c)] =
            uint8_t(std::clamp(int(v) + noise(rng), 0, 255));
      }
  return img;
}

std::vector<uint8_t> encode_png(const mb::RgbImage& img) {
  std::vector<uint8_t> out;
  stbi_write_png_to_func(
      [](void* ctx, void* data, int size) {
        auto* v = static_cast<std::vector<uint8_t>*>(ctx);
        v->insert(v->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
      },
      &out, img.width, img.height, 3, img.rgb.data(), img.width * 3);
  return out;
}

void BM_DecodePng(benchmark::State& state) {
  const std::vector<uint8_t> png = encode_png(photo_like(1024, 768));
  for (auto _ : state) benchmark::DoNotOptimize(mb::decode_image(png, "photo.png").rgb.data());
  state.counters["MB"] = double(png.size()) / 1e6;
}
BENCHMARK(BM_DecodePng)->Name("Media/decode_png")->Unit(benchmark::kMillisecond);

void BM_Resize(benchmark::State& state) {
  const mb::RgbImage img = photo_like(1024, 768);
  for (auto _ : state) benchmark::DoNotOptimize(mb::resize_bicubic_antialias(img, 864, 624).rgb.data());
}
BENCHMARK(BM_Resize)->Name("Media/resize")->Unit(benchmark::kMillisecond);

void BM_ImagePreprocess(benchmark::State& state) {
  const mb::RgbImage img = photo_like(1024, 768);
  const mb::gemma4_vision::ImageProcessorConfig cfg;  // patch 16, pooling 3, 280 soft tokens
  int patches = 0;
  for (auto _ : state) {
    const mb::gemma4_vision::ImagePatches p = mb::gemma4_vision::preprocess_image(img, cfg);
    patches = p.n_patches;
    benchmark::DoNotOptimize(p.pixels.data());
  }
  state.counters["patches"] = patches;
}
BENCHMARK(BM_ImagePreprocess)->Name("Media/image_preprocess")->Unit(benchmark::kMillisecond);

void BM_AudioFeatures(benchmark::State& state) {
  std::vector<float> wave(size_t(30 * 16000));
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.f, 0.05f);
  for (size_t i = 0; i < wave.size(); ++i)
    wave[i] = 0.3f * std::sin(float(i) * 0.06f) * std::sin(float(i) * 0.0004f) + noise(rng);
  int frames = 0;
  for (auto _ : state) {
    const mb::gemma4_audio::AudioFeatures f = mb::gemma4_audio::extract_features(wave);
    frames = f.n_frames;
    benchmark::DoNotOptimize(f.mel.data());
  }
  state.counters["frames"] = frames;
}
BENCHMARK(BM_AudioFeatures)->Name("Media/audio_features")->Unit(benchmark::kMillisecond);

}  // namespace
