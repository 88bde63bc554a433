// Token selection from logits. Greedy when temperature <= 0; otherwise the usual filter chain
// (top-k -> top-p -> min-p, in llama.cpp/vLLM order) then a draw from a seeded RNG whose stream is
// defined here (not by the standard library's distributions), so a seed reproduces across builds.
// Nothing sorts the whole vocabulary (262k entries for Gemma): top-k selects its k, top-p sorts
// only a prefix large enough to hold the nucleus, and the survivors are walked in an order fixed
// by the logits alone (descending after top-k/top-p, else vocabulary order), never by how the
// standard library's selection algorithms happen to permute them.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace mb {

struct SamplerParams {
  float temperature = 0.f;
  int top_k = 0;        // 0 = off
  float top_p = 1.f;    // 1 = off
  float min_p = 0.f;    // 0 = off
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  int32_t sample(std::span<const float> logits);
  const SamplerParams& params() const { return p_; }

 private:
  uint64_t next_u64();
  double next_unit();  // [0, 1)

  SamplerParams p_;
  uint64_t state_;
  struct Candidate {
    float z;     // logit / temperature
    int32_t id;
    double p;    // exp(z - max z), unnormalised
  };
  std::vector<Candidate> cand_;
};

int32_t argmax(std::span<const float> logits);

}  // namespace mb
