// Gemma 3 text models in the registry. They run on Gemma 4's decoder (models/gemma4/model.cpp)
// with Gemma 3's differences switched on by config: (1 + w) norms, no V norm, a query scale of
// query_pre_attn_scalar^-0.5, optional attention soft-cap, linear RoPE scaling on full layers.
// References: transformers 5.17.0 Gemma3TextConfig; llama.cpp convert_hf_to_gguf.py Gemma3Model.
#include <array>
#include <cmath>

#include "core/error.h"
#include "models/gemma4/gemma4.h"
#include "models/gguf_config.h"
#include "models/hf_config.h"
#include "models/model.h"

namespace mb {

extern const char* const kBuiltinGemma3Template;  // chat_template.jinja, embedded by src/CMakeLists.txt

namespace gemma3 {

namespace {

using json = nlohmann::json;

// Gemma3TextConfig: one head dim, legacy rope_theta / rope_local_base_freq / rope_scaling folded
// into the per-type rope_parameters (scaling applies to full layers only), no forced full last
// layer.
ModelConfig parse_hf_text(const json& tc, const std::string& source) {
  hf::Reader r{tc, source};
  ModelConfig c;
  const auto [n_kv, head_dim, intermediate] =
      hf::read_text_basics(tc, source, {"gemma3_text", 26, 262208, 4096, 131072}, c);
  const float qpas = r.get("query_pre_attn_scalar", 256.f);
  MB_CHECK(qpas > 0, "{}: query_pre_attn_scalar must be positive", source);
  c.attn_scale = 1.f / std::sqrt(qpas);
  c.norm_adds_one = true;
  c.v_norm = false;
  MB_CHECK(head_dim % 2 == 0 && c.n_heads % n_kv == 0, "{}: invalid model dimensions", source);
  MB_CHECK(!r.get("use_bidirectional_attention", false), "{}: bidirectional attention is not supported", source);

  const int pattern = r.get("sliding_window_pattern", 6);
  MB_CHECK(pattern > 0, "{}: sliding_window_pattern must be positive", source);
  const std::vector<AttnKind> kinds = hf::layer_kinds(tc, c.n_layers, source, [&](int i) {
    return (i + 1) % pattern ? AttnKind::Sliding : AttnKind::Full;
  });

  RopeConfig full{r.get("rope_theta", 1e6f), 1.f, 1.f}, sliding{r.get("rope_local_base_freq", 1e4f), 1.f, 1.f};
  if (tc.contains("rope_parameters") && tc["rope_parameters"].is_object()) {
    const json& rp = tc["rope_parameters"];
    for (auto [key, rope] : {std::pair{"full_attention", &full}, std::pair{"sliding_attention", &sliding}}) {
      if (!rp.contains(key) || !rp[key].is_object()) continue;
      json p = rp[key];
      if (!p.contains("rope_theta")) p["rope_theta"] = rope->theta;
      *rope = hf::rope(p, source);
    }
  } else if (tc.contains("rope_scaling") && tc["rope_scaling"].is_object()) {
    json p = tc["rope_scaling"];
    if (p.contains("type") && !p.contains("rope_type")) p["rope_type"] = p["type"];
    p["rope_theta"] = full.theta;
    full = hf::rope(p, source);
  }

  c.layers.resize(size_t(c.n_layers));
  for (int i = 0; i < c.n_layers; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = kinds[size_t(i)];
    L.head_dim = head_dim;
    L.n_kv_heads = n_kv;
    L.has_v_proj = true;
    L.kv_source = i;
    L.ffn_dim = intermediate;
    L.rope = L.kind == AttnKind::Full ? full : sliding;
  }
  return c;
}

// Linear RoPE scaling as llama.cpp reads it (rope.scaling.factor, else the older rope.scale_linear).
float linear_rope_factor(const GgufMeta& m) {
  const std::string type = m.get_string("rope.scaling.type", "linear");
  const double factor = m.find("rope.scaling.factor") ? m.get_float("rope.scaling.factor", 0)
                                                       : m.get_float("rope.scale_linear", 0);
  if (factor == 0 || factor == 1) return 1.f;
  MB_CHECK(type == "linear" || type == "none", "{}: rope scaling type '{}' is not supported (supported: linear)",
           m.f.path(), type);
  MB_CHECK(factor > 0, "{}: rope scaling factor {} must be positive", m.f.path(), factor);
  return float(factor);
}

ModelConfig parse_gguf(const GgufFile& f) {
  GgufMeta m{f, "gemma3"};
  ModelConfig c;
  c.model_type = "gemma3_text";
  read_gguf_decoder_dims(m, c);
  const int n = c.n_layers;
  const int64_t default_hd = c.hidden_size / c.n_heads;
  const int head_dim = m.positive_int("attention.key_length", m.get_int("attention.key_length", default_hd));
  MB_CHECK(m.get_int("attention.value_length", head_dim) == head_dim,
           "{}: attention.value_length differs from attention.key_length", f.path());
  MB_CHECK(m.get_int("rope.dimension_count", head_dim) == head_dim,
           "{}: partial rotary embeddings are not supported for gemma3", f.path());
  const int64_t all_heads = c.n_heads;  // llama.cpp's default: no grouped-query attention
  const std::vector<int64_t> n_kv = m.per_layer("attention.head_count_kv", n, &all_heads);
  const std::vector<int64_t> ffn = m.per_layer("feed_forward_length", n);
  // The converter folds Gemma 3's (1 + w) into the stored norm weights.
  c.norm_adds_one = false;
  c.v_norm = false;
  // llama.cpp: the 27B scales queries by (hidden / heads)^-0.5, the others by head_dim^-0.5 (what
  // HF's query_pre_attn_scalar says for every released size).
  c.attn_scale = n == 62 ? 1.f / std::sqrt(float(c.hidden_size / c.n_heads)) : 1.f / std::sqrt(float(head_dim));
  // MarkBase's exporter records query_pre_attn_scalar^-0.5 when a checkpoint has its own.
  if (m.find("attention.scale")) c.attn_scale = float(m.get_float("attention.scale", c.attn_scale));

  // Sliding window every layer but each 6th (llama.cpp's set_swa_pattern(6)); no window key means
  // global attention everywhere.
  const int64_t window = m.get_int("attention.sliding_window", 0);
  MB_CHECK(window >= 0 && window <= (int64_t(1) << 30), "{}: invalid sliding window {}", f.path(), window);
  c.sliding_window = window > 0 ? int(window) : c.max_position;
  const RopeConfig full{float(m.get_float("rope.freq_base", 10000.0)), 1.f, linear_rope_factor(m)};
  const RopeConfig sliding{float(m.get_float("rope.freq_base_swa", 10000.0)), 1.f, 1.f};
  c.layers.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = window > 0 && i % 6 < 5 ? AttnKind::Sliding : AttnKind::Full;
    L.head_dim = head_dim;
    L.n_kv_heads = m.positive_int("attention.head_count_kv", n_kv[size_t(i)]);
    L.ffn_dim = m.positive_int("feed_forward_length", ffn[size_t(i)]);
    L.has_v_proj = true;
    L.kv_source = i;
    L.rope = L.kind == AttnKind::Full ? full : sliding;
  }
  read_gguf_special_tokens(f, "<end_of_turn>", c);
  return c;
}

void write_gguf_metadata(const ModelConfig& c, GgufWriter& w) {
  const std::string a = "gemma3";
  write_gguf_decoder_dims(c, a, w);
  const LayerConfig* full = first_layer_of_kind(c, AttnKind::Full);
  MB_CHECK(full && first_layer_of_kind(c, AttnKind::Sliding), "GGUF export needs both sliding and full layers");
  w.set(a + ".attention.key_length", gguf_u32(c.layers[0].head_dim));
  w.set(a + ".attention.value_length", gguf_u32(c.layers[0].head_dim));
  w.set(a + ".rope.freq_base", gguf_f32(full->rope.theta));
  // llama.cpp derives the query scale from head_dim; a checkpoint whose query_pre_attn_scalar
  // says otherwise keeps its own (a key llama.cpp's gemma3 loader does not read).
  w.set(a + ".attention.scale", gguf_f32(c.attn_scale));
  if (full->rope.linear_factor != 1.f) {
    w.set(a + ".rope.scaling.type", GgufValue::make_string("linear"));
    w.set(a + ".rope.scaling.factor", gguf_f32(full->rope.linear_factor));
  }
}

// generation_config.eos_token_id of the instruction-tuned checkpoints.
constexpr std::array<std::string_view, 2> kStopTokens = {"<end_of_turn>", "<eos>"};

class Gemma3Architecture final : public Architecture {
 public:
  std::string_view name() const override { return "gemma3"; }

