// stats.hpp — summary statistics of repeated timings (median and spread), shared by every benchmark.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace dmoe::bench {

struct Stats {
  double median_ms = 0, min_ms = 0, max_ms = 0, mean_ms = 0, stdev_ms = 0;
  int iterations = 0;
};

inline Stats summarize(std::vector<double> ms) {
  Stats s;
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  s.iterations = int(n);
  s.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  s.min_ms = ms.front();
  s.max_ms = ms.back();
  for (double v : ms) s.mean_ms += v;
  s.mean_ms /= double(n);
  for (double v : ms) s.stdev_ms += (v - s.mean_ms) * (v - s.mean_ms);
  s.stdev_ms = n > 1 ? std::sqrt(s.stdev_ms / double(n - 1)) : 0;
  return s;
}

}  // namespace dmoe::bench
