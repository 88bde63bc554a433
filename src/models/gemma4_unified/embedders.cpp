// Shapes: n = patches (or frames) of one item, P = 48·48·3 pixel values a patch, D = mm_embed_dim,
// O = output_proj_dims, H = language model width, S = audio samples a frame.
#include "models/gemma4_unified/embedders.h"

#include <cmath>

#include "core/error.h"
#include "models/hf_config.h"
#include "models/tower_weights.h"

namespace mb::gemma4_unified {

namespace {
constexpr const char* kVision = "model.vision_embedder.";
constexpr const char* kVisionProjector = "model.embed_vision.embedding_projection.weight";
constexpr const char* kAudioProjector = "model.embed_audio.embedding_projection.weight";
}  // namespace

struct UnifiedEmbedders::Weights {
  int patch_side = 0, pos_table = 0, mm_dim = 0, out_dim = 0, hidden = 0, audio_samples = 640;
  float vision_eps = 1e-6f, audio_eps = 1e-6f;
  Tensor ln1_w, ln1_b, dense_b, ln2_w, ln2_b, pos_w, pos_b;  // [P] or [D]
  Tensor pos;                                                 // lookup rows [pos_table · 2, D]: (x, 0), (y, 1)
  Tensor dense, vision_proj, audio_proj;
};

UnifiedEmbedders::UnifiedEmbedders(std::shared_ptr<const Checkpoint> ck, Backend& be)
    : ck_(std::move(ck)), be_(be), w_(std::make_unique<Weights>()) {
  const std::string source = ck_->path + "/config.json";
  const nlohmann::json& c = ck_->hf_config;
  w_->hidden = ck_->config.hidden_size;
  const TowerWeights tw(*ck_, be_);
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape) { return tw.matrix(name, std::move(shape)); };
  auto vec = [&](const std::string& name, int64_t n) { return tw.vec(name, n); };
  if (c.contains("vision_config") && c["vision_config"].is_object() && ck_->tensors.contains(kVisionProjector)) {
    hf::Reader r{c["vision_config"], source};
    w_->patch_side = r.get("patch_size", 16) * r.get("pooling_kernel_size", 3);
    w_->mm_dim = r.get("mm_embed_dim", 3840);
    w_->out_dim = r.get("output_proj_dims", w_->mm_dim);
    w_->pos_table = r.get("mm_posemb_size", 1120);
    w_->vision_eps = float(r.get("rms_norm_eps", 1e-6));
    const int64_t P = int64_t(w_->patch_side) * w_->patch_side * 3, D = w_->mm_dim;
    MB_CHECK(P > 0 && D > 0 && w_->out_dim == D && w_->pos_table > 0,
             "{}: vision_config has unusable sizes (patch {} px, mm_embed_dim {}, output_proj_dims {})", source,
             w_->patch_side, D, w_->out_dim);
    const std::string v = kVision;
    w_->ln1_w = vec(v + "patch_ln1.weight", P);
    w_->ln1_b = vec(v + "patch_ln1.bias", P);
    w_->dense = matrix(v + "patch_dense.weight", {D, P});
    w_->dense_b = vec(v + "patch_dense.bias", D);
    w_->ln2_w = vec(v + "patch_ln2.weight", D);
    w_->ln2_b = vec(v + "patch_ln2.bias", D);
    const Tensor table = ck_->tensors.get(v + "pos_embedding", {w_->pos_table, 2, D});
    w_->pos = be_.prepare_weight(table.reshaped({2 * int64_t(w_->pos_table), D}), table.dtype,
                                 Backend::WeightUse::Lookup);
    w_->pos_w = vec(v + "pos_norm.weight", D);
    w_->pos_b = vec(v + "pos_norm.bias", D);
    w_->vision_proj = matrix(kVisionProjector, {w_->hidden, D});
  }
  if (c.contains("audio_config") && c["audio_config"].is_object() && ck_->tensors.contains(kAudioProjector)) {
    hf::Reader r{c["audio_config"], source};
    w_->audio_samples = r.get("audio_embed_dim", 640);
    w_->audio_eps = float(r.get("rms_norm_eps", 1e-6));
    MB_CHECK(w_->audio_samples > 0, "{}: audio_config.audio_embed_dim must be positive", source);
    w_->audio_proj = matrix(kAudioProjector, {w_->hidden, w_->audio_samples});
  }
}

