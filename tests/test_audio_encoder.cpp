// The audio encoder (conformer + projector) against transformers 5.17.0 on the tiny multimodal fixture
// (tools/reference/make_mm_fixtures.py): soft tokens from HF's own input features, for a clip of one attention
// chunk and a bit, one of several chunks, one padded in a batch with a longer clip and a mask with holes; and its
// errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>

#include "backends/backend.h"
#include "core/error.h"
#include "models/checkpoint.h"
#include "models/gemma4_audio/encoder.h"
#include "test_util.h"

namespace {

struct Diff {
  double max_abs = 0, max_value = 0;
  size_t nan = 0;
};

Diff compare(const std::vector<float>& got, const std::vector<float>& want) {
  Diff d;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isnan(got[i])) ++d.nan;
    d.max_abs = std::max(d.max_abs, double(std::fabs(got[i] - want[i])));
    d.max_value = std::max(d.max_value, double(std::fabs(want[i])));
  }
  return d;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const mb::Error& e) {
    return e.what();
  }
  return "";
}

TEST(AudioEncoderConfig, ReadsTheAudioConfig) {
  const auto config = mbtest::read_json(mbtest::fixture("mm_e2b_like") + "/config.json");
  const mb::gemma4_audio::AudioConfig c = mb::gemma4_audio::parse_audio_config(config, "config.json");
  EXPECT_EQ(c.hidden, 16);
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.heads, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.ffn, 64);
  EXPECT_EQ(c.sscp_channels[0], 8);
  EXPECT_EQ(c.sscp_channels[1], 4);
  EXPECT_EQ(c.conv_kernel, 3);
  EXPECT_EQ(c.chunk_size, 12);
  EXPECT_EQ(c.context_left, 13);
  EXPECT_EQ(c.context_right, 0);
  EXPECT_FLOAT_EQ(c.logit_cap, 50.f);
  EXPECT_FLOAT_EQ(c.invalid_logit, -1e9f);
  EXPECT_FLOAT_EQ(c.residual_weight, 0.5f);
  EXPECT_FLOAT_EQ(c.gradient_clipping, 1e10f);
  EXPECT_TRUE(c.clipped_linears);
  EXPECT_EQ(c.output_dims, 24);
  EXPECT_EQ(c.text_hidden, 64);
}

TEST(AudioEncoderConfig, RefusesModelsWithoutAudioAndUnsupportedLayouts) {
  const auto no_audio = mbtest::read_json(mbtest::fixture("mm_large_like") + "/config.json");  // audio_config null
  EXPECT_NE(error_of([&] { mb::gemma4_audio::parse_audio_config(no_audio, "config.json"); }).find("cannot read audio"),
            std::string::npos);
  auto config = mbtest::read_json(mbtest::fixture("mm_e2b_like") + "/config.json");
  config["audio_config"]["attention_context_right"] = 2;
  EXPECT_THROW(mb::gemma4_audio::parse_audio_config(config, "config.json"), mb::Error);
  config["audio_config"]["attention_context_right"] = 0;
  config["audio_config"]["num_attention_heads"] = 3;  // 16 does not split into 3 heads
  EXPECT_THROW(mb::gemma4_audio::parse_audio_config(config, "config.json"), mb::Error);
  config["audio_config"]["num_attention_heads"] = 2;
  config["audio_config"]["hidden_act"] = "gelu";
  EXPECT_THROW(mb::gemma4_audio::parse_audio_config(config, "config.json"), mb::Error);
}

// HF's input features and mask in, HF's soft tokens (get_audio_features(...).pooler_output at the valid
// positions) out, within 1e-4.
TEST(AudioEncoderSoftTokens, MatchTransformers) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_audio::AudioEncoder enc(ck, *be);
  const int n_mels = 8, H = enc.config().text_hidden;
  const auto ref = mbtest::read_json(dir + "/reference.json");
  ASSERT_GE(ref["audios"].size(), 3u);  // one of the clips is padded
  for (const auto& clip : ref["audios"]) {
    const std::string name = clip["file"].get<std::string>();
    const std::vector<float> mel = mbtest::read_f32(dir + "/" + clip["features_file"].get<std::string>());
    const int frames = clip["frames"].get<int>(), valid_frames = clip["valid_frames"].get<int>();
    ASSERT_EQ(mel.size(), size_t(frames) * n_mels) << name;
    std::vector<uint8_t> valid(size_t(frames), 0);
    std::fill_n(valid.begin(), valid_frames, uint8_t(1));
    const std::vector<float> want = mbtest::read_f32(dir + "/" + clip["soft_file"].get<std::string>());
    ASSERT_EQ(want.size(), size_t(clip["soft_tokens"].get<int>()) * H) << name;
    const std::vector<float> got = enc.encode(mel, valid, n_mels);
    ASSERT_EQ(got.size(), want.size()) << name;
    const Diff d = compare(got, want);
    EXPECT_EQ(d.nan, 0u) << name;
    RecordProperty(name, std::to_string(d.max_abs));
    std::printf("  %s: %d frames (%d valid) -> %zu soft tokens, max |diff| %.3g (values up to %.3g)\n", name.c_str(),
                frames, valid_frames, want.size() / size_t(H), d.max_abs, d.max_value);
    EXPECT_LT(d.max_abs, 1e-4) << name << ": soft tokens differ by " << d.max_abs;
  }
}

