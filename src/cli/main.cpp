// `markbase` command line. Flags are an interface other tools depend on (see README); errors go
// to stderr with exit code 1, never a crash.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "cli/flags.h"
#include "core/error.h"

// The project's version and the commit built, generated at build time (src/CMakeLists.txt).
extern const char* const kMarkbaseVersion;

int main(int argc, char** argv) {
  CLI::App app{"MarkBase: inference engine for Gemma 4 and Gemma 3"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.formatter(std::make_shared<mb::cli::HelpFormatter>());
  app.set_version_flag("--version", std::string("markbase ") + kMarkbaseVersion);
  mb::cli::register_generate(app);
  mb::cli::register_logits(app);
  mb::cli::register_info(app);
  mb::cli::register_tokenize(app);
  mb::cli::register_bench(app);
  mb::cli::register_quantize(app);
  mb::cli::register_serve(app);
  mb::cli::register_chat(app);
  try {
    mb::cli::check_command_line(app, argc, argv);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "error: %s\n", mb::cli::describe_parse_error(app, e).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
