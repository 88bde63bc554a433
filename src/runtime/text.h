// Text in and out of a model: its tokenizer, chat template and stop tokens, loaded from the same
// path as the weights (tokenizer.json + chat template beside a checkpoint, or GGUF metadata).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace mb {

class Architecture;
class GgufFile;

class TextCodec {
 public:
  // Throws mb::Error when the model carries no tokenizer. `arch` gives the stop tokens and the
  // chat template of files that carry none.
  static TextCodec load(const std::string& model_path, const Architecture& arch);
  // The same, finding the architecture from the model's config.
  static TextCodec load(const std::string& model_path);
  static TextCodec from_gguf(const GgufFile& gguf, const Architecture& arch);
  TextCodec(Tokenizer tokenizer, std::optional<ChatTemplate> chat_template, const Architecture& arch);

  const Tokenizer& tokenizer() const { return tokenizer_; }
  bool has_chat_template() const { return chat_template_.has_value(); }
  void set_chat_template(ChatTemplate t) { chat_template_.emplace(std::move(t)); }

  // Plain text; BOS first when add_bos (and the text does not already start with it).
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  // The chat template's rendering, tokenized with exactly one BOS at the front.
  std::string render_chat(const ChatTemplateInputs& in) const;
  std::vector<int32_t> encode_chat(const ChatTemplateInputs& in) const;
  // A single user turn, as `generate -p TEXT --chat` sends it, after a system turn when `system`
  // is not empty.
  // `media` ("image", "audio") are parts of the turn before the text, as the template prints them.
  std::vector<int32_t> encode_user_prompt(const std::string& text, bool enable_thinking = false,
                                          const std::string& system = "",
                                          const std::vector<std::string>& media = {}) const;

  // Ids that end a reply: the model's end-of-sequence ids plus the template's end-of-turn tokens.
  std::vector<int32_t> stop_ids(const std::vector<int32_t>& model_eos) const;

 private:
  Tokenizer tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  const Architecture* arch_;
  std::string bos_token_ = "<bos>", eos_token_ = "<eos>";  // what templates print as bos_token/eos_token
};

}  // namespace mb
