#include "server/openai.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>

#include "core/error.h"
#include "core/printable.h"
#include "core/utf8.h"
#include "media/file.h"
#include "media/video.h"
#include "runtime/text.h"

namespace mb::server {

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_)
    : std::runtime_error(message), status(status_), param(std::move(param_)), code(std::move(code_)) {}

std::string ApiError::type() const {
  switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

Json ApiError::body() const {
  Json e = {{"message", what()}, {"type", type()}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return Json{{"error", e}};
}

namespace {

// Where a chat request's media parts go while its messages are read (null: parts only render).
struct MediaSink {
  std::string allowed_dir;
  std::vector<MediaItem> items;
};

[[noreturn]] void bad_request(const std::string& param, const std::string& message, std::string code = "") {
  throw ApiError(400, message, param, std::move(code));
}

// The field, or nullptr when absent or null (clients send null for "not set").
const Json* field(const Json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

std::optional<bool> get_bool(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad_request(key, fmt::format("'{}' must be true or false", key));
  return v->get<bool>();
}

std::optional<double> get_number(const Json& obj, const char* key, double lo, double hi, bool lo_open = false) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_request(key, fmt::format("'{}' must be a number", key));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || (lo_open && x == lo) || x > hi) {
    std::string range = std::isinf(hi) ? fmt::format("{} {:g}", lo_open ? ">" : ">=", lo)
                                        : fmt::format("from {:g}{} to {:g}", lo, lo_open ? " (excluded)" : "", hi);
    bad_request(key, fmt::format("'{}' must be a number {}, not {}", key, range, v->dump()));
  }
  return x;
}

// A whole number; 16.0 passes as 16, as JavaScript clients send it.
int64_t as_integer(const Json& v, const std::string& what, int64_t lo, int64_t hi) {
  int64_t x = 0;
  bool ok = false;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= uint64_t(std::numeric_limits<int64_t>::max());
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>(), ok = true;
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    ok = std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9e15;
    x = ok ? int64_t(d) : 0;
  }
  if (!ok || x < lo || x > hi) {
    std::string range = hi == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", lo)
                                                                   : fmt::format("from {} to {}", lo, hi);
    bad_request(what, fmt::format("'{}' must be a whole number {}, not {}", what, range, printable(v.dump(), 40)));
  }
  return x;
}

std::optional<int64_t> get_int(const Json& obj, const char* key, int64_t lo, int64_t hi) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  return as_integer(*v, key, lo, hi);
}

std::optional<std::string> get_string(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) bad_request(key, fmt::format("'{}' must be a string", key));
  return v->get<std::string>();
}

void check_model(const Json& body, const ModelInfo& model) {
  // Optional, as llama.cpp's server has it: a client that names no model gets the one served.
  const std::optional<std::string> name = get_string(body, "model");
  if (name && *name != model.name)
    throw ApiError(404, fmt::format("The model '{}' does not exist; this server serves '{}'", printable(*name, 80),
                                    model.name),
                   "model", "model_not_found");
}

std::vector<int32_t> token_ids(const Json& v, const std::string& what, const ModelInfo& model) {
  if (!v.is_array()) bad_request(what, fmt::format("'{}' must be a list of token ids", what));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const Json& t : v) ids.push_back(int32_t(as_integer(t, what, 0, model.vocab_size - 1)));
  return ids;
}

const TextCodec& need_text(const ModelInfo& model, const char* what) {
  if (!model.text) bad_request(what, "this model has no tokenizer: send token ids");
  return *model.text;
}

