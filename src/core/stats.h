// Small statistics over measurements (benchmark rounds, bandwidth passes).
#pragma once
#include <algorithm>
#include <vector>

namespace mb {

// The median (the mean of the two middle values for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

}  // namespace mb
