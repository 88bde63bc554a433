// Architecture hyper-parameters as data: one struct for every Gemma size, resolved per layer so
// model code never re-derives "is this layer shared / which head dim / which KV source". Each
// architecture (src/models/<name>/) fills it from its config.json or GGUF metadata.
#pragma once
#include <string>
#include <vector>

#include "core/dtype.h"

namespace mb {

enum class AttnKind : uint8_t { Sliding, Full };

struct RopeConfig {
  float theta = 10000.f;
  float partial_rotary_factor = 1.f;  // "proportional": only this fraction of slots rotate
  float linear_factor = 1.f;          // positions divided by this (Gemma 3 "linear" scaling)
};

struct LayerConfig {
  AttnKind kind = AttnKind::Sliding;
  int head_dim = 0;
  int n_kv_heads = 0;
  bool has_v_proj = true;  // false: V comes from the K projection (attention_k_eq_v, full layers)
  int kv_source = -1;      // layer whose KV cache this layer reads; == own index unless KV-shared
  int ffn_dim = 0;
  RopeConfig rope;
};

struct ModelConfig {
  std::string architecture;  // e.g. Gemma4ForConditionalGeneration
  std::string model_type;    // e.g. gemma4_text
  std::string family;        // the registry name of its architecture (models/architecture.h)
  int hidden_size = 0;
  int n_layers = 0;
  int n_heads = 0;
  int vocab_size = 0;
  int sliding_window = 0;
  int max_position = 0;
  int ple_dim = 0;    // hidden_size_per_layer_input; 0 = no per-layer embeddings
  int ple_vocab = 0;  // vocab_size_per_layer_input
  int n_kv_shared_layers = 0;
  bool moe = false;
  int n_experts = 0;
  int top_k_experts = 0;
  int moe_ffn_dim = 0;
  float rms_eps = 1e-6f;
  float final_logit_softcap = 0.f;  // 0 = none
  float attn_logit_softcap = 0.f;   // Gemma 2 style, 0 = none
  float attn_scale = 1.f;           // Gemma 4: 1.0; Gemma 3: query_pre_attn_scalar^-0.5
  bool norm_adds_one = false;       // Gemma 3 RMSNorm multiplies by (1 + w)
  bool v_norm = true;               // Gemma 4 normalises V (no weight); Gemma 3 does not
  bool tie_embeddings = true;
  // use_bidirectional_attention "vision" (26B-A4B, 31B): on sliding layers an image's tokens see
  // the whole image (Batch::last_keys).
  bool bidirectional_images = false;
  // ... and on full-attention layers too: the 12B unified model, as transformers 5.17.0's default
  // (dynamic-cache) path masks it. Its static-cache path keeps full layers causal.
  bool bidirectional_images_all_layers = false;
  int bos_id = 2, eos_id = 1, pad_id = 0;
  std::vector<int> eos_ids;  // every id that ends generation
  DType checkpoint_dtype = DType::F32;
  std::string tensor_prefix;  // prefix of text-decoder tensors in the checkpoint
  std::vector<LayerConfig> layers;

  int max_head_dim() const;
  int first_kv_shared_layer() const { return n_layers - n_kv_shared_layers; }
};

// Throws naming `source` unless every layer's head dim, KV heads and FFN width are usable and each
// KV-shared layer has the geometry of the layer whose KV it reads.
void check_layer_geometry(const ModelConfig& c, const std::string& source);

}  // namespace mb
