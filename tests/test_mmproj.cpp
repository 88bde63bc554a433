// llama.cpp's GGUF pair of a Gemma 4 multimodal model - the text GGUF and the mmproj GGUF its
// converter writes (tools/reference/make_mmproj_gguf.py: convert_hf_to_gguf.py of llama-cpp-python
// 0.3.36's tree on the tiny multimodal fixtures) - read as the Hugging Face checkpoint is: every
// tower tensor equal to the checkpoint's once the converter's changes are undone, and prompt
// logits with images and audio against transformers' (the fixtures' reference.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backends/backend.h"
#include "core/error.h"
#include "formats/gguf.h"
#include "markbase/markbase.h"
#include "models/checkpoint.h"
#include "models/gemma4/gemma4.h"
#include "test_util.h"

namespace {

std::string gguf_dir() { return mbtest::fixture("gguf/llama_cpp_mm"); }

std::vector<float> values(const mb::Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = t.dtype == mb::DType::F32    ? t.f32()[i]
           : t.dtype == mb::DType::F16  ? mb::f16_to_f32(t.ptr<uint16_t>()[i])
                                        : mb::bf16_to_f32(t.ptr<uint16_t>()[i]);
  return v;
}

bool tower_tensor(const std::string& name) {
  return name.rfind("model.vision_tower.", 0) == 0 || name.rfind("model.audio_tower.", 0) == 0 ||
         name.rfind("model.vision_embedder.", 0) == 0 || name.rfind("model.embed_vision.", 0) == 0 ||
         name.rfind("model.embed_audio.", 0) == 0;
}

// The unified fixture's text part does not convert (llama.cpp's converter wants MoE keys its tiny
// config lacks), so its mmproj is hosted by another text GGUF of the same width for the tensor
// checks here and the embedders' soft tokens (UnifiedSoftTokens in test_multimodal.cpp).
std::string text_gguf_for(const std::string& fixture) {
  return gguf_dir() + "/" + (fixture == "mm_unified_like" ? std::string("mm_e2b_like") : fixture) + ".gguf";
}

class MmprojTensors : public ::testing::TestWithParam<std::string> {};

// Each tower tensor of the checkpoint is in the GGUF pair under its own name and shape, with the
// same values: renamed, the patch embedding permuted back from a conv kernel (the unified model's
// columns, patch_ln1 and position table from their llama.cpp orders), the depthwise conv
// reshaped, scalars from one-element tensors; per_dim_scale from its softplus (the inverse in
// double: within float rounding). Nothing is left over on either side.
TEST_P(MmprojTensors, EqualTheCheckpointsOnceTheConverterIsUndone) {
  const std::string fx = GetParam();
  const auto hf = mb::open_checkpoint(mbtest::fixture(fx), {.load_multimodal = true});
  const auto gg = mb::open_checkpoint(text_gguf_for(fx),
                                      {.load_multimodal = true, .mmproj = gguf_dir() + "/" + fx + ".mmproj.gguf"});
  size_t compared = 0;
  for (const auto& [name, e] : hf->tensors.entries()) {
    if (!tower_tensor(name)) continue;
    ++compared;
    const mb::TensorEntry* g = gg->tensors.find(name);
    ASSERT_NE(g, nullptr) << name << " is missing from the GGUF pair";
    std::vector<int64_t> want_shape = e.shape;
    if (want_shape.empty()) want_shape = {1};
    EXPECT_EQ(g->shape, want_shape) << name;
    const std::vector<float> a = values(e.view()), b = values(g->view());
    ASSERT_EQ(a.size(), b.size()) << name;
    const bool softplus_inverted = name.find("per_dim_scale") != std::string::npos;
    for (size_t i = 0; i < a.size(); ++i) {
      if (softplus_inverted)
        ASSERT_NEAR(b[i], a[i], 1e-5 * std::max(1.f, std::fabs(a[i]))) << name << "[" << i << "]";
      else
        ASSERT_EQ(b[i], a[i]) << name << "[" << i << "]";
    }
  }
  EXPECT_GT(compared, 0u);
  for (const auto& [name, e] : gg->tensors.entries())
    if (tower_tensor(name)) {
      EXPECT_TRUE(hf->tensors.contains(name)) << name << " has no counterpart";
    }
  // The configs the towers read agree with the checkpoint's on what they use.
  for (const char* part : {"vision_config", "audio_config"}) {
    if (!hf->hf_config.contains(part) || hf->hf_config[part].is_null()) {
      EXPECT_FALSE(gg->hf_config.contains(part)) << part;
      continue;
    }
    ASSERT_TRUE(gg->hf_config.contains(part)) << part;
    for (const auto& [key, value] : gg->hf_config[part].items()) {
      if (key == "rope_parameters" || key == "model_type" || (key == "output_proj_dims" && fx == "mm_unified_like"))
        continue;
      const nlohmann::json& want = hf->hf_config[part].contains(key) ? hf->hf_config[part][key] : nlohmann::json();
      if (want.is_null()) continue;  // transformers' default (the released value) where the checkpoint has none
      if (want.is_number())
        EXPECT_NEAR(value.get<double>(), want.get<double>(), 1e-9) << part << "." << key;
      else
        EXPECT_EQ(value, want) << part << "." << key;
    }
  }
  for (const char* id : {"image_token_id", "boi_token_id", "eoi_token_id", "audio_token_id", "boa_token_id",
                         "eoa_token_index", "video_token_id"})
    EXPECT_EQ(gg->hf_config[id], hf->hf_config[id]) << id;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MmprojTensors,
                         ::testing::Values("mm_e2b_like", "mm_large_like", "mm_unified_like"));

struct Diff {
  double max_abs = 0, range = 0;
};

Diff compare(const std::vector<float>& got, const std::vector<float>& want) {
  Diff d;
  float lo = 0, hi = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    d.max_abs = std::max(d.max_abs, std::isfinite(got[i]) ? double(std::fabs(got[i] - want[i])) : INFINITY);
    lo = std::min(lo, want[i]);
    hi = std::max(hi, want[i]);
  }
  d.range = hi - lo;
  return d;
}

