// File-provided text (GGUF keys, tensor names, string values) as it may appear in an error
// message: whole and visible. A NUL would cut the message where it is printed as a C string, and
// control bytes would act on the terminal. Header-only: builds that compile the parsers from a list
// of sources (tools/fuzz.sh) need no new entry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mb {

namespace printable_detail {

// Bytes of the well-formed UTF-8 character of 2 to 4 bytes at s[i], or 0 (RFC 3629's table:
// no overlong forms, no surrogates, nothing past U+10FFFF).
inline size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return uint8_t(s[i + k]); };
  const uint8_t lead = b(0);
  size_t n = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // the second byte's range
  if (lead >= 0xC2 && lead <= 0xDF) n = 2;
  else if (lead >= 0xE0 && lead <= 0xEF) n = 3, lo = lead == 0xE0 ? 0xA0 : 0x80, hi = lead == 0xED ? 0x9F : 0xBF;
  else if (lead >= 0xF0 && lead <= 0xF4) n = 4, lo = lead == 0xF0 ? 0x90 : 0x80, hi = lead == 0xF4 ? 0x8F : 0xBF;
  if (n == 0 || i + n > s.size() || b(1) < lo || b(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

}  // namespace printable_detail

// `s` with printable ASCII and well-formed UTF-8 kept as they are, backslashes and quotes escaped
// (\\ \' \"), and control bytes, C1 controls and bytes that are not well-formed UTF-8 written as
// \xNN. Past `max_bytes` of `s` (at a character's end) the rest becomes "... (N bytes)", N the
// size of all of `s`.
inline std::string printable(std::string_view s, size_t max_bytes = 200) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (i >= max_bytes) return out + fmt::format("... ({} bytes)", s.size());
    const uint8_t c = uint8_t(s[i]);
    if (c == '\\' || c == '\'' || c == '"') {
      out += '\\';
      out += char(c);
      ++i;
    } else if (c >= 0x20 && c < 0x7F) {
      out += char(c);
      ++i;
    } else if (const size_t n = printable_detail::utf8_sequence(s, i);
               n > 0 && !(c == 0xC2 && uint8_t(s[i + 1]) < 0xA0)) {  // C1 controls (C2 80..C2 9F) go below
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02X}", c);
      ++i;
    }
  }
  return out;
}

}  // namespace mb
