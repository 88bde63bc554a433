// File-provided text (GGUF keys, tensor names, string values) as it may appear in an error
// message: whole and visible. A NUL would cut the message where it is printed as a C string, and
// control bytes would act on the terminal.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/utf8.h"

namespace mb {

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
    } else if (const int n = utf8_check(reinterpret_cast<const unsigned char*>(s.data()) + i, s.size() - i);
               n > 1 && !(c == 0xC2 && uint8_t(s[i + 1]) < 0xA0)) {  // C1 controls (C2 80..C2 9F) go below
      out.append(s.substr(i, size_t(n)));
      i += size_t(n);
    } else {
      out += fmt::format("\\x{:02X}", c);
      ++i;
    }
  }
  return out;
}

}  // namespace mb
