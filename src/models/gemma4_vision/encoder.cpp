// Shapes: n = real patches of the image, D = vision width, nh = heads, hd = head dim, F = MLP
// width, k = pooling kernel, m = n / k² soft tokens, H = language model width.
#include "models/gemma4_vision/encoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "core/error.h"
#include "core/thread_pool.h"
#include "models/hf_config.h"
#include "models/tower_weights.h"

namespace mb::gemma4_vision {

namespace {
constexpr const char* kTower = "model.vision_tower.";
constexpr const char* kProjector = "model.embed_vision.embedding_projection.weight";
constexpr const char* kHostArrays = "vision tower's host-side arrays";  // one profiler row for every scope

}  // namespace

struct VisionEncoder::Weights {
  struct Layer {
    Tensor input_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm, q_norm, k_norm;
    ClippedLinear q, k, v, o, gate, up, down;
  };
  Tensor patch_proj, pos_table, projector, std_shift, std_scale;  // std_shift = -std_bias
  std::vector<Layer> layers;
  std::vector<float> inv_freq;  // hd/4 frequencies of each half's rotation
};

VisionConfig parse_vision_config(const nlohmann::json& config, const std::string& source) {
  MB_CHECK(config.contains("vision_config") && config["vision_config"].is_object(),
           "{}: this model has no vision_config, so it cannot read images", source);
  const nlohmann::json& v = config["vision_config"];
  hf::Reader r{v, source};
  VisionConfig c;
  c.hidden = r.get("hidden_size", 768);
  c.layers = r.get("num_hidden_layers", 16);
  c.heads = r.get("num_attention_heads", 12);
  c.kv_heads = r.get("num_key_value_heads", c.heads);
  c.head_dim = r.get("head_dim", c.heads > 0 ? c.hidden / c.heads : 0);
  c.ffn = r.get("intermediate_size", 3072);
  c.patch_size = r.get("patch_size", 16);
  c.pooling_kernel = r.get("pooling_kernel_size", 3);
  c.position_table = r.get("position_embedding_size", 10240);
  c.eps = float(r.get("rms_norm_eps", 1e-6));
  c.standardize = r.get("standardize", false);
  c.clipped_linears = r.get("use_clipped_linears", false);
  if (v.contains("rope_parameters") && v["rope_parameters"].is_object())
    c.rope_theta = float(hf::Reader{v["rope_parameters"], source}.get("rope_theta", 100.0));
  const nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  c.text_hidden = hf::Reader{text, source}.get("hidden_size", 0);
  MB_CHECK(c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.heads % c.kv_heads == 0 &&
               c.head_dim > 0 && c.head_dim % 4 == 0 && c.ffn > 0 && c.patch_size > 0 && c.pooling_kernel > 0 &&
               c.position_table > 0 && c.text_hidden > 0,
           "{}: vision_config has unusable sizes (hidden {}, layers {}, heads {}/{}, head_dim {}, ffn {}, patch {}, "
           "pooling {})",
           source, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.ffn, c.patch_size, c.pooling_kernel);
  return c;
}

VisionEncoder::VisionEncoder(std::shared_ptr<const Checkpoint> ck, Backend& be)
    : ck_(std::move(ck)), be_(be), w_(std::make_unique<Weights>()) {
  const std::string source = ck_->path + "/config.json";
  MB_CHECK(!ck_->hf_config.is_null(), "{}: images need a Hugging Face checkpoint folder (config.json)", ck_->path);
  cfg_ = parse_vision_config(ck_->hf_config, source);
  MB_CHECK(ck_->tensors.contains(kProjector),
           "{}: the checkpoint has no vision tower weights ({} is missing), so it cannot read images", ck_->path,
           kProjector);
  const int64_t D = cfg_.hidden, hd = cfg_.head_dim, nh = cfg_.heads, nkv = cfg_.kv_heads, F = cfg_.ffn;
  const int64_t P = int64_t(cfg_.patch_size) * cfg_.patch_size * 3;
  const TowerWeights tw(*ck_, be_);
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape) { return tw.matrix(name, std::move(shape)); };
  auto vec = [&](const std::string& name, int64_t n) { return tw.vec(name, n); };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    return tw.linear(name, out, in, cfg_.clipped_linears);
  };
  const std::string t = kTower;
  w_->patch_proj = matrix(t + "patch_embedder.input_proj.weight", {D, P});
  {
    Tensor table = ck_->tensors.get(t + "patch_embedder.position_embedding_table", {2, cfg_.position_table, D});
    w_->pos_table = be_.prepare_weight(table.reshaped({2 * int64_t(cfg_.position_table), D}), table.dtype,
                                       Backend::WeightUse::Lookup);
  }
  w_->projector = matrix(kProjector, {cfg_.text_hidden, D});
  if (cfg_.standardize) {
    // x - b as x + (-b): the same float.
    std::vector<float> shift = tw.host_values(t + "std_bias", {D});
    for (float& v : shift) v = -v;
    w_->std_shift = backend_values(be_, shift, {D});
    w_->std_scale = backend_values(be_, tw.host_values(t + "std_scale", {D}), {D});
  }
  w_->layers.resize(size_t(cfg_.layers));
  for (int l = 0; l < cfg_.layers; ++l) {
    Weights::Layer& L = w_->layers[size_t(l)];
    const std::string p = t + "encoder.layers." + std::to_string(l) + ".";
    L.input_norm = vec(p + "input_layernorm.weight", D);
    L.post_attn_norm = vec(p + "post_attention_layernorm.weight", D);
    L.pre_ffn_norm = vec(p + "pre_feedforward_layernorm.weight", D);
    L.post_ffn_norm = vec(p + "post_feedforward_layernorm.weight", D);
    L.q_norm = vec(p + "self_attn.q_norm.weight", hd);
    L.k_norm = vec(p + "self_attn.k_norm.weight", hd);
    L.q = linear(p + "self_attn.q_proj", nh * hd, D);
    L.k = linear(p + "self_attn.k_proj", nkv * hd, D);
    L.v = linear(p + "self_attn.v_proj", nkv * hd, D);
    L.o = linear(p + "self_attn.o_proj", D, nh * hd);
    L.gate = linear(p + "mlp.gate_proj", F, D);
    L.up = linear(p + "mlp.up_proj", F, D);
    L.down = linear(p + "mlp.down_proj", D, F);
  }
  // Each half of a head rotates like a head of hd/2 ("axial" RoPE): hd/4 frequencies
  // 1 / theta^(2j / (hd/2)), in f32 as transformers computes them.
  const int half = cfg_.head_dim / 2;
  for (int j = 0; j < half / 2; ++j)
    w_->inv_freq.push_back(1.f / std::pow(cfg_.rope_theta, float(2 * j) / float(half)));
}

