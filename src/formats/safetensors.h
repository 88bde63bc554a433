#pragma once
#include <functional>
#include <string>

#include "formats/tensor_registry.h"

namespace mb {

// Maps one .safetensors file and registers the tensors for which `keep(name)` is true. Every
// header field is validated against the file size before any pointer is formed.
void load_safetensors(const std::string& path, TensorRegistry& reg,
                      const std::function<bool(const std::string&)>& keep = nullptr);

}  // namespace mb
