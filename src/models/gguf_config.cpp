#include "models/gguf_config.h"

#include <algorithm>
#include <map>

#include "models/architecture.h"

namespace mb {

namespace {

template <class Fn>
auto checked(const GgufFile& f, const std::string& full_key, Fn fn) {
  try {
    return fn();
  } catch (const Error& e) {
    fail("{}: metadata key '{}': {}", f.path(), full_key, e.what());
  }
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

int token_id(const GgufFile& f, const char* key, int fallback) {
  const GgufValue* v = f.find(key);
  if (!v) return fallback;
  return checked(f, key, [&] { return int(v->as_int()); });
}

}  // namespace

int64_t GgufMeta::get_int(const std::string& k) const {
  const GgufValue& v = f.get(key(k));
  return checked(f, key(k), [&] { return v.as_int(); });
}

double GgufMeta::get_float(const std::string& k, double fallback) const {
  const GgufValue* v = find(k);
  return v ? checked(f, key(k), [&] { return v->as_float(); }) : fallback;
}

std::string GgufMeta::get_string(const std::string& k, const std::string& fallback) const {
  const GgufValue* v = find(k);
  return v ? checked(f, key(k), [&] { return v->as_string(); }) : fallback;
}

std::vector<int64_t> GgufMeta::per_layer(const std::string& k, int n, const int64_t* fallback) const {
  const GgufValue* v = find(k);
  if (!v) {
    if (fallback) return std::vector<int64_t>(size_t(n), *fallback);
    fail("{}: missing metadata key '{}'", f.path(), key(k));
  }
  if (!v->is_array()) return std::vector<int64_t>(size_t(n), get_int(k));
  std::vector<int64_t> out = checked(f, key(k), [&] { return v->ints(); });
  MB_CHECK(int(out.size()) == n, "{}: metadata key '{}' has {} entries for {} layers", f.path(), key(k), out.size(), n);
  return out;
}

std::vector<bool> GgufMeta::per_layer_bool(const std::string& k, int n) const {
  const GgufValue& v = f.get(key(k));
  return checked(f, key(k), [&] {
    if (!v.is_array()) return std::vector<bool>(size_t(n), v.as_bool());
    MB_CHECK(int(v.size()) == n, "has {} entries for {} layers", v.size(), n);
    std::vector<bool> out(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) out[size_t(i)] = v.bool_at(size_t(i));
    return out;
  });
}

int GgufMeta::positive_int(const std::string& k, int64_t v) const {
  MB_CHECK(v > 0 && v <= (int64_t(1) << 30), "{}: metadata key '{}' = {} is out of range", f.path(), key(k), v);
  return int(v);
}

int gguf_matrix_rows(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.find_tensor(name);
  MB_CHECK(t != nullptr, "{}: missing tensor '{}'", f.path(), name);
  MB_CHECK(t->ne.size() == 2 && t->ne[1] > 0 && t->ne[1] <= (uint64_t(1) << 30),
           "{}: tensor '{}' should be a matrix, found {} dimensions", f.path(), name, t->ne.size());
  return int(t->ne[1]);
}

void read_gguf_decoder_dims(const GgufMeta& m, ModelConfig& c) {
  c.hidden_size = m.positive_int("embedding_length", m.get_int("embedding_length"));
  c.n_layers = m.positive_int("block_count", m.get_int("block_count"));
  // Per-layer vectors are sized by this before any tensor is looked at.
  MB_CHECK(c.n_layers <= 4096, "{}: block_count {} is implausible (at most 4096 layers)", m.f.path(), c.n_layers);
  const std::vector<int64_t> heads = m.per_layer("attention.head_count", c.n_layers);
  MB_CHECK(std::all_of(heads.begin(), heads.end(), [&](int64_t h) { return h == heads[0]; }),
           "{}: per-layer query head counts are not supported", m.f.path());
  c.n_heads = m.positive_int("attention.head_count", heads[0]);
  c.max_position = m.positive_int("context_length", m.get_int("context_length", 131072));
  c.rms_eps = float(m.get_float("attention.layer_norm_rms_epsilon", 1e-6));
  c.final_logit_softcap = float(m.get_float("final_logit_softcapping", 0));
  c.attn_logit_softcap = float(m.get_float("attn_logit_softcapping", 0));
  c.vocab_size = gguf_matrix_rows(m.f, "token_embd.weight");
  c.tie_embeddings = m.f.find_tensor("output.weight") == nullptr;
  c.checkpoint_dtype = file_dtype(m.f);
  c.tensor_prefix = "model.";
}

void read_gguf_special_tokens(const GgufFile& f, std::string_view end_of_turn, ModelConfig& c) {
  c.bos_id = token_id(f, "tokenizer.ggml.bos_token_id", 2);
  c.pad_id = token_id(f, "tokenizer.ggml.padding_token_id", 0);
  const int eos = token_id(f, "tokenizer.ggml.eos_token_id", 1);
  c.eos_ids = {eos};
  const int eot = token_id(f, "tokenizer.ggml.eot_token_id", -1);
  if (eot >= 0) c.eos_ids.push_back(eot);
  if (const GgufValue* toks = f.find("tokenizer.ggml.tokens");
      toks && toks->is_array() && toks->elem == GgufType::STRING) {
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

GgufValue gguf_u32(int64_t v) { return GgufValue::make_uint(GgufType::U32, uint64_t(v)); }
GgufValue gguf_f32(double v) { return GgufValue::make_float(GgufType::F32, v); }

const LayerConfig* first_layer_of_kind(const ModelConfig& c, AttnKind kind) {
  for (auto& L : c.layers)
    if (L.kind == kind) return &L;
  return nullptr;
}

namespace {

GgufValue per_layer_value(const ModelConfig& c, int LayerConfig::*field) {
  std::vector<int64_t> v;
  for (auto& L : c.layers) v.push_back(L.*field);
  if (std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v[0]; })) return gguf_u32(v[0]);
  return GgufValue::make_int_array(GgufType::I32, v);
}

}  // namespace

void write_gguf_decoder_dims(const ModelConfig& c, std::string_view arch, GgufWriter& w) {
  const std::string a(arch);
  w.set("general.architecture", GgufValue::make_string(a));
  w.set(a + ".context_length", gguf_u32(c.max_position));
  w.set(a + ".embedding_length", gguf_u32(c.hidden_size));
  w.set(a + ".block_count", gguf_u32(c.n_layers));
  w.set(a + ".feed_forward_length", per_layer_value(c, &LayerConfig::ffn_dim));
  w.set(a + ".attention.head_count", gguf_u32(c.n_heads));
  w.set(a + ".attention.head_count_kv", per_layer_value(c, &LayerConfig::n_kv_heads));
  w.set(a + ".attention.layer_norm_rms_epsilon", gguf_f32(c.rms_eps));
  if (c.final_logit_softcap > 0) w.set(a + ".final_logit_softcapping", gguf_f32(c.final_logit_softcap));
  w.set(a + ".attention.sliding_window", gguf_u32(c.sliding_window));
}

void write_gguf_special_tokens(const ModelConfig& c, GgufWriter& w) {
  w.set("tokenizer.ggml.bos_token_id", gguf_u32(c.bos_id));
  w.set("tokenizer.ggml.eos_token_id", gguf_u32(c.eos_id));
  w.set("tokenizer.ggml.padding_token_id", gguf_u32(c.pad_id));
}

ModelConfig gguf_model_config(const GgufFile& f) {
  const Architecture& arch = architecture_for_gguf(f);
  ModelConfig c = arch.parse_gguf(f);
  c.family = std::string(arch.name());
  c.architecture = std::string(arch.gguf_architecture()) + " (GGUF)";
  check_layer_geometry(c, f.path());
  return c;
}

std::shared_ptr<GgufFile> load_gguf_model(const std::string& path, ModelConfig& config, TensorRegistry& reg) {
  auto f = GgufFile::open(path);
  config = gguf_model_config(*f);
  const Architecture& arch = architecture_named(config.family);
  f->register_tensors(reg, [&](const std::string& name) { return arch.gguf_to_hf_name(name); });
  return f;
}

}  // namespace mb
