// Shapes: T = mel frames, F = mel bins, C0, C1 = the subsampling convolutions' channels,
// T1 = ceil(T/2), F1 = ceil(F/2), n = ceil(T1/2) conformer frames, F2 = ceil(F1/2), D = conformer
// width, nh = heads, hd = head dim, I = 4·D FFN width, K = light-conv kernel, O = output_proj width,
// H = language model width, M = soft tokens (valid conformer frames).
#include "models/gemma4_audio/encoder.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/thread_pool.h"
#include "models/hf_config.h"
#include "models/tower_weights.h"

namespace mb::gemma4_audio {

namespace {
constexpr const char* kTower = "model.audio_tower.";
constexpr const char* kProjector = "model.embed_audio.embedding_projection.weight";
// Gemma4RMSNorm's default epsilon: the FFNs' and the layers' own norms are built without
// rms_norm_eps (the light convolution's norms and the projector's take it).
constexpr float kDefaultNormEps = 1e-6f;
// Values of one pass of the second convolution's im2col (a 30 s clip would need 110 MB at once).
constexpr int64_t kIm2colBudget = int64_t(1) << 21;

// A Gemma4AudioFeedForward ("macaron" half step).
struct FeedForward {
  Tensor pre_norm, post_norm;
  ClippedLinear up, down;  // D -> I -> D
};

// torch.nn.functional.softplus (beta 1, threshold 20).
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
}  // namespace

struct AudioEncoder::Weights {
  struct Layer {
    FeedForward ff1, ff2;
    Tensor pre_attn_norm, post_attn_norm, out_norm;
    ClippedLinear q, k, v, post;
    Tensor q_gain;    // [hd] softplus(per_dim_scale)
    Tensor rel_keys;  // [P, nh · hd] relative_k_proj(PE(p)) for relative position p = 0 .. P-1
    Tensor conv_pre_norm, conv_norm;
    ClippedLinear conv_start, conv_end;  // D -> 2D (GLU), D -> D
    Tensor depthwise;                    // [D, K]
  };
  Tensor conv0, conv1, input_proj, output_proj, projector;  // conv weights as [C, C_in · 9] im2col matrices
  Tensor norm0, norm1, output_bias;                         // [C0], [C1], [O]
  std::vector<Layer> layers;
  int64_t proj_in = 0;  // input_proj_linear's input width: F2 · C1 for the mel bins the tower was built for
};

AudioConfig parse_audio_config(const nlohmann::json& config, const std::string& source) {
  MB_CHECK(config.contains("audio_config") && config["audio_config"].is_object(),
           "{}: this model has no audio_config, so it cannot read audio", source);
  const nlohmann::json& a = config["audio_config"];
  hf::Reader r{a, source};
  AudioConfig c;
  c.hidden = r.get("hidden_size", 1024);
  c.layers = r.get("num_hidden_layers", 12);
  c.heads = r.get("num_attention_heads", 8);
  c.head_dim = c.heads > 0 ? c.hidden / c.heads : 0;  // transformers derives it; there is no head_dim key
  const std::vector<int> channels = r.get("subsampling_conv_channels", std::vector<int>{128, 32});
  MB_CHECK(channels.size() == 2, "{}: audio_config.subsampling_conv_channels should list 2 widths, has {}", source,
           channels.size());
  c.sscp_channels[0] = channels[0];
  c.sscp_channels[1] = channels[1];
  c.conv_kernel = r.get("conv_kernel_size", 5);
  c.chunk_size = r.get("attention_chunk_size", 12);
  c.context_left = r.get("attention_context_left", 13);
  c.context_right = r.get("attention_context_right", 0);
  c.logit_cap = float(r.get("attention_logit_cap", 50.0));
  c.invalid_logit = float(r.get("attention_invalid_logits_value", -1e9));
  c.residual_weight = float(r.get("residual_weight", 0.5));
  // min(gradient_clipping, the f32 maximum), as transformers clamps an f32 model.
  c.gradient_clipping = float(std::min(r.get("gradient_clipping", 1e10), double(FLT_MAX)));
  c.eps = float(r.get("rms_norm_eps", 1e-6));
  c.clipped_linears = r.get("use_clipped_linears", true);
  c.output_dims = r.get("output_proj_dims", 1536);
  const std::string act = r.get("hidden_act", std::string("silu"));
  MB_CHECK(act == "silu" || act == "swish", "{}: audio_config.hidden_act '{}' is not supported (only silu)", source,
           act);
  const nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  c.text_hidden = hf::Reader{text, source}.get("hidden_size", 0);
  MB_CHECK(c.hidden > 0 && c.hidden <= std::numeric_limits<int>::max() / 4 && c.hidden % 2 == 0 && c.layers > 0 &&
               c.heads > 0 && c.hidden % c.heads == 0 && c.sscp_channels[0] >= 4 && c.sscp_channels[1] > 0 &&
               c.conv_kernel > 0 && c.output_dims > 0 && c.text_hidden > 0 && c.logit_cap > 0 &&
               c.gradient_clipping > 0,
           "{}: audio_config has unusable sizes (hidden {}, layers {}, heads {}, subsampling channels {}/{}, conv "
           "kernel {}, output {}, soft-cap {})",
           source, c.hidden, c.layers, c.heads, c.sscp_channels[0], c.sscp_channels[1], c.conv_kernel, c.output_dims,
           c.logit_cap);
  c.ffn = 4 * c.hidden;  // Gemma4AudioFeedForward's fixed width
  // The relative-position term below follows transformers' blocked layout (chunks of chunk_size queries over
  // context_left - 1 earlier frames), which reads the right positions only without right context and with
  // chunks at least as long as that left context - as in every released Gemma 4.
  MB_CHECK(c.context_right == 0 && c.context_left >= 2 && c.chunk_size >= c.context_left - 1,
           "{}: audio_config's attention_chunk_size {}, attention_context_left {} and attention_context_right {} are "
           "not supported (needs no right context and a chunk of at least context_left - 1 frames)",
           source, c.chunk_size, c.context_left, c.context_right);
  return c;
}

AudioEncoder::AudioEncoder(std::shared_ptr<const Checkpoint> ck, Backend& be)
    : ck_(std::move(ck)), be_(be), w_(std::make_unique<Weights>()) {
  const std::string source = ck_->path + "/config.json";
  MB_CHECK(!ck_->hf_config.is_null(), "{}: audio needs a Hugging Face checkpoint folder (config.json)", ck_->path);
  cfg_ = parse_audio_config(ck_->hf_config, source);
  MB_CHECK(ck_->tensors.contains(kProjector),
           "{}: the checkpoint has no audio tower weights ({} is missing), so it cannot read audio", ck_->path,
           kProjector);
  const int64_t D = cfg_.hidden, nh = cfg_.heads, hd = cfg_.head_dim, I = cfg_.ffn, K = cfg_.conv_kernel;
  const int64_t C0 = cfg_.sscp_channels[0], C1 = cfg_.sscp_channels[1], O = cfg_.output_dims;
  const TowerWeights tw(*ck_, be_);
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape) { return tw.matrix(name, std::move(shape)); };
  auto vec = [&](const std::string& name, int64_t n) { return tw.vec(name, n); };
  auto host_values = [&](const std::string& name, std::vector<int64_t> shape) {
    return tw.host_values(name, std::move(shape));
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    return tw.linear(name, out, in, cfg_.clipped_linears);
  };
  auto feed_forward = [&](const std::string& p) {
    FeedForward f;
    f.pre_norm = vec(p + "pre_layer_norm.weight", D);
    // The residual weight folded into the post norm's gain (the branch's only use): h += norm · (w · rw).
    std::vector<float> post = host_values(p + "post_layer_norm.weight", {D});
    for (float& x : post) x *= cfg_.residual_weight;
    f.post_norm = backend_values(be_, post, {D});
    f.up = linear(p + "ffw_layer_1", I, D);
    f.down = linear(p + "ffw_layer_2", D, I);
    return f;
  };
  const std::string t = kTower, sscp = t + "subsample_conv_projection.";
  // transformers sizes input_proj_linear as (C0 / 4) · C1: the real flattened width F2 · C1 only for
  // F = C0 mel bins (128 on the released models); encode() checks the features against it.
  w_->proj_in = (C0 / 4) * C1;
  w_->conv0 = matrix(sscp + "layer0.conv.weight", {C0, 1, 3, 3});
  w_->norm0 = vec(sscp + "layer0.norm.weight", C0);
  w_->conv1 = matrix(sscp + "layer1.conv.weight", {C1, C0, 3, 3});
  w_->norm1 = vec(sscp + "layer1.norm.weight", C1);
  w_->input_proj = matrix(sscp + "input_proj_linear.weight", {D, w_->proj_in});
  w_->output_proj = matrix(t + "output_proj.weight", {O, D});
  w_->output_bias = vec(t + "output_proj.bias", O);
  w_->projector = matrix(kProjector, {cfg_.text_hidden, O});

