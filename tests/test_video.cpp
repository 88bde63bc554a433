// Video in, against transformers 5.17.0 (tools/reference/make_video_cases.py): frame sampling and MM:SS
// timestamps, decoding (PyAV's frames), the first frame's patches, each frame's soft tokens, and prompt logits
// and greedy ids with a video (pre-expanded on the tiny checkpoints, through Gemma4Processor's chat on
// mm_e2b_like), bidirectional per-frame blocks on mm_large_like, the 12B unified embedders on mm_unified_like.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "backends/backend.h"
#include "core/error.h"
#include "markbase/markbase.h"
#include "media/file.h"
#include "media/video.h"
#include "models/architecture.h"
#include "models/checkpoint.h"
#include "models/gemma4_vision/preprocess.h"
#include "models/media_encoder.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
namespace vis = mb::gemma4_vision;

std::string videos() { return mbtest::fixture("videos"); }

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d = std::max(d, double(std::fabs(a[i] - b[i])));
  }
  return d;
}

mb::VideoFrames decode_all(const std::string& path, const mb::FramePicker& pick) {
  if (fs::is_directory(path)) {
    std::vector<std::vector<uint8_t>> frames;
    for (const std::string& f : mb::list_frame_files(path)) frames.push_back(mb::read_media_file(f));
    return mb::decode_video_frames(frames, path, pick);
  }
  return mb::decode_video(mb::read_media_file(path), path, pick);
}

