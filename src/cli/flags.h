// Command-line checking shared by the subcommands: numeric flags with messages that say what was
// given and what is allowed, and a pass over argv before CLI11's that names unknown subcommands
// and options (with a hint for llama.cpp's flags) instead of misreading them (CLI11 reads `-ngl`
// as `-n gl`).
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace mb::cli {

// A whole number in [lo, hi]; the message names the range ("a whole number >= 0" when hi is the
// type's maximum).
CLI::Validator whole_number(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max());
// A finite number in [lo, hi], or (lo, hi] when lo_open.
CLI::Validator real_number(double lo, double hi, bool lo_open = false);
// --seed: a whole number from 0 to 2^64 - 1, or -1 for a random seed (as llama.cpp).
CLI::Validator seed_value();
// A value seed_value() accepted, or "" (not given): the seed, none for a random one.
std::optional<uint64_t> parse_seed(const std::string& s);

// A memory size: bytes, or a number with K, M, G or T (powers of 1024; "512M", "1.5G", "4GiB").
CLI::Validator size_value();
size_t parse_size(const std::string& s, const char* flag);

// --help with each option's default at the end of its description, "(default: 32)", not glued to
// its type and range ("INT:[0, 4096]=0"). Set on the app before the subcommands are added.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override;
  std::string make_option_desc(const CLI::Option* opt) const override;
};

// Throws mb::Error naming the first unknown subcommand or option in argv (a missing subcommand
// included), with the valid subcommands or a hint. What it lets through CLI11 parses.
void check_command_line(const CLI::App& app, int argc, const char* const* argv);

// A CLI11 parse error as one line for the user: the option by all its names, and where the
// subcommand's options are listed.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e);

// CPUs this process may use: its affinity mask, capped by a cgroup CPU quota.
int usable_cores();

// The warning printed when `threads` (0: all cores) is far more than the cores; empty otherwise.
std::string threads_warning(int threads);

// MARKBASE_PROFILE_OPS set (and not 0): the command times every backend op and prints the table
// (Engine::op_profile) on stderr when it is done with the engine.
bool profile_ops_requested();
void print_op_profile(const std::string& table);

}  // namespace mb::cli