  // Relative positions p = 0 .. P-1 (transformers builds them from context_size / 2 down to 0):
  // PE(p) = [sin(p·τ_i), cos(p·τ_i)], τ_i = exp(-i · ln(10^4) / (D/2 - 1)), in f32 as transformers computes
  // them for an f32 model. For a bf16 model transformers evaluates τ, p·τ, sin and cos in bf16, up to 0.045
  // away from this table (../shared/docs/gemma4-multimodal.md §3.3); we keep f32 throughout.
  const int64_t context = cfg_.chunk_size + cfg_.context_left - 1 + cfg_.context_right, P = context / 2 + 1;
  const int64_t n_timescales = D / 2;
  const double increment = std::log(10000.0) / double(std::max<int64_t>(n_timescales - 1, 1));
  std::vector<float> pe(size_t(P * D));
  for (int64_t i = 0; i < n_timescales; ++i) {
    const float tau = std::exp(float(i) * float(-increment));
    for (int64_t p = 0; p < P; ++p) {
      const float angle = float(p) * tau;
      pe[size_t(p * D + i)] = std::sin(angle);
      pe[size_t(p * D + n_timescales + i)] = std::cos(angle);
    }
  }
  Tensor pe_rows = be_.scratch(DType::F32, {P, D});
  be_.upload(pe.data(), pe_rows);

