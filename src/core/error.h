// Errors carry enough context (file, tensor, expected vs found) for a user to act on them.
// Everything user-facing throws mb::Error; the CLI prints what() and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <string>

#include "markbase/error.h"

namespace mb {

using Error = markbase::Error;

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace mb

#define MB_CHECK(cond, ...)                 \
  do {                                      \
    if (!(cond)) ::mb::fail(__VA_ARGS__);   \
  } while (0)
