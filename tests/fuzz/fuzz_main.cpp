// libFuzzer entry points for the targets of fuzz_targets.h. MARKBASE_FUZZ_TARGET (files, jinja,
// request or output) picks the target; FUZZ_WRITE_SEEDS=DIR writes its seeds into DIR first.
// Built and run by tools/fuzz.sh; not part of the regular test build.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "fuzz_targets.h"

namespace mbfuzz {

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace mbfuzz

namespace {

struct Target {
  const char* name;
  void (*run)(const uint8_t*, size_t);
  void (*write_seeds)(const std::string&);
};

constexpr Target kTargets[] = {{"files", mbfuzz::fuzz_files, mbfuzz::write_file_seeds},
                               {"jinja", mbfuzz::fuzz_jinja, mbfuzz::write_jinja_seeds},
                               {"request", mbfuzz::fuzz_request, mbfuzz::write_request_seeds},
                               {"output", mbfuzz::fuzz_output, mbfuzz::write_output_seeds}};

const Target* target = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* name = std::getenv("MARKBASE_FUZZ_TARGET");
  for (const Target& t : kTargets)
    if (name && std::string(name) == t.name) target = &t;
  if (!target) {
    std::fprintf(stderr, "set MARKBASE_FUZZ_TARGET to files, jinja, request or output\n");
    std::exit(2);
  }
  if (const char* dir = std::getenv("FUZZ_WRITE_SEEDS")) target->write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  target->run(data, size);
  return 0;
}
