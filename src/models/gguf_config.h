// A GGUF model seen as the Hugging Face checkpoint it was converted from: a ModelConfig resolved
// from the `<arch>.*` keys by the architecture named in general.architecture, and tensors
// registered under HF names (prefix "model.", so model code never knows the format). Also the
// readers architectures share for llama.cpp's keys.
// Reference: llama.cpp convert_hf_to_gguf.py, gguf-py constants, src/llama-model.cpp hparams.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "formats/gguf.h"
#include "models/model_config.h"

namespace mb {

class Architecture;

ModelConfig gguf_model_config(const GgufFile& f);

// Opens `path`, fills `config` and registers its tensors under HF names.
std::shared_ptr<GgufFile> load_gguf_model(const std::string& path, ModelConfig& config, TensorRegistry& reg);

// Metadata under "<arch>." with errors that name the file and the key.
struct GgufMeta {
  const GgufFile& f;
  std::string arch;

  std::string key(const std::string& k) const { return arch + "." + k; }
  const GgufValue* find(const std::string& k) const { return f.find(key(k)); }
  int64_t get_int(const std::string& k) const;
  int64_t get_int(const std::string& k, int64_t fallback) const { return find(k) ? get_int(k) : fallback; }
  double get_float(const std::string& k, double fallback) const;
  std::string get_string(const std::string& k, const std::string& fallback) const;
  // A per-layer quantity stored as one integer or as an array of n (llama.cpp's get_key_or_arr);
  // absent: `fallback` for every layer, or an error when there is none.
  std::vector<int64_t> per_layer(const std::string& k, int n, const int64_t* fallback = nullptr) const;
  // One bool per layer, stored as one bool or an array of n.
  std::vector<bool> per_layer_bool(const std::string& k, int n) const;
  // A value in [1, 2^30].
  int positive_int(const std::string& k, int64_t v) const;
};

// The keys every llama.cpp decoder has (embedding_length, block_count, head_count, context
// length, norm epsilon, soft-caps), the vocabulary from token_embd, the tied head and the file's
// dtype; sets tensor_prefix to "model.".
void read_gguf_decoder_dims(const GgufMeta& m, ModelConfig& c);
// bos/pad/eos ids, plus eot and the token whose text is `end_of_turn`: HF's generation configs
// stop on both, and llama.cpp treats end-of-turn text as end of generation the same way.
void read_gguf_special_tokens(const GgufFile& f, std::string_view end_of_turn, ModelConfig& c);
// Rows of a tensor stored as [rows, cols].
int gguf_matrix_rows(const GgufFile& f, const std::string& name);

// The metadata every llama.cpp decoder's GGUF starts with, from the config: `<arch>.` keys for
// context, sizes, heads, FFN widths, norm epsilon, soft-cap and sliding window.
void write_gguf_decoder_dims(const ModelConfig& c, std::string_view arch, GgufWriter& w);
// tokenizer.ggml.{bos,eos,padding}_token_id.
void write_gguf_special_tokens(const ModelConfig& c, GgufWriter& w);
GgufValue gguf_u32(int64_t v);
GgufValue gguf_f32(double v);
// The first layer of a kind, or null.
const LayerConfig* first_layer_of_kind(const ModelConfig& c, AttnKind kind);

}  // namespace mb