// Sampling and stopping fields both endpoints share.
void parse_sampling(const Json& b, const ModelInfo& model, GenerationOptions& g) {
  if (auto v = get_number(b, "temperature", 0, 1e4)) g.temperature = float(*v);
  if (auto v = get_number(b, "top_p", 0, 1, /*lo_open=*/true)) g.top_p = float(*v);
  if (auto v = get_int(b, "top_k", -1, std::numeric_limits<int32_t>::max())) g.top_k = *v < 0 ? 0 : int(*v);
  if (auto v = get_number(b, "min_p", 0, 1)) g.min_p = float(*v);
  if (auto v = get_number(b, "presence_penalty", -2, 2)) g.presence_penalty = float(*v);
  if (auto v = get_number(b, "frequency_penalty", -2, 2)) g.frequency_penalty = float(*v);
  if (auto v = get_number(b, "repetition_penalty", 0, 1e4, /*lo_open=*/true)) g.repetition_penalty = float(*v);
  if (auto v = get_int(b, "n", 1, 128)) g.n = int(*v);
  if (const Json* s = field(b, "seed")) {
    // OpenAI takes any 64-bit integer; negative seeds map to their two's complement.
    if (s->is_number_unsigned()) g.seed = s->get<uint64_t>();
    else g.seed = uint64_t(as_integer(*s, "seed", std::numeric_limits<int64_t>::min(),
                                      std::numeric_limits<int64_t>::max()));
  }
  if (const Json* s = field(b, "stop")) {
    if (s->is_string()) {
      if (!s->get<std::string>().empty()) g.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 16) bad_request("stop", "'stop' takes at most 16 strings");
      for (const Json& x : *s) {
        if (!x.is_string()) bad_request("stop", "'stop' must be a string or a list of strings");
        if (!x.get<std::string>().empty()) g.stop.push_back(x.get<std::string>());
      }
    } else {
      bad_request("stop", "'stop' must be a string or a list of strings");
    }
  }
  if (const Json* s = field(b, "stop_token_ids")) g.stop_ids = token_ids(*s, "stop_token_ids", model);
  if (const Json* lb = field(b, "logit_bias")) {
    if (!lb->is_object()) bad_request("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
    for (const auto& [key, value] : lb->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != key.size() || id < 0 || id >= model.vocab_size)
        bad_request("logit_bias", fmt::format("logit_bias: '{}' is not a token id from 0 to {}", printable(key, 40),
                                              model.vocab_size - 1));
      if (!value.is_number() || !std::isfinite(value.get<double>()) || std::fabs(value.get<double>()) > 100)
        bad_request("logit_bias",
                    fmt::format("logit_bias: the bias of token {} must be a number from -100 to 100", id));
      g.logit_bias.emplace_back(int32_t(id), value.get<float>());
    }
  }
  if (auto v = get_bool(b, "ignore_eos")) g.ignore_eos = *v;
  if (auto v = get_bool(b, "skip_special_tokens")) g.skip_special_tokens = *v;
  if (auto v = get_number(b, "timeout", 0, 1e7, /*lo_open=*/true)) g.timeout_seconds = *v;
  else g.timeout_seconds = model.default_timeout_seconds;
}

void parse_stream(const Json& b, ParsedRequest& r) {
  if (auto v = get_bool(b, "stream")) r.stream = *v;
  if (const Json* so = field(b, "stream_options")) {
    if (!so->is_object()) bad_request("stream_options", "'stream_options' must be an object");
    if (auto v = get_bool(*so, "include_usage")) r.include_usage = *v;
  }
}

// max_tokens (or chat's newer max_completion_tokens); by default up to the context's end for chat
// (OpenAI's own default), 16 for completions (OpenAI's).
void parse_max_tokens(const Json& b, const ModelInfo& model, ParsedRequest& r) {
  const int64_t room = model.max_context - int64_t(r.prompt.size());
  if (room <= 0)
    bad_request(r.endpoint == Endpoint::Chat ? "messages" : "prompt",
                fmt::format("This model's maximum context length is {} tokens. However, your {} resulted in {} tokens.",
                            model.max_context, r.endpoint == Endpoint::Chat ? "messages" : "prompt", r.prompt.size()),
                "context_length_exceeded");
  const int64_t lo = r.endpoint == Endpoint::Chat ? 1 : 0;
  std::optional<int64_t> n = get_int(b, "max_completion_tokens", lo, std::numeric_limits<int32_t>::max());
  if (!n) n = get_int(b, "max_tokens", lo, std::numeric_limits<int32_t>::max());
  const int64_t fallback = r.endpoint == Endpoint::Chat ? room : std::min<int64_t>(16, room);
  r.gen.max_tokens = int(n ? std::min<int64_t>(*n, room) : fallback);
}

// An assistant message's tool call arguments as the chat templates read them: an object. OpenAI
// clients send them as a JSON string.
Json tool_call_arguments(const Json& args, const std::string& where) {
  if (args.is_object()) return args;
  if (args.is_string()) {
    try {
      Json parsed = Json::parse(args.get<std::string>());
      if (parsed.is_object()) return parsed;
    } catch (const Json::exception&) {
    }
  }
  bad_request(where, fmt::format("'{}' must be a JSON object, or a string holding one", where));
}

// Standard base64 (RFC 4648, padding optional, no line breaks): the data: URLs and input_audio of
// OpenAI's content parts. Hand-written: a dozen lines, where no library here has a public decoder.
std::optional<std::vector<uint8_t>> base64_decode(std::string_view s) {
  std::vector<uint8_t> out;
  out.reserve(s.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] != '='; ++i) {
    const char c = s[i];
    int v = c >= 'A' && c <= 'Z' ? c - 'A' : c >= 'a' && c <= 'z' ? c - 'a' + 26 : c >= '0' && c <= '9' ? c - '0' + 52
            : c == '+' || c == '-' ? 62 : c == '/' || c == '_' ? 63 : -1;
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
    }
  }
  for (; i < s.size(); ++i)
    if (s[i] != '=') return std::nullopt;
  return out;
}

