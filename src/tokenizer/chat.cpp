#include "tokenizer/chat.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "core/error.h"

namespace mb {
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read {}", path.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Json read_json(const fs::path& path) {
  try {
    return Json::parse(read_file(path));
  } catch (const Json::exception& e) {
    fail("{}: invalid JSON: {}", path.string(), e.what());
  }
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source) : ChatTemplate({{"default", std::move(source)}}, "chat template") {}

ChatTemplate::ChatTemplate(std::vector<std::pair<std::string, std::string>> named, const std::string& origin) {
  for (auto& [name, source] : named) {
    try {
      jinja::Template t(source);
      templates_.push_back({name, std::move(source), std::move(t)});
    } catch (const Error& e) {
      fail("{} ({}): {}", origin, name, e.what());
    }
  }
}

ChatTemplate ChatTemplate::from_file(const std::string& path) {
  return ChatTemplate({{"default", read_file(path)}}, path);
}

ChatTemplate ChatTemplate::from_checkpoint_dir(const std::string& dir) {
  // Same precedence as transformers' tokenizer loading: template files override the config.
  fs::path d(dir);
  std::vector<std::pair<std::string, std::string>> named;
  if (fs::exists(d / "chat_template.jinja")) named.emplace_back("default", read_file(d / "chat_template.jinja"));
  if (fs::is_directory(d / "additional_chat_templates")) {
    std::vector<fs::path> extra;
    for (const auto& e : fs::directory_iterator(d / "additional_chat_templates"))
      if (e.path().extension() == ".jinja") extra.push_back(e.path());
    std::sort(extra.begin(), extra.end());
    for (const auto& p : extra) named.emplace_back(p.stem().string(), read_file(p));
  }
  if (named.empty() && fs::exists(d / "tokenizer_config.json")) {
    Json cfg = read_json(d / "tokenizer_config.json");
    auto it = cfg.find("chat_template");
    if (it != cfg.end() && it->is_string()) {
      named.emplace_back("default", it->get<std::string>());
    } else if (it != cfg.end() && it->is_array()) {
      for (const Json& t : *it) {
        if (!t.is_object() || !t.contains("name") || !t.contains("template"))
          fail("{}/tokenizer_config.json: chat_template entries must be {{name, template}}", dir);
        named.emplace_back(t["name"].get<std::string>(), t["template"].get<std::string>());
      }
    }
  }
  if (named.empty() && fs::exists(d / "chat_template.json")) {
    Json cfg = read_json(d / "chat_template.json");
    if (cfg.contains("chat_template") && cfg["chat_template"].is_string())
      named.emplace_back("default", cfg["chat_template"].get<std::string>());
  }
  if (named.empty())
    fail(
        "{}: no chat template (looked for chat_template.jinja, tokenizer_config.json \"chat_template\", "
        "chat_template.json)",
        dir);
  return ChatTemplate(std::move(named), dir);
}

const ChatTemplate::Named* ChatTemplate::find(std::string_view name) const {
  for (const Named& n : templates_)
    if (n.name == name) return &n;
  return nullptr;
}

const std::string& ChatTemplate::source() const {
  const Named* n = find("default");
  return (n ? *n : templates_.front()).source;
}

std::string ChatTemplate::render(const ChatTemplateInputs& in) const {
  for (const Json* part : {&in.messages, &in.tools, &in.extra}) jinja::check_nesting(*part);  // before any copy
  if (!in.messages.is_array() || in.messages.empty())
    fail("chat messages must be a non-empty list, got {}", in.messages.is_array() ? "[]" : in.messages.type_name());
  if (!in.tools.is_null() && !in.tools.is_array()) fail("chat tools must be a list or null");
  if (!in.extra.is_object()) fail("chat template extra kwargs must be a JSON object");

  const Named* t = in.tools.is_null() ? nullptr : find("tool_use");
  if (!t) t = find("default");
  if (!t && templates_.size() == 1) t = &templates_.front();
  if (!t) fail("checkpoint has several chat templates and none is named \"default\"");

  // transformers passes special tokens first, then kwargs (which may override them).
  Json vars = {{"bos_token", in.bos_token}, {"eos_token", in.eos_token}, {"enable_thinking", in.enable_thinking}};
  for (auto it = in.extra.begin(); it != in.extra.end(); ++it) {
    if (it.key() == "messages" || it.key() == "tools" || it.key() == "documents" || it.key() == "add_generation_prompt")
      fail("chat template kwarg '{}' must be set through its own field", it.key());
    vars[it.key()] = it.value();
  }
  vars["messages"] = in.messages;
  vars["tools"] = in.tools;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = in.add_generation_prompt;
  return t->tmpl.render(vars);
}

