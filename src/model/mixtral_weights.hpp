// mixtral_weights.hpp — host-side parameters (or gradients) of a Mixtral model, f32, under HF names.
//
//   model.embed_tokens.weight                                  [V, H]
//   model.layers.{L}.input_layernorm.weight                    [H]
//   model.layers.{L}.self_attn.q_proj.weight                   [heads·D, H]
//   model.layers.{L}.self_attn.k_proj.weight, v_proj.weight    [kv_heads·D, H]
//   model.layers.{L}.self_attn.o_proj.weight                   [H, heads·D]
//   model.layers.{L}.post_attention_layernorm.weight           [H]
//   model.layers.{L}.block_sparse_moe.gate.weight              [E, H]
//   model.layers.{L}.block_sparse_moe.experts.{e}.w1.weight    [I, H]  gate projection
//   model.layers.{L}.block_sparse_moe.experts.{e}.w3.weight    [I, H]  up projection
//   model.layers.{L}.block_sparse_moe.experts.{e}.w2.weight    [H, I]  down projection
//   model.norm.weight                                          [H]
//   lm_head.weight                                             [V, H]  (absent when tie_word_embeddings)
//
// A rank holds every dense tensor and the experts [first_expert, first_expert + num_experts) of each layer
// (the MoeWeights of a layer stacks them, see moe_weights.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/mixtral_config.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

struct MixtralLayerWeights {
  std::vector<float> input_layernorm;           // [H]
  std::vector<float> q_proj, k_proj, v_proj;    // [heads·D, H], [kv·D, H], [kv·D, H]
  std::vector<float> o_proj;                    // [H, heads·D]
  std::vector<float> post_attention_layernorm;  // [H]
  MoeWeights moe;                               // gate [E, H] + the held experts
};

struct MixtralWeights {
  std::vector<float> embed_tokens;  // [V, H]
  std::vector<MixtralLayerWeights> layers;
  std::vector<float> norm;          // [H]
  std::vector<float> lm_head;       // [V, H]; empty when tie_word_embeddings
  int32_t first_expert = 0;
  int32_t num_experts = 0;
};

// One parameter tensor: its HF name, shape and storage (a view into a MixtralWeights).
struct ParamView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;
  int64_t numel = 0;
  bool is_expert = false;  // an expert's w1/w2/w3 (sharded over ranks); everything else is replicated
  bool is_gate = false;    // a router: replicated, but EpEngine already sums its gradient over ranks
};

// Zero tensors of the right shapes, holding experts [first_expert, first_expert + num_experts).
MixtralWeights make_mixtral_weights(const MixtralConfig& c, int32_t first_expert, int32_t num_experts);
// HF's initialisation: every matrix normal(0, initializer_range), norms 1. Each tensor has its own stream
// (seed, name), so a rank's share equals the same tensors of the full model.
MixtralWeights random_mixtral_weights(const MixtralConfig& c, uint64_t seed, int32_t first_expert,
                                      int32_t num_experts);
MixtralWeights random_mixtral_weights(const MixtralConfig& c, uint64_t seed);  // all experts

// Every tensor of w under its HF name (dense first within a layer, experts in index order).
std::vector<ParamView> parameter_views(MixtralWeights& w, const MixtralConfig& c);
// The experts [first, first + count) of a full model's weights, dense tensors copied.
MixtralWeights slice_mixtral_experts(const MixtralWeights& w, int32_t first_expert, int32_t num_experts);

}  // namespace dmoe