TEST(VideoSampling, IndicesAndTimestampsMatchTransformers) {
  const auto ref = mbtest::read_json(videos() + "/timestamps.json");
  for (const auto& t : ref["timestamps"])
    EXPECT_EQ(vis::frame_timestamp(t["index"].get<int64_t>(), t["fps"].get<double>()), t["text"].get<std::string>())
        << t["index"] << " at " << t["fps"] << " fps";
  for (const auto& s : ref["samples"])
    EXPECT_EQ(vis::sample_frame_indices(s["total"].get<int64_t>(), s["num_frames"].get<int>()),
              s["indices"].get<std::vector<int64_t>>())
        << s["total"];
  // Fewer frames than asked for (HF raises): every frame.
  EXPECT_EQ(vis::sample_frame_indices(3, 32), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(vis::frame_timestamp(48, 0), "00:02");  // no rate known: 24 fps
}

TEST(VideoDecode, YuvFramesAgreeWithPyAV) {
  if (!mb::video_files_supported()) GTEST_SKIP() << "built without libavformat";
  const auto ref = mbtest::read_json(videos() + "/yuv420.json");
  const auto want_idx = ref["indices"].get<std::vector<int64_t>>();
  const mb::VideoFrames v = decode_all(videos() + "/yuv420.mp4", [&](int64_t total, double fps) {
    EXPECT_EQ(total, ref["total_frames"].get<int64_t>());
    EXPECT_DOUBLE_EQ(fps, ref["fps"].get<double>());
    return want_idx;
  });
  ASSERT_EQ(v.frames.size(), want_idx.size());
  std::ifstream in(videos() + "/" + ref["rgb_file"].get<std::string>(), std::ios::binary);
  std::vector<uint8_t> want((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int w = ref["size"][0], h = ref["size"][1];
  ASSERT_EQ(want.size(), want_idx.size() * size_t(w) * size_t(h) * 3);
  int worst = 0;
  size_t off = 0, differ = 0;
  for (const mb::RgbImage& f : v.frames) {
    ASSERT_EQ(f.width, w);
    ASSERT_EQ(f.height, h);
    for (uint8_t px : f.rgb) {
      const int d = std::abs(int(px) - int(want[off++]));
      worst = std::max(worst, d);
      differ += d != 0;
    }
  }
  RecordProperty("max_level_difference", worst);
  RecordProperty("values_that_differ", int(differ));
  // PyAV's wheel carries its own FFmpeg (8.x) and swscale; Debian's may round the 4:2:0 chroma differently.
  EXPECT_LE(worst, 2) << differ << " of " << want.size() << " values differ";
}

TEST(VideoDecode, BadInputIsAClearError) {
  auto message = [](const std::vector<uint8_t>& bytes) {
    try {
      mb::decode_video(bytes, "clip.mp4", [](int64_t, double) { return std::vector<int64_t>{0}; });
    } catch (const mb::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({}).find("empty"), std::string::npos);
  if (!mb::video_files_supported()) return;
  EXPECT_NE(message({'n', 'o', 't', ' ', 'a', ' ', 'v', 'i', 'd', 'e', 'o'}).find("clip.mp4"), std::string::npos);
  std::vector<uint8_t> mp4 = mb::read_media_file(videos() + "/yuv420.mp4");
  for (size_t keep : {size_t(16), mp4.size() / 3, mp4.size() - 200}) {
    const std::string m = message(std::vector<uint8_t>(mp4.begin(), mp4.begin() + std::ptrdiff_t(keep)));
    EXPECT_NE(m.find("clip.mp4"), std::string::npos) << keep << ": " << m;
  }
  // Picks past the end.
  try {
    mb::decode_video(mp4, "clip.mp4", [](int64_t total, double) { return std::vector<int64_t>{0, total}; });
    ADD_FAILURE() << "expected an error";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("picked"), std::string::npos) << e.what();
  }
}

TEST(VideoDecode, FramesOfDifferentSizesAreRefused) {
  std::vector<std::vector<uint8_t>> frames = {
      mb::read_media_file(mbtest::fixture("mm_e2b_like") + "/image_0.png"),
      mb::read_media_file(mbtest::fixture("mm_e2b_like") + "/image_1.png")};
  EXPECT_THROW(mb::decode_video_frames(frames, "frames", [](int64_t t, double) { return vis::sample_frame_indices(t, 8); }),
               mb::Error);
}

class VideoFixture : public ::testing::TestWithParam<std::string> {};

// Each video's sampled frames, their first frame's patches (lossless sources: the same pixels as PyAV's), and the
// soft tokens and timestamps of every frame.
TEST_P(VideoFixture, SoftTokensMatchTransformers) {
  const std::string dir = mbtest::fixture(GetParam());
  const auto ref = mbtest::read_json(dir + "/video_reference.json");
  const auto proc = mbtest::read_json(dir + "/processor_config.json");
  const vis::VideoProcessorConfig vcfg = vis::parse_video_processor_config(proc);
  EXPECT_EQ(vcfg.num_frames, ref["num_frames"].get<int>());
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(dir, {.load_multimodal = true});
  auto be = mb::make_cpu_backend();
  auto enc = ck->architecture().make_media_encoder(ck, *be);
  for (const auto& v : ref["videos"]) {
    const std::string path = videos() + "/" + v["file"].get<std::string>();
    if (!fs::is_directory(path) && !mb::video_files_supported()) continue;
    mb::MediaItem item;
    item.kind = mb::MediaItem::Kind::Video;
    item.what = path;
    if (fs::is_directory(path))
      for (const std::string& f : mb::list_frame_files(path)) item.frames.push_back(mb::read_media_file(f));
    else
      item.bytes = mb::read_media_file(path);

    if (GetParam() != "mm_unified_like") {  // the first frame's patches, as the tower takes them
      const mb::VideoFrames frames = decode_all(path, [&](int64_t total, double) {
        return vis::sample_frame_indices(total, vcfg.num_frames);
      });
      EXPECT_EQ(frames.indices, v["indices"].get<std::vector<int64_t>>()) << path;
      vis::ImageProcessorConfig fcfg = vcfg.frame;
      const vis::ImagePatches p = vis::preprocess_image(frames.frames.at(0), fcfg);
      const std::vector<float> want = mbtest::read_f32(dir + "/" + v["first_frame_pixels_file"].get<std::string>());
      ASSERT_EQ(p.pixels.size(), want.size()) << path;
      EXPECT_EQ(max_diff(p.pixels, want), 0.0) << path << ": the first frame's patches differ from HF's";
    }

    const mb::MediaEncoding e = enc->encode(item);
    const auto stamps = v["timestamps"].get<std::vector<std::string>>();
    ASSERT_EQ(e.blocks.size(), stamps.size()) << path;
    for (size_t i = 0; i < stamps.size(); ++i) {
      EXPECT_EQ(e.blocks[i].label, stamps[i]) << path << " frame " << i;
      EXPECT_EQ(e.blocks[i].tokens, v["tokens_per_frame"].get<int64_t>()) << path;
    }
    const std::vector<float> want = mbtest::read_f32(dir + "/" + v["soft_file"].get<std::string>());
    ASSERT_EQ(e.soft.size(), want.size()) << path;
    const double d = max_diff(e.soft, want);
    RecordProperty(v["file"].get<std::string>(), std::to_string(d));
    EXPECT_LT(d, 1e-4) << path << ": soft tokens differ by " << d;
  }
}

// The prompt with the video's frames spliced into HF's expansion (the tiny fixtures have made-up timestamp ids):
// the last rows of the logits, whole prompt and 9-token chunks (which must not split a frame where frames are
// bidirectional), and greedy ids.
TEST_P(VideoFixture, PromptLogitsMatchTransformers) {
  const std::string dir = mbtest::fixture(GetParam());
  const auto ref = mbtest::read_json(dir + "/video_reference.json");
  auto engine = markbase::Engine::open({.model_path = dir});
  for (const auto& p : ref["prompts"]) {
    const std::string file = ref["videos"][p["video"].get<size_t>()]["file"].get<std::string>();
    const std::string path = videos() + "/" + file;
    if (!fs::is_directory(path) && !mb::video_files_supported()) continue;
    const std::vector<markbase::Media> media = {{markbase::Media::Kind::Video, path, {}, {}}};
    const auto tokens = p["tokens"].get<std::vector<int32_t>>();
    const std::vector<float> want = mbtest::read_f32(dir + "/" + p["logits_file"].get<std::string>());
    for (int chunk : {0, 9}) {
      const std::vector<float> got = engine->prompt_logits(tokens, chunk, media);
      ASSERT_GE(got.size(), want.size());
      const std::vector<float> tail(got.end() - std::ptrdiff_t(want.size()), got.end());
      const double d = max_diff(tail, want);
      RecordProperty(p["logits_file"].get<std::string>() + " chunk " + std::to_string(chunk), std::to_string(d));
      EXPECT_LT(d, 1e-3) << file << " chunk " << chunk << ": logits differ by " << d;
    }
    markbase::Request req;
    req.prompt_tokens = tokens;
    req.media = media;
    req.max_new_tokens = int(p["greedy"].size());
    req.stop_at_eos = false;
    EXPECT_EQ(engine->generate(req).tokens, p["greedy"].get<std::vector<int32_t>>()) << file;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, VideoFixture, ::testing::Values("mm_e2b_like", "mm_large_like", "mm_unified_like"));

// A chat turn with a video as Gemma4Processor builds it: `MM:SS <|image>...<image|>` per frame, frames joined by
// a space (the timestamps tokenized with the rest), then the logits' last rows and the greedy reply.
TEST(VideoChat, PromptIdsLogitsAndGreedyMatchTransformers) {
  if (!mb::video_files_supported()) GTEST_SKIP() << "built without libavformat";
  const std::string dir = mbtest::fixture("mm_e2b_like");
  const auto ref = mbtest::read_json(dir + "/video_reference.json");
  ASSERT_TRUE(ref.contains("chat"));
  auto engine = markbase::Engine::open({.model_path = dir});
  for (const auto& c : ref["chat"]) {
    const std::string path = videos() + "/" + ref["videos"][c["video"].get<size_t>()]["file"].get<std::string>();
    markbase::Request req;
    req.chat = true;
    req.prompt = c["text"].get<std::string>();
    req.media = {{markbase::Media::Kind::Video, path, {}, {}}};
    req.max_new_tokens = int(c["greedy"].size());
    req.stop_at_eos = false;
    const markbase::Result r = engine->generate(req);
    EXPECT_EQ(r.prompt_ids, c["prompt_ids"].get<std::vector<int32_t>>()) << path;
    EXPECT_EQ(r.tokens, c["greedy"].get<std::vector<int32_t>>()) << path;
    const std::vector<float> want = mbtest::read_f32(dir + "/" + c["logits_file"].get<std::string>());
    const std::vector<float> got = engine->prompt_logits(c["prompt_ids"].get<std::vector<int32_t>>(), 0, req.media);
    ASSERT_GE(got.size(), want.size());
    const double d = max_diff(std::vector<float>(got.end() - std::ptrdiff_t(want.size()), got.end()), want);
    EXPECT_LT(d, 1e-3) << path;
  }
}

// The command line: generate --chat --video with a file and with a folder of frames, and bad media.
TEST(VideoCli, GenerateWithAVideoFileAndAFolder) {
  const std::string dir = mbtest::fixture("mm_e2b_like");
  const auto ref = mbtest::read_json(dir + "/video_reference.json");
  if (mb::video_files_supported()) {
    const auto& c = ref["chat"][0];
    const std::string file = videos() + "/" + ref["videos"][c["video"].get<size_t>()]["file"].get<std::string>();
    const mbtest::CliResult g = mbtest::run_cli("generate -m " + dir + " --chat -p '" + c["text"].get<std::string>() +
                                                "' -n " + std::to_string(c["greedy"].size()) +
                                                " --ignore-eos --print-ids --video " + file);
    ASSERT_EQ(g.exit_code, 0) << g.out;
    std::string want;
    for (const auto& id : c["greedy"]) want += (want.empty() ? "" : ",") + std::to_string(id.get<int>());
    EXPECT_NE(g.out.find(want), std::string::npos) << g.out;
  }
  const mbtest::CliResult folder =
      mbtest::run_cli("generate -m " + dir + " --chat -p 'What happens?' -n 3 --video " + videos() + "/frames");
  EXPECT_EQ(folder.exit_code, 0) << folder.out;
  const mbtest::CliResult bad =
      mbtest::run_cli("generate -m " + dir + " --chat -p 'What happens?' -n 3 --video " + dir + "/config.json");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("config.json"), std::string::npos) << bad.out;
}

}  // namespace
