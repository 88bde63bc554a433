// Issue 20's command-line items, as a user meets them: file-provided GGUF strings in errors,
// escaped and whole; a refused thread start as an error.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "core/error.h"
#include "core/printable.h"
#include "formats/gguf.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

// A shell command line's exit code and output (stdout and stderr together, as `2>&1 | cat` shows).
mbtest::CliResult run_shell(const std::string& script) {
  FILE* p = popen(("{ " + script + " ; } 2>&1").c_str(), "r");
  mbtest::CliResult r{-1, {}};
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

const std::string kCli = MARKBASE_CLI_PATH;

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

// ---- GGUF strings in errors ----------------------------------------------------------------------

TEST(CliGguf, PrintableEscapesAndTruncatesWithoutCutting) {
  using mb::printable;
  EXPECT_EQ(printable("plain.key"), "plain.key");
  EXPECT_EQ(printable(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(printable("\x1b[31mred\n"), "\\x1B[31mred\\x0A");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac"), "caf\xc3\xa9 \xe2\x82\xac");  // UTF-8 kept
  EXPECT_EQ(printable("bad \xff\xc3 \xed\xa0\x80 \xc2\x85"), "bad \\xFF\\xC3 \\xED\\xA0\\x80 \\xC2\\x85");
  EXPECT_EQ(printable("it's \"q\" \\"), "it\\'s \\\"q\\\" \\\\");
  EXPECT_EQ(printable(std::string(300, 'k')), std::string(200, 'k') + "... (300 bytes)");
  EXPECT_EQ(printable(std::string(199, 'k') + "\xc3\xa9xyz", 200), std::string(199, 'k') + "\xc3\xa9... (204 bytes)");
}

namespace {

// A GGUF v3 file with one metadata entry: `key` of GGUF type `type` with `value` bytes after it.
std::string gguf_with_entry(const std::string& key, uint32_t type, const std::string& value) {
  std::string b = "GGUF";
  auto put = [&](auto v) { b.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t(3));
  put(uint64_t(0));  // tensors
  put(uint64_t(1));  // metadata entries
  put(uint64_t(key.size()));
  b += key;
  put(type);
  return b + value;
}

std::string gguf_string(const std::string& s) {
  const uint64_t n = s.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + s;
}

}  // namespace

TEST(CliGguf, CorruptStringsArePrintedEscapedAndWhole) {
  const std::string dir = mbtest::temp_dir("cli_gguf_strings");
  // A key with a NUL and a terminal escape in it, of an unknown type.
  const std::string key = std::string("general.na\0me\x1b[2J", 17) + "_tail";
  write_bytes(dir + "/key.gguf", gguf_with_entry(key, 99, ""));
  auto r = mbtest::run_cli("info -m " + dir + "/key.gguf");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "metadata key 'general.na\\x00me\\x1B[2J_tail' has unknown value type 99")) << r.out;
  try {
    const std::string bytes = gguf_with_entry(key, 99, "");
    mb::GgufFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem");
    ADD_FAILURE() << "parsed";
  } catch (const mb::Error& e) {
    EXPECT_TRUE(has(e.what(), "_tail' has unknown value type 99")) << e.what();
  }
  // A string value with a NUL, shown by describe(): escaped, and cut only at 60 bytes.
  const std::string value = std::string("x\0y", 3) + std::string(100, 'z');
  write_bytes(dir + "/value.gguf", gguf_with_entry("general.alignment", 8, gguf_string(value)));
  r = mbtest::run_cli("info -m " + dir + "/value.gguf");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "general.alignment must be a UINT32, found STRING \"x\\x00y" + std::string(57, 'z') +
                             "... (103 bytes)\""))
      << r.out;
  // A long key of invalid UTF-8: escaped, truncated with its size.
  const std::string long_key = std::string(500, '\xfe');
  write_bytes(dir + "/long.gguf", gguf_with_entry(long_key, 99, ""));
  r = mbtest::run_cli("info -m " + dir + "/long.gguf");
  EXPECT_EQ(r.exit_code, 1);
  std::string shown;
  for (int i = 0; i < 200; ++i) shown += "\\xFE";
  EXPECT_TRUE(has(r.out, "metadata key '" + shown + "... (500 bytes)' has unknown value type 99")) << r.out;
  fs::remove_all(dir);
}

// ---- threads -------------------------------------------------------------------------------------

TEST(CliThreads, AFailedThreadStartIsAnErrorNotAnAbort) {
  // A 1 TB stack per thread: the system refuses the threads (address space or overcommit).
  const auto r = run_shell("ulimit -s 1000000000 && " + kCli + " generate -m " + mbtest::fixture("e2b_like") +
                           " --tokens 2,3 -n 1 --threads 400");
  if (has(r.out, "ulimit")) GTEST_SKIP() << "cannot raise the stack limit here: " << r.out;
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_FALSE(has(r.out, "terminate called")) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("error: cannot start 400 threads: [0-9]+ started, then the system "
                                                  "refused another \\(Resource temporarily unavailable\\)")))
      << r.out;
}

#if !defined(__SANITIZE_ADDRESS__)  // ASan reserves terabytes of address space: no room for a limit
TEST(CliThreads, SomeThreadsStartedAreJoinedBeforeTheError) {
  const auto r = run_shell("ulimit -v 1000000 && " + kCli + " generate -m " + mbtest::fixture("e2b_like") +
                           " --tokens 2,3 -n 1 --threads 400");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("cannot start 400 threads: ([0-9]+) started"))) << r.out;
  EXPECT_GT(std::stoi(m[1]), 1) << r.out;
  EXPECT_LT(std::stoi(m[1]), 400) << r.out;
}
#endif
