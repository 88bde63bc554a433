#include "formats/hf_config.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mb {

namespace {

using json = nlohmann::json;

struct Reader {
  const json& j;
  const std::string& source;

  template <class T>
  T get(const char* key, T fallback) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    try {
      return it->get<T>();
    } catch (const json::exception&) {
      fail("{}: field '{}' has the wrong type: {}", source, key, it->dump());
    }
  }
  template <class T>
  T require(const char* key) const {
    MB_CHECK(j.contains(key) && !j[key].is_null(), "{}: missing required field '{}'", source, key);
    return get<T>(key, T{});
  }
};

DType parse_torch_dtype(const json& j) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) continue;
    std::string s = it->get<std::string>();
    if (s == "bfloat16") return DType::BF16;
    if (s == "float16") return DType::F16;
    return DType::F32;
  }
  return DType::F32;
}

void add_eos(std::vector<int>& ids, const json& v) {
  if (v.is_number_integer()) ids.push_back(v.get<int>());
  if (v.is_array())
    for (auto& x : v)
      if (x.is_number_integer()) ids.push_back(x.get<int>());
}

RopeConfig parse_rope(const json& p, const std::string& source) {
  RopeConfig r;
  std::string type = p.value("rope_type", std::string("default"));
  r.theta = p.value("rope_theta", 10000.f);
  if (type == "proportional") {
    r.partial_rotary_factor = p.value("partial_rotary_factor", 1.f);
    MB_CHECK(p.value("factor", 1.f) == 1.f, "{}: proportional RoPE with factor != 1 is not supported",
             source);
  } else if (type == "linear") {
    r.linear_factor = p.value("factor", 1.f);
  } else if (type != "default") {
    fail("{}: unsupported rope_type '{}' (supported: default, proportional, linear)", source, type);
  }
  return r;
}

