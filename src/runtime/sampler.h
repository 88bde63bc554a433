// Token selection from logits. Greedy when temperature <= 0; otherwise the usual filter chain
// (top-k -> top-p -> min-p, in llama.cpp/vLLM order; core/token_pick.h) then a draw from a seeded
// RNG whose stream is defined here (not by the standard library's distributions), so a seed
// reproduces across builds.
// Nothing sorts the whole vocabulary (262k entries for Gemma): top-k selects its k, top-p sorts
// only a prefix large enough to hold the nucleus, and the survivors are walked in an order fixed
// by the logits alone (descending after top-k/top-p, else vocabulary order), never by how the
// standard library's selection algorithms happen to permute them.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/token_pick.h"

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
  // What sample() would do to the next row, its draw taken from the stream now (as sample() takes
  // it): for a backend that picks where the logits are (Backend::sample_rows).
  TokenPick pick();
  const SamplerParams& params() const { return p_; }

 private:
  uint64_t next_u64();
  double next_unit();  // [0, 1)

  SamplerParams p_;
  uint64_t state_;
  std::vector<PickCandidate> cand_;
};

int32_t argmax(std::span<const float> logits);

// What a request's earlier tokens do to the next token's logits, applied before the sampler in
// vLLM's order: logit_bias, then the repetition penalty (tokens of the prompt or the output: a
// positive logit divided by it, a negative one multiplied), then OpenAI's frequency and presence
// penalties (output tokens only: minus frequency x count, minus presence once).
struct LogitAdjustments {
  std::vector<std::pair<int32_t, float>> bias;
  float repetition_penalty = 1.f, frequency_penalty = 0.f, presence_penalty = 0.f;
  bool any() const {
    return !bias.empty() || repetition_penalty != 1.f || frequency_penalty != 0.f || presence_penalty != 0.f;
  }
};

// The tokens a sequence has seen, as the penalties count them.
class TokenHistory {
 public:
  void add_prompt(std::span<const int32_t> ids);
  void add_output(int32_t id);
  void adjust(std::span<float> logits, const LogitAdjustments& a) const;

 private:
  std::vector<int32_t> seen_;                              // prompt or output, each id once
  std::vector<std::pair<int32_t, int32_t>> output_counts_;  // id -> times generated, by id
};

// log_softmax of `logits` at `chosen` and the `n_top` most likely ids (highest first, ties by id).
struct Logprobs {
  float chosen = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};
Logprobs logprobs(std::span<const float> logits, int32_t chosen, int n_top);

}  // namespace mb
