#include "formats/gguf_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/error.h"

namespace mb {

namespace {

// Metadata under "<arch>." with errors that name the file and the key.
struct Meta {
  const GgufFile& f;
  std::string arch;

  std::string key(const std::string& k) const { return arch + "." + k; }
  const GgufValue* find(const std::string& k) const { return f.find(key(k)); }

  template <class Fn>
  auto checked(const std::string& full_key, Fn fn) const {
    try {
      return fn();
    } catch (const Error& e) {
      fail("{}: metadata key '{}': {}", f.path(), full_key, e.what());
    }
  }
  int64_t get_int(const std::string& k) const {
    const GgufValue& v = f.get(key(k));
    return checked(key(k), [&] { return v.as_int(); });
  }
  int64_t get_int(const std::string& k, int64_t fallback) const { return find(k) ? get_int(k) : fallback; }
  double get_float(const std::string& k, double fallback) const {
    const GgufValue* v = find(k);
    return v ? checked(key(k), [&] { return v->as_float(); }) : fallback;
  }
  std::string get_string(const std::string& full_key, const std::string& fallback) const {
    const GgufValue* v = f.find(full_key);
    return v ? checked(full_key, [&] { return v->as_string(); }) : fallback;
  }
  // A per-layer quantity stored as one integer or as an array of n (llama.cpp's get_key_or_arr).
  std::vector<int64_t> per_layer(const std::string& k, int n, const int64_t* fallback = nullptr) const {
    const GgufValue* v = find(k);
    if (!v) {
      if (fallback) return std::vector<int64_t>(size_t(n), *fallback);
      fail("{}: missing metadata key '{}'", f.path(), key(k));
    }
    if (!v->is_array()) return std::vector<int64_t>(size_t(n), get_int(k));
    std::vector<int64_t> out = checked(key(k), [&] { return v->ints(); });
    MB_CHECK(int(out.size()) == n, "{}: metadata key '{}' has {} entries for {} layers", f.path(), key(k),
             out.size(), n);
    return out;
  }
};

int positive_int(const Meta& m, const std::string& k, int64_t v) {
  MB_CHECK(v > 0 && v <= (int64_t(1) << 30), "{}: metadata key '{}' = {} is out of range", m.f.path(), m.key(k), v);
  return int(v);
}

// Rows of a tensor stored as [rows, cols] (ne = {cols, rows}).
int tensor_rows(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.find_tensor(name);
  MB_CHECK(t != nullptr, "{}: missing tensor '{}'", f.path(), name);
  MB_CHECK(t->ne.size() == 2 && t->ne[1] > 0 && t->ne[1] <= (uint64_t(1) << 30),
           "{}: tensor '{}' should be a matrix, found {} dimensions", f.path(), name, t->ne.size());
  return int(t->ne[1]);
}

int token_id(const GgufFile& f, const char* key, int fallback) {
  const GgufValue* v = f.find(key);
  if (!v) return fallback;
  try {
    return int(v->as_int());
  } catch (const Error& e) {
    fail("{}: metadata key '{}': {}", f.path(), key, e.what());
  }
}

// eos, eot and the chat end-of-turn token: HF's generation configs stop on [1, 106] for Gemma 3 and
// Gemma 4, and llama.cpp treats the end-of-turn text as end-of-generation the same way.
void resolve_special_tokens(const GgufFile& f, const char* end_of_turn, ModelConfig& c) {
  c.bos_id = token_id(f, "tokenizer.ggml.bos_token_id", 2);
  c.pad_id = token_id(f, "tokenizer.ggml.padding_token_id", 0);
  const int eos = token_id(f, "tokenizer.ggml.eos_token_id", 1);
  c.eos_ids = {eos};
  const int eot = token_id(f, "tokenizer.ggml.eot_token_id", -1);
  if (eot >= 0) c.eos_ids.push_back(eot);
  if (const GgufValue* toks = f.find("tokenizer.ggml.tokens"); toks && toks->is_array() && toks->elem == GgufType::STRING) {
    for (size_t i = 0; i < toks->size(); ++i)
      if (toks->string_at(i) == end_of_turn) {
        c.eos_ids.push_back(int(i));
        break;
      }
  }
  std::sort(c.eos_ids.begin(), c.eos_ids.end());
  c.eos_ids.erase(std::unique(c.eos_ids.begin(), c.eos_ids.end()), c.eos_ids.end());
  c.eos_id = eos;
}

// The dtype the file is "in", for display: llama.cpp's general.file_type, else the dtype holding
// the most bytes.
DType file_dtype(const GgufFile& f) {
  static const std::map<int64_t, DType> kFileTypes = {
      {0, DType::F32},   {1, DType::F16},   {2, DType::Q4_0},  {3, DType::Q4_1},  {7, DType::Q8_0},
      {8, DType::Q5_0},  {9, DType::Q5_1},  {14, DType::Q4_K}, {15, DType::Q4_K}, {16, DType::Q5_K},
      {17, DType::Q5_K}, {18, DType::Q6_K}, {32, DType::BF16}};
  if (const GgufValue* ft = f.find("general.file_type"); ft && ft->is_int()) {
    auto it = kFileTypes.find(ft->as_int());
    if (it != kFileTypes.end()) return it->second;
  }
  std::map<DType, uint64_t> bytes;
  for (auto& t : f.tensors()) bytes[t.dtype] += t.nbytes;
  DType best = DType::F32;
  uint64_t most = 0;
  for (auto [d, b] : bytes)
    if (b > most) most = b, best = d;
  return best;
}

void check_layers(const std::string& path, ModelConfig& c) {
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerConfig& L = c.layers[size_t(i)];
    MB_CHECK(L.head_dim > 0 && L.head_dim % 2 == 0 && L.n_kv_heads > 0 && c.n_heads % L.n_kv_heads == 0 &&
                 L.ffn_dim > 0,
             "{}: layer {} has head_dim {}, {} KV heads for {} query heads and FFN width {}", path, i, L.head_dim,
             L.n_kv_heads, c.n_heads, L.ffn_dim);
    const LayerConfig& S = c.layers[size_t(L.kv_source)];
    MB_CHECK(L.head_dim == S.head_dim && L.n_kv_heads == S.n_kv_heads,
             "{}: KV-shared layer {} does not match the geometry of its source layer {}", path, i, L.kv_source);
  }
}

// Linear RoPE scaling as llama.cpp reads it (rope.scaling.factor, else the older rope.scale_linear).
float linear_rope_factor(const Meta& m) {
  const std::string type = m.get_string(m.key("rope.scaling.type"), "linear");
  const double factor = m.find("rope.scaling.factor") ? m.get_float("rope.scaling.factor", 0)
                                                       : m.get_float("rope.scale_linear", 0);
  if (factor == 0 || factor == 1) return 1.f;
  MB_CHECK(type == "linear" || type == "none", "{}: rope scaling type '{}' is not supported (supported: linear)",
           m.f.path(), type);
  MB_CHECK(factor > 0, "{}: rope scaling factor {} must be positive", m.f.path(), factor);
  return float(factor);
}

void common_dims(const Meta& m, ModelConfig& c) {
  c.hidden_size = positive_int(m, "embedding_length", m.get_int("embedding_length"));
  c.n_layers = positive_int(m, "block_count", m.get_int("block_count"));
  // Per-layer vectors are sized by this before any tensor is looked at.
  MB_CHECK(c.n_layers <= 4096, "{}: block_count {} is implausible (at most 4096 layers)", m.f.path(), c.n_layers);
  const std::vector<int64_t> heads = m.per_layer("attention.head_count", c.n_layers);
  MB_CHECK(std::all_of(heads.begin(), heads.end(), [&](int64_t h) { return h == heads[0]; }),
           "{}: per-layer query head counts are not supported", m.f.path());
  c.n_heads = positive_int(m, "attention.head_count", heads[0]);
  c.max_position = positive_int(m, "context_length", m.get_int("context_length", 131072));
  c.rms_eps = float(m.get_float("attention.layer_norm_rms_epsilon", 1e-6));
  c.final_logit_softcap = float(m.get_float("final_logit_softcapping", 0));
  c.attn_logit_softcap = float(m.get_float("attn_logit_softcapping", 0));
  c.vocab_size = tensor_rows(m.f, "token_embd.weight");
  c.tie_embeddings = m.f.find_tensor("output.weight") == nullptr;
  c.checkpoint_dtype = file_dtype(m.f);
  c.tensor_prefix = "model.";
}

void parse_gemma3(const Meta& m, ModelConfig& c) {
  c.family = "gemma3";
  c.model_type = "gemma3_text";
  common_dims(m, c);
  const int n = c.n_layers;
  const int64_t default_hd = c.hidden_size / c.n_heads;
  const int head_dim = positive_int(m, "attention.key_length", m.get_int("attention.key_length", default_hd));
  MB_CHECK(m.get_int("attention.value_length", head_dim) == head_dim,
           "{}: attention.value_length differs from attention.key_length", m.f.path());
  MB_CHECK(m.get_int("rope.dimension_count", head_dim) == head_dim,
           "{}: partial rotary embeddings are not supported for gemma3", m.f.path());
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
  MB_CHECK(window >= 0 && window <= (int64_t(1) << 30), "{}: invalid sliding window {}", m.f.path(), window);
  c.sliding_window = window > 0 ? int(window) : c.max_position;
  const RopeConfig full{float(m.get_float("rope.freq_base", 10000.0)), 1.f, linear_rope_factor(m)};
  const RopeConfig sliding{float(m.get_float("rope.freq_base_swa", 10000.0)), 1.f, 1.f};
  c.layers.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = window > 0 && i % 6 < 5 ? AttnKind::Sliding : AttnKind::Full;
    L.head_dim = head_dim;
    L.n_kv_heads = positive_int(m, "attention.head_count_kv", n_kv[size_t(i)]);
    L.ffn_dim = positive_int(m, "feed_forward_length", ffn[size_t(i)]);
    L.has_v_proj = true;
    L.kv_source = i;
    L.rope = L.kind == AttnKind::Full ? full : sliding;
  }
  resolve_special_tokens(m.f, "<end_of_turn>", c);
}

