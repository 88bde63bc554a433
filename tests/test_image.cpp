// Image decoding, the torchvision-exact resize and Gemma 4 image preprocessing against what Pillow,
// torchvision and transformers 5.17.0 produce (tests/fixtures/images, written by
// tools/reference/make_image_cases.py; its docstring describes every file and key).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "media/image.h"
#include "models/gemma4_vision/preprocess.h"
#include "media/file.h"
#include "test_util.h"

namespace {

using mb::RgbImage;
using mb::gemma4_vision::ImagePatches;
using mb::gemma4_vision::ImageProcessorConfig;
using mb::gemma4_vision::ImageSize;

std::string image_fixture(const std::string& name) { return mbtest::fixture("images") + "/" + name; }

const nlohmann::json& cases() {
  static const nlohmann::json j = mbtest::read_json(image_fixture("cases.json"));
  return j;
}

// The fixtures' fingerprint: sum_i v_i * (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) mod 2^64.
class Fingerprint {
 public:
  void add(uint32_t v) { sum_ += uint64_t(v) * (i_++ * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull); }
  std::string hex() const { return fmt::format("{:016x}", sum_); }

 private:
  uint64_t sum_ = 0, i_ = 0;
};

std::string fingerprint(const std::vector<uint8_t>& v) {
  Fingerprint f;
  for (uint8_t x : v) f.add(x);
  return f.hex();
}

std::string fingerprint(const std::vector<float>& v) {
  Fingerprint f;
  for (float x : v) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    f.add(bits);
  }
  return f.hex();
}

// Number of differing bytes and the largest difference.
std::pair<size_t, int> compare(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t n = 0;
  int worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const int d = std::abs(int(a[i]) - int(b[i]));
    n += d != 0;
    worst = std::max(worst, d);
  }
  return {n, worst};
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mb::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---------------------------------------------------------------------------------------------
// Decoding

TEST(ImageDecode, MatchesPillowOnEveryFixture) {
  int checked = 0;
  for (const auto& c : cases()["decode"]) {
    if (!c["ok"].get<bool>()) continue;
    const std::string file = c["file"];
    SCOPED_TRACE(file);
    const RgbImage img = mb::read_image_file(image_fixture(file));
    EXPECT_EQ(img.width, c["width"].get<int>());
    EXPECT_EQ(img.height, c["height"].get<int>());
    if (fingerprint(img.rgb) != c["fingerprint"].get<std::string>()) {
      const RgbImage pil = mb::read_image_file(image_fixture(c["decoded_png"]));
      const auto [n, worst] = compare(img.rgb, pil.rgb);
      ADD_FAILURE() << n << " of " << img.rgb.size() << " values differ from Pillow's, by up to " << worst;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 19);
}

TEST(ImageDecode, DropsAlphaWithoutCompositingAndAppliesExifOrientation) {
  // rgba_64x48.png: the top-left 20x16 block is fully transparent yet keeps its colour.
  const RgbImage rgba = mb::read_image_file(image_fixture("rgba_64x48.png"));
  const RgbImage pil = mb::read_image_file(image_fixture("decoded/rgba_64x48.png.png"));
  EXPECT_EQ(rgba.rgb, pil.rgb);
  EXPECT_NE(std::vector<uint8_t>(rgba.rgb.begin(), rgba.rgb.begin() + 3), std::vector<uint8_t>(3, 0));
  // Stored 33x20 and 30x20 with EXIF orientations 6 and 8: upright they are 20 wide.
  for (const char* f : {"oriented6_33x20.jpg", "oriented8_30x20.png"}) {
    const RgbImage img = mb::read_image_file(image_fixture(f));
    EXPECT_EQ(img.width, 20) << f;
  }
}

TEST(ImageDecode, RefusesBadFilesWithClearErrors) {
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"truncated.png", "cannot decode this PNG file"},
      {"truncated.jpg", "truncated"},
      {"empty.png", "empty file"},
      {"not_an_image.txt", "not a supported image"},
  };
  for (const auto& [file, words] : expected) {
    const std::string path = image_fixture(file);
    const std::string msg = error_of([&] { mb::read_image_file(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(words), std::string::npos) << msg;
  }
  const std::string missing = image_fixture("no_such_file.png");
  EXPECT_NE(error_of([&] { mb::read_image_file(missing); }).find("cannot open"), std::string::npos);
}

TEST(ImageDecode, RefusesHugeDimensionsBeforeAllocating) {
  auto put_be32 = [](std::vector<uint8_t>& b, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) b[at + size_t(i)] = uint8_t(v >> (24 - 8 * i));
  };
  auto put_le = [](std::vector<uint8_t>& b, size_t at, uint32_t v, int n) {
    for (int i = 0; i < n; ++i) b[at + size_t(i)] = uint8_t(v >> (8 * i));
  };
  std::vector<std::pair<std::string, std::vector<uint8_t>>> forged;
  {
    auto png = mb::read_media_file(image_fixture("photo_97x61.png"));  // IHDR width, height at 16, 20
    put_be32(png, 16, 100000);
    put_be32(png, 20, 100000);
    forged.emplace_back("png", png);
  }
  {
    auto jpg = mb::read_media_file(image_fixture("photo_131x89.jpg"));
    for (size_t i = 2; i + 9 < jpg.size(); ++i) {
      if (jpg[i] == 0xFF && jpg[i + 1] == 0xC0) {  // SOF0: length, precision, height, width
        jpg[i + 5] = 0xEA, jpg[i + 6] = 0x60, jpg[i + 7] = 0xEA, jpg[i + 8] = 0x60;  // 60000 x 60000
        break;
      }
    }
    forged.emplace_back("jpeg", jpg);
  }
  {
    auto gif = mb::read_media_file(image_fixture("anim_40x30.gif"));
    put_le(gif, 6, 60000, 2);
    put_le(gif, 8, 60000, 2);
    forged.emplace_back("gif", gif);
  }
  {
    auto bmp = mb::read_media_file(image_fixture("bmp_23x17.bmp"));  // BITMAPINFOHEADER width, height at 18, 22
    put_le(bmp, 18, 1000000, 4);
    put_le(bmp, 22, 1000000, 4);
    forged.emplace_back("bmp", bmp);
  }
  for (const auto& [name, bytes] : forged) {
    const std::string msg = error_of([&] { mb::decode_image(bytes, "forged." + name); });
    EXPECT_NE(msg.find("forged." + name), std::string::npos) << msg;
    EXPECT_NE(msg.find("larger than"), std::string::npos) << msg;
  }
}

