// Helpers shared by tests: fixture paths, running the CLI, reading binary logits.
#pragma once
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mbtest {

inline std::string source_dir() { return MARKBASE_SOURCE_DIR; }
inline std::string fixture(const std::string& name) { return source_dir() + "/tests/fixtures/" + name; }
inline std::string shared_dir() { return source_dir() + "/../shared"; }

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

inline std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<float> v(size_t(in.tellg()) / 4);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * 4));
  return v;
}

struct CliResult {
  int exit_code;
  std::string out;  // stdout and stderr together
};

inline CliResult run_cli(const std::string& args) {
  std::string cmd = std::string(MARKBASE_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  CliResult r{-1, {}};
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

inline std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("markbase_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace mbtest