  w_->layers.resize(size_t(cfg_.layers));
  for (int l = 0; l < cfg_.layers; ++l) {
    Weights::Layer& L = w_->layers[size_t(l)];
    const std::string p = t + "layers." + std::to_string(l) + ".";
    L.ff1 = feed_forward(p + "feed_forward1.");
    L.ff2 = feed_forward(p + "feed_forward2.");
    L.pre_attn_norm = vec(p + "norm_pre_attn.weight", D);
    L.post_attn_norm = vec(p + "norm_post_attn.weight", D);
    L.out_norm = vec(p + "norm_out.weight", D);
    L.q = linear(p + "self_attn.q_proj", nh * hd, D);
    L.k = linear(p + "self_attn.k_proj", nh * hd, D);
    L.v = linear(p + "self_attn.v_proj", nh * hd, D);
    L.post = linear(p + "self_attn.post", D, nh * hd);
    std::vector<float> q_gain = host_values(p + "self_attn.per_dim_scale", {hd});
    for (float& g : q_gain) g = softplus(g);  // in f32 (a bf16 model's transformers run takes it in bf16)
    L.q_gain = backend_values(be_, q_gain, {hd});
    // The relative keys depend on the weights alone: computed once here.
    const Tensor rel_w = matrix(p + "self_attn.relative_k_proj.weight", {nh * hd, D});
    L.rel_keys = be_.alloc(DType::F32, {P, nh * hd});
    be_.matmul(pe_rows, rel_w, L.rel_keys);
    L.conv_pre_norm = vec(p + "lconv1d.pre_layer_norm.weight", D);
    L.conv_norm = vec(p + "lconv1d.conv_norm.weight", D);
    L.conv_start = linear(p + "lconv1d.linear_start", 2 * D, D);
    L.conv_end = linear(p + "lconv1d.linear_end", D, D);
    L.depthwise = backend_values(be_, host_values(p + "lconv1d.depthwise_conv1d.weight", {D, 1, K}), {D, K});
  }
}

