// The command line as a user meets it (issue 20): flag errors that say what is wrong and exit 1,
// failed thread starts as errors, random seeds that can be repeated, prompts from files and stdin,
// system prompts, stop strings, the context limit, quantize's output file handling, escaped GGUF
// strings in errors, and the stats line on its own line in a pipe.
#include <fcntl.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "cli/flags.h"
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

std::string sh_quote(const std::string& s) {  // for sh
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

const std::string kCli = MARKBASE_CLI_PATH;

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

// The last line of the output: --print-ids' ids.
std::string last_line(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s.substr(s.rfind('\n') + 1);
}

// "seed: N" as --verbose prints it.
std::string printed_seed(const std::string& out) {
  std::smatch m;
  return std::regex_search(out, m, std::regex("seed: +([0-9]+)")) ? m[1].str() : "";
}

std::string printed_prompt_ids(const std::string& out) {
  std::smatch m;
  return std::regex_search(out, m, std::regex("prompt ids: ([0-9,]+)")) ? m[1].str() : "";
}

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

// ==== the command line ================================================================================

// ---- flags ---------------------------------------------------------------------------------------

TEST(CliFlags, ErrorsSayWhatIsWrongAndWhatIsAllowedAndExit1) {
  const std::string m = " -m " + mbtest::fixture("e2b_like");
  std::vector<std::pair<std::string, std::string>> cases = {
      {"generate -p hi -n -1" + m, "-n/--n-predict: expected a whole number from 0 to 2147483647, got '-1'"},
      {"generate -p hi -n abc" + m, "-n/--n-predict: expected a whole number from 0 to 2147483647, got 'abc'"},
      {"generate -p hi -n 1.5" + m, "got '1.5'"},
      {"generate -p hi --temperature -1" + m, "--temperature: expected a number >= 0, got '-1'"},
      {"generate -p hi --temperature nan" + m, "--temperature: expected a number >= 0, got 'nan'"},
      {"generate -p hi --top-k -2" + m, "--top-k: expected a whole number from 0 to 2147483647, got '-2'"},
      {"generate -p hi --top-p 0" + m, "--top-p: expected a number > 0 and <= 1, got '0'"},
      {"generate -p hi --min-p 1.5" + m, "--min-p: expected a number from 0 to 1, got '1.5'"},
      {"generate -p hi --threads -3" + m, "--threads: expected a whole number from 0 to 4096, got '-3'"},
      {"generate -p hi --threads 5000" + m, "--threads: expected a whole number from 0 to 4096, got '5000'"},
      {"generate -p hi -c -5" + m, "-c/--ctx: expected a whole number >= 0, got '-5'"},
      {"generate -p hi --seed -2" + m,
       "--seed: expected a whole number from 0 to 18446744073709551615, or -1 for a random seed, got '-2'"},
      {"generate -p hi --seed 18446744073709551616" + m, "got '18446744073709551616'"},
      {"generate -p hi --system x" + m, "--system requires --chat"},
      {"logits --tokens 1 -o x --chunk -1" + m, "--chunk: expected a whole number from 0 to 2147483647, got '-1'"},
      {"logits --tokens 1" + m, "-o/--output is required"},
      {"bench --synthetic tiny --pp -1", "--pp: expected a whole number from 0 to 1048576, got '-1'"},
      {"bench --synthetic tiny --tg abc", "--tg: expected a whole number from 0 to 1048576, got 'abc'"},
      {"bench --synthetic tiny --reps 0", "--reps: expected a whole number from 1 to 1000000, got '0'"},
      {"bench --synthetic tiny --membw-mb -5", "--membw-mb: expected a whole number from 0 to 16777216"},
      {"bench --synthetic tiny --batch 0", "--batch: batch size 0 is not from 1 to 1024"},
      {"bench --synthetic tiny --batch 1,x", "--batch: 'x' is not a whole number from 0 to 2147483647"},
      {"bench --synthetic tiny --threads 99999", "--threads: expected a whole number from 0 to 4096"},
      // Unknown options are named as such (CLI11 alone reads -ngl as -n gl), with a hint.
      {"generate -p hi -ngl 99" + m, "unknown option '-ngl' for markbase generate: MarkBase runs the whole model on "
                                     "one device: --device cuda"},
      {"generate -p hi --n-gpu-layers 99" + m, "unknown option '--n-gpu-layers'"},
      {"generate -p hi -t 4" + m, "unknown option '-t' for markbase generate: llama.cpp's -t is --threads here"},
      {"generate -p hi --temp 0.5" + m, "llama.cpp's --temp is --temperature here"},
      {"generate -p hi --ctx-size 64" + m, "llama.cpp's --ctx-size is -c/--ctx here"},
      {"generate -p hi --top_k 3" + m, "unknown option '--top_k' for markbase generate; did you mean --top-k?"},
      {"generate -p hi --bogus" + m, "unknown option '--bogus' for markbase generate"},
      {"bench -p 512", "llama.cpp's -p is --pp here"},
      {"serve --kv-mem 4X" + m, "--kv-mem: expected a size such as 512M, 4G or a number of bytes, got '4X'"},
      {"serve --kv-mem -1G" + m, "got '-1G'"},
      {"serve --port 70000" + m, "--port: expected a whole number from 0 to 65535, got '70000'"},
      {"serve --max-seqs 0" + m, "--max-seqs: expected a whole number from 1 to 4096, got '0'"},
      {"serve -np 4" + m, "llama.cpp's -np is --max-seqs here"},
      {"chat --top-p 0" + m, "--top-p: expected a number > 0 and <= 1, got '0'"},
      {"foo", "unknown subcommand 'foo' (subcommands: generate, logits, info, tokenize, bench, quantize, serve, chat)"},
      {"", "give a subcommand: generate, logits, info, tokenize, bench, quantize"},
      {m + " generate -p hi", "unknown option '-m' before the subcommand"},
  };
  if (!mb::cuda_device_available()) {
    // Without a GPU (CI's machines), or in a build without CUDA, --device cuda is a clear error.
    cases.push_back({"generate --tokens 2,3 -n 1 --device cuda" + m, "device 'cuda': "});
    cases.push_back({"bench --synthetic tiny --device cuda --pp 4 --tg 0", "device 'cuda': "});
  }
  for (const auto& [args, expected] : cases) {
    const auto r = mbtest::run_cli(args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "error: ")) << args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, expected)) << args << "\n" << r.out;
    EXPECT_FALSE(has(r.out, "17976931348623157")) << args;  // the 309-digit range CLI11 printed
  }
}

