// llama.cpp's mmproj GGUF of a Gemma 4 model (its converter's Gemma4VisionAudioModel and
// Gemma4UnifiedVisionAudioModel, projector types gemma4v / gemma4a / gemma4uv / gemma4ua) put
// back into the form the towers read from a Hugging Face checkpoint: each tensor under its HF
// name, with what the converter changed undone, and the vision_config / audio_config /
// processor settings the towers and preprocessors need, from the file's clip.* keys, its tensor
// shapes and llama.cpp's fixed values where the file has none.
//
// What the converter changes (conversion/gemma.py, llama-cpp-python 0.3.36's tree):
// - the ViT's patch embedding [E, p·p·3] (row-major p, p, channel) is stored as a conv kernel
//   [E, 3, p, p]; the unified model's patch_dense columns and patch_ln1 are permuted from
//   (row, col, channel) to (channel, row, col) order, and its pos_embedding [T, 2, E] is stored
//   as [2, T, E];
// - the conformer's per_dim_scale is stored as softplus(per_dim_scale) (undone here with the
//   inverse in double: softplus of it gives the stored value back to float rounding), its
//   depthwise conv [C, 1, K] as [C, K];
// - scalars (the clipped linears' bounds) become one-element tensors.
// Hyperparameters the file does not record are llama.cpp's (clip.cpp): the ViT's rope theta 100,
// its pooling 3x3 unless clip.vision.projector.scale_factor says otherwise, the conformer's
// attention chunks of 12 with 13 frames of left context, soft-cap 50, residual weight 0.5 and
// norm eps 1e-6 - the released Gemma 4 values.
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include <fmt/ranges.h>

#include "core/error.h"
#include "formats/gguf.h"
#include "models/checkpoint.h"
#include "models/gemma4/gemma4.h"

