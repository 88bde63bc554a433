// A non-owning view: dtype, row-major shape, pointer. Ownership lives elsewhere (an mmap, a
// backend arena); `owner` keeps such a buffer alive when a view must outlive its creator.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace mb {

enum class Device : uint8_t { CPU, CUDA };

struct Tensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // outermost first, as in PyTorch
  void* data = nullptr;
  Device device = Device::CPU;
  std::shared_ptr<void> owner;
  // A backend's private copy of a weight in the layout its matmul kernels want (see
  // Backend::prepare_weight); data/dtype stay the plain rows, for lookups. Views of other rows or
  // shapes drop it.
  std::shared_ptr<const void> packed;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  // Block types store each innermost row as whole blocks.
  size_t nbytes() const {
    if (!dtype_is_quantized(dtype)) return size_t(numel()) * dtype_block_bytes(dtype);
    return cols() ? size_t(numel() / cols()) * dtype_row_bytes(dtype, cols()) : 0;
  }
  int rank() const { return int(shape.size()); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  int64_t rows() const { return shape.empty() ? 1 : numel() / shape.back(); }
  bool empty() const { return data == nullptr; }

  template <class T> T* ptr() const { return static_cast<T*>(data); }
  float* f32() const { return static_cast<float*>(data); }

  // Rows [begin, begin+count) of the outermost dimension, same storage.
  Tensor slice_rows(int64_t begin, int64_t count) const;
  Tensor reshaped(std::vector<int64_t> new_shape) const;
  std::string shape_str() const;
};

// Host tensor with its own zeroed storage (64-byte aligned for SIMD).
Tensor host_tensor(DType dtype, std::vector<int64_t> shape);

}  // namespace mb
