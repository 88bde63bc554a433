#include "cli/flags.h"

#include <cstdio>
#include <sched.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/printable.h"

namespace mb::cli {

CLI::Validator whole_number(int64_t lo, int64_t hi) {
  const bool open_end = hi == std::numeric_limits<int64_t>::max();
  const std::string range = open_end ? fmt::format(">= {}", lo) : fmt::format("from {} to {}", lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc() && end == s.data() + s.size() && v >= lo && v <= hi) return "";
        return fmt::format("expected a whole number {}, got '{}'", range, printable(s, 40));
      },
      open_end ? fmt::format(">= {}", lo) : fmt::format("[{}, {}]", lo, hi));
}

CLI::Validator real_number(double lo, double hi, bool lo_open) {
  const std::string range = std::isinf(hi) ? fmt::format("{} {}", lo_open ? ">" : ">=", lo)
                            : lo_open      ? fmt::format("> {} and <= {}", lo, hi)
                                           : fmt::format("from {} to {}", lo, hi);
  return CLI::Validator(
      [lo, hi, lo_open, range](std::string& s) -> std::string {
        double v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc() && end == s.data() + s.size() && std::isfinite(v) && (lo_open ? v > lo : v >= lo) &&
            v <= hi)
          return "";
        return fmt::format("expected a number {}, got '{}'", range, printable(s, 40));
      },
      std::isinf(hi) ? range : fmt::format("{}{}, {}]", lo_open ? "(" : "[", lo, hi));
}

std::string HelpFormatter::make_option_opts(const CLI::Option* opt) const {
  std::string s = CLI::Formatter::make_option_opts(opt);
  const std::string shown = "=" + opt->get_default_str();
  if (opt->get_type_size() != 0 && !opt->get_default_str().empty())
    if (const size_t at = s.find(shown); at != std::string::npos) s.erase(at, shown.size());
  return s;
}

std::string HelpFormatter::make_option_desc(const CLI::Option* opt) const {
  const std::string& d = opt->get_default_str();
  if (opt->get_type_size() == 0 || d.empty() || d == "[]") return opt->get_description();
  return fmt::format("{} (default: {})", opt->get_description(), d);
}

namespace {

// Why `s` is no --seed value ("" when it is one); the seed in *v unless random.
std::string seed_problem(const std::string& s, std::optional<uint64_t>* v) {
  if (s.empty() || s == "-1") return "";  // random
  uint64_t seed = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), seed);
  if (ec == std::errc() && end == s.data() + s.size()) {
    *v = seed;
    return "";
  }
  return fmt::format("expected a whole number from 0 to {}, or -1 for a random seed, got '{}'",
                     std::numeric_limits<uint64_t>::max(), printable(s, 40));
}

}  // namespace

std::optional<uint64_t> parse_seed(const std::string& s) {
  std::optional<uint64_t> v;
  const std::string problem = seed_problem(s, &v);
  MB_CHECK(problem.empty(), "--seed: {}", problem);
  return v;
}

CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& s) {
        std::optional<uint64_t> v;
        return seed_problem(s, &v);
      },
      "[0, 2^64-1] or -1 (random)");
}

namespace {

// Why `s` is no memory size ("" when it is one); the size in *bytes.
std::string size_problem(const std::string& s, size_t* bytes) {
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  std::string unit(end, s.data() + s.size());
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();  // 4GB, 4GiB, 512B
  if (unit.size() == 2 && unit.back() == 'I') unit.pop_back();
  const size_t power = unit.empty() ? 0 : std::string("KMGT").find(unit) + 1;  // npos + 1 == 0: unknown
  const bool unit_ok = unit.empty() || (unit.size() == 1 && power > 0);
  if (ec == std::errc() && end != s.data() && std::isfinite(v) && v >= 0 && unit_ok) {
    const double b = v * std::pow(1024.0, double(power));
    if (b < 9e18) {
      *bytes = size_t(b);
      return "";
    }
  }
  return fmt::format("expected a size such as 512M, 4G or a number of bytes, got '{}'", printable(s, 40));
}

}  // namespace

CLI::Validator size_value() {
  return CLI::Validator(
      [](std::string& s) {
        size_t b = 0;
        return size_problem(s, &b);
      },
      "SIZE");
}

size_t parse_size(const std::string& s, const char* flag) {
  size_t b = 0;
  const std::string problem = size_problem(s, &b);
  MB_CHECK(problem.empty(), "{}: {}", flag, problem);
  return b;
}