namespace mb::gemma4 {

namespace {

using json = nlohmann::json;

constexpr std::string_view kVision = "model.vision_tower.", kAudio = "model.audio_tower.";

// One GGUF block name -> HF name (after "v.blk.N." / "a.blk.N."); `linear`: a clipped linear,
// whose ".weight" is HF's ".linear.weight" and whose bounds keep their suffixes.
struct BlockName {
  std::string_view gguf, hf;
  bool linear;
};

constexpr BlockName kVisionBlock[] = {
    {"ln1", "input_layernorm", false},
    {"ln2", "pre_feedforward_layernorm", false},
    {"attn_post_norm", "post_attention_layernorm", false},
    {"ffn_post_norm", "post_feedforward_layernorm", false},
    {"attn_q_norm", "self_attn.q_norm", false},
    {"attn_k_norm", "self_attn.k_norm", false},
    {"attn_q", "self_attn.q_proj", true},
    {"attn_k", "self_attn.k_proj", true},
    {"attn_v", "self_attn.v_proj", true},
    {"attn_out", "self_attn.o_proj", true},
    {"ffn_gate", "mlp.gate_proj", true},
    {"ffn_up", "mlp.up_proj", true},
    {"ffn_down", "mlp.down_proj", true},
};

constexpr BlockName kAudioBlock[] = {
    {"ffn_norm", "feed_forward1.pre_layer_norm", false},
    {"ffn_post_norm", "feed_forward1.post_layer_norm", false},
    {"ffn_up", "feed_forward1.ffw_layer_1", true},
    {"ffn_down", "feed_forward1.ffw_layer_2", true},
    {"ffn_norm_1", "feed_forward2.pre_layer_norm", false},
    {"ffn_post_norm_1", "feed_forward2.post_layer_norm", false},
    {"ffn_up_1", "feed_forward2.ffw_layer_1", true},
    {"ffn_down_1", "feed_forward2.ffw_layer_2", true},
    {"attn_pre_norm", "norm_pre_attn", false},
    {"attn_post_norm", "norm_post_attn", false},
    {"ln2", "norm_out", false},
    {"attn_q", "self_attn.q_proj", true},
    {"attn_k", "self_attn.k_proj", true},
    {"attn_v", "self_attn.v_proj", true},
    {"attn_out", "self_attn.post", true},
    {"attn_k_rel", "self_attn.relative_k_proj", false},
    {"per_dim_scale", "self_attn.per_dim_scale", false},  // softplus undone (below)
    {"conv_norm", "lconv1d.pre_layer_norm", false},
    {"norm_conv", "lconv1d.conv_norm", false},
    {"conv_pw1", "lconv1d.linear_start", true},
    {"conv_pw2", "lconv1d.linear_end", true},
    {"conv_dw", "lconv1d.depthwise_conv1d", false},  // [C, K] -> [C, 1, K]
};

constexpr std::pair<std::string_view, std::string_view> kGlobals[] = {
    {"v.patch_embd.weight", "model.vision_tower.patch_embedder.input_proj.weight"},
    {"v.position_embd.weight", "model.vision_tower.patch_embedder.position_embedding_table"},
    {"v.std_bias", "model.vision_tower.std_bias"},
    {"v.std_scale", "model.vision_tower.std_scale"},
    {"mm.input_projection.weight", "model.embed_vision.embedding_projection.weight"},
    {"mm.a.input_projection.weight", "model.embed_audio.embedding_projection.weight"},
    {"a.pre_encode.out.weight", "model.audio_tower.output_proj.weight"},
    {"a.pre_encode.out.bias", "model.audio_tower.output_proj.bias"},
    {"a.input_projection.weight", "model.audio_tower.subsample_conv_projection.input_proj_linear.weight"},
    {"a.conv1d.0.weight", "model.audio_tower.subsample_conv_projection.layer0.conv.weight"},
    {"a.conv1d.0.norm.weight", "model.audio_tower.subsample_conv_projection.layer0.norm.weight"},
    {"a.conv1d.1.weight", "model.audio_tower.subsample_conv_projection.layer1.conv.weight"},
    {"a.conv1d.1.norm.weight", "model.audio_tower.subsample_conv_projection.layer1.norm.weight"},
};

// The unified model's embedders (gemma4uv / gemma4ua).
constexpr std::pair<std::string_view, std::string_view> kUnifiedGlobals[] = {
    {"v.patch_embd.weight", "model.vision_embedder.patch_dense.weight"},
    {"v.patch_embd.bias", "model.vision_embedder.patch_dense.bias"},
    {"v.patch_norm.1.weight", "model.vision_embedder.patch_ln1.weight"},
    {"v.patch_norm.1.bias", "model.vision_embedder.patch_ln1.bias"},
    {"v.patch_norm.2.weight", "model.vision_embedder.patch_ln2.weight"},
    {"v.patch_norm.2.bias", "model.vision_embedder.patch_ln2.bias"},
    {"v.patch_norm.3.weight", "model.vision_embedder.pos_norm.weight"},
    {"v.patch_norm.3.bias", "model.vision_embedder.pos_norm.bias"},
    {"v.position_embd.weight", "model.vision_embedder.pos_embedding"},
    {"mm.input_projection.weight", "model.embed_vision.embedding_projection.weight"},
    {"mm.a.input_projection.weight", "model.embed_audio.embedding_projection.weight"},
};

constexpr std::string_view kBoundSuffixes[] = {".input_max", ".input_min", ".output_max", ".output_min"};

// HF name of a gemma4v/gemma4a tensor, "" for one this reader does not know.
std::string hf_name_of(const std::string& g) {
  for (const auto& [gg, hf] : kGlobals)
    if (g == gg) return std::string(hf);
  for (const auto& [prefix, table, tower] :
       {std::tuple{std::string_view("v.blk."), std::span<const BlockName>(kVisionBlock), std::string(kVision) + "encoder.layers."},
        std::tuple{std::string_view("a.blk."), std::span<const BlockName>(kAudioBlock), std::string(kAudio) + "layers."}}) {
    std::string_view layer, rest;
    if (!split_layer(g, prefix, layer, rest)) continue;
    for (const BlockName& b : table) {
      const std::string base(b.gguf);
      std::string suffix;
      if (rest == base + ".weight") {
        suffix = b.linear ? ".linear.weight" : ".weight";
        if (b.hf == "self_attn.per_dim_scale") suffix = "";
      } else if (b.linear) {
        for (std::string_view s : kBoundSuffixes)
          if (rest == base + std::string(s)) suffix = s;
        if (suffix.empty()) continue;
      } else {
        continue;
      }
      return tower + std::string(layer) + "." + std::string(b.hf) + suffix;
    }
    return "";
  }
  return "";
}

std::string unified_hf_name_of(const std::string& g) {
  for (const auto& [gg, hf] : kUnifiedGlobals)
    if (g == gg) return std::string(hf);
  return "";
}

int64_t int_key(const GgufFile& f, const std::string& key) { return f.get(key).as_int(); }
int64_t int_key(const GgufFile& f, const std::string& key, int64_t dflt) {
  const GgufValue* v = f.find(key);
  return v ? v->as_int() : dflt;
}
double float_key(const GgufFile& f, const std::string& key, double dflt) {
  const GgufValue* v = f.find(key);
  return v ? v->as_float() : dflt;
}

const GgufTensorInfo& tensor_info(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.find_tensor(name);
  MB_CHECK(t, "{}: the mmproj file has no tensor '{}'", f.path(), name);
  return *t;
}

// A tensor's elements reordered: out element i = in element src[i] (any element size).
std::shared_ptr<std::vector<uint8_t>> permuted(const GgufTensorInfo& t, const std::vector<int64_t>& src) {
  const size_t es = dtype_size(t.dtype);
  MB_CHECK(es > 0 && t.nbytes == src.size() * es, "{}: cannot reorder a tensor of type {}", t.name,
           dtype_name(t.dtype));
  auto out = std::make_shared<std::vector<uint8_t>>(t.nbytes);
  for (size_t i = 0; i < src.size(); ++i) std::memcpy(out->data() + i * es, t.data + size_t(src[i]) * es, es);
  return out;
}

void add_owned(TensorRegistry& reg, const std::string& name, DType dtype, std::vector<int64_t> shape,
               std::shared_ptr<std::vector<uint8_t>> bytes, const std::string& file) {
  TensorEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.data = bytes->data();
  e.nbytes = bytes->size();
  e.file = file;
  e.owner = std::move(bytes);
  reg.add(std::move(e));
}

// Token ids by their text in the text GGUF's vocabulary (the released ids when absent).
int64_t token_id(const Checkpoint& ck, std::string_view text, int64_t dflt) {
  if (!ck.gguf) return dflt;
  const GgufValue* tokens = ck.gguf->find("tokenizer.ggml.tokens");
  if (!tokens || !tokens->is_array()) return dflt;
  for (size_t i = 0; i < tokens->size(); ++i)
    if (tokens->string_at(i) == text) return int64_t(i);
  return dflt;
}

}  // namespace

void attach_mmproj(Checkpoint& ck, const std::string& path) {
  MB_CHECK(ck.gguf, "--mmproj goes with a GGUF model: {} is a checkpoint folder, which holds its own towers", ck.path);
  const std::shared_ptr<GgufFile> f = GgufFile::open(path);
  const GgufValue* arch = f->find("general.architecture");
  MB_CHECK(arch && arch->type == GgufType::STRING && arch->as_string() == "clip",
           "{}: not an mmproj file (general.architecture is {}, expected 'clip'); give the model with -m and its "
           "vision/audio file with --mmproj",
           path, arch ? arch->describe() : std::string("missing"));
  const GgufValue* vt = f->find("clip.vision.projector_type");
  const GgufValue* at = f->find("clip.audio.projector_type");
  const std::string vision_type = vt ? vt->as_string() : "", audio_type = at ? at->as_string() : "";
  MB_CHECK(vision_type.empty() || vision_type == "gemma4v" || vision_type == "gemma4uv",
           "{}: vision projector '{}' is not Gemma 4's (gemma4v, gemma4uv)", path, vision_type);
  MB_CHECK(audio_type.empty() || audio_type == "gemma4a" || audio_type == "gemma4ua",
           "{}: audio projector '{}' is not Gemma 4's (gemma4a, gemma4ua)", path, audio_type);
  MB_CHECK(!vision_type.empty() || !audio_type.empty(), "{}: the mmproj file has neither a vision nor an audio part",
           path);
  const bool unified = vision_type == "gemma4uv" || audio_type == "gemma4ua";
  MB_CHECK(!unified || ((vision_type.empty() || vision_type == "gemma4uv") &&
                        (audio_type.empty() || audio_type == "gemma4ua")),
           "{}: vision projector '{}' and audio projector '{}' belong to different models", path, vision_type,
           audio_type);

  // Tensors: renamed in place where the converter only renamed them, rebuilt where it changed them.
  const int64_t pooling = int_key(*f, "clip.vision.projector.scale_factor", 3);
  MB_CHECK(pooling >= 1 && pooling <= 64, "{}: clip.vision.projector.scale_factor {} is not a pooling size", path,
           pooling);
  std::set<std::string> rebuilt = {"v.patch_embd.weight"};
  if (unified) rebuilt.insert({"v.patch_norm.1.weight", "v.patch_norm.1.bias", "v.position_embd.weight"});
  std::vector<std::string> unknown;
  for (const GgufTensorInfo& t : f->tensors()) {
    const std::string hf = unified ? unified_hf_name_of(t.name) : hf_name_of(t.name);
    if (hf.empty()) unknown.push_back(t.name);
    if (t.name.find(".per_dim_scale.") != std::string::npos || t.name.find(".conv_dw.") != std::string::npos)
      rebuilt.insert(t.name);
  }
  for (const std::string& u : unknown)
    MB_CHECK(u.find(".out_scale.") == std::string::npos,
             "{}: {} is a per-layer output scale of the vision encoder (a layer_scalar), which transformers 5.17.0's "
             "Gemma 4 vision encoder - the one MarkBase matches - does not have",
             path, u);
  MB_CHECK(unknown.empty(), "{}: tensors this reader does not know ({}{}); is it a Gemma 4 mmproj from a newer "
           "converter?",
           path, unknown.front(), unknown.size() > 1 ? fmt::format(" and {} more", unknown.size() - 1) : "");
  f->register_tensors(ck.tensors, [&](const std::string& g) -> std::string {
    if (rebuilt.count(g)) return "";
    return unified ? unified_hf_name_of(g) : hf_name_of(g);
  });
  for (const std::string& g : rebuilt) {
    const GgufTensorInfo* t = f->find_tensor(g);
    if (!t) continue;
    const std::string hf = unified ? unified_hf_name_of(g) : hf_name_of(g);
    const std::vector<int64_t> shape = t->shape();
    const int64_t n = int64_t(t->nbytes / std::max<size_t>(dtype_size(t->dtype), 1));
    std::vector<int64_t> src(static_cast<size_t>(n));
    if (g == "v.patch_embd.weight" && !unified) {
      // [E, 3, p, p] -> [E, p·p·3] with (row, col, channel) innermost last.
      MB_CHECK(shape.size() == 4 && shape[1] == 3 && shape[2] == shape[3], "{}: v.patch_embd.weight has shape {}",
               path, fmt::format("{}", fmt::join(shape, "x")));
      const int64_t E = shape[0], p = shape[2];
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < p; ++r)
          for (int64_t c = 0; c < p; ++c)
            for (int64_t ch = 0; ch < 3; ++ch)
              src[size_t(((e * p + r) * p + c) * 3 + ch)] = ((e * 3 + ch) * p + r) * p + c;
      add_owned(ck.tensors, hf, t->dtype, {E, p * p * 3}, permuted(*t, src), path);
    } else if (unified && (g == "v.patch_embd.weight" || g.rfind("v.patch_norm.1.", 0) == 0)) {
      // Columns (or entries) in (channel, row, col) order back to (row, col, channel):
      // stored[i] = hf[perm[i]] with perm[i] = row·p·3 + col·3 + channel of CHW position i.
      const int64_t width = shape.back(), rows = n / width;
      const int64_t p = int64_t(std::lround(std::sqrt(double(width) / 3.0)));
      MB_CHECK(p * p * 3 == width, "{}: {} has {} columns, not a square patch of 3 channels", path, g, width);
      for (int64_t i = 0; i < width; ++i) {
        const int64_t ch = i / (p * p), r = (i % (p * p)) / p, c = i % p, hf_col = r * p * 3 + c * 3 + ch;
        for (int64_t row = 0; row < rows; ++row) src[size_t(row * width + hf_col)] = row * width + i;
      }
      add_owned(ck.tensors, hf, t->dtype, shape, permuted(*t, src), path);
    } else if (g == "v.position_embd.weight") {  // unified: [2, T, E] -> [T, 2, E]
      MB_CHECK(shape.size() == 3 && shape[0] == 2, "{}: v.position_embd.weight has shape {}", path,
               fmt::format("{}", fmt::join(shape, "x")));
      const int64_t T = shape[1], E = shape[2];
      for (int64_t tt = 0; tt < T; ++tt)
        for (int64_t a = 0; a < 2; ++a)
          for (int64_t e = 0; e < E; ++e) src[size_t((tt * 2 + a) * E + e)] = (a * T + tt) * E + e;
      add_owned(ck.tensors, hf, t->dtype, {T, 2, E}, permuted(*t, src), path);
    } else if (g.find(".conv_dw.") != std::string::npos) {  // [C, K] -> [C, 1, K]
      MB_CHECK(shape.size() == 2, "{}: {} has shape {}", path, g, fmt::format("{}", fmt::join(shape, "x")));
      for (int64_t i = 0; i < n; ++i) src[size_t(i)] = i;
      add_owned(ck.tensors, hf, t->dtype, {shape[0], 1, shape[1]}, permuted(*t, src), path);
    } else {  // per_dim_scale: the inverse of softplus, log(e^y - 1) = y + log(1 - e^-y)
      MB_CHECK(t->dtype == DType::F32, "{}: {} is {}, expected F32", path, g, dtype_name(t->dtype));
      auto bytes = std::make_shared<std::vector<uint8_t>>(t->nbytes);
      for (int64_t i = 0; i < n; ++i) {
        float y;
        std::memcpy(&y, t->data + i * 4, 4);
        MB_CHECK(y > 0.f && std::isfinite(y), "{}: {} holds {}, not a softplus value", path, g, y);
        const float x = float(double(y) + std::log(-std::expm1(-double(y))));
        std::memcpy(bytes->data() + i * 4, &x, 4);
      }
      add_owned(ck.tensors, hf, DType::F32, shape, std::move(bytes), path);
    }
  }