// A mask with invalid frames first and in the middle (which the feature extractor never makes): frames whose
// attention window holds no valid key average their whole context, as transformers' softmax over equal logits
// does, and reach later valid frames through the causal convolution.
TEST(AudioEncoderSoftTokens, MatchTransformersWithHolesInTheMask) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_audio::AudioEncoder enc(ck, *be);
  const auto ref = mbtest::read_json(dir + "/reference.json");
  ASSERT_TRUE(ref.contains("audio_masks"));
  for (const auto& c : ref["audio_masks"]) {
    const std::vector<float> mel = mbtest::read_f32(dir + "/" + c["features_file"].get<std::string>());
    std::ifstream in(dir + "/" + c["mask_file"].get<std::string>(), std::ios::binary);
    const std::vector<uint8_t> valid((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(mel.size(), valid.size() * 8);
    const std::vector<float> want = mbtest::read_f32(dir + "/" + c["soft_file"].get<std::string>());
    ASSERT_EQ(want.size(), size_t(c["soft_tokens"].get<int>()) * size_t(enc.config().text_hidden));
    const std::vector<float> got = enc.encode(mel, valid, 8);
    ASSERT_EQ(got.size(), want.size());
    const Diff d = compare(got, want);
    EXPECT_EQ(d.nan, 0u);
    RecordProperty(c["mask_file"].get<std::string>(), std::to_string(d.max_abs));
    std::printf("  %s: max |diff| %.3g (values up to %.3g)\n", c["mask_file"].get<std::string>().c_str(), d.max_abs,
                d.max_value);
    EXPECT_LT(d.max_abs, 1e-4) << "soft tokens differ by " << d.max_abs;
  }
}

// Padding frames only shape what the mask keeps: the clip alone, cut to its valid frames, gives the same tokens.
TEST(AudioEncoderSoftTokens, PaddingDoesNotChangeThem) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_audio::AudioEncoder enc(ck, *be);
  const auto ref = mbtest::read_json(dir + "/reference.json");
  for (const auto& clip : ref["audios"]) {
    const int frames = clip["frames"].get<int>(), valid_frames = clip["valid_frames"].get<int>();
    if (valid_frames == frames) continue;
    std::vector<float> mel = mbtest::read_f32(dir + "/" + clip["features_file"].get<std::string>());
    std::vector<uint8_t> valid(size_t(frames), 0);
    std::fill_n(valid.begin(), valid_frames, uint8_t(1));
    const std::vector<float> padded = enc.encode(mel, valid, 8);
    // Other values on the padding frames change nothing (they are masked out).
    for (size_t i = size_t(valid_frames) * 8; i < mel.size(); ++i) mel[i] = 3.f;
    EXPECT_EQ(enc.encode(mel, valid, 8), padded);
    mel.resize(size_t(valid_frames) * 8);
    valid.resize(size_t(valid_frames));
    const std::vector<float> alone = enc.encode(mel, valid, 8);
    ASSERT_EQ(alone.size(), padded.size());
    EXPECT_LT(compare(alone, padded).max_abs, 1e-5) << clip["file"];
  }
}

TEST(AudioEncoderSoftTokens, NoValidFrameGivesNone) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_audio::AudioEncoder enc(ck, *be);
  std::vector<float> mel(20 * 8, -2.f);
  std::vector<uint8_t> valid(20, 0);
  EXPECT_TRUE(enc.encode(mel, valid, 8).empty());
  valid[0] = 1;  // frame 0 survives both subsamplings
  EXPECT_EQ(enc.encode(mel, valid, 8).size(), size_t(enc.config().text_hidden));
}

TEST(AudioEncoderErrors, TextOnlyCheckpointSaysItCannotReadAudio) {
  std::shared_ptr<const mb::Checkpoint> ck =
      mb::open_checkpoint(mbtest::fixture("moe_like"), {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  const std::string err = error_of([&] { mb::gemma4_audio::AudioEncoder enc(ck, *be); });
  EXPECT_NE(err.find("cannot read audio"), std::string::npos) << err;
}

TEST(AudioEncoderErrors, MismatchedFeatureSizesAreRefused) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_audio::AudioEncoder enc(ck, *be);
  std::vector<float> mel(10 * 8, -1.f);
  std::vector<uint8_t> valid(10, 1);
  EXPECT_EQ(enc.encode(mel, valid, 8).size(), size_t(3 * enc.config().text_hidden));
  EXPECT_THROW(enc.encode(std::span<const float>(mel).first(79), valid, 8), mb::Error);  // not frames x mels
  EXPECT_THROW(enc.encode(mel, std::span<const uint8_t>(valid).first(9), 8), mb::Error);
  EXPECT_THROW(enc.encode(mel, valid, 0), mb::Error);
  EXPECT_THROW(enc.encode(mel, valid, -8), mb::Error);
  EXPECT_THROW(enc.encode({}, {}, 8), mb::Error);
  // 16 mel bins give 4 · 4 values per frame after subsampling; the tower takes 2 · 4 (8 bins).
  std::vector<float> wide(5 * 16, -1.f);
  std::vector<uint8_t> wide_valid(5, 1);
  const std::string err = error_of([&] { enc.encode(wide, wide_valid, 16); });
  EXPECT_NE(err.find("mel bins"), std::string::npos) << err;
  mel[17] = std::nanf("");
  EXPECT_THROW(enc.encode(mel, valid, 8), mb::Error);
}

}  // namespace
