// One registry for every weight format: safetensors shards and GGUF both register
// name -> {dtype, shape, bytes}; model code asks by (HF) name and checks the shape it expects.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/mmap.h"
#include "core/tensor.h"

namespace mb {

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data;
  size_t nbytes;
  std::string file;
  std::shared_ptr<void> owner;  // set when the bytes had to be copied out of the mapping

  Tensor view() const;
};

class TensorRegistry {
 public:
  void add_file(std::shared_ptr<MappedFile> f) { files_.push_back(std::move(f)); }
  void add(TensorEntry e);

  const TensorEntry* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // Throws a clear error naming the tensor and where it was looked for when it is absent or its
  // shape differs from `expected_shape` (empty = any shape).
  Tensor get(const std::string& name, const std::vector<int64_t>& expected_shape = {}) const;

  const std::map<std::string, TensorEntry>& entries() const { return entries_; }
  std::string describe_sources() const;

 private:
  std::map<std::string, TensorEntry> entries_;
  std::vector<std::shared_ptr<MappedFile>> files_;
};

}  // namespace mb