// Gemma 4 text decoder, as Gemma4TextConfig / Gemma4UnifiedTextConfig resolve it.
void parse_gemma4_text(const json& tc, bool unified, const std::string& source, ModelConfig& c) {
  Reader r{tc, source};
  c.family = "gemma4";
  c.hidden_size = r.get("hidden_size", 2304);
  c.n_layers = r.get("num_hidden_layers", 30);
  c.n_heads = r.get("num_attention_heads", 8);
  const int n_kv = r.get("num_key_value_heads", 4);
  const int head_dim = r.get("head_dim", 256);
  const int intermediate = r.get("intermediate_size", 9216);
  c.vocab_size = r.get("vocab_size", 262144);
  c.sliding_window = r.get("sliding_window", unified ? 1024 : 512);
  c.max_position = r.get("max_position_embeddings", unified ? 262144 : 131072);
  c.rms_eps = r.get("rms_norm_eps", 1e-6f);
  c.final_logit_softcap = r.get("final_logit_softcapping", 0.f);
  c.tie_embeddings = r.get("tie_word_embeddings", true);
  c.attn_scale = 1.f;
  c.n_kv_shared_layers = r.get("num_kv_shared_layers", 0);
  const bool k_eq_v = r.get("attention_k_eq_v", false);
  const bool double_wide = r.get("use_double_wide_mlp", false);
  if (!unified) {
    c.ple_dim = r.get("hidden_size_per_layer_input", 256);
    c.ple_vocab = r.get("vocab_size_per_layer_input", 262144);
    c.moe = r.get("enable_moe_block", false);
    c.n_experts = r.get("num_experts", 0);
    c.top_k_experts = r.get("top_k_experts", 0);
    c.moe_ffn_dim = r.get("moe_intermediate_size", 0);
  }
  c.pad_id = r.get("pad_token_id", 0);
  c.bos_id = r.get("bos_token_id", 2);
  if (tc.contains("eos_token_id")) add_eos(c.eos_ids, tc["eos_token_id"]);
  else c.eos_ids.push_back(1);

  MB_CHECK(c.hidden_size > 0 && c.n_layers > 0 && c.n_heads > 0 && n_kv > 0 && head_dim > 0 &&
               intermediate > 0 && c.vocab_size > 0,
           "{}: non-positive model dimension", source);
  MB_CHECK(c.n_kv_shared_layers >= 0 && c.n_kv_shared_layers < c.n_layers,
           "{}: num_kv_shared_layers {} out of range for {} layers", source, c.n_kv_shared_layers,
           c.n_layers);
  MB_CHECK(c.sliding_window > 0, "{}: sliding_window must be positive", source);
  std::string bidir = r.get("use_bidirectional_attention", std::string());
  MB_CHECK(bidir != "all", "{}: use_bidirectional_attention='all' (non-causal text) is not supported",
           source);
  if (c.moe)
    MB_CHECK(c.n_experts > 0 && c.top_k_experts > 0 && c.top_k_experts <= c.n_experts &&
                 c.moe_ffn_dim > 0,
             "{}: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size", source);

  // layer_types: default 5 sliding : 1 full, and transformers forces the last layer to full.
  std::vector<AttnKind> kinds(c.n_layers);
  if (tc.contains("layer_types") && tc["layer_types"].is_array()) {
    const json& lt = tc["layer_types"];
    MB_CHECK(int(lt.size()) == c.n_layers, "{}: layer_types has {} entries, num_hidden_layers is {}",
             source, lt.size(), c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      std::string s = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (s == "sliding_attention") kinds[i] = AttnKind::Sliding;
      else if (s == "full_attention") kinds[i] = AttnKind::Full;
      else fail("{}: unknown layer type '{}' at layer {}", source, lt[i].dump(), i);
    }
  } else {
    for (int i = 0; i < c.n_layers; ++i)
      kinds[i] = (i + 1) % 6 ? AttnKind::Sliding : AttnKind::Full;
  }
  kinds.back() = AttnKind::Full;

  RopeConfig rope_sliding{10000.f, 1.f, 1.f}, rope_full{1e6f, 0.25f, 1.f};
  if (tc.contains("rope_parameters") && tc["rope_parameters"].is_object()) {
    const json& rp = tc["rope_parameters"];
    if (rp.contains("sliding_attention") || rp.contains("full_attention")) {
      if (rp.contains("sliding_attention") && rp["sliding_attention"].is_object())
        rope_sliding = parse_rope(rp["sliding_attention"], source);
      if (rp.contains("full_attention") && rp["full_attention"].is_object())
        rope_full = parse_rope(rp["full_attention"], source);
    } else {
      rope_sliding = rope_full = parse_rope(rp, source);
    }
  }

  // Full layers: their own head dim, and (with K=V) their own KV-head count. Configs saved by
  // transformers 5.17.0 carry this as per_layer_config; released configs as global_* keys.
  std::vector<int> layer_head_dim(c.n_layers, head_dim), layer_kv(c.n_layers, n_kv),
      layer_ffn(c.n_layers, intermediate);
  if (tc.contains("per_layer_config") && tc["per_layer_config"].is_object()) {
    for (auto& [key, ov] : tc["per_layer_config"].items()) {
      int idx = -1;
      try {
        idx = std::stoi(key);
      } catch (...) {
      }
      MB_CHECK(idx >= 0 && idx < c.n_layers && ov.is_object(),
               "{}: per_layer_config has an invalid entry '{}'", source, key);
      Reader o{ov, source};
      layer_head_dim[idx] = o.get("head_dim", layer_head_dim[idx]);
      layer_kv[idx] = o.get("num_key_value_heads", layer_kv[idx]);
      layer_ffn[idx] = o.get("intermediate_size", layer_ffn[idx]);
    }
  } else {
    const int global_head_dim = r.get("global_head_dim", 512);
    const json& gkv = tc.contains("num_global_key_value_heads") ? tc["num_global_key_value_heads"]
                                                                 : json();
    for (int i = 0; i < c.n_layers; ++i) {
      if (kinds[i] != AttnKind::Full) continue;
      layer_head_dim[i] = global_head_dim;
      if (k_eq_v && gkv.is_number_integer()) layer_kv[i] = gkv.get<int>();
    }
  }

  const int first_shared = c.n_layers - c.n_kv_shared_layers;
  c.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerConfig& L = c.layers[i];
    L.kind = kinds[i];
    L.head_dim = layer_head_dim[i];
    L.n_kv_heads = layer_kv[i];
    MB_CHECK(L.head_dim > 0 && L.head_dim % 2 == 0 && L.n_kv_heads > 0 && c.n_heads % L.n_kv_heads == 0,
             "{}: layer {} has head_dim {} and {} KV heads for {} query heads", source, i, L.head_dim,
             L.n_kv_heads, c.n_heads);
    L.has_v_proj = !(k_eq_v && L.kind == AttnKind::Full);
    L.rope = L.kind == AttnKind::Full ? rope_full : rope_sliding;
    const bool shared = c.n_kv_shared_layers > 0 && i >= first_shared;
    L.ffn_dim = layer_ffn[i] * (double_wide && shared ? 2 : 1);
    L.kv_source = i;
    if (shared) {
      // The last non-shared layer of the same attention type publishes its KV to shared layers.
      L.kv_source = -1;
      for (int s = first_shared - 1; s >= 0; --s)
        if (kinds[s] == L.kind) {
          L.kv_source = s;
          break;
        }
      MB_CHECK(L.kv_source >= 0, "{}: KV-shared layer {} has no earlier layer of the same type", source,
               i);
    }
  }
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerConfig& L = c.layers[i];
    const LayerConfig& S = c.layers[L.kv_source];
    MB_CHECK(L.head_dim == S.head_dim && L.n_kv_heads == S.n_kv_heads,
             "{}: KV-shared layer {} does not match the geometry of its source layer {}", source, i,
             L.kv_source);
  }
}