AudioEncoder::~AudioEncoder() = default;

namespace {
std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  be.to_host(t, v.data());
  return v;
}

// x = x + residual_weight · RMSNorm(clamp(W2 · SiLU(W1 · RMSNorm(clamp(x)))))  (Gemma4AudioFeedForward); the
// residual weight is in post_norm's gain, the clamp after W2 in its clipped matmul.
void feed_forward(Backend& be, const FeedForward& f, const AudioConfig& c, Tensor& h) {
  const int64_t n = h.rows();
  const float clip = c.gradient_clipping;
  Tensor a = be.scratch(DType::F32, h.shape);
  be.clamp_into(h, -clip, clip, a);
  be.rms_norm(a, &f.pre_norm, kDefaultNormEps, false, a);
  Tensor u = be.scratch(DType::F32, {n, c.ffn});
  clipped_matmul(be, a, f.up, u, std::numeric_limits<float>::infinity(), Backend::Activation::Silu);
  a = Tensor();
  Tensor m = be.scratch(DType::F32, {n, c.hidden});
  clipped_matmul(be, u, f.down, m, clip);
  u = Tensor();
  be.add_rms_norm(h, m, &f.post_norm, kDefaultNormEps, false);
}

// Gemma4AudioAttention's chunked local attention as the backend's local_attention op takes it.
// transformers groups the queries in chunks of C; a chunk's queries see the C + L frames of context that start
// L = context_left - 1 frames before the chunk, frames outside the clip reading as zero keys and values. The
// logit of the key d frames back is q·k + q·r(d), soft-capped, where that key is a valid frame and 0 <= d < L
// (the current frame and L - 1 earlier ones); every other entry of the context gets invalid_logit. So a query
// with no such key (a padding frame's) averages the values of its whole context, as transformers' softmax over
// equal logits does. r(d) is row d + context/2 - L of the relative keys, where transformers' rel-shift reads it
// (row d on the released configs). This is the boolean mask transformers builds with its default ("sdpa")
// attention implementation; with "eager" its additive 0/-inf mask goes through the same masked_fill(~mask) and
// comes out inverted (5.17.0), which no real run uses.
Backend::LocalAttention local_attention_params(const AudioConfig& c, const uint8_t* valid) {
  Backend::LocalAttention p;
  p.chunk = c.chunk_size;
  p.left = c.context_left - 1;
  p.context = c.chunk_size + p.left + c.context_right;
  p.rel_offset = p.context / 2 - p.left;
  // Python floats that transformers multiplies f32 tensors by (as f32).
  p.q_scale = float(std::pow(double(c.head_dim), -0.5) / std::log(2.0));
  p.k_scale = float(std::log(1.0 + std::exp(1.0)) / std::log(2.0));
  p.logit_cap = c.logit_cap;
  p.invalid_logit = c.invalid_logit;
  p.valid = valid;
  return p;
}
}  // namespace

