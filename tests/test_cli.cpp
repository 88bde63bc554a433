// Issue 20's command-line items, as a user meets them: file-provided GGUF strings in errors,
// escaped and whole; a refused thread start as an error; requests with random seeds, system
// prompts, stop strings and the context's limit; quantize's output file (OUT.part removed on an
// interrupt, OUT never the input) and the system's reason in file errors.
#include <fcntl.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/printable.h"
#include "formats/gguf.h"
#include "markbase/markbase.h"
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

// ---- the library's requests: seeds, system prompts, stop strings, the context ----------------------

namespace {

std::unique_ptr<markbase::Engine> open_fixture(const char* name, int64_t max_context = 0) {
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture(name);
  o.max_context = max_context;
  return markbase::Engine::open(o);
}

// 12 tokens sampled at temperature 1 after a fixed prompt.
markbase::Request sampled_request() {
  markbase::Request req;
  req.prompt_tokens = {2, 10, 20, 30};
  req.max_new_tokens = 12;
  req.stop_at_eos = false;
  req.sampling.temperature = 1;
  return req;
}

std::string joined(const std::vector<int32_t>& ids) { return fmt::format("{}", fmt::join(ids, ",")); }

// Byte offset of the last UTF-8 character of s.
size_t last_char_start(const std::string& s) {
  size_t i = s.size() - 1;
  while (i > 0 && (uint8_t(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

size_t first_char_size(const std::string& s) {
  size_t n = 1;
  while (n < s.size() && (uint8_t(s[n]) & 0xC0) == 0x80) ++n;
  return n;
}

// Greedy text of e2b_like after {2, 10, 20, 30}, and a stop string of two characters in it (the
// last of one token's text and the first of the next's) whose first occurrence spans two tokens.
struct StopCase {
  markbase::Request req;
  markbase::Result full;
  std::string stop;
  size_t at = 0;      // where the stop string first starts in full.text
  size_t tokens = 0;  // tokens up to the one whose text completes it
};

StopCase stop_case(markbase::Engine& engine) {
  StopCase c;
  c.req.prompt_tokens = {2, 10, 20, 30};
  c.req.max_new_tokens = 24;
  c.req.stop_at_eos = false;
  std::vector<std::string> pieces;
  c.req.on_token = [&](int32_t, std::string_view p) {
    pieces.emplace_back(p);
    return true;
  };
  c.full = engine.generate(c.req);
  c.req.on_token = nullptr;
  auto token_at = [&](size_t i) {  // the token whose text holds byte i
    size_t t = 0;
    for (size_t end = pieces[0].size(); end <= i; end += pieces[++t].size()) {
    }
    return t;
  };
  for (size_t k = 0; k + 1 < c.full.tokens.size() && c.stop.empty(); ++k) {
    if (pieces[k].empty() || pieces[k + 1].empty()) continue;
    const std::string s =
        pieces[k].substr(last_char_start(pieces[k])) + pieces[k + 1].substr(0, first_char_size(pieces[k + 1]));
    c.at = c.full.text.find(s);
    c.tokens = token_at(c.at + s.size() - 1) + 1;
    if (token_at(c.at) + 1 < c.tokens) c.stop = s;
  }
  return c;
}

}  // namespace

TEST(EngineRequest, NoSeedDrawsOneAndReportsIt) {
  auto engine = open_fixture("e2b_like");
  markbase::Request req = sampled_request();
  req.sampling.seed = 11;
  const markbase::Result given = engine->generate(req);
  EXPECT_EQ(given.seed, 11u);
  req.sampling.seed.reset();
  const markbase::Result x = engine->generate(req), y = engine->generate(req);
  EXPECT_NE(x.seed, y.seed);
  EXPECT_NE(x.tokens, y.tokens);  // 12 draws from a near-flat distribution
  req.sampling.seed = x.seed;
  EXPECT_EQ(engine->generate(req).tokens, x.tokens);
}

TEST(EngineRequest, SystemPromptIsATurnBeforeTheUsers) {
  for (const char* fixture : {"e2b_like", "gemma3_like"}) {
    auto engine = open_fixture(fixture);
    markbase::Request req;
    req.prompt = "Hello";
    req.chat = true;
    req.max_new_tokens = 0;
    const std::vector<int32_t> plain = engine->generate(req).prompt_ids;
    req.system_prompt = "Answer_in_French.";  // no spaces: the fixtures' tokenizers decode them as ▁
    const std::vector<int32_t> ids = engine->generate(req).prompt_ids;
    EXPECT_NE(ids, plain) << fixture;
    EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1) << fixture;  // one <bos>
    const std::string rendered = engine->detokenize(ids);
    ASSERT_NE(rendered.find(req.system_prompt), std::string::npos) << rendered;
    EXPECT_LT(rendered.find(req.system_prompt), rendered.find(req.prompt)) << rendered;
    req.chat = false;
    EXPECT_THROW(engine->generate(req), markbase::Error) << fixture;
  }
}

TEST(EngineRequest, StopStringsEndTheTextAcrossTokenBoundaries) {
  auto engine = open_fixture("e2b_like");
  StopCase c = stop_case(*engine);
  ASSERT_EQ(c.full.finish_reason, "length");
  ASSERT_FALSE(c.stop.empty()) << c.full.text;
  c.req.stop = {"never produced \x01", c.stop};
  std::string streamed;
  c.req.on_token = [&](int32_t, std::string_view p) {
    streamed += p;
    EXPECT_EQ(streamed.find(c.stop), std::string::npos) << "the stop string was streamed";
    return true;
  };
  const markbase::Result cut = engine->generate(c.req);
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.text, c.full.text.substr(0, c.at));
  EXPECT_EQ(streamed, cut.text);
  EXPECT_EQ(cut.tokens, std::vector<int32_t>(c.full.tokens.begin(), c.full.tokens.begin() + long(c.tokens)));
  // No occurrence: the whole text, finish "length".
  c.req.stop = {"never produced \x01"};
  c.req.on_token = nullptr;
  const markbase::Result none = engine->generate(c.req);
  EXPECT_EQ(none.text, c.full.text);
  EXPECT_EQ(none.finish_reason, "length");
  c.req.stop = {""};
  EXPECT_THROW(engine->generate(c.req), markbase::Error);
}

TEST(EngineRequest, APromptOfUpToTheContextFitsAndFillingItIsReported) {
  auto engine = open_fixture("gemma3_like", 8);
  auto whole = open_fixture("gemma3_like");
  markbase::Request req;
  req.prompt_tokens = {2, 10, 20, 30, 40};
  req.max_new_tokens = 100;
  req.stop_at_eos = false;
  // n = 5 of 8: ctx - n + 1 = 4 tokens, the same the model's whole context gives.
  const markbase::Result full = engine->generate(req);
  EXPECT_EQ(full.finish_reason, "context");
  req.max_new_tokens = 4;
  const markbase::Result exact = engine->generate(req);
  EXPECT_EQ(exact.finish_reason, "length");  // -n and the context end together: -n is why
  EXPECT_EQ(full.tokens, exact.tokens);
  EXPECT_EQ(whole->generate(req).tokens, exact.tokens);
  // n = ctx: one token, and logits for every position.
  req.prompt_tokens = {2, 10, 20, 30, 40, 50, 60, 70};
  req.max_new_tokens = 5;
  const markbase::Result one = engine->generate(req);
  EXPECT_EQ(one.tokens.size(), 1u);
  EXPECT_EQ(one.finish_reason, "context");
  EXPECT_EQ(engine->prompt_logits(req.prompt_tokens).size(), 8u * size_t(engine->info().vocab_size));
  // One more fits neither.
  req.prompt_tokens.push_back(80);
  for (int run = 0; run < 2; ++run) {
    try {
      if (run == 0) engine->generate(req);
      else engine->prompt_logits(req.prompt_tokens);
      ADD_FAILURE() << "a prompt of 9 tokens ran in a context of 8";
    } catch (const markbase::Error& e) {
      EXPECT_TRUE(has(e.what(), "prompt of 9 tokens exceeds the context size 8")) << e.what();
    }
  }
  EXPECT_THROW(open_fixture("gemma3_like", 40000), markbase::Error);  // the model holds 32768
}

// ---- quantize's output ---------------------------------------------------------------------------

TEST(CliQuantize, RefusesToOverwriteItsInputHoweverSpelled) {
  const std::string dir = mbtest::temp_dir("cli_same");
  auto r = mbtest::run_cli("quantize " + mbtest::fixture("e2b_like") + " " + dir + "/m.gguf --type f32");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto size = fs::file_size(dir + "/m.gguf");
  fs::create_symlink("m.gguf", dir + "/link.gguf");
  fs::create_directory(dir + "/sub");
  fs::copy_file(dir + "/m.gguf", dir + "/x.gguf.part");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"m.gguf ./m.gguf", "OUT ./m.gguf is the input file itself"},
      {"m.gguf sub/../m.gguf", "OUT sub/../m.gguf is the input file itself"},
      {"m.gguf link.gguf", "OUT link.gguf is the input file itself"},
      {"m.gguf sub", "OUT sub is a directory"},
      {"x.gguf.part x.gguf", "the input x.gguf.part is OUT.part"},
  };
  for (const auto& [args, expected] : cases) {
    r = run_shell("cd " + dir + " && " + kCli + " quantize " + args + " --type q8_0");
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "error: quantize: " + expected)) << args << "\n" << r.out;
  }
  EXPECT_EQ(fs::file_size(dir + "/m.gguf"), size);
  EXPECT_EQ(fs::file_size(dir + "/x.gguf.part"), size);
  fs::remove_all(dir);
}