TEST(CliFlags, SizesTakeBinaryUnits) {
  EXPECT_EQ(mb::cli::parse_size("512M", "--kv-mem"), size_t(512) << 20);
  EXPECT_EQ(mb::cli::parse_size("4G", "--kv-mem"), size_t(4) << 30);
  EXPECT_EQ(mb::cli::parse_size("1.5GiB", "--kv-mem"), size_t(3) << 29);
  EXPECT_EQ(mb::cli::parse_size("64k", "--kv-mem"), size_t(64) << 10);
  EXPECT_EQ(mb::cli::parse_size("1000", "--kv-mem"), size_t(1000));
  EXPECT_EQ(mb::cli::parse_size("2TB", "--kv-mem"), size_t(2) << 40);
  for (const char* bad : {"", "M", "4X", "4MM", "-1G", "inf", "1e30G", "4 G"})
    EXPECT_THROW(mb::cli::parse_size(bad, "--kv-mem"), mb::Error) << bad;
}

TEST(CliFlags, ValuesThatLookLikeOptionsStayValues) {
  const std::string m = " -m " + mbtest::fixture("e2b_like");
  // A prompt that starts with a dash, and a value glued to -n.
  auto r = mbtest::run_cli("generate -p -ngl -n2 --print-ids" + m);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string ids = last_line(r.out);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ','), 1) << r.out;  // two ids
  r = mbtest::run_cli("generate --prompt=-x -n 1" + m);
  EXPECT_EQ(r.exit_code, 0) << r.out;
}

