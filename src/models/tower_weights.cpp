#include "models/tower_weights.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mb {

Tensor backend_values(Backend& be, std::span<const float> values, std::vector<int64_t> shape) {
  Tensor t = be.alloc(DType::F32, std::move(shape));
  MB_CHECK(size_t(t.numel()) == values.size(), "{} values for a tensor of {}", values.size(), t.shape_str());
  be.upload(values.data(), t);
  return t;
}

bool rounded_products(const Checkpoint& ck, const Tensor& w) { return !ck.exact_media && w.dtype == DType::BF16; }

void clipped_matmul(Backend& be, const Tensor& x, const ClippedLinear& l, Tensor& y, float limit,
                    Backend::Activation act, const Tensor* times) {
  Backend::Clip clip = l.clip;
  // clamp(clamp(y, lo, hi), -limit, limit) = clamp(y, f(lo), f(hi)) for f = clamp(., -limit, limit):
  // f is monotone, so it moves through the max and the min.
  clip.out_lo = std::min(std::max(clip.out_lo, -limit), limit);
  clip.out_hi = std::min(std::max(clip.out_hi, -limit), limit);
  if (clip.clips_input() || clip.clips_output() || act != Backend::Activation::None)
    be.matmul_clipped(x, l.w, clip, y, act, times);
  else be.matmul(x, l.w, y);
}

Tensor TowerWeights::matrix(const std::string& name, std::vector<int64_t> shape) const {
  Tensor src = ck_.tensors.get(name, std::move(shape));
  MB_CHECK(be_.supports_weight_dtype(src.dtype), "tensor '{}' has dtype {}, which the {} backend cannot use", name,
           dtype_name(src.dtype), be_.name());
  if (src.rank() > 2) src = src.reshaped({src.dim(0), src.numel() / src.dim(0)});
  return be_.prepare_weight(src, src.dtype,
                            rounded_products(ck_, src) ? Backend::WeightUse::MatmulRoundedInputs
                                                       : Backend::WeightUse::Matmul);
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
    l.clip = {scalar(name + ".input_min"), scalar(name + ".input_max"), scalar(name + ".output_min"),
              scalar(name + ".output_max")};
  }
  return l;
}

}  // namespace mb
