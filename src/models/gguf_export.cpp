#include "models/gguf_export.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/printable.h"
#include "core/quant.h"
#include "formats/gguf.h"
#include "models/architecture.h"
#include "models/gguf_config.h"

namespace mb {

namespace {

namespace fs = std::filesystem;

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// llama.cpp's use_more_bits: the first and last eighth of the layers and every third in between.
bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

int layer_of(const std::string& gguf_name) {
  if (gguf_name.rfind("blk.", 0) != 0) return -1;
  return std::atoi(gguf_name.c_str() + 4);
}

// The ids transformers lists as all_special_ids: tokenizer_config.json's bos/eos/unk/pad/mask
// tokens (GemmaTokenizer's defaults, <bos> ... <mask>, where the file names none) and its additional
// (v4) or extra (v5) special tokens, each a string or {"content": ...}. Empty when the folder has
// no tokenizer_config.json.
std::set<int64_t> config_special_ids(const fs::path& dir, const nlohmann::json& vocab) {
  std::set<int64_t> ids;
  std::ifstream in(dir / "tokenizer_config.json");
  if (!in.good()) return ids;
  const nlohmann::json cfg = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!cfg.is_object()) return ids;
  auto add = [&](const nlohmann::json& t) {
    const nlohmann::json& text = t.is_object() ? t.value("content", nlohmann::json()) : t;
    if (!text.is_string()) return;
    if (auto it = vocab.find(text.get<std::string>()); it != vocab.end() && it->is_number_integer())
      ids.insert(it->get<int64_t>());
  };
  const std::string cls = cfg.value("tokenizer_class", nlohmann::json()).is_string() ? cfg["tokenizer_class"].get<std::string>()
                                                                                     : std::string();
  const bool gemma_class = cls == "GemmaTokenizer" || cls == "GemmaTokenizerFast";
  for (auto [key, gemma_default] : {std::pair{"bos_token", "<bos>"}, {"eos_token", "<eos>"}, {"unk_token", "<unk>"},
                                    {"pad_token", "<pad>"}, {"mask_token", "<mask>"}}) {
    if (cfg.contains(key)) add(cfg[key]);
    else if (gemma_class) add(gemma_default);
  }
  for (const char* key : {"additional_special_tokens", "extra_special_tokens"})
    if (auto it = cfg.find(key); it != cfg.end() && (it->is_array() || it->is_object()))
      for (const auto& t : *it) add(t);
  return ids;
}

// tokenizer.json (BPE + merges) -> tokenizer.ggml.*: ids, "a b" merges, and token types as the
// converter llama.cpp uses for the architecture gives them (Architecture::gguf_token_typing).
// Returns the number of tokens.
size_t tokenizer_metadata(const fs::path& p, const Architecture& arch, GgufWriter& w) {
  enum : int64_t { kNormal = 1, kControl = 3, kUserDefined = 4, kByte = 6 };
  std::ifstream in(p);
  MB_CHECK(in.good(), "cannot read {}: {}", p.string(), std::strerror(errno));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
  const auto& vocab = j.at("model").at("vocab");
  std::map<int64_t, std::pair<std::string, bool>> added;  // id -> (text, special flag)
  if (auto it = j.find("added_tokens"); it != j.end())
    for (auto& t : *it) added[t.at("id").get<int64_t>()] = {t.at("content").get<std::string>(), t.value("special", false)};
  const size_t n_base = vocab.size();
  const size_t n_tokens = std::max(n_base, added.empty() ? size_t(0) : size_t(added.rbegin()->first + 1));
  std::vector<std::string> tokens(n_tokens);
  for (auto& [tok, id] : vocab.items()) {
    const int64_t i = id.get<int64_t>();
    MB_CHECK(i >= 0 && size_t(i) < n_base, "{}: vocabulary ids are not dense", p.string());
    tokens[size_t(i)] = tok;
  }
  for (auto& [id, t] : added) {
    MB_CHECK(id >= 0, "{}: negative added token id", p.string());
    if (size_t(id) >= n_base) tokens[size_t(id)] = t.first;
  }
  const Architecture::GgufTokenTyping typing = arch.gguf_token_typing();
  std::set<int64_t> special = typing.by_special_ids ? config_special_ids(p.parent_path(), vocab) : std::set<int64_t>{};
  const bool by_special_ids = typing.by_special_ids && !special.empty();
  if (!by_special_ids)  // no tokenizer_config.json to say: the added tokens' own flags
    for (auto& [id, t] : added)
      if (t.second) special.insert(id);
  std::vector<int64_t> types(n_tokens, kNormal);
  for (size_t i = 0; i < n_tokens; ++i) {
    const std::string& t = tokens[i];
    const bool is_added = added.count(int64_t(i)) > 0;
    if (t.size() == 6 && t.rfind("<0x", 0) == 0 && t.back() == '>') types[i] = kByte;
    else if (special.count(int64_t(i))) types[i] = kControl;
    else if (is_added && (!by_special_ids || i >= n_base)) types[i] = kUserDefined;
    for (std::string_view v : typing.visible)
      if (t == v) types[i] = kUserDefined;
  }
  std::vector<std::string> merges;
  if (auto it = j.at("model").find("merges"); it != j.at("model").end())
    for (auto& m : *it)
      merges.push_back(m.is_array() ? m[0].get<std::string>() + " " + m[1].get<std::string>() : m.get<std::string>());
  w.set("tokenizer.ggml.model", GgufValue::make_string(std::string(arch.gguf_tokenizer_model())));
  w.set("tokenizer.ggml.tokens", GgufValue::make_string_array(std::move(tokens)));
  w.set("tokenizer.ggml.token_type", GgufValue::make_int_array(GgufType::I32, types));
  w.set("tokenizer.ggml.merges", GgufValue::make_string_array(std::move(merges)));
  w.set("tokenizer.ggml.add_bos_token", GgufValue::make_bool(true));
  return n_tokens;
}

void chat_template_metadata(const std::string& dir, GgufWriter& w) {
  for (const char* f : {"chat_template.jinja"}) {
    if (!fs::exists(fs::path(dir) / f)) continue;
    std::ifstream t(fs::path(dir) / f);
    w.set("tokenizer.chat_template", GgufValue::make_string(std::string(std::istreambuf_iterator<char>(t), {})));
  }
}

}  // namespace