UnifiedEmbedders::~UnifiedEmbedders() = default;
bool UnifiedEmbedders::has_vision() const { return !w_->vision_proj.empty(); }
bool UnifiedEmbedders::has_audio() const { return !w_->audio_proj.empty(); }
int UnifiedEmbedders::patch_pixels() const { return w_->patch_side; }
int UnifiedEmbedders::audio_samples_per_token() const { return w_->audio_samples; }

std::vector<float> UnifiedEmbedders::encode_image(std::span<const float> pixels, std::span<const int32_t> pos_x,
                                                  std::span<const int32_t> pos_y) {
  MB_CHECK(has_vision(), "{}: this model has no vision embedder, so it cannot read images", ck_->path);
  const int64_t n = int64_t(pos_x.size()), P = int64_t(w_->patch_side) * w_->patch_side * 3, D = w_->mm_dim,
                H = w_->hidden;
  MB_CHECK(n > 0 && pos_y.size() == size_t(n) && pixels.size() == size_t(n * P),
           "unified vision embedder: {} pixel values for {} patches of {}", pixels.size(), n, P);
  for (int64_t i = 0; i < n; ++i)
    MB_CHECK(pos_x[size_t(i)] >= 0 && pos_y[size_t(i)] >= 0 && pos_x[size_t(i)] < w_->pos_table &&
                 pos_y[size_t(i)] < w_->pos_table,
             "unified vision embedder: patch {} at ({}, {}) is outside the {}-entry position table", i,
             pos_x[size_t(i)], pos_y[size_t(i)], w_->pos_table);
  Tensor x = be_.scratch(DType::F32, {n, P}), h = be_.scratch(DType::F32, {n, D});
  be_.upload(pixels.data(), x);
  be_.layer_norm(x, w_->ln1_w, &w_->ln1_b, 1e-5f, false, x);
  be_.matmul(x, w_->dense, h);
  x = Tensor();
  be_.add(h, w_->dense_b, h);
  be_.layer_norm(h, w_->ln2_w, &w_->ln2_b, 1e-5f, false, h);
  std::vector<int32_t> rows_x(static_cast<size_t>(n)), rows_y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    rows_x[size_t(i)] = pos_x[size_t(i)] * 2;
    rows_y[size_t(i)] = pos_y[size_t(i)] * 2 + 1;
  }
  Tensor ex = be_.scratch(DType::F32, {n, D}), ey = be_.scratch(DType::F32, {n, D});
  be_.embed(w_->pos, rows_x.data(), n, 1.f, ex);
  be_.embed(w_->pos, rows_y.data(), n, 1.f, ey);
  be_.add(ex, ey, ex);  // P[x, 0] + P[y, 1], summed first as transformers does
  be_.add(h, ex, h);
  ex = ey = Tensor();
  be_.layer_norm(h, w_->pos_w, &w_->pos_b, 1e-5f, false, h);
  Tensor& s = h;
  Tensor soft = be_.scratch(DType::F32, {n, H});
  be_.rms_norm(s, nullptr, w_->vision_eps, false, s);
  be_.matmul(s, w_->vision_proj, soft);
  std::vector<float> out(size_t(n * H));
  be_.to_host(soft, out.data());
  return out;
}

std::vector<float> UnifiedEmbedders::encode_audio(std::span<const float> frames) {
  MB_CHECK(has_audio(), "{}: this model has no audio embedder, so it cannot read audio", ck_->path);
  const int64_t S = w_->audio_samples, n = int64_t(frames.size()) / S, H = w_->hidden;
  MB_CHECK(n > 0 && frames.size() == size_t(n * S), "unified audio embedder: {} samples are not frames of {}",
           frames.size(), S);
  Tensor x = be_.scratch(DType::F32, {n, S}), soft = be_.scratch(DType::F32, {n, H});
  be_.upload(frames.data(), x);
  be_.rms_norm(x, nullptr, w_->audio_eps, false, x);
  be_.matmul(x, w_->audio_proj, soft);
  std::vector<float> out(size_t(n * H));
  be_.to_host(soft, out.data());
  return out;
}

}  // namespace mb::gemma4_unified