// Fraction of rotated slots of the full layers: llama.cpp emulates HF's "proportional" RoPE with
// rope_freqs = [1] * rotated/2 + [1e30] * rest (a frequency divided by 1e30 is ~0).
float partial_rotary_from_freqs(const GgufFile& f, int head_dim) {
  const GgufTensorInfo* t = f.find_tensor("rope_freqs.weight");
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

void parse_gemma4(const Meta& m, ModelConfig& c) {
  c.family = "gemma4";
  c.model_type = "gemma4_text";
  common_dims(m, c);
  const int n = c.n_layers;
  const GgufFile& f = m.f;
  const int hd_full = positive_int(m, "attention.key_length", m.get_int("attention.key_length"));
  const int hd_swa = positive_int(m, "attention.key_length_swa", m.get_int("attention.key_length_swa", hd_full));
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
  if (c.ple_dim > 0) c.ple_vocab = tensor_rows(f, "per_layer_token_embd.weight");
  const int64_t n_experts = m.get_int("expert_count", 0);
  if (n_experts > 0) {
    c.moe = true;
    c.n_experts = positive_int(m, "expert_count", n_experts);
    c.top_k_experts = positive_int(m, "expert_used_count", m.get_int("expert_used_count"));
    c.moe_ffn_dim = positive_int(m, "expert_feed_forward_length", m.get_int("expert_feed_forward_length"));
    MB_CHECK(c.top_k_experts <= c.n_experts, "{}: expert_used_count exceeds expert_count", f.path());
  }

  // true = sliding, one bool per layer (or one bool for all).
  std::vector<bool> swa(static_cast<size_t>(n));
  const GgufValue& pat = f.get(m.key("attention.sliding_window_pattern"));
  m.checked(m.key("attention.sliding_window_pattern"), [&] {
    if (!pat.is_array()) {
      std::fill(swa.begin(), swa.end(), pat.as_bool());
      return 0;
    }
    MB_CHECK(int(pat.size()) == n, "has {} entries for {} layers", pat.size(), n);
    for (int i = 0; i < n; ++i) swa[size_t(i)] = pat.bool_at(size_t(i));
    return 0;
  });

  const RopeConfig rope_swa{float(m.get_float("rope.freq_base_swa", 10000.0)), 1.f, 1.f};
  const RopeConfig rope_full{float(m.get_float("rope.freq_base", 10000.0)), partial_rotary_from_freqs(f, hd_full), 1.f};
  const int first_shared = n - c.n_kv_shared_layers;
  // attention_k_eq_v leaves full layers without a V projection; HF applies it to every full layer.
  bool k_eq_v = false;
  for (int i = 0; i < first_shared; ++i)
    if (!swa[size_t(i)] && !f.find_tensor("blk." + std::to_string(i) + ".attn_v.weight")) k_eq_v = true;
  c.layers.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    LayerConfig& L = c.layers[size_t(i)];
    L.kind = swa[size_t(i)] ? AttnKind::Sliding : AttnKind::Full;
    L.head_dim = L.kind == AttnKind::Full ? hd_full : hd_swa;
    L.n_kv_heads = positive_int(m, "attention.head_count_kv", n_kv[size_t(i)]);
    L.ffn_dim = positive_int(m, "feed_forward_length", ffn[size_t(i)]);  // already doubled for double-wide
    L.has_v_proj = !(k_eq_v && L.kind == AttnKind::Full);
    L.rope = L.kind == AttnKind::Full ? rope_full : rope_swa;
    L.kv_source = i;
    if (i >= first_shared) {
      // As transformers: the last non-shared layer of the same attention type.
      L.kv_source = -1;
      for (int s = first_shared - 1; s >= 0; --s)
        if (swa[size_t(s)] == swa[size_t(i)]) {
          L.kv_source = s;
          break;
        }
      MB_CHECK(L.kv_source >= 0, "{}: KV-shared layer {} has no earlier layer of the same type", f.path(), i);
    }
  }
  resolve_special_tokens(f, "<turn|>", c);
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& f) {
  const GgufValue& a = f.get("general.architecture");
  MB_CHECK(a.type == GgufType::STRING, "{}: general.architecture should be a string, found {}", f.path(),
           a.describe());
  Meta m{f, a.str};
  ModelConfig c;
  c.architecture = a.str + " (GGUF)";
  if (a.str == "gemma3") parse_gemma3(m, c);
  else if (a.str == "gemma4") parse_gemma4(m, c);
  else fail("{}: unsupported GGUF architecture '{}' (supported: gemma3, gemma4)", f.path(), a.str);
  check_layers(f.path(), c);
  return c;
}

