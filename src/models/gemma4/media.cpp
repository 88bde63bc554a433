// Gemma 4's media front-ends: an image file through the processor's resize and patchify
// (gemma4_vision/preprocess.h) into the ViT (gemma4_vision/encoder.h); a video's sampled frames the same way,
// each at the video processor's budget and with its timestamp; an audio file decoded,
// downmixed, resampled to the feature extractor's rate, turned into log-mel features
// (gemma4_audio/features.h) and through the conformer (gemma4_audio/encoder.h). The processor's
// settings come from the checkpoint's processor_config.json, as transformers' AutoProcessor reads them.
#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "core/error.h"
#include "core/thread_pool.h"
#include "media/audio.h"
#include "media/image.h"
#include "media/video.h"
#include "models/checkpoint.h"
#include "models/gemma4/gemma4.h"
#include "models/gemma4_audio/encoder.h"
#include "models/gemma4_audio/features.h"
#include "models/gemma4_unified/embedders.h"
#include "models/gemma4_vision/encoder.h"
#include "models/gemma4_vision/preprocess.h"
#include "models/hf_config.h"

namespace mb::gemma4 {

namespace {

namespace fs = std::filesystem;

class Gemma4MediaEncoder final : public MediaEncoder {
 public:
  Gemma4MediaEncoder(std::shared_ptr<const Checkpoint> ck, Backend& be) : ck_(std::move(ck)), be_(be) {
    MB_CHECK(!ck_->hf_config.is_null(),
             "{}: image and audio input need a Hugging Face checkpoint folder, or a GGUF model with its mmproj file "
             "(--mmproj)",
             ck_->path);
    const nlohmann::json& c = ck_->hf_config;
    // The 12B unified model has no towers: its embedders take patches and samples directly.
    if (ck_->tensors.contains("model.vision_embedder.patch_dense.weight") ||
        hf::model_type_of(c) == "gemma4_unified")
      unified_ = std::make_unique<gemma4_unified::UnifiedEmbedders>(ck_, be_);
    const std::string source = ck_->path + "/config.json";
    hf::Reader r{c, source};
    // The ids transformers 5.17.0's Gemma4Config defaults to (the released checkpoints' values).
    ids_.image = r.get("image_token_id", 258880);
    ids_.image_begin = r.get("boi_token_id", 255999);
    ids_.image_end = r.get("eoi_token_id", 258882);
    ids_.audio = r.get("audio_token_id", 258881);
    ids_.audio_begin = r.get("boa_token_id", 256000);
    ids_.audio_end = r.get("eoa_token_index", r.get("eoa_token_id", 258883));
    ids_.video = r.get("video_token_id", 258884);
    hidden_ = ck_->config.hidden_size;
    const fs::path proc = fs::path(ck_->path) / "processor_config.json";
    if (!ck_->processor_config.is_null()) {
      processor_ = ck_->processor_config;
    } else if (fs::is_directory(ck_->path) && fs::exists(proc)) {
      std::ifstream in(proc);
      try {
        processor_ = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        fail("{}: not valid JSON: {}", proc.string(), e.what());
      }
    }
  }

  const MediaTokenIds& token_ids() const override { return ids_; }
  int hidden_size() const override { return hidden_; }

  MediaEncoding encode(const MediaItem& item) override { return std::move(encode_batch({&item})[0]); }