namespace {

// llama.cpp flags a llama.cpp user may try (llama-cli's, llama-bench's): the flag here that does
// the same (when the subcommand has it), or why there is none.
struct LlamaFlags {
  const char* flags;  // space-separated
  const char* ours;   // an option name here, or null
  const char* note;   // why MarkBase has no such flag, when `ours` is null
};
constexpr LlamaFlags kLlamaFlags[] = {
    {"-ngl --n-gpu-layers --gpu-layers", nullptr,
     "MarkBase runs the whole model on one device: --device cuda puts every layer on the GPU"},
    {"-t -tb --threads-batch", "--threads", nullptr},
    {"--temp", "--temperature", nullptr},
    {"-s", "--seed", nullptr},
    {"--ctx-size", "--ctx", nullptr},
    {"-np --parallel", "--max-seqs", nullptr},
    {"-a --alias", "--served-model-name", nullptr},
    {"--file", "-f", nullptr},
    {"-sys --system-prompt", "--system", nullptr},
    {"-r --reverse-prompt", "--stop", nullptr},
    {"-v", "--verbose", nullptr},
    {"-p", "--pp", nullptr},
    {"-n", "--tg", nullptr},
    {"-r", "--reps", nullptr},
    {"-fa --flash-attn", nullptr, "attention always runs fused, there is no switch"},
    {"-b --batch-size -ub --ubatch-size", nullptr,
     "prompts run in steps of up to 512 tokens, there is no batch-size flag"},
    {"--repeat-penalty --presence-penalty --frequency-penalty", nullptr, "repetition penalties are not implemented"},
    {"-cnv --conversation -i --interactive", nullptr, "there is no interactive mode; --chat sends one user turn"},
    {"--no-mmap --mlock", nullptr, "model files are always memory-mapped"},
};

bool listed(const char* flags, const std::string& name) {
  std::istringstream words(flags);
  for (std::string w; words >> w;)
    if (w == name) return true;
  return false;
}

// Every name of an option ("-n", "--n-predict"); none for positionals.
std::vector<std::string> option_names(const CLI::Option& o) {
  std::vector<std::string> names;
  for (const std::string& s : o.get_snames()) names.push_back("-" + s);
  for (const std::string& l : o.get_lnames()) names.push_back("--" + l);
  return names;
}

std::string option_label(const CLI::Option& o) { return fmt::format("{}", fmt::join(option_names(o), "/")); }

const CLI::Option* find_option(const CLI::App& cmd, const std::string& name) {
  for (const CLI::Option* o : cmd.get_options())
    for (const std::string& n : option_names(*o))
      if (n == name) return o;
  return nullptr;
}

bool takes_value(const CLI::Option& o) { return o.get_items_expected_min() > 0; }

// Edits (insert, delete, replace) from a to b; hand-written because no dependency offers it and
// a suggestion for a mistyped flag needs nothing more.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string subcommand_list(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(s->get_name());
  return fmt::format("{}", fmt::join(names, ", "));
}

[[noreturn]] void unknown_option(const CLI::App& cmd, const std::string& name) {
  const std::string where = "markbase " + cmd.get_name();
  for (const LlamaFlags& f : kLlamaFlags) {
    if (!listed(f.flags, name)) continue;
    if (!f.ours) fail("unknown option '{}' for {}: {} ({} is llama.cpp's)", name, where, f.note, name);
    if (const CLI::Option* o = find_option(cmd, f.ours))
      fail("unknown option '{}' for {}: llama.cpp's {} is {} here", name, where, name, option_label(*o));
  }
  const CLI::Option* best = nullptr;
  size_t best_d = 3;  // a suggestion only for up to 2 edits, and fewer than half the name
  for (const CLI::Option* o : cmd.get_options())
    for (const std::string& n : option_names(*o))
      if (const size_t d = edit_distance(name, n); d < best_d && 2 * d < name.size()) {
        best = o;
        best_d = d;
      }
  if (best) fail("unknown option '{}' for {}; did you mean {}?", name, where, option_label(*best));
  fail("unknown option '{}' for {} ({} --help lists the options)", name, where, where);
}

}  // namespace

