// Images and audio into the language model, against transformers 5.17.0 on the tiny multimodal
// fixtures (tools/reference/make_mm_fixtures.py): the encoders' soft tokens from HF's own patches,
// and prompt logits and greedy continuations with the media read from their files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backends/backend.h"
#include "core/error.h"
#include "markbase/markbase.h"
#include "media/file.h"
#include "models/checkpoint.h"
#include "models/gemma4_unified/embedders.h"
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

// The 12B unified model's encoder-free embedders, from HF's merged patches and raw frames: from
// the checkpoint, and from llama.cpp's mmproj of it (tests/test_mmproj.cpp; its text part does not
// convert, so another text GGUF of the same width hosts it).
class UnifiedSoftTokens : public ::testing::TestWithParam<bool> {};

TEST_P(UnifiedSoftTokens, MatchTransformers) {
  const std::string dir = mbtest::fixture("mm_unified_like");
  const std::string gguf = mbtest::fixture("gguf/llama_cpp_mm");
  std::shared_ptr<const mb::Checkpoint> ck =
      GetParam() ? mb::open_checkpoint(gguf + "/mm_e2b_like.gguf",
                                       {.load_multimodal = true, .mmproj = gguf + "/mm_unified_like.mmproj.gguf"})
                 : mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  mb::gemma4_unified::UnifiedEmbedders emb(ck, *be);
  const auto ref = mbtest::read_json(dir + "/reference.json");
  for (const auto& im : ref["images"]) {
    const std::vector<float> got = emb.encode_image(mbtest::read_f32(dir + "/" + im["pixels_file"].get<std::string>()),
                                                    im["pos_x"].get<std::vector<int32_t>>(),
                                                    im["pos_y"].get<std::vector<int32_t>>());
    const std::vector<float> want = mbtest::read_f32(dir + "/" + im["soft_file"].get<std::string>());
    ASSERT_EQ(got.size(), want.size());
    const Diff d = compare(got, want);
    RecordProperty(im["file"].get<std::string>(), std::to_string(d.max_abs));
    EXPECT_LT(d.max_abs, 1e-4) << im["file"];
  }
  for (const auto& a : ref["audios"]) {
    const std::vector<float> got = emb.encode_audio(mbtest::read_f32(dir + "/" + a["features_file"].get<std::string>()));
    const Diff d = compare(got, mbtest::read_f32(dir + "/" + a["soft_file"].get<std::string>()));
    EXPECT_LT(d.max_abs, 1e-4) << a["file"];
  }
}

INSTANTIATE_TEST_SUITE_P(Sources, UnifiedSoftTokens, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "MmprojGguf" : "Checkpoint"; });

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

