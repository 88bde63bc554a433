// `markbase` command line. Flags are an interface other tools depend on (see README); errors go
// to stderr with a non-zero exit, never a crash.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"MarkBase: inference engine for Gemma 4 and Gemma 3"};
  app.require_subcommand(1);
  mb::cli::register_generate(app);
  mb::cli::register_logits(app);
  mb::cli::register_info(app);
  mb::cli::register_tokenize(app);
  mb::cli::register_bench(app);
  mb::cli::register_quantize(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
