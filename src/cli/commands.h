#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace mb::cli {

void register_generate(CLI::App& app);
void register_logits(CLI::App& app);
void register_info(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_bench(CLI::App& app);
void register_quantize(CLI::App& app);
void register_serve(CLI::App& app);
void register_chat(CLI::App& app);

// $MARKBASE_MODEL, else the Gemma 3 270M GGUF that tools/setup.sh installs; throws if absent.
std::string default_model_path();

// "2,17,44" -> {2, 17, 44}; throws mb::Error naming `flag` on anything else.
std::vector<int32_t> parse_token_list(const std::string& s, const char* flag = "--tokens");

// --threads N, the same for every subcommand that runs a model.
constexpr int kMaxThreads = 4096;
void add_threads_option(CLI::App* cmd, int& threads);
// --mmproj FILE (llama.cpp's mmproj GGUF for a GGUF model's images and audio) and --image-tokens N.
void add_media_model_options(CLI::App* cmd, std::string& mmproj, int& image_tokens, bool& exact_media);

}  // namespace mb::cli
