// Fuzz targets "jinja", "request" and "output": what a chat server parses from its users (a
// template file, a request body) and from its model (the generated turn). See fuzz_targets.h.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "fuzz_targets.h"
#include "runtime/text.h"
#include "server/openai.h"
#include "tokenizer/chat.h"
#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer.h"

namespace mbfuzz {
namespace {

using Json = nlohmann::ordered_json;

const std::string kSource = MARKBASE_SOURCE_DIR;
const std::string kTemplates = kSource + "/tests/fixtures/chat/templates/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Json read_json(const std::string& path) {
  std::string text = read_file(path);
  return text.empty() ? Json::object() : Json::parse(text);
}

// A conversation with every part the chat templates read: system prompt, text and image parts,
// thinking, a tool call with nested arguments, a tool response, tools; plus plain values.
const Json& variables() {
  static const Json v = Json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": [{"type": "text", "text": "Hi \u00fc \ud83d\ude42"}, {"type": "image"}]},
      {"role": "assistant", "content": "", "reasoning_content": "Think.",
       "tool_calls": [{"type": "function", "function": {"name": "f",
                       "arguments": {"a": 1, "b": [1.5, null, true], "c": {"d": "x"}}}}]},
      {"role": "tool", "name": "f", "content": "{\"ok\": true}"},
      {"role": "user", "content": "Bye"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "Does f.",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer", "enum": [1, 2]}},
                              "required": ["a"]}}}],
    "add_generation_prompt": true, "enable_thinking": true, "bos_token": "<bos>", "eos_token": "<eos>",
    "s": "  Hello World  ", "n": 3, "x": 2.5, "l": [3, 1, 2], "d": {"b": 2, "A": 1}, "none": null})");
  return v;
}

// Limits that keep a runaway template to about a second under the sanitizers, so the fuzzer spends
// its time on inputs rather than on one loop (the default limits are tested in test_jinja.cpp).
void fuzz_limits() {
  static const bool once = (mb::jinja::set_render_limits({int64_t(1) << 22, int64_t(1) << 26}), true);
  (void)once;
}

}  // namespace

void fuzz_jinja(const uint8_t* data, size_t size) {
  fuzz_limits();
  const std::string source(reinterpret_cast<const char*>(data), size);
  try {
    (void)mb::jinja::Template(source).render(variables());
  } catch (const mb::Error&) {
  }
}

void write_jinja_seeds(const std::string& dir) {
  for (const char* name : {"gemma-4-31B-it.jinja", "gemma-4-31B-it-interleaved.jinja", "gemma-3-it.jinja"})
    write_file(dir + "/" + name, read_file(kTemplates + name));
  const Json cases = read_json(kSource + "/tests/fixtures/jinja/cases.json");
  int i = 0;
  for (const Json& c : cases.value("cases", Json::array()))
    write_file(dir + "/case_" + std::to_string(i++), c["source"].get<std::string>());
}

// What `markbase tokenize --messages` does with its JSON file (src/cli/commands.cpp), with the
// request's own fields in place of the flags.
mb::ChatTemplateInputs request_inputs(const Json& req) {
  mb::ChatTemplateInputs in;
  Json messages = req.is_object() && req.contains("messages") ? req["messages"] : req;
  MB_CHECK(messages.is_array(), "request: expected a JSON list of messages");
  in.messages = messages;
  if (!req.is_object()) return in;
  auto flag = [&](const char* key, bool& out) {
    if (!req.contains(key)) return;
    MB_CHECK(req[key].is_boolean(), "request: '{}' must be true or false", key);
    out = req[key].get<bool>();
  };
  flag("add_generation_prompt", in.add_generation_prompt);
  flag("enable_thinking", in.enable_thinking);
  if (req.contains("tools") && !req["tools"].is_null()) {
    MB_CHECK(req["tools"].is_array(), "request: expected a JSON list of tools");
    in.tools = req["tools"];
  }
  if (req.contains("chat_template_kwargs")) {
    MB_CHECK(req["chat_template_kwargs"].is_object(), "request: chat_template_kwargs must be an object");
    in.extra = req["chat_template_kwargs"];
  }
  return in;
}

void fuzz_request(const uint8_t* data, size_t size) {
  static const mb::ChatTemplate tmpl = mb::ChatTemplate::from_file(kTemplates + "gemma-4-31B-it.jinja");
  static const mb::Tokenizer tok =
      mb::Tokenizer::from_hf_json_file(kSource + "/tests/fixtures/e2b_like/tokenizer.json");
  fuzz_limits();
  Json req;
  try {
    req = Json::parse(data, data + size);
  } catch (const Json::exception&) {  // what the CLI turns into "invalid JSON" (a number like 1e400 too)
    return;
  }
  try {
    (void)tok.encode(tmpl.render(request_inputs(req)));
  } catch (const mb::Error&) {
  }
  // The same bytes as the server's endpoints read them: a 4xx (ApiError) is the answer to bad input.
  static const mb::TextCodec codec = mb::TextCodec::load(kSource + "/tests/fixtures/e2b_like");
  static const mb::server::ModelInfo model =
      mb::server::describe_model(&codec, "fixture", 512, int32_t(codec.tokenizer().vocab_size()), 0);
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  mb::server::Json json;
  try {
    json = mb::server::parse_body(body);
  } catch (const mb::server::ApiError&) {
    return;
  }
  for (auto* parse : {&mb::server::parse_chat_request, &mb::server::parse_completion_request})
    try {
      (void)parse(json, model);
    } catch (const mb::server::ApiError&) {
    } catch (const mb::Error&) {
    }
  for (auto* call : {&mb::server::tokenize, &mb::server::detokenize})
    try {
      (void)call(json, model);
    } catch (const mb::server::ApiError&) {
    } catch (const mb::Error&) {
    }
}

void write_request_seeds(const std::string& dir) {
  const Json cases = read_json(kSource + "/tests/fixtures/chat/render_cases.json");
  int i = 0;
  for (const Json& c : cases.value("cases", Json::array())) {
    Json req = {{"model", "fixture"}, {"messages", c["messages"]}, {"tools", c["tools"]},
                {"add_generation_prompt", c["add_generation_prompt"]}, {"enable_thinking", c["enable_thinking"]}};
    write_file(dir + "/request_" + std::to_string(i++) + ".json", req.dump());
  }
}

void fuzz_output(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const mb::ParsedOutput p = mb::parse_gemma4_output(text);
    for (const mb::ToolCall& c : p.tool_calls)
      if (c.name.empty() || !c.arguments.is_object()) std::abort();  // the parser promises both
  } catch (const mb::Error&) {
  }
  try {
    (void)mb::parse_gemma4_value(text);
  } catch (const mb::Error&) {
  }
}

void write_output_seeds(const std::string& dir) {
  const Json cases = read_json(kSource + "/tests/fixtures/chat/parse_cases.json");
  int i = 0;
  for (const Json& c : cases.value("cases", Json::array()))
    write_file(dir + "/output_" + std::to_string(i++), c["text"].get<std::string>());
}

}  // namespace mbfuzz
