#include "models/hf_config.h"

#include <algorithm>

#include "models/architecture.h"

namespace mb {

namespace hf {

using json = nlohmann::json;

std::string class_of(const json& config) {
  auto it = config.find("architectures");
  return it != config.end() && it->is_array() && !it->empty() && (*it)[0].is_string() ? (*it)[0].get<std::string>()
                                                                                    : std::string();
}

std::string model_type_of(const json& config) {
  auto it = config.find("model_type");
  return it != config.end() && it->is_string() ? it->get<std::string>() : std::string();
}

bool has_torch_dtype(const json& config) { return config.contains("dtype") || config.contains("torch_dtype"); }

DType torch_dtype(const json& j) {
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

void add_eos_ids(std::vector<int>& ids, const json& v) {
  if (v.is_number_integer()) ids.push_back(v.get<int>());
  if (v.is_array())
    for (auto& x : v)
      if (x.is_number_integer()) ids.push_back(x.get<int>());
}

RopeConfig rope(const json& p, const std::string& source) {
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

std::vector<AttnKind> layer_kinds(const json& tc, int n_layers, const std::string& source,
                                  const std::function<AttnKind(int)>& default_kind) {
  std::vector<AttnKind> kinds(static_cast<size_t>(n_layers));
  auto it = tc.find("layer_types");
  if (it == tc.end() || !it->is_array()) {
    for (int i = 0; i < n_layers; ++i) kinds[size_t(i)] = default_kind(i);
    return kinds;
  }
  MB_CHECK(int(it->size()) == n_layers, "{}: layer_types has {} entries, num_hidden_layers is {}", source,
           it->size(), n_layers);
  for (int i = 0; i < n_layers; ++i) {
    const json& t = (*it)[size_t(i)];
    const std::string s = t.is_string() ? t.get<std::string>() : "";
    if (s == "sliding_attention") kinds[size_t(i)] = AttnKind::Sliding;
    else if (s == "full_attention") kinds[size_t(i)] = AttnKind::Full;
    else fail("{}: unknown layer type '{}' at layer {}", source, t.dump(), i);
  }
  return kinds;
}

TextDims read_text_basics(const json& tc, const std::string& source, const TextDefaults& d, ModelConfig& c) {
  Reader r{tc, source};
  c.model_type = model_type_of(tc);
  if (c.model_type.empty()) c.model_type = d.model_type;
  c.checkpoint_dtype = torch_dtype(tc);
  c.hidden_size = r.get("hidden_size", 2304);
  c.n_layers = r.get("num_hidden_layers", d.n_layers);
  c.n_heads = r.get("num_attention_heads", 8);
  const TextDims dims{r.get("num_key_value_heads", 4), r.get("head_dim", 256), r.get("intermediate_size", 9216)};
  c.vocab_size = r.get("vocab_size", d.vocab_size);
  c.sliding_window = r.get("sliding_window", d.sliding_window);
  c.max_position = r.get("max_position_embeddings", d.max_position);
  c.rms_eps = r.get("rms_norm_eps", 1e-6f);
  c.final_logit_softcap = r.get("final_logit_softcapping", 0.f);
  c.attn_logit_softcap = r.get("attn_logit_softcapping", 0.f);
  c.tie_embeddings = r.get("tie_word_embeddings", true);
  c.pad_id = r.get("pad_token_id", 0);
  c.bos_id = r.get("bos_token_id", 2);
  if (tc.contains("eos_token_id")) add_eos_ids(c.eos_ids, tc["eos_token_id"]);
  else c.eos_ids.push_back(1);
  MB_CHECK(c.hidden_size > 0 && c.n_layers > 0 && c.n_heads > 0 && dims.n_kv_heads > 0 && dims.head_dim > 0 &&
               dims.intermediate > 0 && c.vocab_size > 0,
           "{}: non-positive model dimension", source);
  MB_CHECK(c.sliding_window > 0, "{}: sliding_window must be positive", source);
  return dims;
}

ModelConfig parse_text_config(const json& config, const std::string& source, const std::string& hf_class,
                              const std::function<ModelConfig(const json&, const std::string&)>& parse_text) {
  auto it = config.find("text_config");
  MB_CHECK(it != config.end() && it->is_object(), "{}: {} config has no text_config", source, hf_class);
  ModelConfig c = parse_text(*it, source + " (text_config)");
  c.checkpoint_dtype = torch_dtype(has_torch_dtype(config) ? config : *it);
  if (config.contains("eos_token_id")) add_eos_ids(c.eos_ids, config["eos_token_id"]);
  return c;
}

}  // namespace hf

ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& source,
                            const nlohmann::json* generation_config) {
  const Architecture& arch = architecture_for_hf_config(config, source);
  ModelConfig c;
  try {
    c = arch.parse_hf_config(config, source);
  } catch (const nlohmann::json::exception& e) {  // a field of an unexpected JSON type
    fail("{}: {}", source, e.what());
  }
  c.family = std::string(arch.name());
  c.architecture = hf::class_of(config);
  if (generation_config && generation_config->is_object() && generation_config->contains("eos_token_id"))
    hf::add_eos_ids(c.eos_ids, (*generation_config)["eos_token_id"]);
  std::sort(c.eos_ids.begin(), c.eos_ids.end());
  c.eos_ids.erase(std::unique(c.eos_ids.begin(), c.eos_ids.end()), c.eos_ids.end());
  if (!c.eos_ids.empty()) c.eos_id = c.eos_ids.front();
  check_layer_geometry(c, source);
  return c;
}

}  // namespace mb