// A media part's bytes: a data: URL (base64), or a local path (file:// URL or plain) under the
// allowed folder. Other URLs are refused: the server never fetches.
std::vector<uint8_t> media_bytes(const std::string& url, const MediaSink& sink, const std::string& where) {
  if (url.rfind("data:", 0) == 0) {
    const size_t comma = url.find(',');
    if (comma == std::string::npos || url.substr(0, comma).find(";base64") == std::string::npos)
      bad_request(where, fmt::format("'{}': a data: URL must be base64 (data:<type>;base64,<data>)", where));
    auto bytes = base64_decode(std::string_view(url).substr(comma + 1));
    if (!bytes || bytes->empty()) bad_request(where, fmt::format("'{}': the data: URL's base64 is invalid or empty", where));
    return std::move(*bytes);
  }
  if (url.find("://") != std::string::npos && url.rfind("file://", 0) != 0)
    bad_request(where, fmt::format("'{}': this server does not fetch URLs; send the media inline as a data: URL "
                                   "(base64)", where));
  if (sink.allowed_dir.empty())
    bad_request(where, fmt::format("'{}': reading files on the server is off (start it with --allowed-media-dir DIR "
                                   "to allow files under DIR); send the media inline as a data: URL", where));
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::path(url.rfind("file://", 0) == 0 ? url.substr(7) : url), ec);
  const fs::path root = fs::weakly_canonical(fs::path(sink.allowed_dir), ec);
  const auto rel = p.lexically_relative(root);
  if (ec || rel.empty() || *rel.begin() == ".." || !p.is_absolute())
    bad_request(where, fmt::format("'{}': {} is not under the server's --allowed-media-dir", where, printable(url, 200)));
  try {
    return read_media_file(p.string());
  } catch (const Error& e) {
    bad_request(where, fmt::format("'{}': {}", where, e.what()));
  }
}

// A video part: `video_url` ({"url": ...} or a URL string: one video file), `input_video` ({"data": base64,
// "format": "mp4"} for a file, or {"frames": [URL, ...]} for its frames as images, each URL as image_url takes).
MediaItem video_part(const Json& p, const std::string& type, const std::string& pw, MediaSink* sink) {
  MediaItem item;
  item.kind = MediaItem::Kind::Video;
  item.what = pw;
  const std::string at = pw + "." + type;
  const Json* v = field(p, type.c_str());
  if (type == "input_video") {
    const Json* data = v && v->is_object() ? field(*v, "data") : nullptr;
    const Json* frames = v && v->is_object() ? field(*v, "frames") : nullptr;
    if (data && data->is_string()) {
      if (sink) {
        auto bytes = base64_decode(data->get<std::string>());
        if (!bytes || bytes->empty()) bad_request(at + ".data", fmt::format("'{}.data' is not valid base64", at));
        item.bytes = std::move(*bytes);
      }
    } else if (frames && frames->is_array() && !frames->empty() && frames->size() <= size_t(kMaxVideoFramesKept)) {
      for (size_t f = 0; f < frames->size(); ++f) {
        const Json& u = (*frames)[f];
        const Json* url = u.is_object() ? field(u, "url") : &u;
        const std::string fw = fmt::format("{}.frames[{}]", at, f);
        if (!url || !url->is_string()) bad_request(fw, fmt::format("'{}' must be a URL string", fw));
        if (sink) item.frames.push_back(media_bytes(url->get<std::string>(), *sink, fw));
      }
    } else {
      bad_request(at, fmt::format("'{}' must be {{\"data\": base64, \"format\": \"mp4\" | ...}} or {{\"frames\": "
                                  "[1 to {} image URLs]}}", at, kMaxVideoFramesKept));
    }
  } else {
    const Json* url = v && v->is_object() ? field(*v, "url") : v;
    if (!url || !url->is_string())
      bad_request(at, fmt::format("'{}' must be {{\"url\": \"data:...\"}} or a URL string", at));
    if (sink) item.bytes = media_bytes(url->get<std::string>(), *sink, at);
  }
  return item;
}

// An image_url / audio_url / input_audio / video_url / input_video part: its media item, and the template's part
// for it.
Json media_part(const Json& p, const std::string& type, const std::string& pw, MediaSink* sink) {
  if (type == "video_url" || type == "input_video") {
    MediaItem item = video_part(p, type, pw, sink);
    if (sink) sink->items.push_back(std::move(item));
    return {{"type", "video"}};
  }
  const bool image = type == "image_url" || type == "image";
  MediaItem item;
  item.kind = image ? MediaItem::Kind::Image : MediaItem::Kind::Audio;
  item.what = pw;
  if (type == "input_audio") {
    const Json* a = field(p, "input_audio");
    const Json* data = a && a->is_object() ? field(*a, "data") : nullptr;
    if (!data || !data->is_string())
      bad_request(pw + ".input_audio", fmt::format("'{}.input_audio' must be {{\"data\": base64, \"format\": "
                                                   "\"wav\" | \"mp3\" | ...}}", pw));
    if (sink) {
      auto bytes = base64_decode(data->get<std::string>());
      if (!bytes || bytes->empty())
        bad_request(pw + ".input_audio.data", fmt::format("'{}.input_audio.data' is not valid base64", pw));
      item.bytes = std::move(*bytes);
    }
  } else {
    const Json* u = field(p, type.c_str());
    const Json* url = u && u->is_object() ? field(*u, "url") : u;
    if (!url || !url->is_string())
      bad_request(pw + "." + type, fmt::format("'{}.{}' must be {{\"url\": \"data:...\"}} or a URL string", pw, type));
    if (sink) item.bytes = media_bytes(url->get<std::string>(), *sink, pw + "." + type);
  }
  if (sink) sink->items.push_back(std::move(item));
  return {{"type", image ? "image" : "audio"}};
}