void check_command_line(const CLI::App& app, int argc, const char* const* argv) {
  const CLI::App* cmd = nullptr;  // the subcommand, once named
  bool top_level_option = false;  // --help or --version before any subcommand
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;  // the rest is positional
    const bool is_option = a.size() >= 2 && a[0] == '-' && !std::isdigit(static_cast<unsigned char>(a[1])) &&
                           a[1] != '.';  // "-1", "-.5": a negative number, not an option
    if (!is_option) {
      if (cmd) continue;  // a positional: CLI11 checks it
      for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
        if (s->get_name() == a) cmd = s;
      if (!cmd) fail("unknown subcommand '{}' (subcommands: {})", printable(a, 60), subcommand_list(app));
      continue;
    }
    if (!cmd) {
      if (find_option(app, a)) {
        top_level_option = true;
        continue;
      }
      fail("unknown option '{}' before the subcommand: options follow it, as in `markbase generate -m PATH -p TEXT` "
           "(subcommands: {})", printable(a, 60), subcommand_list(app));
    }
    const bool long_form = a[1] == '-';
    const size_t eq = long_form ? a.find('=') : std::string::npos;
    const std::string name = long_form ? a.substr(0, eq) : a.substr(0, 2);
    const CLI::Option* o = find_option(*cmd, name);
    // `-Xrest`: CLI11 would read it as -X with the value "rest" (-ngl as -n gl). A value glued to
    // a short option is taken only when it does not start with a letter (-n32 is -n 32).
    if (!long_form && a.size() > 2 && (!o || !takes_value(*o) || std::isalpha(static_cast<unsigned char>(a[2]))))
      unknown_option(*cmd, printable(a, 60));
    if (!o) unknown_option(*cmd, printable(name, 60));
    // The value after an option is the option's, whatever it looks like (-p -, -n -1).
    if (takes_value(*o) && eq == std::string::npos && a.size() == name.size()) ++i;
  }
  if (!cmd && !top_level_option)
    fail("give a subcommand: {} (`markbase --help` describes them)", subcommand_list(app));
}

std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  std::string msg = e.what();
  const std::vector<CLI::App*> parsed = app.get_subcommands();
  if (parsed.empty()) return msg;
  const CLI::App& cmd = *parsed.front();
  // CLI11 names an option by its long name: name it as the user may have typed it too.
  for (const CLI::Option* o : cmd.get_options()) {
    const std::string n = o->get_name();
    if (!n.empty() && msg.size() > n.size() && msg.rfind(n, 0) == 0 && (msg[n.size()] == ':' || msg[n.size()] == ' ')) {
      msg = option_label(*o) + msg.substr(n.size());
      break;
    }
  }
  return fmt::format("{} (`markbase {} --help` lists the options)", msg, cmd.get_name());
}

int usable_cores() {
  int n = int(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = std::max(1, CPU_COUNT(&set));
  // A container's CPU limit: cgroup v2's cpu.max ("QUOTA PERIOD", or "max PERIOD" for none) of
  // this process's cgroup, else cgroup v1's cfs quota (-1: none).
  auto words = [](const std::string& path) {
    std::ifstream in(path);
    std::vector<std::string> w;
    for (std::string s; in >> s;) w.push_back(s);
    return w;
  };
  std::string cgroup = "/";
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);)
    if (line.rfind("0::", 0) == 0) cgroup = line.substr(3);
  std::vector<std::string> limit = words("/sys/fs/cgroup" + cgroup + "/cpu.max");
  if (limit.size() != 2) limit = words("/sys/fs/cgroup/cpu.max");
  if (limit.size() != 2) {
    const auto quota = words("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
    const auto period = words("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    if (quota.size() == 1 && period.size() == 1) limit = {quota[0], period[0]};
  }
  if (limit.size() == 2 && limit[0] != "max" && limit[0][0] != '-') {
    const double quota = std::atof(limit[0].c_str()), period = std::atof(limit[1].c_str());
    if (quota > 0 && period > 0) n = std::min(n, std::max(1, int(std::ceil(quota / period))));
  }
  return n;
}

bool profile_ops_requested() {
  const char* v = std::getenv("MARKBASE_PROFILE_OPS");
  return v && *v && std::string(v) != "0";
}

void print_op_profile(const std::string& table) {
  if (!table.empty()) std::fprintf(stderr, "MARKBASE_PROFILE_OPS: %s", table.c_str());
}

std::string threads_warning(int threads) {
  const int cores = usable_cores();
  if (threads <= 2 * cores) return "";
  return fmt::format(
      "warning: --threads {} is more than twice the {} core{} this process may use: threads beyond the cores only "
      "compete for them, and usually make each step slower",
      threads, cores, cores == 1 ? "" : "s");
}

}  // namespace mb::cli
