#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace mb {

Tensor Tensor::slice_rows(int64_t begin, int64_t count) const {
  MB_CHECK(!shape.empty() && begin >= 0 && count >= 0 && begin + count <= shape[0],
           "slice_rows [{}, {}) out of range for shape {}", begin, begin + count, shape_str());
  Tensor t = *this;
  t.packed.reset();
  t.shape[0] = count;
  size_t row_bytes = shape[0] ? nbytes() / size_t(shape[0]) : 0;
  t.data = static_cast<uint8_t*>(data) + size_t(begin) * row_bytes;
  return t;
}

Tensor Tensor::reshaped(std::vector<int64_t> new_shape) const {
  Tensor t = *this;
  if (new_shape != shape) t.packed.reset();
  t.shape = std::move(new_shape);
  MB_CHECK(t.numel() == numel(), "cannot reshape {} to {}", shape_str(), t.shape_str());
  return t;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Tensor host_tensor(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  size_t bytes = (t.nbytes() + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes ? bytes : 64);
  MB_CHECK(p != nullptr, "out of memory allocating {} bytes", bytes);
  std::memset(p, 0, bytes);
  t.owner = std::shared_ptr<void>(p, std::free);
  t.data = p;
  return t;
}

}  // namespace mb