Json chat_message(const Json& m, size_t i, MediaSink* sink) {
  const std::string where = fmt::format("messages[{}]", i);
  if (!m.is_object()) bad_request(where, fmt::format("'{}' must be an object with 'role' and 'content'", where));
  const Json* role = field(m, "role");
  if (!role || !role->is_string()) bad_request(where + ".role", fmt::format("'{}.role' must be a string", where));
  std::string r = role->get<std::string>();
  if (r == "developer") r = "system";  // OpenAI's newer name for the system turn
  if (r != "system" && r != "user" && r != "assistant" && r != "tool")
    bad_request(where + ".role", fmt::format("'{}.role' must be system, developer, user, assistant or tool, not '{}'",
                                             where, printable(r, 40)));
  Json out = Json::object();
  out["role"] = r;
  const Json* content = field(m, "content");
  if (!content) {
    if (r != "assistant" || !field(m, "tool_calls"))
      bad_request(where + ".content", fmt::format("'{}.content' is missing", where));
    out["content"] = "";
  } else if (content->is_string()) {
    out["content"] = *content;
  } else if (content->is_array()) {
    Json parts = Json::array();
    for (size_t k = 0; k < content->size(); ++k) {
      const Json& p = (*content)[k];
      const std::string pw = fmt::format("{}.content[{}]", where, k);
      const Json* type = p.is_object() ? field(p, "type") : nullptr;
      if (!type || !type->is_string()) bad_request(pw, fmt::format("'{}' must be an object with a 'type'", pw));
      const std::string t = type->get<std::string>();
      if (t == "image_url" || t == "audio_url" || t == "input_audio" || t == "video_url" || t == "input_video") {
        parts.push_back(media_part(p, t, pw, sink));
        continue;
      }
      if (t != "text")
        bad_request(pw, fmt::format("'{}': content parts are text, image_url, audio_url, input_audio, video_url or input_video, not '{}'", pw,
                                    printable(t, 40)));
      const Json* text = field(p, "text");
      if (!text || !text->is_string()) bad_request(pw + ".text", fmt::format("'{}.text' must be a string", pw));
      parts.push_back({{"type", "text"}, {"text", *text}});
    }
    out["content"] = parts;
  } else {
    bad_request(where + ".content", fmt::format("'{}.content' must be a string or a list of parts", where));
  }
  if (const Json* calls = field(m, "tool_calls")) {
    if (!calls->is_array()) bad_request(where + ".tool_calls", fmt::format("'{}.tool_calls' must be a list", where));
    Json list = Json::array();
    for (size_t k = 0; k < calls->size(); ++k) {
      const Json& c = (*calls)[k];
      const std::string cw = fmt::format("{}.tool_calls[{}]", where, k);
      const Json* fn = c.is_object() ? field(c, "function") : nullptr;
      const Json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
      if (!name || !name->is_string())
        bad_request(cw, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": "
                                    "{{\"name\", \"arguments\"}}}}", cw));
      const Json* args = field(*fn, "arguments");
      Json call = {{"type", "function"},
                   {"function", {{"name", *name},
                                 {"arguments", args ? tool_call_arguments(*args, cw + ".function.arguments")
                                                    : Json::object()}}}};
      if (const Json* id = field(c, "id"); id && id->is_string()) call["id"] = *id;
      list.push_back(call);
    }
    out["tool_calls"] = list;
  }
  for (const char* key : {"tool_call_id", "name", "reasoning_content", "reasoning"})
    if (const Json* v = field(m, key)) {
      if (!v->is_string()) bad_request(where + "." + key, fmt::format("'{}.{}' must be a string", where, key));
      out[key] = *v;
    }
  return out;
}

