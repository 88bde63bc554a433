// A Jinja2 interpreter for chat templates: the subset that Hugging Face chat templates use,
// configured like transformers' ImmutableSandboxedEnvironment (trim_blocks, lstrip_blocks,
// loopcontrols, `raise_exception`, `strftime_now`, json.dumps-style `tojson`), so that a
// checkpoint's own template renders byte-for-byte as transformers renders it.
//
// Values follow Python semantics (truthiness, ==, str(), repr of lists/dicts, float repr,
// Undefined that prints as "" but fails on attribute access). Template inputs are JSON;
// ordered_json keeps dict insertion order, which `tojson` and `.items()` expose.
//
// Bounded (an mb::Error, never a crash or a hang): nesting of the template's brackets, blocks and
// expressions (256 levels) and of lists and dicts (512), and what one render spends
// (RenderLimits: a loop or recursion without end, or a value that keeps doubling, fails).
//
// Not supported (rejected with an mb::Error naming the line): extends/block/include/import,
// call blocks, recursive loops, *args/**kwargs at call sites, and filters/tests outside the
// list in jinja.cpp. Known approximations: upper/lower/title change ASCII letters only;
// tuples are lists (so `{{ (1, 2) }}` prints `[1, 2]`); map/select return lists, not generators.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace mb::jinja {

using Json = nlohmann::ordered_json;

// What one render may spend before it fails with an mb::Error. Steps (expressions, statements,
// loop iterations, elements compared, bytes scanned / 64) bound its time; bytes (of the strings,
// lists and dicts it builds, 16 per element, and of its output) bound its memory. The defaults
// hold the Gemma 4 template on thousands of messages (its per-message look-back is quadratic).
struct RenderLimits {
  int64_t steps = int64_t(1) << 27;
  int64_t bytes = int64_t(512) << 20;
};
RenderLimits render_limits();
// Process-wide (a server's setting, or a fuzzer's); returns the previous limits.
RenderLimits set_render_limits(const RenderLimits& limits);

// Throws mb::Error when `value` nests lists and dicts deeper than a render accepts. render()
// checks its variables; check what you build them from first when it comes from users (copying a
// JSON value recurses into it).
void check_nesting(const Json& value);

class Template {
 public:
  // Parses `source`; throws mb::Error "chat template line N: ..." on syntax errors and on
  // constructs this interpreter does not implement.
  explicit Template(const std::string& source);

  // `variables` must be a JSON object; each key becomes a template variable (JSON null is
  // Python None, which differs from a missing key: `x is defined` is true for null).
  // Throws mb::Error naming the template line on runtime errors and on raise_exception().
  std::string render(const Json& variables) const;

  struct Program;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace mb::jinja
