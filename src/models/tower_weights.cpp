#include "models/tower_weights.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mb {

void layer_norm_rows(std::span<float> x, int64_t width, std::span<const float> w, std::span<const float> b, float eps,
                     bool relu) {
  MB_CHECK(width > 0 && x.size() % size_t(width) == 0 && w.size() == size_t(width) && (b.empty() || b.size() == w.size()),
           "layer norm: {} values in rows of {} with {} weights and {} biases", x.size(), width, w.size(), b.size());
  for (float* row = x.data(); row != x.data() + x.size(); row += width) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < width; ++c) mean += row[c];
    mean /= double(width);
    for (int64_t c = 0; c < width; ++c) var += (row[c] - mean) * (row[c] - mean);
    var /= double(width);
    const double rstd = 1.0 / std::sqrt(var + double(eps));
    for (int64_t c = 0; c < width; ++c) {
      float y = float((row[c] - mean) * rstd) * w[size_t(c)];
      if (!b.empty()) y += b[size_t(c)];
      row[c] = relu ? std::max(0.f, y) : y;
    }
  }
}

bool ClippedLinear::clips_input() const { return std::isfinite(in_lo) || std::isfinite(in_hi); }
bool ClippedLinear::clips_output() const { return std::isfinite(out_lo) || std::isfinite(out_hi); }

void clipped_matmul(Backend& be, const Tensor& x, const ClippedLinear& l, Tensor& y) {
  if (l.clips_input()) {
    Tensor xc = be.scratch(DType::F32, x.shape);
    be.copy(x, xc);
    be.clamp(xc, l.in_lo, l.in_hi);
    be.matmul(xc, l.w, y);
  } else {
    be.matmul(x, l.w, y);
  }
  if (l.clips_output()) be.clamp(y, l.out_lo, l.out_hi);
}

Tensor TowerWeights::matrix(const std::string& name, std::vector<int64_t> shape) const {
  Tensor src = ck_.tensors.get(name, std::move(shape));
  MB_CHECK(be_.supports_weight_dtype(src.dtype), "tensor '{}' has dtype {}, which the {} backend cannot use", name,
           dtype_name(src.dtype), be_.name());
  if (src.rank() > 2) src = src.reshaped({src.dim(0), src.numel() / src.dim(0)});
  return be_.prepare_weight(src, src.dtype);
}

Tensor TowerWeights::vec(const std::string& name, int64_t n) const {
  return be_.prepare_weight(ck_.tensors.get(name, {n}), DType::F32);
}

std::vector<float> TowerWeights::host_values(const std::string& name, std::vector<int64_t> shape) const {
  Tensor t = ck_.tensors.get(name, std::move(shape));
  MB_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16,
           "tensor '{}' has unsupported dtype {}", name, dtype_name(t.dtype));
  std::vector<float> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype == DType::F32    ? t.f32()[i]
             : t.dtype == DType::BF16 ? bf16_to_f32(t.ptr<uint16_t>()[i])
                                      : f16_to_f32(t.ptr<uint16_t>()[i]);
  return out;
}

float TowerWeights::scalar(const std::string& name) const {
  Tensor t = ck_.tensors.get(name, {});
  MB_CHECK(t.numel() == 1, "tensor '{}' should hold one value, has shape {}", name, t.shape_str());
  return host_values(name, t.shape)[0];
}

ClippedLinear TowerWeights::linear(const std::string& name, int64_t out, int64_t in, bool clipped) const {
  ClippedLinear l;
  l.w = matrix(name + ".linear.weight", {out, in});
  if (clipped) {
    l.in_lo = scalar(name + ".input_min");
    l.in_hi = scalar(name + ".input_max");
    l.out_lo = scalar(name + ".output_min");
    l.out_hi = scalar(name + ".output_max");
  }
  return l;
}

}  // namespace mb