TEST(CliFlags, HelpShowsDefaultsAndVersionExists) {
  auto r = mbtest::run_cli("generate --help");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "tokens to generate, at most (default: 32)")) << r.out;
  EXPECT_TRUE(has(r.out, "(default: random)")) << r.out;
  EXPECT_TRUE(has(r.out, "--threads INT:[0, 4096]")) << r.out;
  r = mbtest::run_cli("bench --help");
  EXPECT_TRUE(has(r.out, "prompt tokens per sequence (default: 512)")) << r.out;
  r = mbtest::run_cli("--version");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("^markbase [0-9]+\\.[0-9]+\\.[0-9]+"))) << r.out;
}

// MARKBASE_PROFILE_OPS=1: the op table of the whole run on stderr when it ends, from any command; the
// output itself is unchanged (the profiler forwards every op).
TEST(CliProfileOps, TheRunsOpTableWhenAsked) {
  const std::string cmd = "generate -m " + mbtest::fixture("e2b_like") + " --tokens 2,3,4 -n 3 --print-ids";
  const auto plain = mbtest::run_cli(cmd);
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_FALSE(has(plain.out, "MARKBASE_PROFILE_OPS")) << plain.out;
  ::setenv("MARKBASE_PROFILE_OPS", "1", 1);
  const auto profiled = mbtest::run_cli(cmd);
  ::unsetenv("MARKBASE_PROFILE_OPS");
  ASSERT_EQ(profiled.exit_code, 0) << profiled.out;
  EXPECT_TRUE(has(profiled.out, "MARKBASE_PROFILE_OPS: cpu backend")) << profiled.out;
  EXPECT_TRUE(std::regex_search(profiled.out, std::regex("\\n +[0-9.]+ +[0-9.]+% +[0-9]+ +[0-9.]+ +matmul "))) << profiled.out;
  EXPECT_TRUE(has(profiled.out, "attention")) << profiled.out;
  // The generated ids are the unprofiled run's.
  const auto ids = [](const std::string& out) {
    std::smatch m;
    return std::regex_search(out, m, std::regex("(^|\\n)([0-9]+(,[0-9]+)*)\\n")) ? m[2].str() : std::string();
  };
  EXPECT_FALSE(ids(plain.out).empty()) << plain.out;
  EXPECT_EQ(ids(plain.out), ids(profiled.out)) << profiled.out;
}

// ---- threads: the warning -----------------------------------------------------------------------

TEST(CliThreads, FarMoreThreadsThanCoresWarn) {
  const int cores = mb::cli::usable_cores();
  const std::string base = "generate -m " + mbtest::fixture("e2b_like") + " --tokens 2,3 -n 1 --threads ";
  auto r = mbtest::run_cli(base + std::to_string(2 * cores + 1));
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "warning: --threads " + std::to_string(2 * cores + 1) + " is more than twice the " +
                             std::to_string(cores) + " core"))
      << r.out;
  r = mbtest::run_cli(base + std::to_string(cores));
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_FALSE(has(r.out, "warning")) << r.out;
}

// ---- seeds ---------------------------------------------------------------------------------------

TEST(CliSeed, NoSeedIsRandomAndThePrintedSeedRepeatsTheRun) {
  const std::string base = "generate -m " + mbtest::fixture("e2b_like") +
                           " --tokens 2,10,20,30 -n 12 --temperature 1 --ignore-eos --print-ids --verbose";
  const auto a = mbtest::run_cli(base), b = mbtest::run_cli(base), c = mbtest::run_cli(base + " --seed -1");
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_EQ(b.exit_code, 0) << b.out;
  ASSERT_EQ(c.exit_code, 0) << c.out;
  const std::string seed = printed_seed(a.out);
  ASSERT_FALSE(seed.empty()) << a.out;
  EXPECT_NE(seed, printed_seed(b.out));
  EXPECT_NE(seed, printed_seed(c.out));
  EXPECT_NE(last_line(a.out), last_line(b.out));  // 12 draws from a near-flat distribution
  EXPECT_NE(last_line(a.out), last_line(c.out));
  const auto again = mbtest::run_cli(base + " --seed " + seed);
  ASSERT_EQ(again.exit_code, 0) << again.out;
  EXPECT_EQ(last_line(again.out), last_line(a.out));
  EXPECT_EQ(printed_seed(again.out), seed);
}

