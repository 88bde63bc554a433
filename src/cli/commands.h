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

// $MARKBASE_MODEL, else the Gemma 3 270M GGUF that tools/setup.sh installs; throws if absent.
std::string default_model_path();

// "2,17,44" -> {2, 17, 44}; throws mb::Error on anything else.
std::vector<int32_t> parse_token_list(const std::string& s);

}  // namespace mb::cli
