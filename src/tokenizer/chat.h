// Chat prompts and model-output parsing.
//
// ChatTemplate renders a checkpoint's own Jinja chat template exactly as transformers'
// `apply_chat_template(..., tokenize=False)` does. The Gemma 3 and Gemma 4 templates write
// `bos_token` themselves, so the rendered text already starts with "<bos>": tokenize it with
// no automatic BOS (and do not strip that one), or the model sees two.
//
// parse_gemma4_output() is the inverse of how the Gemma 4 templates render a model turn:
// it splits the thinking channel, the tool calls and the answer.
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja.h"

namespace mb {

// The arguments of one render, named as in apply_chat_template. JSON is ordered_json so that
// dict order survives into `tojson`/`.items()`; a plain nlohmann::json converts implicitly.
struct ChatTemplateInputs {
  // [{role, content}], content a string or a list of parts ({type: text, text}, {type: image},
  // {type: audio}, {type: video}); assistant messages may carry tool_calls, reasoning_content.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // OpenAI function schemas; null means "no tools" (None)
  bool add_generation_prompt = false;
  bool enable_thinking = false;  // always passed to the template, as enable_thinking=...
  std::string bos_token = "<bos>";
  std::string eos_token = "<eos>";
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // further template kwargs
};

class ChatTemplate {
 public:
  // Looks where transformers does: chat_template.jinja (plus additional_chat_templates/*.jinja),
  // else tokenizer_config.json "chat_template" (a string, or a list of {name, template}),
  // else chat_template.json (processor config).
  static ChatTemplate from_checkpoint_dir(const std::string& dir);
  static ChatTemplate from_file(const std::string& path);
  explicit ChatTemplate(std::string source);

  // Uses the "tool_use" template when tools are given and one exists, else "default".
  std::string render(const ChatTemplateInputs& in) const;

  const std::string& source() const;  // the default template's text

 private:
  struct Named {
    std::string name, source;
    jinja::Template tmpl;
  };
  ChatTemplate(std::vector<std::pair<std::string, std::string>> named, const std::string& origin);
  const Named* find(std::string_view name) const;

  std::vector<Named> templates_;
};

// The tokens that end a Gemma 4 model turn (generation_config.eos_token_id of the IT checkpoints):
// generation stops at them (models/gemma4) and parse_gemma4_output ends the turn at them.
inline constexpr std::array<std::string_view, 3> kGemma4StopTokens = {"<turn|>", "<eos>", "<|tool_response>"};

struct ToolCall {
  std::string name;
  nlohmann::ordered_json arguments;  // always an object
};

struct ParsedOutput {
  std::string thinking;  // text of the <|channel>thought ... <channel|> block(s), trimmed
  std::string content;   // the answer: everything else up to a stop token, trimmed
  std::vector<ToolCall> tool_calls;
};

// Parses one generated Gemma 4 model turn (the text after the prompt, with or without its stop
// token). Throws mb::Error on a malformed tool call.
ParsedOutput parse_gemma4_output(std::string_view text);

// Parses "call:NAME{key:value,...}", the text between <|tool_call> and <tool_call|>.
ToolCall parse_gemma4_tool_call(std::string_view text);

// Parses a value as the Gemma 4 templates write it: {key:value,...} with bare keys,
// [a,b], <|"|>string<|"|>, numbers, true/false, None/null.
nlohmann::ordered_json parse_gemma4_value(std::string_view text);

}  // namespace mb
