// Images and audio into the language model, against transformers 5.17.0 on the tiny multimodal
// fixtures (tools/reference/make_mm_fixtures.py): the encoders' soft tokens from HF's own patches,
// and prompt logits and greedy continuations with the media read from their files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backends/backend.h"
#include "core/error.h"
#include "models/checkpoint.h"
#include "models/gemma4_vision/encoder.h"
#include "test_util.h"

namespace {

struct Diff {
  double max_abs = 0, range = 0;
  bool nan = false;
};

Diff compare(const std::vector<float>& got, const std::vector<float>& want) {
  Diff d;
  float lo = 0, hi = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isnan(got[i])) d.nan = true;
    d.max_abs = std::max(d.max_abs, double(std::fabs(got[i] - want[i])));
    lo = std::min(lo, want[i]);
    hi = std::max(hi, want[i]);
  }
  d.range = hi - lo;
  return d;
}

class VisionSoftTokens : public ::testing::TestWithParam<std::string> {};

// The encoder alone, from HF's patches: clipped linears (mm_e2b_like) and standardisation
// (mm_large_like), two images of different grids each.
TEST_P(VisionSoftTokens, MatchTransformers) {
  const std::string dir = mbtest::fixture(GetParam());
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_vision::VisionEncoder enc(ck, *be);
  const auto ref = mbtest::read_json(dir + "/reference.json");
  ASSERT_FALSE(ref["images"].empty());
  for (const auto& im : ref["images"]) {
    const std::vector<float> pixels = mbtest::read_f32(dir + "/" + im["pixels_file"].get<std::string>());
    const auto px = im["pos_x"].get<std::vector<int32_t>>(), py = im["pos_y"].get<std::vector<int32_t>>();
    const std::vector<float> want = mbtest::read_f32(dir + "/" + im["soft_file"].get<std::string>());
    const std::vector<float> got = enc.encode(pixels, px, py);
    ASSERT_EQ(got.size(), want.size()) << im["file"];
    const Diff d = compare(got, want);
    EXPECT_FALSE(d.nan);
    RecordProperty(im["file"].get<std::string>(), std::to_string(d.max_abs));
    EXPECT_LT(d.max_abs, 1e-4) << im["file"] << ": soft tokens differ by " << d.max_abs << " (range " << d.range
                               << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, VisionSoftTokens, ::testing::Values("mm_e2b_like", "mm_large_like"));

TEST(VisionEncoderErrors, TextOnlyCheckpointSaysItCannotReadImages) {
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(mbtest::fixture("moe_like"), {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  try {
    mb::gemma4_vision::VisionEncoder enc(ck, *be);
    FAIL() << "expected an error";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read images"), std::string::npos) << e.what();
  }
}

TEST(VisionEncoderErrors, PatchesThatDoNotPoolAreRefused) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_vision::VisionEncoder enc(ck, *be);
  std::vector<float> pixels(3 * 48, 0.5f);
  std::vector<int32_t> px = {0, 1, 2}, py = {0, 0, 0};
  EXPECT_THROW(enc.encode(pixels, px, py), mb::Error);
  std::vector<int32_t> far = {0, 100000, 0};
  EXPECT_THROW(enc.encode(pixels, far, py), mb::Error);
}

}  // namespace