// Truncated and corrupted versions of every fixture decode or throw mb::Error; never anything
// else (run under ASan/UBSan in CI).
TEST(ImageDecode, SurvivesTruncatedAndCorruptedBytes) {
  std::mt19937 rng(7);
  int decoded = 0, refused = 0;
  for (const auto& c : cases()["decode"]) {
    if (!c["ok"].get<bool>()) continue;
    const auto bytes = mb::read_media_file(image_fixture(c["file"]));
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<uint8_t> b = bytes;
      if (trial < 16) {
        b.resize(b.size() * size_t(trial) / 16);
      } else {
        for (int k = 0; k < 1 + trial % 4; ++k) b[rng() % b.size()] = uint8_t(rng());
      }
      try {
        const RgbImage img = mb::decode_image(b, "fuzzed");
        EXPECT_EQ(img.rgb.size(), size_t(img.width) * size_t(img.height) * 3);
        ++decoded;
      } catch (const mb::Error&) {
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded, 0);
}

// ---------------------------------------------------------------------------------------------
// Resize

TEST(ImageResize, MatchesTorchvisionBitExactly) {
  const auto blob = mb::read_media_file(image_fixture(cases()["resize_cases"]["file"]));
  const int count = cases()["resize_cases"]["count"];
  size_t at = 0;
  for (int i = 0; i < count; ++i) {
    ASSERT_LE(at + 16, blob.size());
    int32_t dims[4];
    std::memcpy(dims, &blob[at], 16);
    at += 16;
    const auto [w, h, ow, oh] = dims;
    SCOPED_TRACE(fmt::format("{}x{} -> {}x{}", w, h, ow, oh));
    const size_t in_len = size_t(w) * size_t(h) * 3, out_len = size_t(ow) * size_t(oh) * 3;
    ASSERT_LE(at + in_len + out_len, blob.size());
    const RgbImage src{w, h, std::vector<uint8_t>(blob.begin() + long(at), blob.begin() + long(at + in_len))};
    const std::vector<uint8_t> expected(blob.begin() + long(at + in_len), blob.begin() + long(at + in_len + out_len));
    at += in_len + out_len;
    const RgbImage out = mb::resize_bicubic_antialias(src, ow, oh);
    ASSERT_EQ(out.width, ow);
    ASSERT_EQ(out.height, oh);
    const auto [n, worst] = compare(out.rgb, expected);
    EXPECT_EQ(n, 0u) << "differ by up to " << worst;
  }
  EXPECT_EQ(at, blob.size());
}

TEST(ImageResize, RejectsBadSizes) {
  const RgbImage img{2, 2, std::vector<uint8_t>(12, 7)};
  EXPECT_EQ(mb::resize_bicubic_antialias(img, 2, 2).rgb, img.rgb);
  EXPECT_THROW(mb::resize_bicubic_antialias(img, 0, 5), mb::Error);
  EXPECT_THROW(mb::resize_bicubic_antialias(img, 1 << 16, 1 << 16), mb::Error);
  EXPECT_THROW(mb::resize_bicubic_antialias(RgbImage{3, 3, std::vector<uint8_t>(5)}, 4, 4), mb::Error);
}

// ---------------------------------------------------------------------------------------------
// Gemma 4 preprocessing

ImageProcessorConfig config_of(const nlohmann::json& c) {
  return {c.value("patch_size", 16), c.value("pooling_kernel_size", 3), c["max_soft_tokens"].get<int>()};
}

TEST(ImagePreprocess, SizeRuleWorkedExamples) {
  // ../shared/docs/gemma4-multimodal.md §2.1, width x height.
  struct Example {
    int w, h, budget, rw, rh, tokens;
  };
  for (const Example& e : std::vector<Example>{{640, 480, 280, 912, 672, 266},
                                               {1024, 1024, 280, 768, 768, 256},
                                               {1920, 1080, 280, 1056, 576, 264},
                                               {1024, 1024, 70, 384, 384, 64},
                                               {1024, 1024, 1120, 1584, 1584, 1089},
                                               {224, 224, 280, 768, 768, 256}}) {
    const ImageSize s = mb::gemma4_vision::aspect_ratio_preserving_size({e.w, e.h}, {}, e.budget);
    EXPECT_EQ(s, (ImageSize{e.rw, e.rh})) << e.w << "x" << e.h << " at " << e.budget;
    EXPECT_EQ((s.width / 48) * (s.height / 48), e.tokens);
  }
  for (const auto& c : cases()["sizes"]) {
    const ImageSize s =
        mb::gemma4_vision::aspect_ratio_preserving_size({c["width"], c["height"]}, config_of(c), c["max_soft_tokens"]);
    EXPECT_EQ(s, (ImageSize{c["resized_w"], c["resized_h"]})) << c.dump();
  }
}

TEST(ImagePreprocess, RefusesBudgetsTransformersRefuses) {
  const RgbImage img{3, 2, std::vector<uint8_t>(18, 100)};
  for (const auto& c : cases()["errors"]) {
    const int budget = c["max_soft_tokens"];
    const ImageProcessorConfig cfg{4, 2, 70};
    // 0 means "no override" here, so test it through the config instead.
    const std::string msg = budget == 0 ? error_of([&] { mb::gemma4_vision::preprocess_image(img, {4, 2, 0}); })
                                        : error_of([&] { mb::gemma4_vision::preprocess_image(img, cfg, budget); });
    EXPECT_NE(msg.find("must be one of 70, 140, 280, 560, 1120, got " + std::to_string(budget)), std::string::npos)
        << msg;
  }
}

TEST(ImagePreprocess, RescaleIsTorchsFloat32Multiply) {
  // 384x384 keeps its size at 70 tokens, so the patches hold the input values x * float32(1/255).
  RgbImage img{384, 384, std::vector<uint8_t>(384 * 384 * 3)};
  for (size_t i = 0; i < img.rgb.size(); ++i) img.rgb[i] = uint8_t(i % 256);
  const ImagePatches p = mb::gemma4_vision::preprocess_image(img, {16, 3, 70});
  ASSERT_EQ(p.resized_w, 384);
  const auto& bits = cases()["rescale_f32_bits"];
  ASSERT_EQ(bits.size(), 256u);
  // Patch 0, row 0 holds input bytes 0..47; row 1 starts at 384 * 3.
  for (int v = 0; v < 48; ++v) {
    uint32_t b;
    std::memcpy(&b, &p.pixels[size_t(v)], 4);
    EXPECT_EQ(b, bits[size_t(v)].get<uint32_t>()) << v;
  }
  for (int v = 0; v < 256; ++v) {
    const float f = float(v) * static_cast<float>(1.0 / 255.0);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    EXPECT_EQ(b, bits[size_t(v)].get<uint32_t>()) << v;
  }
}

TEST(ImagePreprocess, MatchesTransformersOnEveryFixture) {
  int checked = 0;
  for (const auto& c : cases()["preprocess"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const RgbImage img = mb::read_image_file(image_fixture(c["file"]));
    const ImagePatches p = mb::gemma4_vision::preprocess_image(img, config_of(c));
    EXPECT_EQ(p.resized_w, c["resized_w"].get<int>());
    EXPECT_EQ(p.resized_h, c["resized_h"].get<int>());
    EXPECT_EQ(p.grid_w, c["grid_w"].get<int>());
    EXPECT_EQ(p.grid_h, c["grid_h"].get<int>());
    EXPECT_EQ(p.n_patches, c["n_patches"].get<int>());
    EXPECT_EQ(p.n_soft_tokens, c["n_soft_tokens"].get<int>());
    ASSERT_EQ(p.pos_x.size(), size_t(p.n_patches));
    for (int n = 0; n < p.n_patches; ++n) {
      ASSERT_EQ(p.pos_x[size_t(n)], n % p.grid_w);
      ASSERT_EQ(p.pos_y[size_t(n)], n / p.grid_w);
    }
    if (fingerprint(p.pixels) != c["pixels_fingerprint"].get<std::string>()) {
      // Tell a resize difference from a layout one.
      const RgbImage r = mb::resize_bicubic_antialias(img, p.resized_w, p.resized_h);
      ADD_FAILURE() << "pixel_values differ; the resized image "
                    << (fingerprint(r.rgb) == c["resized_fingerprint"].get<std::string>() ? "matches" : "differs");
    }
    double sum = 0;
    for (float v : p.pixels) sum += v;
    EXPECT_NEAR(sum, c["pixels_sum"].get<double>(), 1e-6 * std::max(1.0, std::abs(sum)));
    if (c.contains("resized_png")) {
      const RgbImage expected = mb::read_image_file(image_fixture(c["resized_png"]));
      const RgbImage r = mb::resize_bicubic_antialias(img, p.resized_w, p.resized_h);
      const auto [n, worst] = compare(r.rgb, expected.rgb);
      EXPECT_EQ(n, 0u) << "resized pixels differ by up to " << worst;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 57);
}

TEST(ImagePreprocess, ParsesProcessorConfig) {
  // What Gemma4Processor.save_pretrained writes (image_processor nested among the other parts).
  const auto saved = mbtest::read_json(image_fixture("processor_config.json"));
  const ImageProcessorConfig cfg = mb::gemma4_vision::parse_image_processor_config(saved);
  EXPECT_EQ(cfg.patch_size, 4);
  EXPECT_EQ(cfg.pooling_kernel_size, 2);
  EXPECT_EQ(cfg.max_soft_tokens, 70);
  // A flat preprocessor_config.json, and defaults for absent keys.
  const ImageProcessorConfig flat =
      mb::gemma4_vision::parse_image_processor_config(saved["image_processor"]);
  EXPECT_EQ(flat.patch_size, 4);
  const ImageProcessorConfig defaults = mb::gemma4_vision::parse_image_processor_config(nlohmann::json::object());
  EXPECT_EQ(defaults.patch_size, 16);
  EXPECT_EQ(defaults.pooling_kernel_size, 3);
  EXPECT_EQ(defaults.max_soft_tokens, 280);
  for (const char* bad : {R"({"image_processor": {"max_soft_tokens": 100}})",
                          R"({"image_processor": {"patch_size": "16"}})", R"({"image_processor": {"patch_size": 0}})",
                          R"({"image_processor": {"do_normalize": true}})", R"({"image_processor": {"resample": 2}})",
                          R"({"image_processor": []})", "[]"}) {
    EXPECT_THROW(mb::gemma4_vision::parse_image_processor_config(nlohmann::json::parse(bad)), mb::Error) << bad;
  }
}

TEST(ImagePreprocess, UnifiedMergeMatchesTransformers) {
  for (const auto& c : cases()["unified"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const RgbImage img = mb::read_image_file(image_fixture(c["file"]));
    const ImagePatches small = mb::gemma4_vision::preprocess_image(img, {16, 3, c["max_soft_tokens"].get<int>()});
    const ImagePatches merged = mb::gemma4_vision::merge_patches_unified(small, 3);
    EXPECT_EQ(merged.n_patches, c["n_tokens"].get<int>());
    EXPECT_EQ(merged.n_soft_tokens, c["n_soft_tokens"].get<int>());
    EXPECT_EQ(merged.patch_size * merged.patch_size * 3, c["row_len"].get<int>());
    EXPECT_EQ(merged.grid_w, c["grid_w"].get<int>());
    EXPECT_EQ(merged.grid_h, c["grid_h"].get<int>());
    Fingerprint pos;
    for (int n = 0; n < merged.n_patches; ++n) {
      pos.add(uint32_t(merged.pos_x[size_t(n)]));
      pos.add(uint32_t(merged.pos_y[size_t(n)]));
    }
    EXPECT_EQ(pos.hex(), c["positions_fingerprint"].get<std::string>());
    EXPECT_EQ(fingerprint(merged.pixels), c["pixels_fingerprint"].get<std::string>());
    // A merged patch is the resized image cut directly into 48-px patches.
    const ImagePatches direct = mb::gemma4_vision::preprocess_image(img, {48, 1, c["max_soft_tokens"].get<int>()});
    EXPECT_EQ(direct.pixels, merged.pixels);
  }
}

}  // namespace
