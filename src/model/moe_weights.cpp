#include "model/moe_weights.hpp"

#include <cmath>
#include <system_error>
#include <thread>

#include "core/error.hpp"
#include "core/random.hpp"

namespace dmoe {

MoeWeights make_moe_weights(const MoeConfig& config, int32_t first_expert, int32_t num_experts) {
  DMOE_REQUIRE(first_expert >= 0 && num_experts >= 0 && first_expert + num_experts <= config.experts,
               "weights: experts [{}, {}) are outside [0, {})", first_expert, first_expert + num_experts,
               config.experts);
  MoeWeights w;
  w.hidden = config.hidden;
  w.ffn = config.ffn;
  w.experts = config.experts;
  w.first_expert = first_expert;
  w.num_experts = num_experts;
  w.activation = config.activation;
  const size_t matrix = size_t(config.ffn * config.hidden);
  w.gate.assign(size_t(config.experts * config.hidden), 0.f);
  w.w1.assign(num_experts * matrix, 0.f);
  if (config.activation == Activation::swiglu) w.w3.assign(num_experts * matrix, 0.f);
  w.w2.assign(num_experts * matrix, 0.f);
  return w;
}

MoeWeights random_moe_weights(const MoeConfig& config, uint64_t seed) {
  MoeWeights w = make_moe_weights(config, 0, config.experts);
  Rng rng(seed);
  const double in_scale = 1.0 / std::sqrt(double(config.hidden));
  const double out_scale = 1.0 / std::sqrt(double(config.ffn));
  auto fill = [&](std::vector<float>& v, double scale) {
    for (auto& x : v) {
      x = float(rng.normal() * scale);
      if (config.dtype == DType::bf16) x = round_to_bf16(x);
    }
  };
  fill(w.gate, in_scale);
  fill(w.w1, in_scale);
  fill(w.w3, in_scale);
  fill(w.w2, out_scale);
  return w;
}

float hashed_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = (seed * 0x9e3779b97f4a7c15ull) ^ (stream * 0xd1b54a32d192ed03ull) ^ (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * 0x1p-24f * 2.f - 1.f;  // [-1, 1)
}

namespace {

// v[i] = scale * hashed_uniform(seed, stream, i), split over hardware threads.
void fill_hashed(std::vector<float>& v, uint64_t seed, uint64_t stream, float scale, bool round_bf16) {
  const size_t n = v.size();
  const size_t threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), n / (1 << 20) + 1));
  const auto fill = [&](size_t t) {
    for (size_t i = n * t / threads; i < n * (t + 1) / threads; ++i) {
      const float x = scale * hashed_uniform(seed, stream, i);
      v[i] = round_bf16 ? round_to_bf16(x) : x;
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    try {
      pool.emplace_back(fill, t);
    } catch (const std::system_error&) {
      fill(t);  // no thread to be had (ulimit -v, -u): this one does the part; the values do not depend on who
    }
  }
  for (auto& th : pool) th.join();
}

}  // namespace

MoeWeights hashed_moe_weights(const MoeConfig& config, uint64_t seed, int32_t first_expert, int32_t num_experts) {
  MoeWeights w = make_moe_weights(config, first_expert, num_experts);
  const bool bf16 = config.dtype == DType::bf16;
  // uniform[-a, a) has std a/sqrt(3): a = sqrt(3/fan_in) gives std 1/sqrt(fan_in).
  const float in_scale = float(std::sqrt(3.0 / double(config.hidden)));
  const float out_scale = float(std::sqrt(3.0 / double(config.ffn)));
  fill_hashed(w.gate, seed, 0, in_scale, bf16);
  const size_t m = size_t(config.ffn * config.hidden);
  std::vector<float> tmp(m);
  for (int32_t l = 0; l < num_experts; ++l) {
    const uint64_t e = uint64_t(first_expert + l);
    auto put = [&](std::vector<float>& dst, uint64_t which, float scale) {
      fill_hashed(tmp, seed, 1 + 3 * e + which, scale, bf16);
      std::copy(tmp.begin(), tmp.end(), dst.begin() + l * m);
    };
    put(w.w1, 0, in_scale);
    if (!w.w3.empty()) put(w.w3, 1, in_scale);
    put(w.w2, 2, out_scale);
  }
  return w;
}

std::vector<float> hashed_activations(uint64_t seed, int64_t rows, int64_t cols, bool round_bf16) {
  std::vector<float> v(size_t(rows * cols));
  fill_hashed(v, seed, ~uint64_t(0), float(std::sqrt(3.0)), round_bf16);
  return v;
}

MoeWeights slice_experts(const MoeWeights& w, int32_t first_expert, int32_t num_experts) {
  DMOE_REQUIRE(first_expert >= w.first_expert && first_expert + num_experts <= w.first_expert + w.num_experts,
               "weights: experts [{}, {}) are not all held (held: [{}, {}))", first_expert,
               first_expert + num_experts, w.first_expert, w.first_expert + w.num_experts);
  MoeWeights s = w;
  s.first_expert = first_expert;
  s.num_experts = num_experts;
  const size_t matrix = size_t(w.ffn * w.hidden);
  const size_t begin = size_t(first_expert - w.first_expert) * matrix;
  const size_t end = begin + size_t(num_experts) * matrix;
  s.w1.assign(w.w1.begin() + begin, w.w1.begin() + end);
  if (!w.w3.empty()) s.w3.assign(w.w3.begin() + begin, w.w3.begin() + end);
  s.w2.assign(w.w2.begin() + begin, w.w2.begin() + end);
  return s;
}

}  // namespace dmoe