// ---------------------------------------------------------------------------------------------
// Gemma 4 output parsing

namespace {

constexpr std::string_view kQuote = "<|\"|>";
// Lists and objects nest by recursion here and when the result is printed or copied.
constexpr int kMaxValueDepth = 512;

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
  return s;
}

// Recursive-descent reader over the template's value syntax (format_argument with bare keys).
class ValueReader {
 public:
  explicit ValueReader(std::string_view s) : s_(s) {}

  Json read_all() {
    Json v = value();
    skip_ws();
    if (i_ != s_.size()) error("unexpected trailing text");
    return v;
  }

  Json value() {
    skip_ws();
    if (i_ >= s_.size()) error("expected a value");
    if (starts(kQuote)) return quoted();
    if (s_[i_] == '{') return object();
    if (s_[i_] == '[') return array();
    if (s_[i_] == '"') return json_string();
    return bare();
  }

 private:
  [[noreturn]] void error(std::string_view what) const {
    fail("Gemma 4 tool call: {} at offset {} in '{}'", what, i_, s_);
  }
  bool starts(std::string_view p) const { return s_.substr(i_, p.size()) == p; }
  void skip_ws() {
    while (i_ < s_.size() && is_ws(s_[i_])) ++i_;
  }
  void expect(char c) {
    skip_ws();
    if (i_ >= s_.size() || s_[i_] != c) error(fmt::format("expected '{}'", c));
    ++i_;
  }

  std::string quoted() {
    i_ += kQuote.size();
    size_t end = s_.find(kQuote, i_);
    if (end == std::string_view::npos) error("unterminated <|\"|> string");
    std::string out(s_.substr(i_, end - i_));
    i_ = end + kQuote.size();
    return out;
  }

  Json json_string() {  // models sometimes fall back to JSON quoting
    size_t start = i_++;
    while (i_ < s_.size() && s_[i_] != '"') i_ += s_[i_] == '\\' ? 2 : 1;
    if (i_ >= s_.size()) error("unterminated string");
    ++i_;
    try {
      return Json::parse(s_.substr(start, i_ - start));
    } catch (const Json::exception&) {
      error("invalid JSON string");
    }
  }

  // Counts the lists and objects open around the reader.
  struct Nest {
    ValueReader& r;
    explicit Nest(ValueReader& reader) : r(reader) {
      if (++r.depth_ > kMaxValueDepth) r.error(fmt::format("values nested more than {} levels deep", kMaxValueDepth));
    }
    ~Nest() { --r.depth_; }
  };

  Json object() {
    Nest nest(*this);
    ++i_;
    Json out = Json::object();
    skip_ws();
    if (i_ < s_.size() && s_[i_] == '}') return ++i_, out;
    while (true) {
      skip_ws();
      std::string key;
      if (starts(kQuote)) {
        key = quoted();
      } else if (i_ < s_.size() && s_[i_] == '"') {
        key = json_string().get<std::string>();
      } else {
        size_t colon = s_.find(':', i_);
        if (colon == std::string_view::npos) error("expected 'key:'");
        key = std::string(trim(s_.substr(i_, colon - i_)));
        if (key.empty()) error("empty key");
        i_ = colon;
      }
      expect(':');
      out[key] = value();
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      expect('}');
      return out;
    }
  }

  Json array() {
    Nest nest(*this);
    ++i_;
    Json out = Json::array();
    skip_ws();
    if (i_ < s_.size() && s_[i_] == ']') return ++i_, out;
    while (true) {
      out.push_back(value());
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      expect(']');
      return out;
    }
  }