// Prompt logits with the fixtures' images and audio read from their files, through a GGUF model
// and its mmproj (the fixtures' image budget: --image-tokens 70), against transformers' from the
// Hugging Face checkpoint: f32 files within the bound of the checkpoint's own test (1e-3), the f16
// mmproj within 1e-2 of the logit range (its weights are rounded to f16; measured 1.8e-3).
TEST(MmprojLogits, MatchTransformers) {
  struct Case {
    std::string fixture, mmproj;
    double rel_bound;
  };
  for (const Case& c : {Case{"mm_e2b_like", "mm_e2b_like.mmproj.gguf", 0}, Case{"mm_large_like", "mm_large_like.mmproj.gguf", 0},
                        Case{"mm_e2b_like", "mm_e2b_like.mmproj-f16.gguf", 1e-2}}) {
    const std::string dir = mbtest::fixture(c.fixture);
    auto engine = markbase::Engine::open({.model_path = gguf_dir() + "/" + c.fixture + ".gguf",
                                          .mmproj_path = gguf_dir() + "/" + c.mmproj,
                                          .image_tokens = 70});
    const auto ref = mbtest::read_json(dir + "/reference.json");
    for (const auto& p : ref["prompts"]) {
      std::vector<markbase::Media> media;
      for (int i : p["images"].get<std::vector<int>>())
        media.push_back({markbase::Media::Kind::Image, dir + "/" + ref["images"][size_t(i)]["file"].get<std::string>(),
                         {}, {}});
      for (int i : p["audios"].get<std::vector<int>>())
        media.push_back({markbase::Media::Kind::Audio, dir + "/" + ref["audios"][size_t(i)]["file"].get<std::string>(),
                         {}, {}});
      const std::string logits_file = dir + "/" + p["logits_file"].get<std::string>();
      const std::vector<float> got = engine->prompt_logits(p["tokens"].get<std::vector<int32_t>>(), 0, media);
      const std::vector<float> want = mbtest::read_f32(logits_file);
      ASSERT_EQ(got.size(), want.size()) << c.mmproj << " " << logits_file;
      const Diff d = compare(got, want);
      const double bound = c.rel_bound > 0 ? c.rel_bound * d.range : 1e-3;
      RecordProperty(c.mmproj + " " + p["logits_file"].get<std::string>(), std::to_string(d.max_abs / d.range));
      EXPECT_LT(d.max_abs, bound) << c.mmproj << " " << logits_file << ": logits differ by " << d.max_abs
                                  << " (range " << d.range << ")";
      if (c.rel_bound == 0) {
        markbase::Request req;
        req.prompt_tokens = p["tokens"].get<std::vector<int32_t>>();
        req.media = media;
        req.max_new_tokens = int(p["greedy"].size());
        req.stop_at_eos = false;
        EXPECT_EQ(engine->generate(req).tokens, p["greedy"].get<std::vector<int32_t>>()) << c.mmproj << " " << logits_file;
      }
    }
  }
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A small clip GGUF: the mm_large_like mmproj's keys and tensors, with changes.
std::string clip_file(const std::string& name, const std::string& projector, const std::string& extra_tensor) {
  const auto src = mb::GgufFile::open(gguf_dir() + "/mm_large_like.mmproj.gguf");
  mb::GgufWriter w;
  for (const auto& [k, v] : src->metadata()) w.set(k, v);
  w.set("clip.vision.projector_type", mb::GgufValue::make_string(projector));
  for (const mb::GgufTensorInfo& t : src->tensors()) w.add_tensor(t.name, t.dtype, t.shape(), t.data);
  if (!extra_tensor.empty()) {
    const float one = 1.f;
    w.add_tensor(extra_tensor, mb::DType::F32, {1}, &one);
  }
  const std::string path = mbtest::temp_dir("mmproj") + "/" + name;
  w.write(path);
  return path;
}

TEST(MmprojErrors, AreClearAndNameTheFile) {
  const std::string text = gguf_dir() + "/mm_large_like.gguf";
  auto open = [&](const std::string& model, const std::string& mmproj) {
    return [=] { mb::open_checkpoint(model, {.load_multimodal = true, .mmproj = mmproj}); };
  };
  // A text GGUF where the mmproj goes; a checkpoint folder with --mmproj; a missing file.
  expect_error(open(text, text), "not an mmproj file");
  expect_error(open(mbtest::fixture("mm_large_like"), gguf_dir() + "/mm_large_like.mmproj.gguf"),
               "--mmproj goes with a GGUF model");
  expect_error(open(text, gguf_dir() + "/nope.gguf"), "nope.gguf");
  // Another model's projector; a tensor this reader does not know (never silently dropped).
  expect_error(open(text, clip_file("llava.gguf", "llava", "")), "not Gemma 4's");
  expect_error(open(text, clip_file("extra.gguf", "gemma4v", "v.blk.0.mystery.weight")), "v.blk.0.mystery.weight");
  expect_error(open(text, clip_file("scale.gguf", "gemma4v", "v.blk.1.out_scale.weight")), "output scale");
  // The engine checks the file when it opens, not at the first image.
  expect_error([&] { markbase::Engine::open({.model_path = text, .mmproj_path = text}); }, "not an mmproj file");
  expect_error([&] { markbase::Engine::open({.model_path = text, .image_tokens = 100}); }, "70, 140, 280, 560, 1120");
  // A GGUF model without one says how to give it.
  auto engine = markbase::Engine::open({.model_path = text});
  const std::string img = mbtest::fixture("mm_large_like") + "/image_0.png";
  const std::vector<int32_t> prompt = {2, 498, 500, 499};
  expect_error([&] { engine->prompt_logits(prompt, 0, {{markbase::Media::Kind::Image, img, {}, {}}}); },
               "--mmproj");
}

// The command line: --mmproj and --image-tokens on logits, and --image-tokens' accepted values.
TEST(MmprojCli, LogitsWithAnImage) {
  const std::string dir = mbtest::fixture("mm_large_like");
  const auto ref = mbtest::read_json(dir + "/reference.json");
  const auto& p = ref["prompts"][0];
  std::string ids;
  for (const auto& t : p["tokens"]) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(t.get<int>());
  }
  const std::string out = mbtest::temp_dir("mmproj_cli") + "/logits.bin";
  std::string args = "logits -m " + gguf_dir() + "/mm_large_like.gguf --mmproj " + gguf_dir() +
                     "/mm_large_like.mmproj.gguf --image-tokens 70 --tokens " + ids + " -o " + out;
  for (int i : p["images"].get<std::vector<int>>())
    args += " --image " + dir + "/" + ref["images"][size_t(i)]["file"].get<std::string>();
  const mbtest::CliResult r = mbtest::run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_LT(compare(mbtest::read_f32(out), mbtest::read_f32(dir + "/" + p["logits_file"].get<std::string>())).max_abs,
            1e-3);
  const mbtest::CliResult bad = mbtest::run_cli("logits -m " + gguf_dir() + "/mm_large_like.gguf --image-tokens 100 "
                                                "--tokens 2 -o " + out);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("image-tokens"), std::string::npos) << bad.out;
}

}  // namespace