TEST(CliSeed, AGivenSeedIsTheLibrarysSeed) {
  // --seed S feeds the sampler's stream exactly as the library's SamplingParams::seed = S does.
  auto engine = open_fixture("e2b_like");
  markbase::Request req = sampled_request();
  req.sampling.seed = 11;
  const auto r = mbtest::run_cli("generate -m " + mbtest::fixture("e2b_like") +
                                 " --tokens 2,10,20,30 -n 12 --temperature 1 --ignore-eos --print-ids --seed 11");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(last_line(r.out), joined(engine->generate(req).tokens));
}

// ---- prompts -------------------------------------------------------------------------------------

TEST(CliPrompt, FromAFileOrStdinAsFromTheCommandLine) {
  const std::string dir = mbtest::temp_dir("cli_prompt");
  const std::string m = " -m " + mbtest::fixture("gemma3_like") + " -n 6 --ignore-eos --print-ids";
  const auto direct = mbtest::run_cli("generate -p 'Hello there'" + m);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  write_bytes(dir + "/prompt.txt", "Hello there\n");  // a file's last newline is not part of the prompt
  const auto file = mbtest::run_cli("generate -f " + dir + "/prompt.txt" + m);
  ASSERT_EQ(file.exit_code, 0) << file.out;
  EXPECT_EQ(last_line(file.out), last_line(direct.out));
  const auto in = run_shell("echo 'Hello there' | " + kCli + " generate -p -" + m + " --verbose");
  ASSERT_EQ(in.exit_code, 0) << in.out;
  EXPECT_EQ(last_line(in.out), last_line(direct.out));
  EXPECT_TRUE(has(in.out, "bytes of text from stdin")) << in.out;
  const auto ids = mbtest::run_cli("tokenize -m " + mbtest::fixture("gemma3_like") + " --text 'Hello there' --bos");
  EXPECT_EQ(printed_prompt_ids(in.out) + "\n", ids.out);

  auto r = mbtest::run_cli("generate -f " + dir + "/missing.txt" + m);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "error: cannot open prompt file " + dir + "/missing.txt: No such file or directory")) << r.out;
  r = run_shell(kCli + " generate -p -" + m + " < /dev/null");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "error: the prompt read from stdin is empty")) << r.out;
  r = mbtest::run_cli("generate -p hi -f " + dir + "/prompt.txt" + m);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.out, "excludes")) << r.out;
  fs::remove_all(dir);
}

TEST(CliPrompt, SystemPromptRendersAsTheTemplatesMessages) {
  const std::string dir = mbtest::temp_dir("cli_system");
  for (const char* fixture : {"e2b_like", "gemma3_like"}) {
    const std::string m = mbtest::fixture(fixture);
    const std::string system = "Answer_in_French.", user = "Hello";  // no spaces: the fixtures decode them as ▁
    nlohmann::json msgs = nlohmann::json::array({{{"role", "system"}, {"content", system}},
                                                 {{"role", "user"}, {"content", user}}});
    write_bytes(dir + "/messages.json", msgs.dump());
    const auto expected =
        mbtest::run_cli("tokenize -m " + m + " --messages " + dir + "/messages.json --add-generation-prompt");
    ASSERT_EQ(expected.exit_code, 0) << expected.out;
    const auto with = mbtest::run_cli("generate -m " + m + " --chat --system " + sh_quote(system) + " -p " +
                                      sh_quote(user) + " -n 0 --verbose");
    ASSERT_EQ(with.exit_code, 0) << with.out;
    EXPECT_EQ(printed_prompt_ids(with.out) + "\n", expected.out) << fixture;
    const auto without = mbtest::run_cli("generate -m " + m + " --chat -p " + sh_quote(user) + " -n 0 --verbose");
    ASSERT_EQ(without.exit_code, 0) << without.out;
    EXPECT_NE(printed_prompt_ids(without.out), printed_prompt_ids(with.out)) << fixture;

  }
  fs::remove_all(dir);
}

// ---- stop strings --------------------------------------------------------------------------------