  // config.json's multimodal parts.
  json c = {{"architectures", {unified ? "Gemma4UnifiedForConditionalGeneration" : "Gemma4ForConditionalGeneration"}},
            {"model_type", unified ? "gemma4_unified" : "gemma4"},
            {"text_config", {{"hidden_size", ck.config.hidden_size}}},
            {"image_token_id", token_id(ck, "<|image|>", 258880)},
            {"boi_token_id", token_id(ck, "<|image>", 255999)},
            {"eoi_token_id", token_id(ck, "<image|>", 258882)},
            {"audio_token_id", token_id(ck, "<|audio|>", 258881)},
            {"boa_token_id", token_id(ck, "<|audio>", 256000)},
            {"eoa_token_index", token_id(ck, "<audio|>", 258883)},
            {"video_token_id", token_id(ck, "<|video|>", 258884)}};
  json processor = json::object();
  if (!vision_type.empty()) {
    const int64_t patch = int_key(*f, "clip.vision.patch_size"), hidden = int_key(*f, "clip.vision.embedding_length");
    const double eps = float_key(*f, "clip.vision.attention.layer_norm_epsilon", 1e-6);
    json v;
    if (unified) {
      const std::vector<int64_t> pos = tensor_info(*f, "v.position_embd.weight").shape();
      v = {{"model_type", "gemma4_unified_vision"}, {"mm_embed_dim", hidden}, {"output_proj_dims", hidden},
           {"mm_posemb_size", pos.size() == 3 ? pos[1] : 0}, {"patch_size", patch}, {"pooling_kernel_size", pooling},
           {"rms_norm_eps", eps}};
    } else {
      const int64_t heads = int_key(*f, "clip.vision.attention.head_count");
      const int64_t head_dim = tensor_info(*f, "v.blk.0.attn_q_norm.weight").shape().back();
      const int64_t kv_rows = tensor_info(*f, "v.blk.0.attn_k.weight").shape().front();
      const std::vector<int64_t> pos = tensor_info(*f, "v.position_embd.weight").shape();
      MB_CHECK(head_dim > 0 && kv_rows % head_dim == 0 && pos.size() == 3, "{}: unusable vision tensor shapes", path);
      v = {{"model_type", "gemma4_vision"},
           {"hidden_size", hidden},
           {"intermediate_size", int_key(*f, "clip.vision.feed_forward_length")},
           {"num_hidden_layers", int_key(*f, "clip.vision.block_count")},
           {"num_attention_heads", heads},
           {"num_key_value_heads", kv_rows / head_dim},
           {"head_dim", head_dim},
           {"patch_size", patch},
           {"pooling_kernel_size", pooling},
           {"position_embedding_size", pos[1]},
           {"rms_norm_eps", eps},
           {"rope_parameters", {{"rope_theta", 100.0}, {"rope_type", "axial"}}},
           {"standardize", f->find_tensor("v.std_bias") != nullptr},
           {"use_clipped_linears", f->find_tensor("v.blk.0.attn_q.input_max") != nullptr}};
    }
    c["vision_config"] = v;
    processor["image_processor"] = {{"patch_size", patch}, {"pooling_kernel_size", pooling}};
  }
  if (!audio_type.empty()) {
    const int64_t hidden = int_key(*f, "clip.audio.embedding_length");
    json a;
    if (unified) {
      a = {{"model_type", "gemma4_unified_audio"}, {"audio_embed_dim", hidden}, {"rms_norm_eps", 1e-6}};
    } else {
      const std::vector<int64_t> c0 = tensor_info(*f, "a.conv1d.0.weight").shape(),
                                 c1 = tensor_info(*f, "a.conv1d.1.weight").shape(),
                                 dw = tensor_info(*f, "a.blk.0.conv_dw.weight").shape(),
                                 out = tensor_info(*f, "a.pre_encode.out.weight").shape();
      MB_CHECK(c0.size() == 4 && c1.size() == 4 && dw.size() == 2 && out.size() == 2,
               "{}: unusable audio tensor shapes", path);
      a = {{"model_type", "gemma4_audio"},
           {"hidden_size", hidden},
           {"num_hidden_layers", int_key(*f, "clip.audio.block_count")},
           {"num_attention_heads", int_key(*f, "clip.audio.attention.head_count")},
           {"subsampling_conv_channels", {c0[0], c1[0]}},
           {"conv_kernel_size", dw[1]},
           {"output_proj_dims", out[0]},
           {"attention_chunk_size", 12},
           {"attention_context_left", 13},
           {"attention_context_right", 0},
           {"attention_logit_cap", 50.0},
           {"residual_weight", 0.5},
           {"rms_norm_eps", 1e-6},
           {"hidden_act", "silu"},
           {"use_clipped_linears", f->find_tensor("a.blk.0.attn_q.input_max") != nullptr}};
      processor["feature_extractor"] = {{"feature_extractor_type", "Gemma4AudioFeatureExtractor"},
                                        {"feature_size", int_key(*f, "clip.audio.num_mel_bins", 128)}};
    }
    c["audio_config"] = a;
  }
  ck.hf_config = std::move(c);
  ck.processor_config = std::move(processor);
}

}  // namespace mb::gemma4
