// The fuzz targets of tools/fuzz.sh, linked into one libFuzzer binary; MARKBASE_FUZZ_TARGET picks
// the one a run feeds (fuzz_main.cpp). Each takes any bytes: an mb::Error (and, where JSON is
// parsed, nlohmann's parse error) is the expected answer to bad input; anything else (a crash, a
// sanitizer report, another exception, a hang, runaway memory or recursion) is a finding.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mbfuzz {

void write_file(const std::string& path, const std::string& bytes);

// GGUF and safetensors files (fuzz_files.cpp).
void fuzz_files(const uint8_t* data, size_t size);
void write_file_seeds(const std::string& dir);

// Jinja template source, rendered with a conversation of every shape the templates read
// (fuzz_chat.cpp).
void fuzz_jinja(const uint8_t* data, size_t size);
void write_jinja_seeds(const std::string& dir);

// A chat request as a server receives it: JSON bytes -> {messages, tools, add_generation_prompt,
// enable_thinking, chat_template_kwargs} -> the real Gemma 4 template -> token ids; and the same
// bytes through the OpenAI adapter's chat, completion, tokenize and detokenize parsing.
void fuzz_request(const uint8_t* data, size_t size);
void write_request_seeds(const std::string& dir);

// Generated Gemma 4 text -> thinking, tool calls, content (parse_gemma4_output / _value).
void fuzz_output(const uint8_t* data, size_t size);
void write_output_seeds(const std::string& dir);

}  // namespace mbfuzz