TEST(CliStop, TheTextEndsBeforeTheStopString) {
  auto engine = open_fixture("e2b_like");
  StopCase c = stop_case(*engine);
  ASSERT_FALSE(c.stop.empty()) << c.full.text;
  const auto r = mbtest::run_cli("generate -m " + mbtest::fixture("e2b_like") +
                                 " --tokens 2,10,20,30 -n 24 --ignore-eos --stop 'never produced' --stop " +
                                 sh_quote(c.stop) + " --print-ids");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string text = c.full.text.substr(0, c.at);
  EXPECT_EQ(r.out.substr(0, text.size() + 1), text + "\n") << r.out;
  EXPECT_TRUE(has(r.out, "finish: stop")) << r.out;
  const std::vector<int32_t> ids(c.full.tokens.begin(), c.full.tokens.begin() + long(c.tokens));
  EXPECT_EQ(last_line(r.out), joined(ids));
}

// ---- context -------------------------------------------------------------------------------------

TEST(CliContext, GenerateAndLogitsAgreeOnWhatFitsAndGenerateSaysWhenItIsFull) {
  const std::string m = " -m " + mbtest::fixture("gemma3_like") + " -c 8";
  const std::string five = "2,10,20,30,40", eight = five + ",50,60,70", nine = eight + ",80";
  const std::string gen = " --ignore-eos --print-ids";
  const std::string logits_out = mbtest::temp_dir("cli_ctx") + "/logits.bin";
  // A prompt of n <= ctx tokens fits both; generate then makes ctx - n + 1 tokens at most.
  auto r = mbtest::run_cli("generate --tokens " + five + " -n 100" + gen + m);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "| 4 new tokens in")) << r.out;
  EXPECT_TRUE(has(r.out, "finish: context")) << r.out;
  const std::string four = last_line(r.out);
  r = mbtest::run_cli("generate --tokens " + five + " -n 4" + gen + m);  // -n ends it first
  EXPECT_TRUE(has(r.out, "finish: length")) << r.out;
  EXPECT_EQ(last_line(r.out), four);
  r = mbtest::run_cli("generate --tokens " + five + " -n 4" + gen + " -m " + mbtest::fixture("gemma3_like"));
  EXPECT_EQ(last_line(r.out), four);  // the same tokens as with the model's whole context
  r = mbtest::run_cli("generate --tokens " + eight + " -n 5" + gen + m);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "| 1 new tokens in")) << r.out;
  EXPECT_TRUE(has(r.out, "finish: context")) << r.out;
  r = mbtest::run_cli("logits --tokens " + eight + " -o " + logits_out + m);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(fs::file_size(logits_out), 8u * 512u * 4u);
  // One more token fits neither, with the same message.
  for (const std::string& cmd : {"generate --tokens " + nine + gen, "logits --tokens " + nine + " -o " + logits_out}) {
    r = mbtest::run_cli(cmd + m);
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_TRUE(has(r.out, "error: prompt of 9 tokens exceeds the context size 8")) << r.out;
  }
  r = mbtest::run_cli("generate --tokens 2,3 -c 40000 -m " + mbtest::fixture("gemma3_like"));
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "context size 40000 is out of range: the model holds at most 32768 tokens")) << r.out;
  fs::remove_all(fs::path(logits_out).parent_path());
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

// ---- stdout and stderr in one pipe ---------------------------------------------------------------

TEST(CliOutput, TheStatsLineStartsOnItsOwnLineInAPipe) {
  const std::string m = mbtest::fixture("e2b_like");
  for (const std::string args : {"-n 6 --ignore-eos", "-n 6 --ignore-eos --print-ids"}) {
    const auto r = run_shell(kCli + " generate -m " + m + " --tokens 2,10,20,30 " + args + " 2>&1 | cat");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const size_t stats = r.out.find("prompt 4 tokens in ");
    ASSERT_NE(stats, std::string::npos) << r.out;
    ASSERT_GT(stats, 0u);
    EXPECT_EQ(r.out[stats - 1], '\n') << r.out;
    // The text alone on stdout, ended by one newline.
    const auto text = run_shell(kCli + " generate -m " + m + " --tokens 2,10,20,30 -n 6 --ignore-eos 2>/dev/null");
    EXPECT_EQ(r.out.substr(0, stats), text.out);
    ASSERT_FALSE(text.out.empty());
    EXPECT_EQ(text.out.back(), '\n');
  }
}