  bool reads_hf_config(const std::string& hf_class, const std::string& model_type) const override {
    return nested(hf_class, model_type) || flat(hf_class, model_type);
  }
  std::vector<std::string_view> hf_classes() const override {
    return {"Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"};
  }
  ModelConfig parse_hf_config(const json& config, const std::string& source) const override {
    const std::string hf_class = hf::class_of(config), model_type = hf::model_type_of(config);
    if (flat(hf_class, model_type)) {
      ModelConfig c = parse_hf_text(config, source);
      if (!model_type.empty()) c.model_type = model_type;
      return c;
    }
    return hf::parse_text_config(config, source, hf_class.empty() ? model_type : hf_class, parse_hf_text);
  }
  bool is_multimodal_tensor(std::string_view name) const override {
    return gemma4::is_multimodal_tensor(name);
  }

  std::string_view gguf_architecture() const override { return "gemma3"; }
  ModelConfig parse_gguf(const GgufFile& f) const override { return gemma3::parse_gguf(f); }
  void write_gguf_metadata(const ModelConfig& c, GgufWriter& w) const override { gemma3::write_gguf_metadata(c, w); }
  bool gguf_adds_one(const std::string& gguf_name) const override {
    constexpr std::string_view suffix = "norm.weight";
    return gguf_name.size() >= suffix.size() && gguf_name.compare(gguf_name.size() - suffix.size(), suffix.size(),
                                                                  suffix) == 0;
  }
  std::string_view gguf_tokenizer_model() const override { return "gpt2"; }
  std::span<const TensorNamePair> gguf_global_names() const override {
    return gemma4::global_names().first(gemma4::kCommonGlobalNames);
  }
  std::span<const TensorNamePair> gguf_layer_names() const override {
    return gemma4::layer_names().first(gemma4::kCommonLayerNames);
  }

  std::unique_ptr<Model> make_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                    const ModelLoadOptions& opts) const override {
    return gemma4::make_decoder(std::move(ck), backend, opts);
  }

  std::span<const std::string_view> stop_tokens() const override { return kStopTokens; }
  std::string_view builtin_chat_template() const override { return kBuiltinGemma3Template; }

 private:
  static bool nested(const std::string& c, const std::string& t) {
    return c == "Gemma3ForConditionalGeneration" || (c.empty() && t == "gemma3");
  }
  static bool flat(const std::string& c, const std::string& t) {
    return c == "Gemma3ForCausalLM" || (c.empty() && t == "gemma3_text");
  }
};

}  // namespace

}  // namespace gemma3

const Architecture& gemma3_architecture() {
  static const gemma3::Gemma3Architecture arch;
  return arch;
}

}  // namespace mb
