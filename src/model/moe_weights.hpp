// moe_weights.hpp — host-side weights and gradients of one MoE layer (f32, row-major).
//
// Layout follows the checkpoint names (Mixtral): gate.weight [E, H]; experts.{e}.w1.weight [I, H] (gate
// projection), experts.{e}.w3.weight [I, H] (up projection, SwiGLU only), experts.{e}.w2.weight [H, I]
// (down projection). Here the experts are stacked: w1 [Ne, I, H], w3 [Ne, I, H], w2 [Ne, H, I] for the
// Ne experts first_expert .. first_expert+Ne-1 (all experts, or one rank's share).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"

namespace dmoe {

struct MoeWeights {
  int64_t hidden = 0;
  int64_t ffn = 0;
  int32_t experts = 0;        // E: experts of the whole layer (gate has E rows)
  int32_t first_expert = 0;   // first expert held here
  int32_t num_experts = 0;    // Ne: experts held here
  Activation activation = Activation::swiglu;
  std::vector<float> gate;    // [E, H]
  std::vector<float> w1;      // [Ne, I, H]
  std::vector<float> w3;      // [Ne, I, H], empty unless SwiGLU
  std::vector<float> w2;      // [Ne, H, I]

  const float* w1_of(int32_t local) const { return w1.data() + local * ffn * hidden; }
  const float* w3_of(int32_t local) const { return w3.empty() ? nullptr : w3.data() + local * ffn * hidden; }
  const float* w2_of(int32_t local) const { return w2.data() + local * hidden * ffn; }
};

// Zero-initialised weights of the right shapes for `config` holding experts [first, first + count).
MoeWeights make_moe_weights(const MoeConfig& config, int32_t first_expert, int32_t num_experts);

// Deterministic random weights (scaled normal, std 1/sqrt(fan_in)); rounded to bf16 if config.dtype is.
MoeWeights random_moe_weights(const MoeConfig& config, uint64_t seed);

// Uniform weights with the same standard deviation (1/sqrt(fan_in)), each value a hash of (seed, tensor,
// index): fast, parallel (threads), and any rank can produce any expert's values without the others —
// used by benchmarks at real model sizes. Rounded to bf16 if config.dtype is.
MoeWeights hashed_moe_weights(const MoeConfig& config, uint64_t seed, int32_t first_expert, int32_t num_experts);
// The value hashed_moe_weights and hashed_activations use for element `index` of stream `stream`.
float hashed_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// rows × cols values, std 1 (for inputs x, dy).
std::vector<float> hashed_activations(uint64_t seed, int64_t rows, int64_t cols, bool round_bf16);

// The experts [first, first + count) of w, with the full gate (what one rank holds).
MoeWeights slice_experts(const MoeWeights& w, int32_t first_expert, int32_t num_experts);

}  // namespace dmoe
