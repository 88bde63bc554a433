// UTF-8 in one place: the tokenizer, the Jinja engine and error messages about file contents all
// decode, check and encode code points with these.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mb {

// Decodes one code point of valid UTF-8 (callers check with utf8_check first).
inline uint32_t utf8_decode(const unsigned char* p, int* len) {
  unsigned c = p[0];
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return ((c & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (c < 0xF0) {
    *len = 3;
    return ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *len = 4;
  return ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

// Length of the valid UTF-8 character at p (n bytes available): >0 complete, 0 a valid but
// unfinished prefix, <0 ill-formed; -k means the first k bytes form the maximal ill-formed
// subpart (Unicode / CPython errors="replace" rule: one U+FFFD each).
inline int utf8_check(const unsigned char* p, size_t n) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  int need;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n) return 0;
    unsigned b = p[k];
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -k;
  }
  return need + 1;
}

// The code point at s[i] and its length; an ill-formed or cut byte reads as U+FFFD of length 1.
inline uint32_t utf8_decode_lenient(std::string_view s, size_t i, size_t* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  int n = 1;
  if (utf8_check(p, s.size() - i) <= 0) {
    *len = 1;
    return 0xFFFD;
  }
  const uint32_t cp = utf8_decode(p, &n);
  *len = size_t(n);
  return cp;
}

inline bool utf8_valid(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0, n = s.size(); i < n;) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const int r = utf8_check(p + i, n - i);
    if (r <= 0) return false;
    i += size_t(r);
  }
  return true;
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace mb