// The chat template's inputs from a request's messages, tools and chat_template_kwargs.
ChatTemplateInputs chat_inputs(const Json& b, bool add_generation_prompt, MediaSink* sink) {
  const Json* messages = field(b, "messages");
  if (!messages) bad_request("messages", "'messages' is missing");
  if (!messages->is_array() || messages->empty())
    bad_request("messages", "'messages' must be a non-empty list of {role, content}");
  ChatTemplateInputs in;
  for (size_t i = 0; i < messages->size(); ++i) in.messages.push_back(chat_message((*messages)[i], i, sink));
  in.add_generation_prompt = add_generation_prompt;
  bool use_tools = true;
  if (const Json* choice = field(b, "tool_choice")) {
    if (*choice == "none") use_tools = false;
    else if (*choice != "auto")
      bad_request("tool_choice", "'tool_choice' may be \"auto\" or \"none\"; forcing a tool call is not supported");
  }
  if (const Json* tools = field(b, "tools")) {
    if (!tools->is_array()) bad_request("tools", "'tools' must be a list of {type: function, function: {...}}");
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json& t = (*tools)[i];
      const Json* fn = t.is_object() ? field(t, "function") : nullptr;
      const Json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
      const Json* type = t.is_object() ? field(t, "type") : nullptr;
      if (!name || !name->is_string() || name->get<std::string>().empty() || (type && *type != "function"))
        bad_request(fmt::format("tools[{}]", i),
                    fmt::format("'tools[{}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"description\": ..., \"parameters\": {{...}}}}}}", i));
      if (const Json* params = field(*fn, "parameters"); params && !params->is_object())
        bad_request(fmt::format("tools[{}].function.parameters", i),
                    "a tool's 'parameters' must be a JSON schema object");
    }
    if (use_tools && !tools->empty()) in.tools = *tools;
  }
  if (const Json* kw = field(b, "chat_template_kwargs")) {
    if (!kw->is_object()) bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (const auto& [key, value] : kw->items()) {
      if (key == "enable_thinking") {
        if (!value.is_boolean())
          bad_request("chat_template_kwargs.enable_thinking",
                      "'chat_template_kwargs.enable_thinking' must be true or false");
        in.enable_thinking = value.get<bool>();
      } else if (key == "add_generation_prompt") {
        if (!value.is_boolean()) bad_request("chat_template_kwargs.add_generation_prompt", "must be true or false");
        in.add_generation_prompt = value.get<bool>();
      } else if (key == "messages" || key == "tools" || key == "bos_token" || key == "eos_token") {
        bad_request("chat_template_kwargs", fmt::format("chat_template_kwargs may not set '{}'", key));
      } else {
        in.extra[key] = value;
      }
    }
  }
  return in;
}

std::vector<int32_t> render_chat(const TextCodec& text, const ChatTemplateInputs& in) {
  try {
    return text.encode_chat(in);
  } catch (const Error& e) {
    // The template's own raise_exception (roles out of order ...) or a value it cannot render.
    bad_request("messages", fmt::format("the chat template refused these messages: {}", e.what()));
  }
}

void check_response_format(const Json& b) {
  if (const Json* rf = field(b, "response_format")) {
    const Json* type = rf->is_object() ? field(*rf, "type") : nullptr;
    if (!type || *type != "text")
      bad_request("response_format", "only {\"type\": \"text\"} is supported as 'response_format'");
  }
}

}  // namespace

ModelInfo describe_model(const TextCodec* text, std::string name, int64_t max_context, int32_t vocab_size,
                         double default_timeout_seconds) {
  ModelInfo m;
  m.name = std::move(name);
  m.max_context = max_context;
  m.vocab_size = vocab_size;
  m.text = text;
  m.default_timeout_seconds = default_timeout_seconds;
  if (text) {
    const Tokenizer& t = text->tokenizer();
    m.gemma4_markup = t.find_token("<|tool_call>") >= 0 && t.find_token("<|channel>") >= 0;
  }
  return m;
}

