#include "core/token_pick.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mb {

int32_t pick_token(std::span<const float> logits, const TokenPick& p, std::vector<PickCandidate>& cand) {
  if (p.temperature <= 0.f) {
    int32_t best = -1;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!std::isfinite(logits[i])) return -1;
      if (best < 0 || logits[i] > logits[size_t(best)]) best = int32_t(i);  // the first of equal maxima
    }
    return best;
  }
  cand.clear();
  float mx = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isfinite(logits[i])) {
      const float z = logits[i] / p.temperature;
      cand.push_back({z, int32_t(i), 0.0});
      mx = std::max(mx, z);
    }
  if (cand.empty()) return -1;
  auto first = [](const PickCandidate& a, const PickCandidate& b) { return a.z > b.z || (a.z == b.z && a.id < b.id); };
  // Top-k: the k first in (z desc, id asc) order, then sorted.
  if (p.top_k > 0 && size_t(p.top_k) < cand.size()) {
    std::nth_element(cand.begin(), cand.begin() + p.top_k, cand.end(), first);
    cand.resize(size_t(p.top_k));
    std::sort(cand.begin(), cand.end(), first);
  }
  double sum = 0;
  for (PickCandidate& c : cand) sum += (c.p = std::exp(double(c.z - mx)));
  size_t keep = cand.size();
  // Top-p: sort a prefix of m candidates; when its mass falls short, take a 4x larger one (the
  // nucleus is usually a few dozen tokens; a flat distribution ends in one sort of everything).
  if (p.top_p < 1.f) {
    const double target = double(p.top_p) * sum;
    for (size_t m = std::min<size_t>(keep, 64);; m = std::min(keep, 4 * m)) {
      if (m < keep) std::nth_element(cand.begin(), cand.begin() + int64_t(m), cand.end(), first);
      std::sort(cand.begin(), cand.begin() + int64_t(m), first);
      double acc = 0;
      size_t i = 0;
      while (i < m && (acc += cand[i].p) < target) ++i;
      if (i < m || m == keep) {
        keep = std::min(m, i + 1);
        break;
      }
    }
    cand.resize(keep);
  }
  if (p.min_p > 0.f) {
    const double floor = double(p.min_p);
    cand.erase(std::remove_if(cand.begin(), cand.end(), [&](const PickCandidate& c) { return c.p < floor; }),
               cand.end());
  }
  double total = 0;
  for (const PickCandidate& c : cand) total += c.p;
  double r = p.u * total;
  for (const PickCandidate& c : cand) {
    r -= c.p;
    if (r < 0) return c.id;
  }
  return cand.back().id;
}

int32_t pick_row(std::span<const float> logits, const TokenPick& p, std::vector<PickCandidate>& scratch) {
  for (float v : logits)
    if (!std::isfinite(v)) return -1;
  return pick_token(logits, p, scratch);
}

}  // namespace mb