// Gemma 3 text decoder, as Gemma3TextConfig resolves it: (1 + w) norms, query_pre_attn_scalar,
// one head dim, legacy rope_theta / rope_local_base_freq / rope_scaling folded into the
// per-type rope_parameters (scaling applies to full layers only), no forced full last layer.
void parse_gemma3_text(const json& tc, const std::string& source, ModelConfig& c) {
  Reader r{tc, source};
  c.family = "gemma3";
  c.hidden_size = r.get("hidden_size", 2304);
  c.n_layers = r.get("num_hidden_layers", 26);
  c.n_heads = r.get("num_attention_heads", 8);
  const int n_kv = r.get("num_key_value_heads", 4);
  const int head_dim = r.get("head_dim", 256);
  const int intermediate = r.get("intermediate_size", 9216);
  c.vocab_size = r.get("vocab_size", 262208);
  c.sliding_window = r.get("sliding_window", 4096);
  c.max_position = r.get("max_position_embeddings", 131072);
  c.rms_eps = r.get("rms_norm_eps", 1e-6f);
  c.final_logit_softcap = r.get("final_logit_softcapping", 0.f);
  c.attn_logit_softcap = r.get("attn_logit_softcapping", 0.f);
  c.tie_embeddings = r.get("tie_word_embeddings", true);
  const float qpas = r.get("query_pre_attn_scalar", 256.f);
  MB_CHECK(qpas > 0, "{}: query_pre_attn_scalar must be positive", source);
  c.attn_scale = 1.f / std::sqrt(qpas);
  c.norm_adds_one = true;
  c.v_norm = false;
  c.pad_id = r.get("pad_token_id", 0);
  c.bos_id = r.get("bos_token_id", 2);
  if (tc.contains("eos_token_id")) add_eos(c.eos_ids, tc["eos_token_id"]);
  else c.eos_ids.push_back(1);
  MB_CHECK(c.hidden_size > 0 && c.n_layers > 0 && c.n_heads > 0 && n_kv > 0 && head_dim > 0 && head_dim % 2 == 0 &&
               intermediate > 0 && c.vocab_size > 0 && c.sliding_window > 0 && c.n_heads % n_kv == 0,
           "{}: invalid model dimensions", source);
  MB_CHECK(!r.get("use_bidirectional_attention", false), "{}: bidirectional attention is not supported", source);

  std::vector<AttnKind> kinds(c.n_layers);
  if (tc.contains("layer_types") && tc["layer_types"].is_array()) {
    MB_CHECK(int(tc["layer_types"].size()) == c.n_layers, "{}: layer_types has {} entries for {} layers", source,
             tc["layer_types"].size(), c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      std::string s = tc["layer_types"][i].is_string() ? tc["layer_types"][i].get<std::string>() : "";
      MB_CHECK(s == "sliding_attention" || s == "full_attention", "{}: unknown layer type at layer {}", source, i);
      kinds[i] = s == "full_attention" ? AttnKind::Full : AttnKind::Sliding;
    }
  } else {
    const int pattern = r.get("sliding_window_pattern", 6);
    for (int i = 0; i < c.n_layers; ++i) kinds[i] = (i + 1) % pattern ? AttnKind::Sliding : AttnKind::Full;
  }

  RopeConfig full{r.get("rope_theta", 1e6f), 1.f, 1.f}, sliding{r.get("rope_local_base_freq", 1e4f), 1.f, 1.f};
  if (tc.contains("rope_parameters") && tc["rope_parameters"].is_object()) {
    const json& rp = tc["rope_parameters"];
    if (rp.contains("full_attention") && rp["full_attention"].is_object()) {
      json p = rp["full_attention"];
      if (!p.contains("rope_theta")) p["rope_theta"] = full.theta;
      full = parse_rope(p, source);
    }
    if (rp.contains("sliding_attention") && rp["sliding_attention"].is_object()) {
      json p = rp["sliding_attention"];
      if (!p.contains("rope_theta")) p["rope_theta"] = sliding.theta;
      sliding = parse_rope(p, source);
    }
  } else if (tc.contains("rope_scaling") && tc["rope_scaling"].is_object()) {
    json p = tc["rope_scaling"];
    if (p.contains("type") && !p.contains("rope_type")) p["rope_type"] = p["type"];
    p["rope_theta"] = full.theta;
    full = parse_rope(p, source);
  }

  c.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerConfig& L = c.layers[i];
    L.kind = kinds[i];
    L.head_dim = head_dim;
    L.n_kv_heads = n_kv;
    L.has_v_proj = true;
    L.kv_source = i;
    L.ffn_dim = intermediate;
    L.rope = L.kind == AttnKind::Full ? full : sliding;
  }
}

}  // namespace