  // Numbers are printed by Python's str() (1, -2, 0.5, 1e-05), null as None, booleans as
  // true/false; anything else unquoted is kept as a string rather than rejected.
  Json bare() {
    size_t start = i_;
    while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != '}' && s_[i_] != ']') ++i_;
    std::string_view tok = trim(s_.substr(start, i_ - start));
    if (tok.empty()) error("expected a value");
    if (tok == "true" || tok == "True") return true;
    if (tok == "false" || tok == "False") return false;
    if (tok == "None" || tok == "null") return nullptr;
    const char* b = tok.data();
    const char* e = tok.data() + tok.size();
    int64_t n = 0;
    if (auto r = std::from_chars(b, e, n); r.ec == std::errc() && r.ptr == e) return n;
    double d = 0;
    if (auto r = std::from_chars(b, e, d); r.ec == std::errc() && r.ptr == e) return d;
    return std::string(tok);
  }

  std::string_view s_;
  size_t i_ = 0;
  int depth_ = 0;
};

std::string strip_copy(std::string_view s) { return std::string(trim(s)); }

}  // namespace

Json parse_gemma4_value(std::string_view text) { return ValueReader(text).read_all(); }

ToolCall parse_gemma4_tool_call(std::string_view text) {
  std::string_view body = trim(text);
  if (body.substr(0, 5) != "call:") fail("Gemma 4 tool call must start with 'call:', got '{}'", text);
  size_t brace = body.find('{');
  if (brace == std::string_view::npos) fail("Gemma 4 tool call has no argument object: '{}'", text);
  ToolCall call{std::string(trim(body.substr(5, brace - 5))), parse_gemma4_value(body.substr(brace))};
  if (call.name.empty()) fail("Gemma 4 tool call has no function name: '{}'", text);
  if (!call.arguments.is_object()) fail("Gemma 4 tool call arguments must be an object: '{}'", text);
  return call;
}

ParsedOutput parse_gemma4_output(std::string_view text) {
  constexpr std::string_view kChannel = "<|channel>", kChannelEnd = "<channel|>";
  constexpr std::string_view kCall = "<|tool_call>", kCallEnd = "<tool_call|>";
  ParsedOutput out;
  std::string content, thinking;
  const std::string_view markers[] = {kChannel, kCall, kGemma4StopTokens[0], kGemma4StopTokens[1],
                                      kGemma4StopTokens[2]};
  size_t found[std::size(markers)] = {};  // where each marker occurs next, searched again once passed
  for (size_t k = 0; k < std::size(markers); ++k) found[k] = text.find(markers[k]);
  size_t i = 0;
  while (i < text.size()) {
    // The earliest marker decides what the text up to it is.
    size_t next = text.size();
    std::string_view marker;
    for (size_t k = 0; k < std::size(markers); ++k) {
      if (found[k] < i) found[k] = text.find(markers[k], i);
      if (found[k] < next) next = found[k], marker = markers[k];
    }
    content.append(text.substr(i, next - i));
    if (marker.empty() || marker == kGemma4StopTokens[0] || marker == kGemma4StopTokens[1] ||
        marker == kGemma4StopTokens[2])
      break;  // a stop token ends the turn
    size_t body = next + marker.size();
    std::string_view end_marker = marker == kChannel ? kChannelEnd : kCallEnd;
    size_t end = text.find(end_marker, body);
    std::string_view inner = text.substr(body, end == std::string_view::npos ? std::string_view::npos : end - body);
    i = end == std::string_view::npos ? text.size() : end + end_marker.size();
    if (marker == kChannel) {
      if (inner.substr(0, 8) == "thought\n") inner.remove_prefix(8);
      if (!thinking.empty()) thinking += '\n';
      thinking.append(inner);
    } else {
      out.tool_calls.push_back(parse_gemma4_tool_call(inner));
    }
  }
  out.thinking = strip_copy(thinking);
  out.content = strip_copy(content);
  return out;
}

}  // namespace mb
