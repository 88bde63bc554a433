#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/splitmix64.h"

namespace mb {

int32_t argmax(std::span<const float> logits) {
  MB_CHECK(!logits.empty(), "argmax of empty logits");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[size_t(best)]) best = int32_t(i);  // first of equal maxima, like torch.argmax
  return best;
}

Sampler::Sampler(const SamplerParams& p) : p_(p), state_(p.seed ^ kSplitmix64Gamma) {
  MB_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0, got {}", p.temperature);
  MB_CHECK(p.top_k >= 0, "top_k must be >= 0, got {}", p.top_k);
  MB_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got {}", p.top_p);
  MB_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1], got {}", p.min_p);
}

uint64_t Sampler::next_u64() { return splitmix64_next(state_); }

double Sampler::next_unit() { return double(next_u64() >> 11) * 0x1.0p-53; }

int32_t Sampler::sample(std::span<const float> logits) {
  if (p_.temperature <= 0.f) return argmax(logits);
  const int32_t id = pick_token(logits, pick(), cand_);
  MB_CHECK(id >= 0, "all logits are non-finite");
  return id;
}

TokenPick Sampler::pick() {
  TokenPick t;
  t.temperature = p_.temperature;
  if (p_.temperature <= 0.f) return t;
  t.top_k = p_.top_k;
  t.top_p = p_.top_p;
  t.min_p = p_.min_p;
  t.u = next_unit();
  return t;
}

}  // namespace mb

namespace mb {

void TokenHistory::add_prompt(std::span<const int32_t> ids) {
  seen_.insert(seen_.end(), ids.begin(), ids.end());
  std::sort(seen_.begin(), seen_.end());
  seen_.erase(std::unique(seen_.begin(), seen_.end()), seen_.end());
}

void TokenHistory::add_output(int32_t id) {
  auto it = std::lower_bound(seen_.begin(), seen_.end(), id);
  if (it == seen_.end() || *it != id) seen_.insert(it, id);
  auto c = std::lower_bound(output_counts_.begin(), output_counts_.end(), std::pair<int32_t, int32_t>{id, 0});
  if (c == output_counts_.end() || c->first != id) c = output_counts_.insert(c, {id, 0});
  ++c->second;
}

void TokenHistory::adjust(std::span<float> logits, const LogitAdjustments& a) const {
  const int64_t n = int64_t(logits.size());
  for (const auto& [id, b] : a.bias)
    if (id >= 0 && id < n) logits[size_t(id)] += b;
  if (a.repetition_penalty != 1.f)
    for (int32_t id : seen_) {
      if (id < 0 || id >= n) continue;
      float& x = logits[size_t(id)];
      x = x > 0 ? x / a.repetition_penalty : x * a.repetition_penalty;
    }
  if (a.frequency_penalty != 0.f || a.presence_penalty != 0.f)
    for (const auto& [id, count] : output_counts_)
      if (id >= 0 && id < n) logits[size_t(id)] -= a.frequency_penalty * float(count) + a.presence_penalty;
}

Logprobs logprobs(std::span<const float> logits, int32_t chosen, int n_top) {
  MB_CHECK(chosen >= 0 && size_t(chosen) < logits.size(), "logprobs: token {} is outside the logits", chosen);
  float mx = -std::numeric_limits<float>::infinity();
  for (float x : logits) mx = std::max(mx, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - mx);
  const double log_z = double(mx) + std::log(sum);
  Logprobs r;
  r.chosen = float(double(logits[size_t(chosen)]) - log_z);
  if (n_top > 0) {
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
    const size_t k = std::min(ids.size(), size_t(n_top));
    std::partial_sort(ids.begin(), ids.begin() + int64_t(k), ids.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (size_t i = 0; i < k; ++i) r.top.push_back({ids[i], float(double(logits[size_t(ids[i])]) - log_z)});
  }
  return r;
}

}  // namespace mb