TEST(CliQuantize, ErrorsCarryTheSystemsReason) {
  const std::string dir = mbtest::temp_dir("cli_errno");
  const std::string in = mbtest::fixture("e2b_like");
  auto r = mbtest::run_cli("quantize " + in + " " + dir + "/missing/out.gguf --type f32");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "cannot open " + dir + "/missing/out.gguf.part for writing: No such file or directory"))
      << r.out;
  // Permission denied: sysfs refuses new files even to root; elsewhere a read-only folder does.
  std::string denied = "/sys/kernel";
  if (geteuid() != 0) {
    denied = dir + "/ro";
    fs::create_directory(denied);
    chmod(denied.c_str(), 0555);
  }
  if (fs::is_directory(denied)) {
    r = mbtest::run_cli("quantize " + in + " " + denied + "/out.gguf --type f32");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_TRUE(has(r.out, "cannot open " + denied + "/out.gguf.part for writing: Permission denied")) << r.out;
  }
  r = mbtest::run_cli("logits -m " + in + " --tokens 2,3 -o " + dir + "/missing/l.bin");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "cannot open " + dir + "/missing/l.bin for writing: No such file or directory")) << r.out;
  r = mbtest::run_cli("logits -m " + in + " --tokens 2,3 -o " + dir);
  EXPECT_TRUE(has(r.out, "cannot open " + dir + " for writing: Is a directory")) << r.out;
  r = mbtest::run_cli("tokenize -m " + in + " --messages " + dir + "/missing.json");
  EXPECT_TRUE(has(r.out, "cannot open JSON file " + dir + "/missing.json: No such file or directory")) << r.out;
  chmod((dir + "/ro").c_str(), 0755);
  fs::remove_all(dir);
}

