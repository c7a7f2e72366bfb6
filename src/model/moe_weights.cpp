#include "model/moe_weights.hpp"

#include <cmath>

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
