// random.hpp — a small deterministic generator (splitmix64), the same on every platform, so random
// weights and inputs made from a seed are reproducible across machines and test runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace dmoe {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return double(next() >> 11) * 0x1p-53; }
  // Standard normal (Box-Muller).
  double normal() {
    const double u1 = uniform() + 0x1p-54, u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  std::vector<float> normal_vector(size_t n, double scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = float(normal() * scale);
    return v;
  }

 private:
  uint64_t state_;
};

}  // namespace dmoe
