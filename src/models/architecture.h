// An architecture is one folder under src/models/: how its Hugging Face config.json and its GGUF
// metadata read into a ModelConfig, its tensors' GGUF names, the GGUF metadata it is written with,
// its forward pass, and its text conventions (stop tokens, a chat template for files without
// one). The registry (architecture.cpp) lists every architecture; everything else asks the
// registry, so no code outside an architecture's folder compares architecture names.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "models/model_config.h"

namespace mb {

class Backend;
class GgufFile;
class GgufWriter;
class MediaEncoder;
class Model;
struct Checkpoint;
struct ModelLoadOptions;

// (GGUF name, Hugging Face name) of a tensor; names of layer tensors without their prefixes
// ("attn_q.weight" for "blk.N.attn_q.weight", "self_attn.q_proj.weight" for
// "model.layers.N.self_attn.q_proj.weight").
using TensorNamePair = std::pair<std::string_view, std::string_view>;

class Architecture {
 public:
  virtual ~Architecture() = default;

  // ModelConfig::family of the configs this architecture produces.
  virtual std::string_view name() const = 0;

  // --- Hugging Face checkpoints
  // Whether config.json's architectures[0] (or, when that is absent, its model_type) is one of
  // this architecture's classes.
  virtual bool reads_hf_config(const std::string& hf_class, const std::string& model_type) const = 0;
  // The HF classes it reads, for the error listing what is supported.
  virtual std::vector<std::string_view> hf_classes() const = 0;
  // config.json -> ModelConfig, applying the defaults transformers applies; `source` names the
  // file in errors. generation_config.json's stop ids are merged by the caller.
  virtual ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& source) const = 0;
  // Tensors of the vision/audio towers, which a text-only run never maps.
  virtual bool is_multimodal_tensor(std::string_view hf_name) const { return false; }

  // --- GGUF (llama.cpp's names and keys)
  virtual std::string_view gguf_architecture() const = 0;  // general.architecture
  virtual ModelConfig parse_gguf(const GgufFile& f) const = 0;
  virtual void write_gguf_metadata(const ModelConfig& c, GgufWriter& w) const = 0;
  // Tensors llama.cpp's converter writes that follow from the config alone (no HF checkpoint
  // holds them), by GGUF name; they are derived from the config on every export.
  virtual std::vector<std::string> gguf_derived_tensors() const { return {}; }
  virtual void add_gguf_derived_tensors(const ModelConfig& c, GgufWriter& w) const {}
  // Whether the GGUF stores 1 + w for this tensor where the HF checkpoint stores w.
  virtual bool gguf_adds_one(const std::string& gguf_name) const { return false; }
  virtual std::string_view gguf_tokenizer_model() const = 0;  // tokenizer.ggml.model
  // How llama.cpp's converter types this architecture's tokens (tokenizer.ggml.token_type).
  struct GgufTokenTyping {
    // Control = transformers' all_special_ids (from tokenizer_config.json), other added tokens of
    // the base vocabulary Normal; false: Control = an added token's own "special" flag.
    bool by_special_ids = false;
    // Tokens written User-defined so that llama.cpp prints them (its chat parser reads them).
    std::span<const std::string_view> visible;
  };
  virtual GgufTokenTyping gguf_token_typing() const { return {}; }
  virtual std::span<const TensorNamePair> gguf_global_names() const = 0;
  virtual std::span<const TensorNamePair> gguf_layer_names() const = 0;

  // HF name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight",
  // "output.weight" -> "lm_head.weight"); "" for a derived tensor; other names unchanged.
  std::string gguf_to_hf_name(const std::string& gguf_name) const;
  // The inverse, "" for an HF name with no GGUF counterpart.
  std::string hf_to_gguf_name(const std::string& hf_name) const;

  // --- The forward pass
  virtual std::unique_ptr<Model> make_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                            const ModelLoadOptions& opts) const = 0;
  // Its image/audio front-ends over a checkpoint opened with its multimodal tensors; throws for an
  // architecture (or a checkpoint) that reads text only.
  virtual std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const Checkpoint> ck,
                                                           Backend& backend) const;
  // Adds llama.cpp's mmproj GGUF at `path` to a GGUF checkpoint: its tensors under the names and
  // its settings in the form make_media_encoder reads; throws for an architecture without one.
  virtual void attach_mmproj(Checkpoint& ck, const std::string& path) const;

  // --- Text
  // Token texts that end a reply (the instruction-tuned generation_config's stop ids).
  virtual std::span<const std::string_view> stop_tokens() const = 0;
  // The chat template of the instruction-tuned models, for files that carry none (base GGUFs).
  virtual std::string_view builtin_chat_template() const = 0;
};

// A per-layer tensor name "<prefix><digits>.<rest>" -> (digits, rest); false for any other.
bool split_layer(std::string_view name, std::string_view prefix, std::string_view& index, std::string_view& rest);

// Every architecture, in the order they are tried.
std::span<const Architecture* const> architectures();
// By registry name (ModelConfig::family); throws mb::Error for an unknown name.
const Architecture& architecture_named(std::string_view name);
// The architecture that reads this config.json (`source` names it in errors); throws listing the
// supported classes.
const Architecture& architecture_for_hf_config(const nlohmann::json& config, const std::string& source);
// The architecture of a GGUF file's general.architecture; throws listing the supported ones.
const Architecture& architecture_for_gguf(const GgufFile& f);

}  // namespace mb