VisionEncoder::~VisionEncoder() = default;


std::vector<float> VisionEncoder::encode(std::span<const float> pixels, std::span<const int32_t> pos_x,
                                         std::span<const int32_t> pos_y) {
  const Patches one{pixels, pos_x, pos_y};
  return std::move(encode_batch(std::span<const Patches>(&one, 1))[0]);
}

std::vector<std::vector<float>> VisionEncoder::encode_batch(std::span<const Patches> images) {
  const int64_t D = cfg_.hidden, hd = cfg_.head_dim, nh = cfg_.heads, nkv = cfg_.kv_heads, F = cfg_.ffn,
                k = cfg_.pooling_kernel, H = cfg_.text_hidden;
  const int64_t P = int64_t(cfg_.patch_size) * cfg_.patch_size * 3;
  MB_CHECK(!images.empty(), "vision encoder: no images");
  // Rows of image i: [begin[i], begin[i] + count[i]) of the stacked patches.
  const size_t B = images.size();
  std::vector<int64_t> begin(B), count(B), grid_w(B);
  int64_t n = 0;
  for (size_t b = 0; b < B; ++b) {
    const Patches& im = images[b];
    const int64_t ni = int64_t(im.pos_x.size());
    MB_CHECK(ni > 0 && im.pos_y.size() == size_t(ni) && im.pixels.size() == size_t(ni * P),
             "vision encoder: {} pixel values for {} patches of {} (and {} y positions)", im.pixels.size(), ni, P,
             im.pos_y.size());
    int32_t gw = 0, gh = 0;
    for (int64_t i = 0; i < ni; ++i) {
      const int32_t x = im.pos_x[size_t(i)], y = im.pos_y[size_t(i)];
      MB_CHECK(x >= 0 && y >= 0 && x < cfg_.position_table && y < cfg_.position_table,
               "vision encoder: patch {} at ({}, {}) is outside the {}-entry position table", i, x, y,
               cfg_.position_table);
      gw = std::max(gw, x + 1);
      gh = std::max(gh, y + 1);
    }
    MB_CHECK(gw % k == 0 && gh % k == 0 && int64_t(gw) * gh == ni,
             "vision encoder: a {}x{} patch grid with {} patches does not pool by {}", gw, gh, ni, k);
    begin[b] = n;
    count[b] = ni;
    grid_w[b] = gw;
    n += ni;
  }
  std::vector<int32_t> all_x, all_y;
  all_x.reserve(size_t(n));
  all_y.reserve(size_t(n));
  for (const Patches& im : images) {
    all_x.insert(all_x.end(), im.pos_x.begin(), im.pos_x.end());
    all_y.insert(all_y.end(), im.pos_y.begin(), im.pos_y.end());
  }

  // Patch embedding: (2·pixel - 1) · Wᵀ plus the x and y rows of the position table.
  std::vector<float> centred(size_t(n * P));
  {
    const HostTimer timer(be_, kHostArrays);
    for (size_t b = 0; b < B; ++b) {
      const float* src = images[b].pixels.data();
      float* dst = centred.data() + begin[b] * P;
      ThreadPool::global().parallel_for(count[b], 64, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * P; i < r1 * P; ++i) dst[i] = 2.f * (src[i] - 0.5f);
      });
    }
  }
  Tensor px = be_.scratch(DType::F32, {n, P});
  be_.upload(centred.data(), px);
  Tensor h = be_.scratch(DType::F32, {n, D});
  be_.matmul(px, w_->patch_proj, h);
  px = Tensor();
  std::vector<int32_t> ids_y = all_y;
  for (int32_t& y : ids_y) y += cfg_.position_table;  // the y table follows the x table
  Tensor ex = be_.scratch(DType::F32, {n, D}), ey = be_.scratch(DType::F32, {n, D});
  be_.embed(w_->pos_table, all_x.data(), n, 1.f, ex);
  be_.embed(w_->pos_table, ids_y.data(), n, 1.f, ey);
  be_.add(ex, ey, ex);
  be_.add(h, ex, h);
  ex = ey = Tensor();

  // Each head is rotated as two half-heads, the first by the patch's column and the second by its
  // row: viewed as [n·nh·2, 1, hd/2] rows, row (t, head, half) takes position pos_x[t] or pos_y[t].
  std::optional<HostTimer> timer(std::in_place, be_, kHostArrays);
  std::vector<int32_t> q_pos(size_t(n * nh * 2)), k_pos(size_t(n * nkv * 2));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < nh; ++j) {
      q_pos[size_t((t * nh + j) * 2)] = all_x[size_t(t)];
      q_pos[size_t((t * nh + j) * 2 + 1)] = all_y[size_t(t)];
    }
    for (int64_t j = 0; j < nkv; ++j) {
      k_pos[size_t((t * nkv + j) * 2)] = all_x[size_t(t)];
      k_pos[size_t((t * nkv + j) * 2 + 1)] = all_y[size_t(t)];
    }
  }
  // Bidirectional attention over each image through the causal op: image i's keys sit at positions
  // 0..n_i-1 of its own store, and each of its queries, placed at n_i-1, sees all of them.
  std::vector<int32_t> key_slots(static_cast<size_t>(n)), query_last(static_cast<size_t>(n));
  std::vector<KVStore> stores(B);
  const bool kv_views = be_.kv_dtype() == DType::F32;
  std::vector<Backend::AttentionSeq> writes(B), reads(B);
  for (size_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < count[b]; ++i) {
      key_slots[size_t(begin[b] + i)] = int32_t(i);
      query_last[size_t(begin[b] + i)] = int32_t(count[b] - 1);
    }
    // Where the backend keeps f32 keys and values, each layer's stores are views of its K and V
    // rows (below) instead of copies (a 2,520-patch layer's K and V are 15 MB).
    if (!kv_views) {
      stores[b].k = be_.alloc(be_.kv_dtype(), {count[b], nkv, hd});
      stores[b].v = be_.alloc(be_.kv_dtype(), {count[b], nkv, hd});
    }
    stores[b].capacity = count[b];
    writes[b] = {&stores[b], begin[b], count[b], key_slots.data() + begin[b]};
    reads[b] = {&stores[b], begin[b], count[b], query_last.data() + begin[b]};
  }
  timer.reset();
  AttentionParams ap;  // scale 1: the q/k norms set the logits' size
  ap.scale = 1.f;
  ap.rounded_inputs = !w_->layers.empty() && rounded_products(*ck_, w_->layers[0].q.w);

  // Each residual add writes the next block's normed input in the same pass (add_rms_norm_norm):
  // `a` holds the layer's attention input, made by the previous layer's end (the first layer's here).
  Tensor a = be_.scratch(DType::F32, {n, D});
  if (!w_->layers.empty()) be_.rms_norm(h, &w_->layers[0].input_norm, cfg_.eps, false, a);
  for (size_t li = 0; li < w_->layers.size(); ++li) {
    const Weights::Layer& L = w_->layers[li];
    Tensor q = be_.scratch(DType::F32, {n, nh, hd}), kk = be_.scratch(DType::F32, {n, nkv, hd}),
           v = be_.scratch(DType::F32, {n, nkv, hd});
    clipped_matmul(be_, a, L.q, q);
    clipped_matmul(be_, a, L.k, kk);
    clipped_matmul(be_, a, L.v, v);
    a = Tensor();
    Tensor q_rows = q.reshaped({n * nh, hd}), k_rows = kk.reshaped({n * nkv, hd}), v_rows = v.reshaped({n * nkv, hd});
    be_.rms_norm(q_rows, &L.q_norm, cfg_.eps, false, q_rows);
    be_.rms_norm(k_rows, &L.k_norm, cfg_.eps, false, k_rows);
    be_.rms_norm(v_rows, nullptr, cfg_.eps, false, v_rows);
    Tensor q_halves = q.reshaped({n * nh * 2, 1, hd / 2}), k_halves = kk.reshaped({n * nkv * 2, 1, hd / 2});
    be_.rope(q_halves, q_pos.data(), w_->inv_freq.data());
    be_.rope(k_halves, k_pos.data(), w_->inv_freq.data());
    if (kv_views) {
      for (size_t b = 0; b < B; ++b) {
        stores[b].k = kk.slice_rows(begin[b], count[b]);
        stores[b].v = v.slice_rows(begin[b], count[b]);
      }
    } else {
      be_.kv_write_batch(kk, v, writes);
    }
    kk = v = Tensor();
    Tensor att = be_.scratch(DType::F32, {n, nh, hd});
    be_.attention_batch(q, reads, ap, att);
    q = Tensor();
    Tensor o = be_.scratch(DType::F32, {n, D});
    clipped_matmul(be_, att.reshaped({n, nh * hd}), L.o, o);
    att = Tensor();
    Tensor b = be_.scratch(DType::F32, {n, D});
    be_.add_rms_norm_norm(h, o, &L.post_attn_norm, cfg_.eps, false, 1.f, &L.pre_ffn_norm, b);
    o = Tensor();

    Tensor g = be_.scratch(DType::F32, {n, F}), u = be_.scratch(DType::F32, {n, F});
    clipped_matmul(be_, b, L.up, u);
    clipped_matmul(be_, b, L.gate, g, std::numeric_limits<float>::infinity(), Backend::Activation::GeluTanhTimes, &u);
    b = Tensor();
    u = Tensor();
    Tensor m = be_.scratch(DType::F32, {n, D});
    clipped_matmul(be_, g, L.down, m);
    g = Tensor();
    if (li + 1 < w_->layers.size()) {
      a = be_.scratch(DType::F32, {n, D});
      be_.add_rms_norm_norm(h, m, &L.post_ffn_norm, cfg_.eps, false, 1.f, &w_->layers[li + 1].input_norm, a);
    } else {
      be_.add_rms_norm(h, m, &L.post_ffn_norm, cfg_.eps, false);
    }
  }
  stores.clear();

  // k x k average pooling in raster order of each image's pooled grid, in f32 with weights f32(1/k²)
  // as transformers' one-hot matmul does (each pooled row sums its patches in patch order); then
  // × sqrt(D) and, on the large encoders, standardised: (x - std_bias) · std_scale.
  const int64_t kk = k * k;
  std::vector<int64_t> pooled_begin(B);
  int64_t m = 0;
  for (size_t b = 0; b < B; ++b) {
    pooled_begin[b] = m;
    m += count[b] / kk;
  }
  std::vector<int32_t> pooled_rows(size_t(m * kk));
  std::vector<int64_t> filled(static_cast<size_t>(m), 0);
  for (size_t b = 0; b < B; ++b) {
    const int64_t pooled_w = grid_w[b] / k;
    for (int64_t i = 0; i < count[b]; ++i) {
      const int64_t t = begin[b] + i;
      const int64_t slot = pooled_begin[b] + all_x[size_t(t)] / k + pooled_w * (all_y[size_t(t)] / k);
      MB_CHECK(slot < pooled_begin[b] + count[b] / kk && filled[size_t(slot)] < kk,
               "vision encoder: patch ({}, {}) of image {} does not pool into its {}x{} grid", all_x[size_t(t)],
               all_y[size_t(t)], b, pooled_w, count[b] / kk / std::max<int64_t>(pooled_w, 1));
      pooled_rows[size_t(slot * kk + filled[size_t(slot)]++)] = int32_t(t);
    }
  }
  Tensor s = be_.scratch(DType::F32, {m, D});
  be_.gather_sum_rows(h, pooled_rows.data(), kk, 1.f / float(kk), s);
  h = Tensor();
  be_.scale(s, float(std::sqrt(double(D))));
  if (cfg_.standardize) {
    be_.add(s, w_->std_shift, s);
    be_.mul(s, w_->std_scale, s);
  }

  // The projector: RMS norm without weight, then D -> H.
  be_.rms_norm(s, nullptr, cfg_.eps, false, s);
  Tensor soft = be_.scratch(DType::F32, {m, H});
  be_.matmul(s, w_->projector, soft);
  std::vector<float> all(size_t(m * H));
  be_.to_host(soft, all.data());
  std::vector<std::vector<float>> out(B);
  for (size_t b = 0; b < B; ++b) {
    const int64_t rows = count[b] / (k * k);
    out[b].assign(all.begin() + pooled_begin[b] * H, all.begin() + (pooled_begin[b] + rows) * H);
  }
  return out;
}

}  // namespace mb::gemma4_vision
