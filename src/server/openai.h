// The OpenAI API over the runtime, without the HTTP: request bodies in (checked field by field,
// every mistake an ApiError naming the field), GenerationOptions and prompt ids out; the engine's
// events in, OpenAI's response objects, stream chunks and errors out. http_server.cpp only moves
// bytes between these functions and the sockets.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/media_encoder.h"
#include "runtime/request.h"
#include "tokenizer/chat.h"

namespace mb {
class TextCodec;
}

namespace mb::server {

using Json = nlohmann::ordered_json;

// An answer other than 200, as OpenAI writes it: {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "");
  int status;
  std::string param, code;
  std::string type() const;  // from the status: invalid_request_error, not_found_error ...
  Json body() const;
};

// What the adapter needs to know about the served model.
struct ModelInfo {
  std::string name;            // what clients send as "model"
  int64_t max_context = 0;     // tokens per sequence, prompt included
  int32_t vocab_size = 0;
  const TextCodec* text = nullptr;  // nullptr: the model has no tokenizer (token-id prompts only)
  // The model writes its thinking and tool calls with Gemma 4's markup (<|channel>, <|tool_call>),
  // known from its vocabulary; its chat output then goes through parse_gemma4_output.
  bool gemma4_markup = false;
  double default_timeout_seconds = 0;  // the server's --timeout, for requests that give none
  // Local files a client may name as media lie under this folder (resolved, links followed);
  // empty: none. URLs are never fetched.
  std::string allowed_media_dir;
};

ModelInfo describe_model(const TextCodec* text, std::string name, int64_t max_context, int32_t vocab_size,
                         double default_timeout_seconds);

// A request body as JSON: 400 for invalid UTF-8, malformed JSON or anything but an object.
Json parse_body(std::string_view body);

enum class Endpoint { Chat, Completion };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::Chat;
  std::vector<int32_t> prompt;
  GenerationOptions gen;
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage
  bool parse_markup = false;    // chat output split into content, reasoning_content, tool_calls
  std::string echo;             // completions with echo: the prompt text, put before each choice's
  int completion_logprobs = -1; // completions: the "logprobs" number asked for, -1 when none
  std::vector<MediaItem> media; // chat: images and audio of the messages, in order
};

// POST /v1/chat/completions and /v1/completions. Throws ApiError (400, or 404 for another model).
ParsedRequest parse_chat_request(const Json& body, const ModelInfo& model);
ParsedRequest parse_completion_request(const Json& body, const ModelInfo& model);

// POST /tokenize ({"prompt"} or {"messages"}) and /detokenize ({"tokens"}), as vLLM answers them.
Json tokenize(const Json& body, const ModelInfo& model);
Json detokenize(const Json& body, const ModelInfo& model);

// GET /v1/models.
Json model_list(const ModelInfo& model, int64_t created);

// One choice's output as the engine's events arrive: its text, tokens and finish reason, and the
// parts of it already sent as stream deltas.
class ChoiceOutput {
 public:
  explicit ChoiceOutput(bool parse_markup) : parse_markup_(parse_markup) {}

  void add(const StreamEvent& e);
  bool finished() const { return !finish_reason_.empty(); }
  const std::string& text() const { return text_; }
  const std::string& engine_finish_reason() const { return finish_reason_; }
  const std::string& error() const { return error_; }

  // What the text added since the last call releases as a chat delta: {"content"},
  // {"reasoning_content"}, {"tool_calls": [...]} or nothing ({}). Text that may still turn out to
  // be markup (a marker cut between events, an unfinished tool call) is held until it is known.
  Json chat_delta();
  // OpenAI's finish reason: "tool_calls" when the reply is tool calls, "length" for max_tokens or
  // a full context; the engine's own word otherwise ("stop", "cancelled", "timeout", "error").
  std::string finish_reason() const;
  // The whole reply as a chat message.
  Json message();
  // Logprobs of the tokens added since the last call (chat: {"content": [...]}; completions:
  // {"tokens", "token_logprobs", "top_logprobs", "text_offset"}); null when none were asked for.
  Json chat_logprobs(const TextCodec* text, bool since_last);
  Json completion_logprobs(const TextCodec* text, bool since_last, size_t text_offset_base);

 private:
  bool parse_markup_;
  std::string text_, finish_reason_, error_;
  std::vector<GeneratedToken> tokens_;
  size_t logprobs_sent_ = 0;
  // What chat_delta() has released so far.
  std::string sent_content_, sent_thinking_;
  size_t sent_tool_calls_ = 0;
  std::vector<std::string> tool_call_ids_;  // the same id in the stream and in message()
  size_t completion_offset_ = 0;            // text_offset of the next completion logprob
  const std::string& tool_call_id(size_t k);
  Json tool_call_json(size_t k, const ToolCall& call);
};

// "length" for the engine's "length" and "context", the engine's word otherwise.
std::string openai_finish_reason(const std::string& engine_reason);

// {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}.
Json usage_json(const RequestUsage& u);

// A random id with the given prefix: "chatcmpl-" + 24 hex digits.
std::string new_id(std::string_view prefix);

// Prometheus text for GET /metrics.
std::string prometheus_text(const EngineMetrics& m, const std::string& model_name);

}  // namespace mb::server
