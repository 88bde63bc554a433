#include "cli/files.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <memory>

#include "core/error.h"

namespace mb::cli {

namespace fs = std::filesystem;

std::string read_file(const std::string& path, const char* what) {
  if (path == "-") {
    std::string s(std::istreambuf_iterator<char>(std::cin), {});
    MB_CHECK(!std::cin.bad(), "cannot read the {} from stdin: {}", what, std::strerror(errno));
    return s;
  }
  MB_CHECK(!fs::is_directory(path), "{} {} is a directory", what, path);
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!f) fail("cannot open {} {}: {}", what, path, std::strerror(errno));
  std::string s;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f.get())) > 0;) s.append(buf, n);
  if (std::ferror(f.get())) fail("cannot read {} {}: {}", what, path, std::strerror(errno));
  return s;
}

void write_file(const std::string& path, const void* data, size_t n) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!f) fail("cannot open {} for writing: {}", path, std::strerror(errno));
  if (n > 0 && std::fwrite(data, 1, n, f.get()) != n) fail("error writing {}: {}", path, std::strerror(errno));
  if (std::fclose(f.release()) != 0) fail("error writing {}: {}", path, std::strerror(errno));
}

namespace {

// Whether a and b name the same file: the same inode when both exist, else the same path once
// `.`, `..` and links are resolved.
bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  const fs::path ca = fs::weakly_canonical(a, ec);
  if (ec) return false;
  const fs::path cb = fs::weakly_canonical(b, ec);
  return !ec && ca == cb;
}

}  // namespace

void check_output_path(const std::string& in, const std::string& out, const char* cmd) {
  MB_CHECK(!fs::is_directory(out), "{}: OUT {} is a directory; give a file name, such as {}/model.gguf", cmd, out,
           fs::path(out).string());
  MB_CHECK(!same_file(in, out), "{}: OUT {} is the input file itself, which the output must not overwrite", cmd, out);
  MB_CHECK(!same_file(in, out + ".part"), "{}: the input {} is OUT.part, the temporary file OUT is written as; "
           "rename the input or choose another OUT", cmd, in);
}

namespace {

// The temporary file to remove when a signal ends the process. A fixed buffer: the handler may
// only make async-signal-safe calls (unlink, signal, raise), so it cannot touch a std::string.
char g_temp_path[4096];
volatile sig_atomic_t g_temp_armed = 0;
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_previous[std::size(kSignals)];

extern "C" void remove_temp_and_reraise(int sig) {
  if (g_temp_armed) unlink(g_temp_path);
  signal(sig, SIG_DFL);  // then end the process as the signal would have
  raise(sig);
}

}  // namespace

PartialOutput::PartialOutput(std::string out) : out_(std::move(out)), temp_(out_ + ".part") {
  MB_CHECK(!g_temp_armed, "one partial output at a time");
  MB_CHECK(temp_.size() < sizeof g_temp_path, "output path too long: {}", out_);
  std::memcpy(g_temp_path, temp_.c_str(), temp_.size() + 1);
  g_temp_armed = 1;
  struct sigaction sa {};
  sa.sa_handler = remove_temp_and_reraise;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    sigaction(kSignals[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler != SIG_IGN) sigaction(kSignals[i], &sa, nullptr);  // nohup's SIGHUP stays ignored
  }
}

PartialOutput::~PartialOutput() {
  if (!committed_) {
    std::error_code ec;
    fs::remove(temp_, ec);
  }
  g_temp_armed = 0;
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
}

void PartialOutput::commit() {
  std::error_code ec;
  fs::rename(temp_, out_, ec);
  if (ec) fail("cannot rename {} to {}: {}", temp_, out_, ec.message());
  committed_ = true;
  g_temp_armed = 0;
}

void PartialOutput::die_with_parent(pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) raise(SIGTERM);  // it died before prctl
}

}  // namespace mb::cli
