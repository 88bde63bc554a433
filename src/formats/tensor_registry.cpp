#include "formats/tensor_registry.h"

#include "core/error.h"

namespace mb {

Tensor TensorEntry::view() const {
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.data = const_cast<uint8_t*>(data);
  t.owner = owner;
  return t;
}

void TensorRegistry::add(TensorEntry e) {
  auto [it, inserted] = entries_.emplace(e.name, e);
  MB_CHECK(inserted, "tensor '{}' appears twice (in {} and {})", e.name, it->second.file, e.file);
}

const TensorEntry* TensorRegistry::find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

static std::string shape_string(const std::vector<int64_t>& s) {
  Tensor t;
  t.shape = s;
  return t.shape_str();
}

Tensor TensorRegistry::get(const std::string& name, const std::vector<int64_t>& expected) const {
  const TensorEntry* e = find(name);
  if (!e) fail("missing tensor '{}' in {}", name, describe_sources());
  if (!expected.empty() && e->shape != expected)
    fail("tensor '{}' in {} has shape {}, expected {}", name, e->file, shape_string(e->shape),
         shape_string(expected));
  return e->view();
}

std::string TensorRegistry::describe_sources() const {
  if (files_.empty()) return "(no files)";
  std::string s = files_[0]->path();
  if (files_.size() > 1) s += fmt::format(" and {} more shard(s)", files_.size() - 1);
  return s;
}

}  // namespace mb
