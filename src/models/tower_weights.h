// What the media towers (gemma4_vision, gemma4_audio, gemma4_unified) share: reading their weights
// from a checkpoint for a backend, and Gemma 4's clipped linears.
#pragma once
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"

namespace mb {

// A Gemma4ClippableLinear: y = clamp(W · clamp(x, in), out); bounds ±inf when the model has none.
struct ClippedLinear {
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  Tensor w;
  Backend::Clip clip{-kInf, kInf, -kInf, kInf};
};

// y = clamp(W · clamp(x)); x is left as it was (other projections read it). With `limit`, y is then
// clamped to [-limit, limit] too (in the same pass: the two clamps compose into one).
// act (and times): Backend::matmul_clipped's activation after the clamps.
void clipped_matmul(Backend& be, const Tensor& x, const ClippedLinear& l, Tensor& y,
                    float limit = std::numeric_limits<float>::infinity(),
                    Backend::Activation act = Backend::Activation::None, const Tensor* times = nullptr);

// Values computed on the host (a derived table, a reshaped weight) as an f32 tensor of `be`.
Tensor backend_values(Backend& be, std::span<const float> values, std::vector<int64_t> shape);

// Whether a tower's matrix w takes its products on activations rounded to bf16
// (Backend::WeightUse::MatmulRoundedInputs): bf16 weights, unless Checkpoint::exact_media. A tower's
// attention follows its matrices (AttentionParams::rounded_inputs).
bool rounded_products(const Checkpoint& ck, const Tensor& w);

// Errors name the tensor and the backend.
class TowerWeights {
 public:
  TowerWeights(const Checkpoint& ck, Backend& be) : ck_(ck), be_(be) {}
  // A matrix in the checkpoint's dtype, prepared for the backend's matmuls (a conv kernel of rank
  // > 2 as its im2col rows [out, in · kernel]), on rounded inputs where rounded_products says.
  Tensor matrix(const std::string& name, std::vector<int64_t> shape) const;
  Tensor vec(const std::string& name, int64_t n) const;  // f32, for norms
  std::vector<float> host_values(const std::string& name, std::vector<int64_t> shape) const;  // f32 on the host
  float scalar(const std::string& name) const;  // a 0-dim (or one-element) tensor
  // `name`.linear.weight [out, in], and with `clipped` its four bounds.
  ClippedLinear linear(const std::string& name, int64_t out, int64_t in, bool clipped) const;

 private:
  const Checkpoint& ck_;
  Backend& be_;
};

}  // namespace mb
