#include "runtime/text.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace mb {

namespace fs = std::filesystem;

TextCodec::TextCodec(Tokenizer tokenizer, std::optional<ChatTemplate> chat_template, std::string family)
    : tokenizer_(std::move(tokenizer)), chat_template_(std::move(chat_template)), family_(std::move(family)) {}

TextCodec TextCodec::load(const std::string& model_path) {
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
    const std::string family = tok.find_token("<|turn>") >= 0 ? "gemma4" : "gemma3";
    TextCodec codec(std::move(tok), std::move(tmpl), family);
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
  fail("{}: reading the tokenizer from this file type is not supported", model_path);
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

std::vector<int32_t> TextCodec::encode_user_prompt(const std::string& text, bool enable_thinking) const {
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}});
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
  if (family_ == "gemma4")
    for (auto s : kGemma4StopTokens) add(s);
  else
    for (auto s : kGemma3StopTokens) add(s);
  if (tokenizer_.eos_id() >= 0) ids.push_back(tokenizer_.eos_id());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace mb