namespace {

// Prompt logits with the media read from their files (preprocessing, encoders, placement, the
// decoder with soft tokens, bidirectional image blocks on mm_large_like), and greedy continuations.
struct MmPrompt {
  std::vector<int32_t> tokens, greedy;
  std::vector<markbase::Media> media;
  std::string logits_file;
};

std::vector<MmPrompt> mm_prompts(const std::string& dir) {
  const auto ref = mbtest::read_json(dir + "/reference.json");
  std::vector<MmPrompt> out;
  for (const auto& p : ref["prompts"]) {
    MmPrompt m;
    m.tokens = p["tokens"].get<std::vector<int32_t>>();
    m.greedy = p["greedy"].get<std::vector<int32_t>>();
    m.logits_file = dir + "/" + p["logits_file"].get<std::string>();
    for (int i : p["images"].get<std::vector<int>>())
      m.media.push_back({markbase::Media::Kind::Image, dir + "/" + ref["images"][size_t(i)]["file"].get<std::string>(), {}, {}});
    for (int i : p["audios"].get<std::vector<int>>())
      m.media.push_back({markbase::Media::Kind::Audio, dir + "/" + ref["audios"][size_t(i)]["file"].get<std::string>(), {}, {}});
    out.push_back(std::move(m));
  }
  return out;
}

class MediaPromptLogits : public ::testing::TestWithParam<std::string> {};

TEST_P(MediaPromptLogits, MatchTransformers) {
  const std::string dir = mbtest::fixture(GetParam());
  auto engine = markbase::Engine::open({.model_path = dir});
  for (const MmPrompt& p : mm_prompts(dir)) {
    for (int chunk : {0, 7}) {
      const std::vector<float> got = engine->prompt_logits(p.tokens, chunk, p.media);
      const std::vector<float> want = mbtest::read_f32(p.logits_file);
      ASSERT_EQ(got.size(), want.size()) << p.logits_file;
      const Diff d = compare(got, want);
      EXPECT_FALSE(d.nan);
      RecordProperty(p.logits_file + " chunk " + std::to_string(chunk), std::to_string(d.max_abs));
      EXPECT_LT(d.max_abs, 1e-3) << p.logits_file << " (chunk " << chunk << "): logits differ by " << d.max_abs
                                 << " (range " << d.range << ")";
    }
    markbase::Request req;
    req.prompt_tokens = p.tokens;
    req.media = p.media;
    req.max_new_tokens = int(p.greedy.size());
    req.stop_at_eos = false;
    EXPECT_EQ(engine->generate(req).tokens, p.greedy) << p.logits_file;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MediaPromptLogits,
                         ::testing::Values("mm_e2b_like", "mm_large_like", "mm_unified_like"));

}  // namespace

namespace {

// A chat turn with images, as transformers' Gemma4Processor builds it: the template's single
// placeholder expanded per image, then the greedy reply.
TEST(MediaChat, PromptIdsAndGreedyMatchTransformers) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  const auto ref = mbtest::read_json(dir + "/reference.json");
  ASSERT_TRUE(ref.contains("chat"));
  auto engine = markbase::Engine::open({.model_path = dir});
  for (const auto& c : ref["chat"]) {
    markbase::Request req;
    req.chat = true;
    req.prompt = c["text"].get<std::string>();
    for (const auto& f : c["images"]) req.media.push_back({markbase::Media::Kind::Image, dir + "/" + f.get<std::string>(), {}, {}});
    for (const auto& f : c["audios"]) req.media.push_back({markbase::Media::Kind::Audio, dir + "/" + f.get<std::string>(), {}, {}});
    req.max_new_tokens = int(c["greedy"].size());
    req.stop_at_eos = false;
    const markbase::Result r = engine->generate(req);
    EXPECT_EQ(r.prompt_ids, c["prompt_ids"].get<std::vector<int32_t>>()) << c["text"];
    EXPECT_EQ(r.tokens, c["greedy"].get<std::vector<int32_t>>()) << c["text"];
  }
}

TEST(MediaChat, CountsThatDoNotMatchAreClearErrors) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  auto engine = markbase::Engine::open({.model_path = dir});
  const markbase::Media img{markbase::Media::Kind::Image, dir + "/image_0.png", {}, {}};
  auto message_of = [&](const std::vector<int32_t>& ids, const std::vector<markbase::Media>& media) {
    try {
      engine->prompt_logits(ids, 0, media);
    } catch (const markbase::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // A run of 3 placeholders for an image of 60 soft tokens.
  EXPECT_NE(message_of({2, 10, 498, 500, 500, 500, 499}, {img}).find("gives 60 soft tokens"), std::string::npos);
  // One placeholder (what generate expands): logits writes a row per given id, so it asks for the whole run.
  const std::string one = message_of({2, 10, 498, 500, 499}, {img});
  EXPECT_NE(one.find("one row per given id"), std::string::npos) << one;
  EXPECT_NE(one.find("in order: 60"), std::string::npos) << one;
  // Two runs, one image.
  std::vector<int32_t> two = {2, 498};
  two.insert(two.end(), 60, 500);
  two.insert(two.end(), {499, 7, 498});
  two.insert(two.end(), 60, 500);
  two.push_back(499);
  EXPECT_NE(message_of(two, {img}).find("more image placeholder runs"), std::string::npos);
  // A missing file, a corrupt one, and an image for a model without a vision tower.
  EXPECT_NE(message_of({2, 500}, {{markbase::Media::Kind::Image, dir + "/nope.png", {}, {}}}).find("no such file"),
            std::string::npos);
  EXPECT_NE(message_of({2, 500}, {{markbase::Media::Kind::Image, "", {'G', 'I', 'F', '8'}, {}}}).find("image 1"),
            std::string::npos);
  // A good image, then a corrupt one (the images decode side by side): the error names the second.
  const std::string second =
      message_of({2, 500, 7, 500}, {img, {markbase::Media::Kind::Image, "", {'G', 'I', 'F', '8'}, {}}});
  EXPECT_NE(second.find("image 2"), std::string::npos) << second;
  auto text_only = markbase::Engine::open({.model_path = mbtest::fixture("moe_like")});
  EXPECT_THROW(text_only->prompt_logits(std::vector<int32_t>{2, 5}, 0, {img}), markbase::Error);
}

// The same image twice in one request: encoded once, placed twice; the same logits as its bytes given twice under
// other names (the same content hash) in a fresh engine.
TEST(MediaChat, TheSameImageTwiceInOneRequest) {
  const std::string dir = mbtest::fixture("mm_large_like");
  const std::string path = dir + "/image_0.png";
  const std::vector<uint8_t> bytes = mb::read_media_file(path);
  const int64_t n = mbtest::read_json(dir + "/reference.json")["images"][0]["soft_tokens"].get<int64_t>();
  std::vector<int32_t> tokens = {2, 11};
  for (int32_t next : {12, 13}) {
    tokens.push_back(498);
    tokens.insert(tokens.end(), size_t(n), 500);
    tokens.insert(tokens.end(), {499, next});
  }
  auto engine = markbase::Engine::open({.model_path = dir});
  const auto twice = engine->prompt_logits(tokens, 0, {{markbase::Media::Kind::Image, path, {}, {}},
                                                       {markbase::Media::Kind::Image, path, {}, {}}});
  auto fresh = markbase::Engine::open({.model_path = dir});
  const auto copies = fresh->prompt_logits(tokens, 0, {{markbase::Media::Kind::Image, "", bytes, {}},
                                                       {markbase::Media::Kind::Image, "copy.png", bytes, {}}});
  ASSERT_EQ(twice.size(), copies.size());
  for (size_t i = 0; i < twice.size(); ++i) ASSERT_FALSE(std::isnan(twice[i]));
  EXPECT_EQ(twice, copies);
}

// The same placeholders with another image must not reuse the first image's cached KV.
TEST(MediaChat, PrefixCacheKeysImagesByContent) {
  const std::string dir = mbtest::fixture("mm_large_like");
  auto engine = markbase::Engine::open({.model_path = dir});
  const auto ref = mbtest::read_json(dir + "/reference.json");
  auto greedy = [&](markbase::Engine& e, const std::string& image) {
    markbase::Request req;
    req.prompt_tokens = {2, 11, 12, 13, 500, 14, 15};
    req.media = {{markbase::Media::Kind::Image, dir + "/" + image, {}, {}}};
    req.max_new_tokens = 6;
    req.stop_at_eos = false;
    return e.generate(req).tokens;
  };
  const auto first = greedy(*engine, "image_0.png");
  const auto other = greedy(*engine, "image_2.png");  // same size, other pixels: same prompt ids
  const auto again = greedy(*engine, "image_0.png");
  auto fresh = markbase::Engine::open({.model_path = dir});
  EXPECT_EQ(other, greedy(*fresh, "image_2.png"));
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
}

}  // namespace

namespace {

// The command line: generate --chat --image and logits --image, as other tools call them.
TEST(MediaCli, GenerateAndLogitsWithImages) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  const auto ref = mbtest::read_json(dir + "/reference.json");
  const auto& c = ref["chat"][1];  // two images
  std::string args = "generate -m " + dir + " --chat -p '" + c["text"].get<std::string>() + "' -n " +
                     std::to_string(c["greedy"].size()) + " --ignore-eos --print-ids";
  for (const auto& f : c["images"]) args += " --image " + dir + "/" + f.get<std::string>();
  const mbtest::CliResult g = mbtest::run_cli(args);
  ASSERT_EQ(g.exit_code, 0) << g.out;
  std::string want;
  for (const auto& id : c["greedy"]) want += (want.empty() ? "" : ",") + std::to_string(id.get<int>());
  EXPECT_NE(g.out.find(want), std::string::npos) << g.out;

  const auto& p = ref["prompts"][1];
  std::string ids;
  for (const auto& t : p["tokens"]) ids += (ids.empty() ? "" : ",") + std::to_string(t.get<int>());
  const std::string out = mbtest::temp_dir("mm_logits") + "/logits.bin";
  std::string largs = "logits -m " + dir + " --tokens " + ids + " -o " + out;
  for (int i : p["images"].get<std::vector<int>>())
    largs += " --image " + dir + "/" + ref["images"][size_t(i)]["file"].get<std::string>();
  const mbtest::CliResult l = mbtest::run_cli(largs);
  ASSERT_EQ(l.exit_code, 0) << l.out;
  const Diff d = compare(mbtest::read_f32(out), mbtest::read_f32(dir + "/" + p["logits_file"].get<std::string>()));
  EXPECT_LT(d.max_abs, 1e-3);

  const mbtest::CliResult bad = mbtest::run_cli("generate -m " + dir + " -p hi -n 1 --image " + dir + "/config.json");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("config.json"), std::string::npos) << bad.out;
}

}  // namespace