  // The images that go through the ViT run in batches (stacked patches); the rest one by one.
  std::vector<MediaEncoding> encode_batch(const std::vector<const MediaItem*>& items) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<MediaEncoding> out(items.size());
    std::vector<size_t> tower_images;
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i]->kind == MediaItem::Kind::Image && !unified_) tower_images.push_back(i);
    // The tower's images decode and resize side by side on the pool's threads (a decoder is serial; a
    // lone image's resize takes the whole pool), a pool's worth at a time; a bad image's error is
    // raised at its turn in prompt order.
    ThreadPool& pool = ThreadPool::global();
    std::vector<gemma4_vision::ImagePatches> prepared(tower_images.size());
    std::vector<std::exception_ptr> failed(tower_images.size());
    size_t ready = 0;  // tower images [0, ready) prepared (or failed)
    auto prepare_wave = [&] {
      const HostTimer timer(be_, "images decoded, resized and cut into patches");
      const size_t k0 = ready, k1 = std::min(tower_images.size(), ready + size_t(pool.size()));
      pool.parallel_for(int64_t(k1 - k0), 1, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) {
          const size_t k = k0 + size_t(j);
          try {
            const MediaItem& item = *items[tower_images[k]];
            prepared[k] = gemma4_vision::preprocess_image(decode_image(item.bytes, item.what), image_cfg_);
          } catch (...) {
            failed[k] = std::current_exception();
          }
        }
      });
      ready = k1;
    };
    std::vector<gemma4_vision::ImagePatches> patches;
    for (size_t i = 0, k = 0; i < items.size(); ++i) {
      const MediaItem& item = *items[i];
      if (item.kind == MediaItem::Kind::Image && !unified_) {
        open_vision(item.what);
        if (k == ready) prepare_wave();
        if (failed[k]) std::rethrow_exception(failed[k]);
        patches.push_back(std::move(prepared[k++]));
      } else if (item.kind == MediaItem::Kind::Video) {
        out[i] = encode_video(item);
      } else {
        out[i].soft = item.kind == MediaItem::Kind::Image ? encode_unified_image(item) : encode_audio(item);
      }
    }
    if (!patches.empty()) {
      std::vector<std::vector<float>> soft = encode_on_tower(std::move(patches));
      for (size_t k = 0; k < tower_images.size(); ++k) out[tower_images[k]].soft = std::move(soft[k]);
    }
    for (MediaEncoding& e : out)
      if (e.blocks.empty()) e.blocks.push_back({int64_t(e.soft.size()) / hidden_, ""});
    return out;
  }

 private:
  // Soft tokens of each image's patches through the ViT, in batches of up to kMaxBatchPatches patches.
  std::vector<std::vector<float>> encode_on_tower(std::vector<gemma4_vision::ImagePatches> patches) {
    constexpr size_t kMaxBatchPatches = 16384;
    std::vector<std::vector<float>> out;
    for (size_t b = 0; b < patches.size();) {
      std::vector<gemma4_vision::VisionEncoder::Patches> batch;
      size_t rows = 0;
      for (; b < patches.size() && (batch.empty() || rows + size_t(patches[b].n_patches) <= kMaxBatchPatches); ++b) {
        rows += size_t(patches[b].n_patches);
        batch.push_back({patches[b].pixels, patches[b].pos_x, patches[b].pos_y});
      }
      for (auto& soft : vision_->encode_batch(batch)) out.push_back(std::move(soft));
    }
    return out;
  }

  // Gemma4VideoProcessor + Gemma4Processor.replace_video_token: frames sampled uniformly, each through the
  // image path (its own budget, division rescale) and the vision tower alone; a block per frame, labelled
  // with its timestamp.
  MediaEncoding encode_video(const MediaItem& item) {
    const gemma4_vision::VideoProcessorConfig cfg = gemma4_vision::parse_video_processor_config(processor_);
    const FramePicker pick = [&](int64_t total, double) {
      return gemma4_vision::sample_frame_indices(total, cfg.num_frames);
    };
    const VideoFrames v = item.frames.empty() ? decode_video(item.bytes, item.what, pick)
                                              : decode_video_frames(item.frames, item.what, pick);
    MediaEncoding e;
    const std::vector<std::vector<float>> soft = encode_frames(v.frames, cfg.frame, item.what);
    for (size_t f = 0; f < v.frames.size(); ++f) {
      e.blocks.push_back({int64_t(soft[f].size()) / hidden_, gemma4_vision::frame_timestamp(v.indices[f], v.fps)});
      e.soft.insert(e.soft.end(), soft[f].begin(), soft[f].end());
    }
    return e;
  }

  // Each frame's soft tokens (through the ViT in batches).
  std::vector<std::vector<float>> encode_frames(const std::vector<RgbImage>& frames,
                                                gemma4_vision::ImageProcessorConfig frame_cfg, const std::string& what) {
    std::vector<std::vector<float>> out;
    if (unified_) {
      MB_CHECK(unified_->has_vision(), "{}: this model has no vision embedder, so it cannot read video ({})",
               ck_->path, what);
      const gemma4_vision::ImageProcessorConfig icfg = unified_image_config();
      frame_cfg.patch_size = icfg.patch_size;
      frame_cfg.pooling_kernel_size = icfg.pooling_kernel_size;
      for (const RgbImage& img : frames) {
        const gemma4_vision::ImagePatches p = gemma4_vision::merge_patches_unified(
            gemma4_vision::preprocess_image(img, frame_cfg), frame_cfg.pooling_kernel_size);
        out.push_back(unified_->encode_image(p.pixels, p.pos_x, p.pos_y));
      }
      return out;
    }
    open_vision(what);
    if (!processor_.contains("video_processor")) {  // no video settings: the image path's geometry
      frame_cfg.patch_size = image_cfg_.patch_size;
      frame_cfg.pooling_kernel_size = image_cfg_.pooling_kernel_size;
    }
    MB_CHECK(frame_cfg.patch_size == vision_->config().patch_size &&
                 frame_cfg.pooling_kernel_size == vision_->config().pooling_kernel,
             "{}: processor_config.json's video patch size {} and pooling {} differ from the vision tower's {} and {}",
             ck_->path, frame_cfg.patch_size, frame_cfg.pooling_kernel_size, vision_->config().patch_size,
             vision_->config().pooling_kernel);
    std::vector<gemma4_vision::ImagePatches> patches;
    for (const RgbImage& img : frames) patches.push_back(gemma4_vision::preprocess_image(img, frame_cfg));
    return encode_on_tower(std::move(patches));
  }

  void open_vision(const std::string& what) {
    if (vision_) return;
    MB_CHECK(ck_->hf_config.contains("vision_config") && ck_->hf_config["vision_config"].is_object(),
             "{}: this model has no vision tower, so it cannot read images or video ({})", ck_->path, what);
    const HostTimer timer(be_, "vision tower loaded");
    vision_ = std::make_unique<gemma4_vision::VisionEncoder>(ck_, be_);
    image_cfg_ = gemma4_vision::parse_image_processor_config(processor_);
    if (ck_->image_tokens > 0) image_cfg_.max_soft_tokens = ck_->image_tokens;
    if (!processor_.contains("image_processor")) {  // no processor file: the tower's own geometry
      image_cfg_.patch_size = vision_->config().patch_size;
      image_cfg_.pooling_kernel_size = vision_->config().pooling_kernel;
    }
    MB_CHECK(image_cfg_.patch_size == vision_->config().patch_size &&
                 image_cfg_.pooling_kernel_size == vision_->config().pooling_kernel,
             "{}: processor_config.json's patch size {} and pooling {} differ from the vision tower's {} and {}",
             ck_->path, image_cfg_.patch_size, image_cfg_.pooling_kernel_size, vision_->config().patch_size,
             vision_->config().pooling_kernel);
  }

  // The 12B unified model's image: merged patches through its embedder (no tower).
  std::vector<float> encode_unified_image(const MediaItem& item) {
    MB_CHECK(unified_->has_vision(), "{}: this model has no vision embedder, so it cannot read images ({})",
             ck_->path, item.what);
    const gemma4_vision::ImageProcessorConfig cfg = unified_image_config();
    const gemma4_vision::ImagePatches p = gemma4_vision::merge_patches_unified(
        gemma4_vision::preprocess_image(decode_image(item.bytes, item.what), cfg), cfg.pooling_kernel_size);
    return unified_->encode_image(p.pixels, p.pos_x, p.pos_y);
  }

  std::vector<float> encode_audio(const MediaItem& item) {
    if (unified_) {
      MB_CHECK(unified_->has_audio(), "{}: this model has no audio embedder, so it cannot read audio ({})", ck_->path,
               item.what);
      MB_CHECK(unified_->audio_samples_per_token() == gemma4_audio::kUnifiedAudioSamplesPerToken,
               "{}: audio frames of {} samples (the processor cuts {})", ck_->path, unified_->audio_samples_per_token(),
               gemma4_audio::kUnifiedAudioSamplesPerToken);
      const Waveform w = decode_audio(item.bytes, item.what);
      const std::vector<float> mono = resample(to_mono(w), w.sample_rate, 16000);
      MB_CHECK(!mono.empty(), "{}: the audio has no samples", item.what);
      return unified_->encode_audio(gemma4_audio::unified_audio_frames(mono));
    }
    if (!audio_) {
      MB_CHECK(ck_->hf_config.contains("audio_config") && ck_->hf_config["audio_config"].is_object(),
               "{}: this model has no audio tower, so it cannot read audio ({})", ck_->path, item.what);
      const HostTimer timer(be_, "audio tower loaded");
      audio_ = std::make_unique<gemma4_audio::AudioEncoder>(ck_, be_);
      audio_cfg_ = gemma4_audio::parse_audio_feature_config(processor_);
    }
    std::vector<float> mono;
    gemma4_audio::AudioFeatures f;
    {
      const HostTimer timer(be_, "audio decoded, resampled and turned into features");
      const Waveform w = decode_audio(item.bytes, item.what);
      mono = resample(to_mono(w), w.sample_rate, audio_cfg_.sampling_rate);
      f = gemma4_audio::extract_features(mono, audio_cfg_);
    }
    MB_CHECK(f.n_soft_tokens > 0, "{}: the audio is too short to give a soft token ({} samples at {} Hz)", item.what,
             mono.size(), audio_cfg_.sampling_rate);
    return audio_->encode(f.mel, f.valid, f.n_mels);
  }

  gemma4_vision::ImageProcessorConfig unified_image_config() const {
    gemma4_vision::ImageProcessorConfig cfg = gemma4_vision::parse_image_processor_config(processor_);
    if (ck_->image_tokens > 0) cfg.max_soft_tokens = ck_->image_tokens;
    if (!processor_.contains("image_processor")) {  // no processor file: the model's own geometry
      const nlohmann::json& v = ck_->hf_config["vision_config"];
      hf::Reader r{v, ck_->path + "/config.json"};
      cfg.patch_size = r.get("patch_size", 16);
      cfg.pooling_kernel_size = r.get("pooling_kernel_size", 3);
    }
    MB_CHECK(cfg.patch_size * cfg.pooling_kernel_size == unified_->patch_pixels(),
             "{}: processor_config.json's patches ({} px × {}) differ from the model's {} px", ck_->path, cfg.patch_size,
             cfg.pooling_kernel_size, unified_->patch_pixels());
    return cfg;
  }

  std::shared_ptr<const Checkpoint> ck_;
  Backend& be_;
  std::unique_ptr<gemma4_unified::UnifiedEmbedders> unified_;
  MediaTokenIds ids_;
  int hidden_ = 0;
  nlohmann::json processor_ = nlohmann::json::object();
  std::mutex mu_;
  std::unique_ptr<gemma4_vision::VisionEncoder> vision_;
  gemma4_vision::ImageProcessorConfig image_cfg_;
  std::unique_ptr<gemma4_audio::AudioEncoder> audio_;
  gemma4_audio::AudioFeatureConfig audio_cfg_;
};

}  // namespace

std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const Checkpoint> ck, Backend& backend) {
  return std::make_unique<Gemma4MediaEncoder>(std::move(ck), backend);
}

}  // namespace mb::gemma4