Json parse_body(std::string_view body) {
  const auto* p = reinterpret_cast<const unsigned char*>(body.data());
  for (size_t i = 0; i < body.size();) {
    const int len = utf8_check(p + i, body.size() - i);
    if (len <= 0) bad_request("", fmt::format("the request body is not valid UTF-8 (at byte {})", i));
    i += size_t(len);
  }
  Json j;
  try {
    j = Json::parse(body);
  } catch (const Json::exception& e) {
    bad_request("", fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_request("", "the request body must be a JSON object");
  return j;
}

ParsedRequest parse_chat_request(const Json& b, const ModelInfo& model) {
  check_model(b, model);
  ParsedRequest r;
  r.endpoint = Endpoint::Chat;
  const TextCodec& text = need_text(model, "messages");
  if (!text.has_chat_template()) bad_request("messages", "this model has no chat template: use /v1/completions");
  MediaSink sink{model.allowed_media_dir, {}};
  r.prompt = render_chat(text, chat_inputs(b, true, &sink));
  r.media = std::move(sink.items);
  check_response_format(b);
  parse_stream(b, r);
  parse_sampling(b, model, r.gen);
  parse_max_tokens(b, model, r);
  if (auto v = get_bool(b, "logprobs")) r.gen.logprobs = *v;
  if (auto v = get_int(b, "top_logprobs", 0, 20)) {
    if (!r.gen.logprobs && *v > 0) bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r.gen.top_logprobs = int(*v);
  }
  // The markup is what the parser reads, so it must reach the text; clients never see it.
  r.parse_markup = model.gemma4_markup;
  if (r.parse_markup) r.gen.skip_special_tokens = false;
  else if (!field(b, "skip_special_tokens")) r.gen.skip_special_tokens = true;
  return r;
}

ParsedRequest parse_completion_request(const Json& b, const ModelInfo& model) {
  check_model(b, model);
  ParsedRequest r;
  r.endpoint = Endpoint::Completion;
  const Json* prompt = field(b, "prompt");
  if (!prompt) bad_request("prompt", "'prompt' is missing");
  const Json* p = prompt;
  // A list of one prompt is one prompt; several in one request are not supported.
  if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
    if (p->size() != 1) bad_request("prompt", "send one prompt per request (use n for several choices)");
    p = &(*p)[0];
  }
  bool add_special = true;
  if (auto v = get_bool(b, "add_special_tokens")) add_special = *v;
  bool echo = false;
  if (auto v = get_bool(b, "echo")) echo = *v;
  if (p->is_string()) {
    const TextCodec& text = need_text(model, "prompt");
    r.prompt = text.encode(p->get<std::string>(), add_special);
    if (echo) r.echo = p->get<std::string>();
  } else if (p->is_array()) {
    r.prompt = token_ids(*p, "prompt", model);
    if (echo) r.echo = need_text(model, "echo").tokenizer().decode(r.prompt);
  } else {
    bad_request("prompt", "'prompt' must be a string or a list of token ids");
  }
  if (r.prompt.empty()) bad_request("prompt", "the prompt is empty");
  if (auto s = get_string(b, "suffix"); s && !s->empty()) bad_request("suffix", "'suffix' is not supported");
  parse_stream(b, r);
  parse_sampling(b, model, r.gen);
  if (auto best = get_int(b, "best_of", 1, 128); best && *best != r.gen.n)
    bad_request("best_of", "'best_of' other than n is not supported");
  parse_max_tokens(b, model, r);
  if (auto v = get_int(b, "logprobs", 0, 20)) {
    if (echo) bad_request("logprobs", "'logprobs' with 'echo' (the prompt's logprobs) is not supported");
    r.completion_logprobs = int(*v);
    r.gen.logprobs = true;
    r.gen.top_logprobs = int(*v);
  }
  if (!field(b, "skip_special_tokens")) r.gen.skip_special_tokens = true;
  return r;
}

Json tokenize(const Json& b, const ModelInfo& model) {
  check_model(b, model);
  const TextCodec& text = need_text(model, "prompt");
  std::vector<int32_t> ids;
  if (field(b, "messages")) {
    if (!text.has_chat_template()) bad_request("messages", "this model has no chat template");
    bool add_generation_prompt = true;
    if (auto v = get_bool(b, "add_generation_prompt")) add_generation_prompt = *v;
    ids = render_chat(text, chat_inputs(b, add_generation_prompt, nullptr));
  } else {
    std::optional<std::string> prompt = get_string(b, "prompt");
    if (!prompt) prompt = get_string(b, "content");  // llama.cpp's name
    if (!prompt) bad_request("prompt", "'prompt' (a string) or 'messages' is missing");
    bool add_special = true;
    if (auto v = get_bool(b, "add_special_tokens")) add_special = *v;
    ids = text.encode(*prompt, add_special);
  }
  Json out = {{"count", ids.size()}, {"max_model_len", model.max_context}, {"tokens", ids}};
  if (get_bool(b, "return_token_strs").value_or(false)) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(std::string(text.tokenizer().token_text(id)));
    out["token_strs"] = strs;
  }
  return out;
}

Json detokenize(const Json& b, const ModelInfo& model) {
  check_model(b, model);
  const TextCodec& text = need_text(model, "tokens");
  const Json* tokens = field(b, "tokens");
  if (!tokens) bad_request("tokens", "'tokens' is missing");
  return Json{{"prompt", text.tokenizer().decode(token_ids(*tokens, "tokens", model))}};
}

Json model_list(const ModelInfo& model, int64_t created) {
  Json m = {{"id", model.name}, {"object", "model"}, {"created", created}, {"owned_by", "markbase"},
            {"max_model_len", model.max_context}};
  return Json{{"object", "list"}, {"data", Json::array({m})}};
}

// ---- output ----------------------------------------------------------------------------------

