// Gemma 4's configs as transformers 5.17.0 (Gemma4TextConfig) and llama.cpp (convert_hf_to_gguf.py
// Gemma4Model, src/llama-model.cpp) read them; ../shared/docs/gemma4-text.md §1 and §3.2.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "models/gemma4/gemma4.h"
#include "models/gguf_config.h"
#include "models/hf_config.h"

namespace mb::gemma4 {

namespace {

using json = nlohmann::json;

// As transformers: a KV-shared layer reads the last non-shared layer of its own attention type.
void resolve_kv_sources(ModelConfig& c, const std::string& source) {
  const int first_shared = c.first_kv_shared_layer();
  for (int i = 0; i < c.n_layers; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kv_source = i;
    if (i < first_shared) continue;
    L.kv_source = -1;
    for (int s = first_shared - 1; s >= 0; --s)
      if (c.layers[size_t(s)].kind == L.kind) {
        L.kv_source = s;
        break;
      }
    MB_CHECK(L.kv_source >= 0, "{}: KV-shared layer {} has no earlier layer of the same type", source, i);
  }
}

// Fraction of rotated slots of the full layers: llama.cpp emulates HF's "proportional" RoPE with
// rope_freqs = [1] * rotated/2 + [1e30] * rest (a frequency divided by 1e30 is ~0).
float partial_rotary_from_freqs(const GgufFile& f, int head_dim) {
  const GgufTensorInfo* t = f.find_tensor(std::string(kRopeFreqsTensor));
  if (!t) return 1.f;
  MB_CHECK(t->dtype == DType::F32 && t->ne.size() == 1 && t->ne[0] == uint64_t(head_dim / 2),
           "{}: rope_freqs.weight should be F32 [{}]", f.path(), head_dim / 2);
  std::vector<float> v(static_cast<size_t>(t->ne[0]));
  std::memcpy(v.data(), t->data, v.size() * 4);
  size_t rotated = 0;
  while (rotated < v.size() && v[rotated] == 1.f) ++rotated;
  for (size_t i = rotated; i < v.size(); ++i)
    MB_CHECK(v[i] >= 1e20f, "{}: rope_freqs.weight is not of the form [1, ..., 1, 1e30, ...] (entry {} = {})",
             f.path(), i, v[i]);
  return float(2 * rotated) / float(head_dim);
}

}  // namespace

ModelConfig parse_hf_text(const json& tc, bool unified, const std::string& source) {
  hf::Reader r{tc, source};
  ModelConfig c;
  const auto [n_kv, head_dim, intermediate] = hf::read_text_basics(
      tc, source,
      {unified ? "gemma4_unified_text" : "gemma4_text", 30, 262144, unified ? 1024 : 512, unified ? 262144 : 131072},
      c);
  c.attn_scale = 1.f;
  c.attn_logit_softcap = 0.f;  // Gemma4TextConfig has no attention soft-cap
  c.n_kv_shared_layers = r.get("num_kv_shared_layers", 0);
  const bool k_eq_v = r.get("attention_k_eq_v", false);
  const bool double_wide = r.get("use_double_wide_mlp", false);
  if (!unified) {
    c.ple_dim = r.get("hidden_size_per_layer_input", 256);
    c.ple_vocab = c.ple_dim > 0 ? r.get("vocab_size_per_layer_input", 262144) : 0;
    c.moe = r.get("enable_moe_block", false);
    c.n_experts = r.get("num_experts", 0);
    c.top_k_experts = r.get("top_k_experts", 0);
    c.moe_ffn_dim = r.get("moe_intermediate_size", 0);
  }
  MB_CHECK(c.n_kv_shared_layers >= 0 && c.n_kv_shared_layers < c.n_layers,
           "{}: num_kv_shared_layers {} out of range for {} layers", source, c.n_kv_shared_layers, c.n_layers);
  std::string bidir = r.get("use_bidirectional_attention", std::string());
  MB_CHECK(bidir != "all", "{}: use_bidirectional_attention='all' (non-causal text) is not supported",
           source);
  c.bidirectional_images = bidir == "vision";
  c.bidirectional_images_all_layers = unified && c.bidirectional_images;
  if (c.moe)
    MB_CHECK(c.n_experts > 0 && c.top_k_experts > 0 && c.top_k_experts <= c.n_experts &&
                 c.moe_ffn_dim > 0,
             "{}: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size", source);

  // layer_types: default 5 sliding : 1 full, and transformers forces the last layer to full.
  std::vector<AttnKind> kinds = hf::layer_kinds(tc, c.n_layers, source, [](int i) {
    return (i + 1) % 6 ? AttnKind::Sliding : AttnKind::Full;
  });
  kinds.back() = AttnKind::Full;

  RopeConfig rope_sliding{10000.f, 1.f, 1.f}, rope_full{1e6f, 0.25f, 1.f};
  if (tc.contains("rope_parameters") && tc["rope_parameters"].is_object()) {
    const json& rp = tc["rope_parameters"];
    if (rp.contains("sliding_attention") || rp.contains("full_attention")) {
      if (rp.contains("sliding_attention") && rp["sliding_attention"].is_object())
        rope_sliding = hf::rope(rp["sliding_attention"], source);
      if (rp.contains("full_attention") && rp["full_attention"].is_object())
        rope_full = hf::rope(rp["full_attention"], source);
    } else {
      rope_sliding = rope_full = hf::rope(rp, source);
    }
  }

  // Full layers: their own head dim, and (with K=V) their own KV-head count. Configs saved by
  // transformers 5.17.0 carry this as per_layer_config; released configs as global_* keys.
  std::vector<int> layer_head_dim(size_t(c.n_layers), head_dim), layer_kv(size_t(c.n_layers), n_kv),
      layer_ffn(size_t(c.n_layers), intermediate);
  if (tc.contains("per_layer_config") && tc["per_layer_config"].is_object()) {
    for (auto& [key, ov] : tc["per_layer_config"].items()) {
      int idx = -1;
      try {
        idx = std::stoi(key);
      } catch (...) {
      }
      MB_CHECK(idx >= 0 && idx < c.n_layers && ov.is_object(),
               "{}: per_layer_config has an invalid entry '{}'", source, key);
      hf::Reader o{ov, source};
      layer_head_dim[size_t(idx)] = o.get("head_dim", layer_head_dim[size_t(idx)]);
      layer_kv[size_t(idx)] = o.get("num_key_value_heads", layer_kv[size_t(idx)]);
      layer_ffn[size_t(idx)] = o.get("intermediate_size", layer_ffn[size_t(idx)]);
    }
  } else {
    const int global_head_dim = r.get("global_head_dim", 512);
    const json& gkv = tc.contains("num_global_key_value_heads") ? tc["num_global_key_value_heads"] : json();
    for (int i = 0; i < c.n_layers; ++i) {
      if (kinds[size_t(i)] != AttnKind::Full) continue;
      layer_head_dim[size_t(i)] = global_head_dim;
      if (k_eq_v && gkv.is_number_integer()) layer_kv[size_t(i)] = gkv.get<int>();
    }
  }

  const int first_shared = c.first_kv_shared_layer();
  c.layers.resize(size_t(c.n_layers));
  for (int i = 0; i < c.n_layers; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = kinds[size_t(i)];
    L.head_dim = layer_head_dim[size_t(i)];
    L.n_kv_heads = layer_kv[size_t(i)];
    L.has_v_proj = !(k_eq_v && L.kind == AttnKind::Full);
    L.rope = L.kind == AttnKind::Full ? rope_full : rope_sliding;
    const bool shared = c.n_kv_shared_layers > 0 && i >= first_shared;
    L.ffn_dim = layer_ffn[size_t(i)] * (double_wide && shared ? 2 : 1);
  }
  resolve_kv_sources(c, source);
  return c;
}

ModelConfig parse_gguf(const GgufFile& f) {
  GgufMeta m{f, "gemma4"};
  ModelConfig c;
  c.model_type = "gemma4_text";
  read_gguf_decoder_dims(m, c);
  const int n = c.n_layers;
  const int hd_full = m.positive_int("attention.key_length", m.get_int("attention.key_length"));
  const int hd_swa = m.positive_int("attention.key_length_swa", m.get_int("attention.key_length_swa", hd_full));
  MB_CHECK(m.get_int("attention.value_length", hd_full) == hd_full &&
               m.get_int("attention.value_length_swa", hd_swa) == hd_swa,
           "{}: value head dims differ from key head dims", f.path());
  MB_CHECK(m.get_int("rope.dimension_count_swa", hd_swa) == hd_swa,
           "{}: partial rotary embeddings on sliding layers are not supported", f.path());
  const int64_t all_heads = c.n_heads;
  const std::vector<int64_t> n_kv = m.per_layer("attention.head_count_kv", n, &all_heads);
  const std::vector<int64_t> ffn = m.per_layer("feed_forward_length", n);
  c.attn_scale = 1.f;
  c.norm_adds_one = false;  // Gemma 4 norms multiply by w; the converter does not shift them
  c.v_norm = true;
  const int64_t window = m.get_int("attention.sliding_window");
  MB_CHECK(window > 0 && window <= (int64_t(1) << 30), "{}: invalid sliding window {}", f.path(), window);
  c.sliding_window = int(window);
  const int64_t shared = m.get_int("attention.shared_kv_layers", 0);
  MB_CHECK(shared >= 0 && shared < n, "{}: attention.shared_kv_layers {} out of range for {} layers", f.path(),
           shared, n);
  c.n_kv_shared_layers = int(shared);
  c.ple_dim = int(m.get_int("embedding_length_per_layer_input", 0));
  MB_CHECK(c.ple_dim >= 0, "{}: negative embedding_length_per_layer_input", f.path());
  if (c.ple_dim > 0) c.ple_vocab = gguf_matrix_rows(f, "per_layer_token_embd.weight");
  const int64_t n_experts = m.get_int("expert_count", 0);
  if (n_experts > 0) {
    c.moe = true;
    c.n_experts = m.positive_int("expert_count", n_experts);
    c.top_k_experts = m.positive_int("expert_used_count", m.get_int("expert_used_count"));
    c.moe_ffn_dim = m.positive_int("expert_feed_forward_length", m.get_int("expert_feed_forward_length"));
    MB_CHECK(c.top_k_experts <= c.n_experts, "{}: expert_used_count exceeds expert_count", f.path());
  }

  const std::vector<bool> swa = m.per_layer_bool("attention.sliding_window_pattern", n);
  const RopeConfig rope_swa{float(m.get_float("rope.freq_base_swa", 10000.0)), 1.f, 1.f};
  const RopeConfig rope_full{float(m.get_float("rope.freq_base", 10000.0)), partial_rotary_from_freqs(f, hd_full),
                             1.f};
  // attention_k_eq_v leaves full layers without a V projection; HF applies it to every full layer.
  bool k_eq_v = false;
  for (int i = 0; i < c.first_kv_shared_layer(); ++i)
    if (!swa[size_t(i)] && !f.find_tensor("blk." + std::to_string(i) + ".attn_v.weight")) k_eq_v = true;
  c.layers.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = swa[size_t(i)] ? AttnKind::Sliding : AttnKind::Full;
    L.head_dim = L.kind == AttnKind::Full ? hd_full : hd_swa;
    L.n_kv_heads = m.positive_int("attention.head_count_kv", n_kv[size_t(i)]);
    L.ffn_dim = m.positive_int("feed_forward_length", ffn[size_t(i)]);  // already doubled for double-wide
    L.has_v_proj = !(k_eq_v && L.kind == AttnKind::Full);
    L.rope = L.kind == AttnKind::Full ? rope_full : rope_swa;
  }
  resolve_kv_sources(c, f.path());
  read_gguf_special_tokens(f, "<turn|>", c);
  // GGUF files do not record use_bidirectional_attention. The released configs set it to "vision"
  // on exactly the Gemma 4 models without per-layer embeddings (26B-A4B, 31B; E2B and E4B have
  // none), so an image's tokens see each other on sliding layers there, as transformers runs them
  // (llama.cpp instead decodes every Gemma 4 image non-causally on all layers).
  c.bidirectional_images = c.ple_dim == 0;
  return c;
}

