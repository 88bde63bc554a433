#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mb {

int32_t argmax(std::span<const float> logits) {
  MB_CHECK(!logits.empty(), "argmax of empty logits");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[size_t(best)]) best = int32_t(i);  // first of equal maxima, like torch.argmax
  return best;
}

Sampler::Sampler(const SamplerParams& p) : p_(p), state_(p.seed ^ 0x9E3779B97F4A7C15ull) {
  MB_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0, got {}", p.temperature);
  MB_CHECK(p.top_k >= 0, "top_k must be >= 0, got {}", p.top_k);
  MB_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got {}", p.top_p);
  MB_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1], got {}", p.min_p);
}

// splitmix64: tiny, fast, and its output is fixed by this code alone.
uint64_t Sampler::next_u64() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Sampler::next_unit() { return double(next_u64() >> 11) * 0x1.0p-53; }

int32_t Sampler::sample(std::span<const float> logits) {
  if (p_.temperature <= 0.f) return argmax(logits);
  cand_.clear();
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isfinite(logits[i])) cand_.push_back({logits[i] / p_.temperature, int32_t(i)});
  MB_CHECK(!cand_.empty(), "all logits are non-finite");
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = cand_.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
    keep = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + keep, cand_.end(), by_logit);
    cand_.resize(keep);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax over the survivors, in descending order.
  const float mx = cand_[0].first;
  std::vector<double> prob(cand_.size());
  double sum = 0;
  for (size_t i = 0; i < cand_.size(); ++i) sum += (prob[i] = std::exp(double(cand_[i].first - mx)));
  for (auto& p : prob) p /= sum;
  if (p_.top_p < 1.f) {
    double acc = 0;
    size_t i = 0;
    for (; i < prob.size(); ++i) {
      acc += prob[i];
      if (acc >= p_.top_p) break;
    }
    keep = std::min(prob.size(), i + 1);
    prob.resize(keep);
  }
  if (p_.min_p > 0.f) {
    const double floor = prob[0] * p_.min_p;
    size_t i = 1;
    while (i < prob.size() && prob[i] >= floor) ++i;
    prob.resize(i);
  }
  double total = 0;
  for (double p : prob) total += p;
  double r = next_unit() * total;
  for (size_t i = 0; i < prob.size(); ++i) {
    r -= prob[i];
    if (r < 0) return cand_[i].second;
  }
  return cand_[prob.size() - 1].second;
}

}  // namespace mb