QuantType parse_quant_type(const std::string& s) {
  if (s == "f32") return QuantType::F32;
  if (s == "bf16") return QuantType::BF16;
  if (s == "q8_0") return QuantType::Q8_0;
  if (s == "q4_0") return QuantType::Q4_0;
  if (s == "q4_k_m") return QuantType::Q4_K_M;
  fail("unknown quantization type '{}' (f32, bf16, q8_0, q4_0, q4_k_m)", s);
}

DType gguf_tensor_type(QuantType q, const std::string& name, const std::vector<int64_t>& shape, int n_layers,
                       DType source) {
  const DType flt = dtype_is_quantized(source) ? DType::F32 : source;
  if (q == QuantType::Keep) return source;
  if (shape.size() < 2 || ends_with(name, "norm.weight") || name == "rope_freqs.weight" ||
      name.find("ffn_gate_inp") != std::string::npos || ends_with(name, ".scale"))
    return DType::F32;
  const int64_t cols = shape.back();
  auto fits = [&](DType t) { return cols % int64_t(dtype_block_size(t)) == 0; };
  auto or_fallback = [&](DType t) {
    if (fits(t)) return t;
    if (t == DType::Q4_K && fits(DType::Q5_0)) return DType::Q5_0;
    if (t == DType::Q6_K && fits(DType::Q8_0)) return DType::Q8_0;
    return flt;
  };
  switch (q) {
    case QuantType::Keep: return source;
    case QuantType::F32: return DType::F32;
    case QuantType::BF16: return DType::BF16;
    case QuantType::Q8_0: return or_fallback(DType::Q8_0);
    case QuantType::Q4_0: return or_fallback(DType::Q4_0);
    case QuantType::Q4_K_M: {
      if (name == "token_embd.weight" || name == "output.weight") return or_fallback(DType::Q6_K);
      const int layer = layer_of(name);
      if ((name.find("attn_v.weight") != std::string::npos || name.find("ffn_down") != std::string::npos) &&
          layer >= 0 && use_more_bits(layer, n_layers))
        return or_fallback(DType::Q6_K);
      return or_fallback(DType::Q4_K);
    }
  }
  return flt;
}