TEST(CliQuantize, AnInterruptRemovesThePartialOutput) {
  const std::string dir = mbtest::temp_dir("cli_sigint");
  // An input big enough that writing OUT.part takes a while: the tiny synthetic model in f32.
  const auto made = mbtest::run_cli("bench --synthetic tiny --dtype f32 --pp 0 --tg 0 --save " + dir + "/big.gguf");
  if (made.exit_code != 0 && has(made.out, "tokenizer")) GTEST_SKIP() << made.out;
  ASSERT_EQ(made.exit_code, 0) << made.out;
  const std::string out = dir + "/out.gguf", part = out + ".part";
  int interrupted = 0;
  for (int attempt = 0; attempt < 20 && interrupted < 2; ++attempt) {
    const int sig = interrupted == 0 ? SIGINT : SIGTERM;
    fs::remove(out);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, 2);
      execl(kCli.c_str(), kCli.c_str(), "quantize", (dir + "/big.gguf").c_str(), out.c_str(), "--type", "f32",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    // Signal as soon as OUT.part appears.
    bool seen = false;
    int status = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (!seen && fs::exists(part)) {
        seen = true;
        kill(pid, sig);
      }
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) kill(pid, SIGKILL);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!seen || fs::exists(out)) continue;  // finished before the signal landed: try again
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_FALSE(fs::exists(part)) << "signal " << sig << " left " << part;
    ++interrupted;
  }
  EXPECT_EQ(interrupted, 2) << "never caught quantize while it wrote " << part;
  fs::remove_all(dir);
}