std::vector<float> AudioEncoder::encode(std::span<const float> mel, std::span<const uint8_t> valid, int n_mels) {
  const int64_t T = int64_t(valid.size()), F = n_mels, D = cfg_.hidden, C0 = cfg_.sscp_channels[0],
                C1 = cfg_.sscp_channels[1], O = cfg_.output_dims, H = cfg_.text_hidden;
  MB_CHECK(T > 0 && F > 0 && mel.size() == size_t(T) * size_t(F),
           "audio encoder: {} feature values for {} frames of {} mel bins", mel.size(), T, n_mels);
  const int64_t T1 = (T + 1) / 2, F1 = (F + 1) / 2, n = (T1 + 1) / 2, F2 = (F1 + 1) / 2;
  MB_CHECK(F2 * C1 == w_->proj_in,
           "audio encoder: {} mel bins give {} values per frame after subsampling; the audio tower takes {} ({} mel "
           "bins)",
           n_mels, F2 * C1, w_->proj_in, 4 * (C0 / 4));
  for (size_t i = 0; i < mel.size(); ++i)
    MB_CHECK(std::isfinite(mel[i]), "audio encoder: feature {} of frame {} is {}", i % size_t(F), i / size_t(F),
             mel[i]);

  // The frame mask as the two stride-2 convolutions subsample it (mask[::2] twice); the soft tokens are the
  // conformer's outputs at the valid entries.
  std::vector<uint8_t> mask1(static_cast<size_t>(T1)), mask2(static_cast<size_t>(n));
  for (int64_t t = 0; t < T1; ++t) mask1[size_t(t)] = valid[size_t(2 * t)] != 0;
  for (int64_t t = 0; t < n; ++t) mask2[size_t(t)] = mask1[size_t(2 * t)];
  std::vector<int32_t> kept;
  for (int64_t t = 0; t < n; ++t)
    if (mask2[size_t(t)]) kept.push_back(int32_t(t));
  if (kept.empty()) return {};
  const int64_t M = int64_t(kept.size());

  // Sub-sampling: 3x3 stride-2 convolutions (padding 1, no bias) over the (time, mel) image as im2col matmuls,
  // each followed by a LayerNorm over its channels and a ReLU; invalid frames read as zeros in each.
  // [T, F] -> [T1, F1, C0] -> [n, F2, C1] -> [n, D]
  const Backend::Im2col conv{3, 2, 1};
  Tensor features = be_.scratch(DType::F32, {T, F, 1});
  be_.upload(mel.data(), features);
  Tensor x0 = be_.scratch(DType::F32, {T1, F1, 9});
  be_.im2col(features, valid.data(), conv, 0, x0);
  features = Tensor();
  Tensor z1 = be_.scratch(DType::F32, {T1, F1, C0});
  be_.matmul(x0.reshaped({T1 * F1, 9}), w_->conv0, z1);
  x0 = Tensor();
  be_.layer_norm(z1, w_->norm0, nullptr, cfg_.eps, /*relu=*/true, z1);

  // The second convolution a few frames at a time (its im2col is 9 · C0 wide).
  const int64_t patch = C0 * 9, frames_per_pass = std::max<int64_t>(1, kIm2colBudget / (F2 * patch));
  Tensor z2 = be_.scratch(DType::F32, {n * F2, C1});
  for (int64_t begin = 0; begin < n; begin += frames_per_pass) {
    const int64_t frames = std::min(frames_per_pass, n - begin);
    Tensor x1 = be_.scratch(DType::F32, {frames, F2, patch});
    be_.im2col(z1, mask1.data(), conv, begin, x1);
    Tensor y1 = z2.slice_rows(begin * F2, frames * F2);
    be_.matmul(x1.reshaped({frames * F2, patch}), w_->conv1, y1);
  }
  z1 = Tensor();
  be_.layer_norm(z2, w_->norm1, nullptr, cfg_.eps, /*relu=*/true, z2);
  Tensor h = be_.scratch(DType::F32, {n, D});
  be_.matmul(z2.reshaped({n, F2 * C1}), w_->input_proj, h);  // a frame's values in (mel, channel) order
  z2 = Tensor();

  const float clip = cfg_.gradient_clipping;
  const int64_t nh = cfg_.heads, hd = cfg_.head_dim;
  const Backend::LocalAttention attention = local_attention_params(cfg_, mask2.data());
  for (const Weights::Layer& L : w_->layers) {
    feed_forward(be_, L.ff1, cfg_, h);

    // Attention: h += RMSNorm(clamp(post(attention(RMSNorm(clamp(h))))))
    Tensor a = be_.scratch(DType::F32, {n, D});
    be_.clamp_into(h, -clip, clip, a);
    be_.rms_norm(a, &L.pre_attn_norm, kDefaultNormEps, false, a);
    Tensor q = be_.scratch(DType::F32, {n, D}), k = be_.scratch(DType::F32, {n, D}),
           v = be_.scratch(DType::F32, {n, D});
    clipped_matmul(be_, a, L.q, q);
    clipped_matmul(be_, a, L.k, k);
    clipped_matmul(be_, a, L.v, v);
    a = Tensor();
    Tensor att = be_.scratch(DType::F32, {n, nh, hd});
    be_.local_attention(q.reshaped({n, nh, hd}), k.reshaped({n, nh, hd}), v.reshaped({n, nh, hd}), L.q_gain,
                        L.rel_keys, attention, att);
    q = k = v = Tensor();
    Tensor o = be_.scratch(DType::F32, {n, D});
    clipped_matmul(be_, att.reshaped({n, D}), L.post, o, clip);
    att = Tensor();
    // Light convolution: h += end(SiLU(RMSNorm(clamp(conv(GLU(start(RMSNorm(h)))))))), its input norm
    // written by the attention's residual add.
    Tensor b = be_.scratch(DType::F32, {n, D});
    if (cfg_.eps == kDefaultNormEps) {
      be_.add_rms_norm_norm(h, o, &L.post_attn_norm, kDefaultNormEps, false, 1.f, &L.conv_pre_norm, b);
    } else {
      be_.add_rms_norm(h, o, &L.post_attn_norm, kDefaultNormEps, false);
      be_.rms_norm(h, &L.conv_pre_norm, cfg_.eps, false, b);
    }
    o = Tensor();
    Tensor g = be_.scratch(DType::F32, {n, 2 * D});
    clipped_matmul(be_, b, L.conv_start, g);
    b = Tensor();
    Tensor cv = be_.scratch(DType::F32, {n, D});
    be_.glu_causal_conv(g, L.depthwise, cv);
    g = Tensor();
    be_.clamp(cv, -clip, clip);
    be_.rms_norm(cv, &L.conv_norm, cfg_.eps, false, cv);
    be_.silu(cv);
    Tensor e = be_.scratch(DType::F32, {n, D});
    clipped_matmul(be_, cv, L.conv_end, e);
    cv = Tensor();
    be_.add(h, e, h);
    e = Tensor();

    feed_forward(be_, L.ff2, cfg_, h);
    be_.clamp(h, -clip, clip);
    be_.rms_norm(h, &L.out_norm, kDefaultNormEps, false, h);
  }

  // Only the valid frames go on (every op from here is per frame): output_proj with its bias, then the projector
  // (RMS norm without weight, O -> H).
  Tensor kept_rows = be_.scratch(DType::F32, {M, D});
  be_.gather_rows(h, kept.data(), M, kept_rows);
  h = Tensor();
  Tensor s = be_.scratch(DType::F32, {M, O});
  be_.matmul(kept_rows, w_->output_proj, s);
  kept_rows = Tensor();
  be_.add(s, w_->output_bias, s);
  be_.rms_norm(s, nullptr, cfg_.eps, false, s);
  Tensor soft = be_.scratch(DType::F32, {M, H});
  be_.matmul(s, w_->projector, soft);
  return download(be_, soft);
}

}  // namespace mb::gemma4_audio