void export_gguf(const Checkpoint& ck, const std::string& out_path, QuantType q,
                 const std::function<void(const ExportProgress&)>& progress, const std::string& tokenizer_json) {
  const ModelConfig& c = ck.config;
  const Architecture& arch = ck.architecture();
  GgufWriter w;
  // (GGUF name, registry entry) of every text-decoder tensor.
  std::vector<std::pair<std::string, const TensorEntry*>> todo;
  if (ck.gguf) {
    for (auto& [k, v] : ck.gguf->metadata())
      if (k != "general.alignment" && k != "general.file_type") w.set(k, v);
    for (const GgufTensorInfo& t : ck.gguf->tensors()) {
      const std::string hf = arch.gguf_to_hf_name(t.name);
      if (hf.empty()) continue;  // derived from the config: written below
      const TensorEntry* e = ck.tensors.find(hf);
      MB_CHECK(e != nullptr, "{}: tensor '{}' (registered as '{}') is missing from the loaded model", ck.path,
               printable(t.name), printable(hf));
      todo.push_back({t.name, e});
    }
  } else {
    arch.write_gguf_metadata(c, w);
    write_gguf_special_tokens(c, w);
    if (!tokenizer_json.empty()) {
      MB_CHECK(fs::is_regular_file(tokenizer_json), "tokenizer file {} does not exist", tokenizer_json);
      // llama.cpp sizes the vocabulary by the token list and requires token_embd to match.
      const size_t n_tokens = tokenizer_metadata(tokenizer_json, arch, w);
      MB_CHECK(int64_t(n_tokens) == c.vocab_size, "{} has {} tokens but the model's vocabulary is {}", tokenizer_json,
               n_tokens, c.vocab_size);
    } else if (fs::exists(fs::path(ck.path) / "tokenizer.json")) {
      tokenizer_metadata(fs::path(ck.path) / "tokenizer.json", arch, w);
    }
    chat_template_metadata(ck.path, w);
    for (auto& [name, e] : ck.tensors.entries()) {
      // Vision/audio parts belong in llama.cpp's separate mmproj file.
      if (name.rfind(c.tensor_prefix, 0) != 0 && name != "lm_head.weight") continue;
      const std::string hf = name == "lm_head.weight" ? name : "model." + name.substr(c.tensor_prefix.size());
      const std::string g = arch.hf_to_gguf_name(hf);
      MB_CHECK(!g.empty(), "no GGUF name for tensor '{}'", name);
      todo.push_back({g, &e});
    }
  }
  arch.add_gguf_derived_tensors(c, w);
  std::map<DType, size_t> bytes_by_dtype;
  ExportProgress prog;
  prog.total = todo.size();
  for (auto& [g, e] : todo) {
    prog.tensor = g;
    if (progress) progress(prog);
    const int64_t cols = e->shape.empty() ? 1 : e->shape.back();
    const int64_t rows = cols ? int64_t(e->nbytes / dtype_row_bytes(e->dtype, cols)) : 0;
    DType out = gguf_tensor_type(q, g, e->shape, c.n_layers, e->dtype);
    bytes_by_dtype[out] += dtype_row_bytes(out, cols) * size_t(rows);
    const bool shift = !ck.gguf && arch.gguf_adds_one(g);  // the GGUF stores 1 + w
    if (out == e->dtype && !shift) {  // unchanged: written from the checkpoint's bytes, which outlive `w`
      MB_CHECK(e->nbytes == dtype_row_bytes(out, cols) * size_t(rows), "tensor '{}': {} bytes do not fit its shape",
               e->name, e->nbytes);
      w.add_tensor_view(g, out, e->shape, e->data);
      ++prog.done;
      continue;
    }
    std::vector<float> row(static_cast<size_t>(cols));
    std::vector<uint8_t> buf(dtype_row_bytes(out, cols) * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* in = e->data + size_t(r) * dtype_row_bytes(e->dtype, cols);
      if (dtype_is_quantized(e->dtype)) dequantize_row(e->dtype, in, row.data(), cols);
      else
        for (int64_t i = 0; i < cols; ++i) {
          float v;
          if (e->dtype == DType::F32) std::memcpy(&v, in + 4 * i, 4);
          else {
            uint16_t h;
            std::memcpy(&h, in + 2 * i, 2);
            v = e->dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
          }
          row[size_t(i)] = shift ? 1.f + v : v;
        }
      uint8_t* o = buf.data() + size_t(r) * dtype_row_bytes(out, cols);
      if (dtype_is_quantized(out)) quantize_row(out, row.data(), o, cols);
      else if (out == DType::F32) std::memcpy(o, row.data(), size_t(cols) * 4);
      else
        for (int64_t i = 0; i < cols; ++i) {
          uint16_t h = out == DType::BF16 ? f32_to_bf16(row[size_t(i)]) : f32_to_f16(row[size_t(i)]);
          std::memcpy(o + 2 * i, &h, 2);
        }
    }
    w.add_tensor(g, out, e->shape, buf.data());
    ++prog.done;
  }
  uint32_t file_type = q == QuantType::F32 ? 0 : q == QuantType::BF16 ? 32 : q == QuantType::Q8_0 ? 7
                       : q == QuantType::Q4_0 ? 2 : 15;
  if (q == QuantType::Keep) {
    // The source GGUF's own type, else llama.cpp's "mostly X" for the dtype holding the most bytes.
    const GgufValue* ft = ck.gguf ? ck.gguf->find("general.file_type") : nullptr;
    if (ft && ft->is_int()) {
      file_type = uint32_t(ft->as_int());
    } else {
      DType most = DType::F32;
      for (auto& [d, b] : bytes_by_dtype)
        if (b > bytes_by_dtype[most]) most = d;
      file_type = most == DType::F16 ? 1 : most == DType::BF16 ? 32 : most == DType::Q4_0 ? 2 : most == DType::Q4_1 ? 3
                : most == DType::Q8_0 ? 7 : most == DType::Q5_0 ? 8 : most == DType::Q5_1 ? 9 : most == DType::Q4_K ? 14
                : most == DType::Q5_K ? 16 : most == DType::Q6_K ? 18 : 0;
    }
  }
  w.set("general.file_type", gguf_u32(file_type));
  w.write(out_path);
  prog.tensor.clear();
  if (progress) progress(prog);
}

}  // namespace mb
