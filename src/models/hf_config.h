// Hugging Face config.json (+ generation_config.json) -> ModelConfig, through the architecture
// that reads the config (models/architecture.h), and the readers architectures share.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/model_config.h"

namespace mb {

// `source` names config.json in errors; the generation config's eos_token_id joins the stop ids.
ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& source,
                            const nlohmann::json* generation_config = nullptr);

namespace hf {

// Typed access to one JSON object; errors name the file and the key.
struct Reader {
  const nlohmann::json& j;
  const std::string& source;

  template <class T>
  T get(const char* key, T fallback) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    try {
      return it->get<T>();
    } catch (const nlohmann::json::exception&) {
      fail("{}: field '{}' has the wrong type: {}", source, key, it->dump());
    }
  }
};

// architectures[0], "" when absent.
std::string class_of(const nlohmann::json& config);
// model_type, "" when absent or not a string.
std::string model_type_of(const nlohmann::json& config);
// "dtype" or the older "torch_dtype".
DType torch_dtype(const nlohmann::json& config);
bool has_torch_dtype(const nlohmann::json& config);
// eos_token_id: one id or a list.
void add_eos_ids(std::vector<int>& ids, const nlohmann::json& v);
// One rope_parameters entry: rope_type default, proportional (partial_rotary_factor) or linear.
RopeConfig rope(const nlohmann::json& params, const std::string& source);
// layer_types as attention kinds, or default_kind(i) for each layer when the key is absent.
std::vector<AttnKind> layer_kinds(const nlohmann::json& text_config, int n_layers, const std::string& source,
                                  const std::function<AttnKind(int)>& default_kind);

// The defaults a Gemma text config class gives the fields they all have.
struct TextDefaults {
  const char* model_type;
  int n_layers, vocab_size, sliding_window, max_position;
};
struct TextDims {
  int n_kv_heads, head_dim, intermediate;
};
// Reads model_type, dtype, hidden size, layers, heads, vocabulary, window, context, norm epsilon,
// soft-caps, the tied head and the special ids into `c`, and checks they are positive; returns the
// per-layer defaults (KV heads, head dim, FFN width) the caller resolves per layer.
TextDims read_text_basics(const nlohmann::json& text_config, const std::string& source, const TextDefaults& d,
                          ModelConfig& c);

// A ...ForConditionalGeneration config keeps the decoder's under text_config. Parses it with
// `parse_text` (given the text config and its name for errors; it reads the dtype of the config
// it is given, as for a flat config), then applies what the outer config says for the whole
// checkpoint (dtype, eos_token_id).
ModelConfig parse_text_config(const nlohmann::json& config, const std::string& source,
                              const std::string& hf_class,
                              const std::function<ModelConfig(const nlohmann::json&, const std::string&)>& parse_text);

}  // namespace hf
}  // namespace mb