namespace {

constexpr std::string_view kChannel = "<|channel>", kChannelEnd = "<channel|>";
constexpr std::string_view kCall = "<|tool_call>", kCallEnd = "<tool_call|>";

// The part of a growing Gemma 4 reply that later text cannot reinterpret: without a marker cut
// between two events, an unfinished tool call, or a thinking block whose "thought\n" header is
// still incomplete (the parser removes the header only once it is whole).
std::string_view settled(std::string_view text) {
  size_t cut = text.size();
  const std::string_view markers[] = {kChannel, kChannelEnd, kCall, kCallEnd,
                                      kGemma4StopTokens[0], kGemma4StopTokens[1], kGemma4StopTokens[2]};
  for (std::string_view m : markers)
    for (size_t len = std::min(m.size() - 1, text.size()); len > 0; --len)
      if (text.substr(text.size() - len) == m.substr(0, len)) {
        cut = std::min(cut, text.size() - len);
        break;
      }
  text = text.substr(0, cut);
  const size_t call = text.rfind(kCall);
  if (call != std::string_view::npos && text.find(kCallEnd, call) == std::string_view::npos)
    text = text.substr(0, call);
  const size_t channel = text.rfind(kChannel);
  if (channel != std::string_view::npos && text.find(kChannelEnd, channel) == std::string_view::npos) {
    const std::string_view inner = text.substr(channel + kChannel.size());
    if (inner.size() < 8 && std::string_view("thought\n").substr(0, inner.size()) == inner)
      text = text.substr(0, channel);
  }
  return text;
}

// The part of `now` past what was sent, when `now` extends it.
std::optional<std::string> extension(const std::string& now, const std::string& sent) {
  if (now.size() <= sent.size() || now.compare(0, sent.size(), sent) != 0) return std::nullopt;
  return now.substr(sent.size());
}

ParsedOutput parse_or_plain(std::string_view text) {
  try {
    return parse_gemma4_output(text);
  } catch (const Error&) {
    // A malformed tool call: the reply is returned as the model wrote it.
    ParsedOutput p;
    p.content = std::string(text);
    return p;
  }
}

std::string token_string(const TextCodec* text, int32_t id) {
  if (!text) return fmt::format("<{}>", id);
  return text->tokenizer().decode(std::span<const int32_t>(&id, 1));
}

// The token's bytes: a <0xXX> byte token is that byte, whatever its text shows.
Json token_bytes(const TextCodec* text, int32_t id) {
  Json out = Json::array();
  if (text && text->tokenizer().is_byte(id)) {
    const std::string piece(text->tokenizer().token_text(id));
    out.push_back(std::stoi(piece.substr(3, 2), nullptr, 16));
    return out;
  }
  for (unsigned char c : token_string(text, id)) out.push_back(int(c));
  return out;
}

double finite_logprob(float lp) { return std::isfinite(lp) ? double(lp) : -9999.0; }

}  // namespace

void ChoiceOutput::add(const StreamEvent& e) {
  text_ += e.text;
  tokens_.insert(tokens_.end(), e.tokens.begin(), e.tokens.end());
  if (!e.finish_reason.empty()) finish_reason_ = e.finish_reason;
  if (!e.error.empty()) error_ = e.error;
}

const std::string& ChoiceOutput::tool_call_id(size_t k) {
  while (tool_call_ids_.size() <= k) tool_call_ids_.push_back(new_id("call_"));
  return tool_call_ids_[k];
}

Json ChoiceOutput::tool_call_json(size_t k, const ToolCall& call) {
  return Json{{"id", tool_call_id(k)},
              {"type", "function"},
              {"function", {{"name", call.name}, {"arguments", call.arguments.dump()}}}};
}

Json ChoiceOutput::chat_delta() {
  Json d = Json::object();
  if (!parse_markup_) {
    if (auto more = extension(text_, sent_content_)) {
      d["content"] = *more;
      sent_content_ = text_;
    }
    return d;
  }
  const ParsedOutput p = parse_or_plain(finished() ? std::string_view(text_) : settled(text_));
  if (auto more = extension(p.thinking, sent_thinking_)) {
    d["reasoning_content"] = *more;
    sent_thinking_ = p.thinking;
  }
  if (auto more = extension(p.content, sent_content_)) {
    d["content"] = *more;
    sent_content_ = p.content;
  }
  if (p.tool_calls.size() > sent_tool_calls_) {
    Json calls = Json::array();
    for (size_t k = sent_tool_calls_; k < p.tool_calls.size(); ++k) {
      Json c = tool_call_json(k, p.tool_calls[k]);
      c["index"] = k;
      calls.push_back(c);
    }
    d["tool_calls"] = calls;
    sent_tool_calls_ = p.tool_calls.size();
  }
  return d;
}

std::string openai_finish_reason(const std::string& engine_reason) {
  return engine_reason == "context" ? "length" : engine_reason;
}

std::string ChoiceOutput::finish_reason() const {
  if (parse_markup_ && finish_reason_ == "stop" && !parse_or_plain(text_).tool_calls.empty()) return "tool_calls";
  return openai_finish_reason(finish_reason_);
}

Json ChoiceOutput::message() {
  Json m = {{"role", "assistant"}};
  if (!parse_markup_) {
    m["content"] = text_;
    return m;
  }
  const ParsedOutput p = parse_or_plain(text_);
  m["content"] = p.content.empty() && !p.tool_calls.empty() ? Json(nullptr) : Json(p.content);
  m["reasoning_content"] = p.thinking.empty() ? Json(nullptr) : Json(p.thinking);
  if (!p.tool_calls.empty()) {
    Json calls = Json::array();
    for (size_t k = 0; k < p.tool_calls.size(); ++k) calls.push_back(tool_call_json(k, p.tool_calls[k]));
    m["tool_calls"] = calls;
  }
  return m;
}