void write_gguf_metadata(const ModelConfig& c, GgufWriter& w) {
  const std::string a = "gemma4";
  write_gguf_decoder_dims(c, a, w);
  const LayerConfig* full = first_layer_of_kind(c, AttnKind::Full);
  const LayerConfig* swa = first_layer_of_kind(c, AttnKind::Sliding);
  MB_CHECK(full && swa, "GGUF export needs both sliding and full layers");
  w.set(a + ".attention.key_length", gguf_u32(full->head_dim));
  w.set(a + ".attention.value_length", gguf_u32(full->head_dim));
  w.set(a + ".attention.key_length_swa", gguf_u32(swa->head_dim));
  w.set(a + ".attention.value_length_swa", gguf_u32(swa->head_dim));
  std::vector<bool> pattern;
  for (auto& L : c.layers) pattern.push_back(L.kind == AttnKind::Sliding);
  w.set(a + ".attention.sliding_window_pattern", GgufValue::make_bool_array(pattern));
  w.set(a + ".attention.shared_kv_layers", gguf_u32(c.n_kv_shared_layers));
  w.set(a + ".embedding_length_per_layer_input", gguf_u32(c.ple_dim));
  w.set(a + ".rope.freq_base", gguf_f32(full->rope.theta));
  w.set(a + ".rope.freq_base_swa", gguf_f32(swa->rope.theta));
  w.set(a + ".rope.dimension_count", gguf_u32(full->head_dim));
  w.set(a + ".rope.dimension_count_swa", gguf_u32(swa->head_dim));
  if (c.moe) {
    w.set(a + ".expert_count", gguf_u32(c.n_experts));
    w.set(a + ".expert_used_count", gguf_u32(c.top_k_experts));
    w.set(a + ".expert_feed_forward_length", gguf_u32(c.moe_ffn_dim));
  }
}

void add_rope_freqs(const ModelConfig& c, GgufWriter& w) {
  const LayerConfig* full = first_layer_of_kind(c, AttnKind::Full);
  MB_CHECK(full != nullptr, "GGUF export needs a full-attention layer");
  std::vector<float> freqs(size_t(full->head_dim / 2), 1e30f);
  const int rotated = int(float(full->head_dim) * full->rope.partial_rotary_factor / 2);
  std::fill(freqs.begin(), freqs.begin() + rotated, 1.f);
  w.add_tensor(std::string(kRopeFreqsTensor), DType::F32, {int64_t(freqs.size())}, freqs.data());
}

}  // namespace mb::gemma4
