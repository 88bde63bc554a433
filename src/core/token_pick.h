// One token picked from a row of logits: the sampler's filter chain and draw, given the draw's
// uniform number. Here rather than in the runtime so that backends can pick where the logits are
// (Backend::sample_rows) with the host's exact rules, and the runtime's Sampler stays the only
// owner of the random stream (it draws `u`; whoever picks only consumes it).
//
// Rules (llama.cpp/vLLM order): z = logit / temperature over the finite logits; top-k keeps the k
// first in (z descending, id ascending) order; p = exp(z - max z) in double; top-p keeps the
// shortest prefix in that order whose mass reaches top_p of the candidates' mass; min-p drops p <
// min_p (stable). The survivors are walked in descending order after top-k or top-p, else in
// vocabulary order, subtracting p from u * (their mass); the first to take it below zero is the
// pick (the last survivor if rounding leaves none).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace mb {

struct TokenPick {
  float temperature = 0.f;  // <= 0: the first maximum (greedy)
  int32_t top_k = 0;        // 0: off
  float top_p = 1.f;        // 1: off
  float min_p = 0.f;        // 0: off
  double u = 0;             // the draw, in [0, 1)
};

struct PickCandidate {
  float z;     // logit / temperature
  int32_t id;
  double p;    // exp(z - max z), unnormalised
};

// The pick; -1 when the row holds no finite logit (greedy: when it holds any non-finite one, as
// Backend::first_max_or_nonfinite). `scratch` is reused between calls.
int32_t pick_token(std::span<const float> logits, const TokenPick& p, std::vector<PickCandidate>& scratch);
// pick_token, or -1 when the row holds any non-finite logit (what Backend::sample_rows gives: a
// NaN ends the request instead of being skipped).
int32_t pick_row(std::span<const float> logits, const TokenPick& p, std::vector<PickCandidate>& scratch);

}  // namespace mb