int ModelConfig::max_head_dim() const {
  int m = 0;
  for (auto& l : layers) m = std::max(m, l.head_dim);
  return m;
}

ModelConfig parse_hf_config(const json& config, const std::string& source,
                            const json* generation_config) {
  MB_CHECK(config.is_object(), "{}: expected a JSON object", source);
  ModelConfig c;
  std::string arch;
  if (config.contains("architectures") && config["architectures"].is_array() &&
      !config["architectures"].empty() && config["architectures"][0].is_string())
    arch = config["architectures"][0].get<std::string>();
  const std::string model_type = config.value("model_type", std::string());
  c.architecture = arch;
  c.checkpoint_dtype = parse_torch_dtype(config);

  const bool nested = arch == "Gemma4ForConditionalGeneration" ||
                      arch == "Gemma4UnifiedForConditionalGeneration" ||
                      (arch.empty() && (model_type == "gemma4" || model_type == "gemma4_unified"));
  const bool flat = arch == "Gemma4ForCausalLM" || arch == "Gemma4UnifiedForCausalLM" ||
                    (arch.empty() && (model_type == "gemma4_text" || model_type == "gemma4_unified_text"));
  if (nested) {
    MB_CHECK(config.contains("text_config") && config["text_config"].is_object(),
             "{}: {} config has no text_config", source, arch.empty() ? model_type : arch);
    const json& tc = config["text_config"];
    const bool unified = arch.find("Unified") != std::string::npos || model_type == "gemma4_unified";
    c.model_type = tc.value("model_type", unified ? "gemma4_unified_text" : "gemma4_text");
    parse_gemma4_text(tc, unified, source + " (text_config)", c);
    if (!config.contains("dtype") && !config.contains("torch_dtype")) c.checkpoint_dtype = parse_torch_dtype(tc);
    if (config.contains("eos_token_id")) add_eos(c.eos_ids, config["eos_token_id"]);
  } else if (flat) {
    const bool unified = arch.find("Unified") != std::string::npos || model_type == "gemma4_unified_text";
    c.model_type = model_type;
    parse_gemma4_text(config, unified, source, c);
  } else if (arch == "Gemma3ForConditionalGeneration" || (arch.empty() && model_type == "gemma3")) {
    MB_CHECK(config.contains("text_config") && config["text_config"].is_object(), "{}: {} config has no text_config",
             source, arch.empty() ? model_type : arch);
    const json& tc = config["text_config"];
    c.model_type = tc.value("model_type", "gemma3_text");
    parse_gemma3_text(tc, source + " (text_config)", c);
    if (!config.contains("dtype") && !config.contains("torch_dtype")) c.checkpoint_dtype = parse_torch_dtype(tc);
    if (config.contains("eos_token_id")) add_eos(c.eos_ids, config["eos_token_id"]);
  } else if (arch == "Gemma3ForCausalLM" || (arch.empty() && model_type == "gemma3_text")) {
    c.model_type = model_type.empty() ? "gemma3_text" : model_type;
    parse_gemma3_text(config, source, c);
  } else {
    fail("{}: unknown architecture '{}' (model_type '{}'); supported: Gemma4ForConditionalGeneration, "
         "Gemma4ForCausalLM, Gemma4UnifiedForConditionalGeneration, Gemma4UnifiedForCausalLM, "
         "Gemma3ForConditionalGeneration, Gemma3ForCausalLM",
         source, arch, model_type);
  }
  if (generation_config && generation_config->is_object() && generation_config->contains("eos_token_id"))
    add_eos(c.eos_ids, (*generation_config)["eos_token_id"]);
  std::sort(c.eos_ids.begin(), c.eos_ids.end());
  c.eos_ids.erase(std::unique(c.eos_ids.begin(), c.eos_ids.end()), c.eos_ids.end());
  if (!c.eos_ids.empty()) c.eos_id = c.eos_ids.front();
  return c;
}

}  // namespace mb
