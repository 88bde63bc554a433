// The one exception type of MarkBase's public API. Kept apart from markbase.h so that the
// engine's lowest layer (src/core) can throw it without depending on the API it serves.
#pragma once
#include <stdexcept>
#include <string>

namespace markbase {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace markbase
