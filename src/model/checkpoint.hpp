// checkpoint.hpp — MoE layer weights and gradients in safetensors files, under Mixtral's tensor names.
//
// With a prefix P (default layer_prefix(0) = "model.layers.0.block_sparse_moe."):
//   P + "gate.weight"              [E, H]  router
//   P + "experts.{e}.w1.weight"    [I, H]  gate projection (SwiGLU) / up projection (relu, gelu)
//   P + "experts.{e}.w3.weight"    [I, H]  up projection, SwiGLU only
//   P + "experts.{e}.w2.weight"    [H, I]  down projection
// Gradients are stored as "grad." + the weight's name. bf16/f16 tensors are widened to f32 on load.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/config.hpp"
#include "model/moe_weights.hpp"
#include "model/safetensors.hpp"

namespace dmoe {

// "model.layers.{layer}.block_sparse_moe."
std::string layer_prefix(int layer);
// Full tensor names under a prefix.
std::string gate_name(const std::string& prefix);
std::string expert_weight_name(const std::string& prefix, int32_t expert, const char* matrix);  // "w1"|"w2"|"w3"

// The prefix of the MoE layer to load. With `layer`, that layer (error listing the layers present if its
// gate is missing); without, the lowest model.layers.{L} holding a gate, else "block_sparse_moe." or ""
// (a bare "gate.weight"); else an error saying which names were looked for.
std::string find_moe_prefix(const SafetensorsFile& file, std::optional<int> layer = std::nullopt);

// The full gate and experts [first_expert, first_expert + num_experts), shapes checked against config.
MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix,
                            int32_t first_expert, int32_t num_experts);
// All config.experts experts.
MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix);

// Adds the gate and the held experts (global index first_expert + local) stored as `stored_as`.
void save_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights, const std::string& prefix,
                      DType stored_as = DType::f32);
// Adds gradients (same layout as weights) under "grad." + prefix.
void add_moe_grads(SafetensorsWriter& writer, const MoeWeights& grads, const std::string& prefix,
                   DType stored_as = DType::f32);

// The shapes of the layer at `prefix`: hidden and experts from the gate, ffn from expert 0's w1,
// activation swiglu when w3 is present (else relu: relu and gelu files look alike), dtype bf16 when the
// gate is stored as BF16. tokens and top_k cannot be inferred and stay 0 — the caller sets them.
MoeConfig infer_moe_config(const SafetensorsFile& file, const std::string& prefix);

}  // namespace dmoe