namespace {

// GGUF <-> HF tensor names (gguf-py tensor_mapping / constants for gemma3 and gemma4).
const std::vector<std::pair<std::string, std::string>>& global_names() {
  static const std::vector<std::pair<std::string, std::string>> v = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"},
      {"per_layer_model_proj.weight", "model.per_layer_model_projection.weight"},
      {"per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight"},
  };
  return v;
}

const std::vector<std::pair<std::string, std::string>>& layer_names() {
  static const std::vector<std::pair<std::string, std::string>> v = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q_norm.weight", "self_attn.q_norm.weight"},
      {"attn_k_norm.weight", "self_attn.k_norm.weight"},
      {"post_attention_norm.weight", "post_attention_layernorm.weight"},
      {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
      {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
      {"pre_ffw_norm_2.weight", "pre_feedforward_layernorm_2.weight"},
      {"post_ffw_norm_1.weight", "post_feedforward_layernorm_1.weight"},
      {"post_ffw_norm_2.weight", "post_feedforward_layernorm_2.weight"},
      {"ffn_gate_inp.weight", "router.proj.weight"},
      {"ffn_gate_inp.scale", "router.scale"},
      {"ffn_down_exps.scale", "router.per_expert_scale"},
      {"ffn_gate_up_exps.weight", "experts.gate_up_proj"},
      {"ffn_down_exps.weight", "experts.down_proj"},
      {"inp_gate.weight", "per_layer_input_gate.weight"},
      {"proj.weight", "per_layer_projection.weight"},
      {"post_norm.weight", "post_per_layer_input_norm.weight"},
      {"layer_output_scale.weight", "layer_scalar"},
  };
  return v;
}

// "<prefix><digits>.<rest>" -> (digits, rest)
bool split_layer(const std::string& s, const std::string& prefix, std::string& index, std::string& rest) {
  if (s.rfind(prefix, 0) != 0) return false;
  const size_t dot = s.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return false;
  index = s.substr(prefix.size(), dot - prefix.size());
  if (!std::all_of(index.begin(), index.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) return false;
  rest = s.substr(dot + 1);
  return true;
}

}  // namespace

std::string gguf_to_hf_name(const std::string& g) {
  if (g == "rope_freqs.weight") return "";
  for (auto& [gg, hf] : global_names())
    if (g == gg) return hf;
  std::string index, rest;
  if (split_layer(g, "blk.", index, rest))
    for (auto& [gg, hf] : layer_names())
      if (rest == gg) return "model.layers." + index + "." + hf;
  return g;
}

std::string hf_to_gguf_name(const std::string& h) {
  for (auto& [gg, hf] : global_names())
    if (h == hf) return gg;
  std::string index, rest;
  if (split_layer(h, "model.layers.", index, rest))
    for (auto& [gg, hf] : layer_names())
      if (rest == hf) return "blk." + index + "." + gg;
  return "";
}

std::shared_ptr<GgufFile> load_gguf_model(const std::string& path, ModelConfig& config, TensorRegistry& reg) {
  auto f = GgufFile::open(path);
  config = gguf_model_config(*f);
  f->register_tensors(reg, gguf_to_hf_name);
  return f;
}

}  // namespace mb