Json ChoiceOutput::chat_logprobs(const TextCodec* text, bool since_last) {
  Json content = Json::array();
  for (size_t i = since_last ? logprobs_sent_ : 0; i < tokens_.size(); ++i) {
    const GeneratedToken& t = tokens_[i];
    Json top = Json::array();
    for (const TokenLogprob& a : t.top)
      top.push_back({{"token", token_string(text, a.token)}, {"logprob", finite_logprob(a.logprob)},
                     {"bytes", token_bytes(text, a.token)}});
    content.push_back({{"token", token_string(text, t.token)}, {"logprob", finite_logprob(t.logprob)},
                       {"bytes", token_bytes(text, t.token)}, {"top_logprobs", top}});
  }
  logprobs_sent_ = tokens_.size();
  return Json{{"content", content}};
}

Json ChoiceOutput::completion_logprobs(const TextCodec* text, bool since_last, size_t text_offset_base) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  if (!since_last) logprobs_sent_ = 0, completion_offset_ = 0;
  for (size_t i = logprobs_sent_; i < tokens_.size(); ++i) {
    const GeneratedToken& t = tokens_[i];
    const std::string s = token_string(text, t.token);
    tokens.push_back(s);
    lps.push_back(finite_logprob(t.logprob));
    Json top = Json::object();
    for (const TokenLogprob& a : t.top) {
      const std::string as = token_string(text, a.token);
      if (!top.contains(as)) top[as] = finite_logprob(a.logprob);
    }
    tops.push_back(top);
    offsets.push_back(text_offset_base + completion_offset_);
    completion_offset_ += s.size();
  }
  logprobs_sent_ = tokens_.size();
  return Json{{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

Json usage_json(const RequestUsage& u) {
  return Json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens}}}};
}

std::string new_id(std::string_view prefix) {
  thread_local std::mt19937_64 rng{(uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()};
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

// ---- metrics ---------------------------------------------------------------------------------

namespace {

std::string label_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void metric(std::string& out, const char* name, const char* type, const char* help, const std::string& labels,
            double value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}{{{}}} {}\n", name, help, name, type, name, labels, value);
}

void histogram(std::string& out, const char* name, const char* help, const std::string& labels, const Histogram& h) {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  // Histogram::observe counts each observation in its own bucket; Prometheus buckets are cumulative.
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.counts.size(); ++i) {
    const std::string le = i < Histogram::kBounds.size() ? fmt::format("{}", Histogram::kBounds[i]) : "+Inf";
    cumulative += h.counts[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, le, cumulative);
  }
  out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, labels, h.sum, name, labels, h.total);
}

}  // namespace

std::string prometheus_text(const EngineMetrics& m, const std::string& model_name) {
  const std::string l = fmt::format("model_name=\"{}\"", label_value(model_name));
  std::string o;
  metric(o, "markbase_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", l, double(m.waiting));
  metric(o, "markbase_num_requests_running", "gauge", "Sequences in the running batch.", l, double(m.running));
  metric(o, "markbase_num_preemptions_total", "counter", "Sequences preempted (KV freed, recomputed later).", l,
         double(m.preempted_total));
  metric(o, "markbase_kv_pages_total", "gauge", "KV cache pages.", l, double(m.pages_total));
  metric(o, "markbase_kv_pages_used", "gauge", "KV cache pages held by sequences.", l, double(m.pages_used));
  metric(o, "markbase_kv_pages_free", "gauge", "KV cache pages not held by a sequence.", l,
         double(m.pages_total - m.pages_used));
  metric(o, "markbase_kv_pages_cached", "gauge", "Free KV pages still holding reusable prefix KV.", l,
         double(m.pages_cached));
  metric(o, "markbase_kv_page_tokens", "gauge", "Tokens per KV page.", l, double(m.page_tokens));
  metric(o, "markbase_kv_cache_usage_ratio", "gauge", "Fraction of KV pages held by sequences.", l,
         m.pages_total > 0 ? double(m.pages_used) / double(m.pages_total) : 0.0);
  metric(o, "markbase_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", l,
         double(m.prefix_query_tokens));
  metric(o, "markbase_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", l,
         double(m.prefix_hit_tokens));
  metric(o, "markbase_prefix_cache_hit_rate", "gauge", "Prefix cache hits over queries, in tokens, since start.", l,
         m.prefix_query_tokens > 0 ? double(m.prefix_hit_tokens) / double(m.prefix_query_tokens) : 0.0);
  metric(o, "markbase_prompt_tokens_total", "counter", "Prompt tokens processed.", l, double(m.prompt_tokens_total));
  metric(o, "markbase_generation_tokens_total", "counter", "Tokens generated.", l, double(m.generated_tokens_total));
  metric(o, "markbase_requests_finished_total", "counter", "Requests finished.", l, double(m.requests_finished));
  metric(o, "markbase_generation_tokens_per_second", "gauge", "Tokens generated per second, over the last seconds.", l,
         m.tokens_per_second);
  histogram(o, "markbase_time_to_first_token_seconds", "Submit to first token.", l, m.ttft);
  histogram(o, "markbase_inter_token_latency_seconds", "Time between a sequence's tokens.", l, m.itl);
  return o;
}

}  // namespace mb::server
