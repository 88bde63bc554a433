#include "runtime/text.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "formats/gguf.h"
#include "models/architecture.h"
#include "models/checkpoint.h"

namespace mb {

namespace fs = std::filesystem;

TextCodec::TextCodec(Tokenizer tokenizer, std::optional<ChatTemplate> chat_template, const Architecture& arch)
    : tokenizer_(std::move(tokenizer)), chat_template_(std::move(chat_template)), arch_(&arch) {}

TextCodec TextCodec::load(const std::string& model_path) { return load(model_path, model_architecture(model_path)); }

TextCodec TextCodec::load(const std::string& model_path, const Architecture& arch) {
  fs::path p(model_path);
  MB_CHECK(fs::exists(p), "model path {} does not exist", model_path);
  if (fs::is_directory(p)) {
    MB_CHECK(fs::exists(p / "tokenizer.json"), "{}: no tokenizer.json in the checkpoint folder", model_path);
    Tokenizer tok = Tokenizer::from_hf_json_file((p / "tokenizer.json").string());
    std::optional<ChatTemplate> tmpl;
    try {
      tmpl = ChatTemplate::from_checkpoint_dir(model_path);
    } catch (const Error&) {
      // No template: plain text still works; --chat reports the absence when asked for.
    }
    TextCodec codec(std::move(tok), std::move(tmpl), arch);
    if (codec.tokenizer_.bos_id() >= 0) codec.bos_token_ = codec.tokenizer_.token_text(codec.tokenizer_.bos_id());
    if (codec.tokenizer_.eos_id() >= 0) codec.eos_token_ = codec.tokenizer_.token_text(codec.tokenizer_.eos_id());
    if (fs::exists(p / "tokenizer_config.json")) {
      // transformers hands the template these strings; they may be plain or {"content": ...}.
      std::ifstream in(p / "tokenizer_config.json");
      nlohmann::json cfg = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      auto token = [&](const char* key, std::string& out) {
        if (!cfg.is_object() || !cfg.contains(key)) return;
        const auto& v = cfg[key];
        if (v.is_string()) out = v.get<std::string>();
        else if (v.is_object() && v.contains("content") && v["content"].is_string()) out = v["content"].get<std::string>();
      };
      token("bos_token", codec.bos_token_);
      token("eos_token", codec.eos_token_);
    }
    return codec;
  }
  MB_CHECK(is_gguf_file(model_path), "{}: expected a checkpoint folder or a GGUF file", model_path);
  return from_gguf(*GgufFile::open(model_path), arch);
}

TextCodec TextCodec::from_gguf(const GgufFile& g, const Architecture& arch) {
  MB_CHECK(g.find("tokenizer.ggml.tokens") != nullptr, "{}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)",
           g.path());
  std::vector<std::string> tokens = g.get("tokenizer.ggml.tokens").strings();
  std::vector<std::string> merges;
  if (const GgufValue* m = g.find("tokenizer.ggml.merges")) merges = m->strings();
  std::vector<int32_t> types;
  if (const GgufValue* t = g.find("tokenizer.ggml.token_type"))
    for (int64_t v : t->ints()) types.push_back(int32_t(v));
  VocabOptions o;
  if (const GgufValue* sc = g.find("tokenizer.ggml.scores"))
    for (double v : sc->floats()) o.scores.push_back(float(v));
  auto id = [&](const char* key, int32_t& out) {
    if (const GgufValue* v = g.find(key); v && v->is_int()) out = int32_t(v->as_int());
  };
  id("tokenizer.ggml.bos_token_id", o.bos_id);
  id("tokenizer.ggml.eos_token_id", o.eos_id);
  id("tokenizer.ggml.padding_token_id", o.pad_id);
  id("tokenizer.ggml.unknown_token_id", o.unk_id);
  Tokenizer tok = Tokenizer::from_vocab(std::move(tokens), std::move(merges), std::move(types), o);
  std::optional<ChatTemplate> tmpl;
  if (const GgufValue* t = g.find("tokenizer.chat_template"); t && t->type == GgufType::STRING)
    tmpl.emplace(t->as_string());
  else  // base-model GGUFs carry no template; use the architecture's instruction-tuned one
    tmpl.emplace(std::string(arch.builtin_chat_template()));
  TextCodec codec(std::move(tok), std::move(tmpl), arch);
  if (codec.tokenizer_.bos_id() >= 0) codec.bos_token_ = codec.tokenizer_.token_text(codec.tokenizer_.bos_id());
  if (codec.tokenizer_.eos_id() >= 0) codec.eos_token_ = codec.tokenizer_.token_text(codec.tokenizer_.eos_id());
  return codec;
}

std::vector<int32_t> TextCodec::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids = tokenizer_.encode(text);
  const int32_t bos = tokenizer_.bos_id();
  if (add_bos && bos >= 0 && (ids.empty() || ids.front() != bos)) ids.insert(ids.begin(), bos);
  return ids;
}

std::string TextCodec::render_chat(const ChatTemplateInputs& in) const {
  MB_CHECK(chat_template_.has_value(), "this model has no chat template (chat_template.jinja or tokenizer_config.json)");
  ChatTemplateInputs with_tokens = in;
  with_tokens.bos_token = bos_token_;
  with_tokens.eos_token = eos_token_;
  return chat_template_->render(with_tokens);
}

std::vector<int32_t> TextCodec::encode_chat(const ChatTemplateInputs& in) const {
  // Gemma templates write bos_token themselves; transformers tokenizes the rendering without
  // adding special tokens. Add one only for a template that does not.
  return encode(render_chat(in), /*add_bos=*/true);
}

std::vector<int32_t> TextCodec::encode_user_prompt(const std::string& text, bool enable_thinking,
                                                   const std::string& system,
                                                   const std::vector<std::string>& media) const {
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::array();
  if (!system.empty()) in.messages.push_back({{"role", "system"}, {"content", system}});
  if (media.empty()) {
    in.messages.push_back({{"role", "user"}, {"content", text}});
  } else {
    nlohmann::ordered_json parts = nlohmann::ordered_json::array();
    for (const std::string& m : media) parts.push_back({{"type", m}});
    parts.push_back({{"type", "text"}, {"text", text}});
    in.messages.push_back({{"role", "user"}, {"content", parts}});
  }
  in.add_generation_prompt = true;
  in.enable_thinking = enable_thinking;
  return encode_chat(in);
}

std::vector<int32_t> TextCodec::stop_ids(const std::vector<int32_t>& model_eos) const {
  std::vector<int32_t> ids = model_eos;
  auto add = [&](std::string_view piece) {
    int32_t id = tokenizer_.find_token(piece);
    if (id >= 0) ids.push_back(id);
  };
  for (std::string_view s : arch_->stop_tokens()) add(s);
  if (tokenizer_.eos_id() >= 0) ids.push_back(tokenizer_.eos_id());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace mb
