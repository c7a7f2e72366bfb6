// config.hpp — MoeConfig: the shape and semantics of one distributed MoE layer.
//
// Every engine (CPU reference, vanilla EP on CUDA, Flash, Flow) takes the same MoeConfig. validate()
// rejects each impossible combination with a message that names the field, the value and the rule.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.hpp"

namespace dmoe {

enum class Activation : uint8_t { relu, gelu, swiglu };
// Which routed tokens an expert over capacity drops.
//   latest_tokens: keep the earliest tokens (by token index), drop the latest first (GShard/Switch).
//   lowest_weight: keep the tokens with the largest gate weight, ties to the earlier token.
enum class DropPolicy : uint8_t { latest_tokens, lowest_weight };

const char* activation_name(Activation a);
const char* drop_policy_name(DropPolicy p);
// Parse a name; throws dmoe::Error listing the allowed names when it is unknown.
Activation parse_activation(std::string_view name);
DropPolicy parse_drop_policy(std::string_view name);
DType parse_dtype(std::string_view name);

// Number of weight matrices per expert: SwiGLU has w1 (gate), w3 (up) and w2 (down), the others w1, w2.
constexpr int expert_matrices(Activation a) { return a == Activation::swiglu ? 3 : 2; }

struct MoeConfig {
  int64_t tokens = 0;           // T: tokens per rank
  int64_t hidden = 0;           // H: model width
  int64_t ffn = 0;              // I: expert FFN width
  int32_t experts = 0;          // E: experts in total (over all ranks)
  int32_t top_k = 0;            // k: experts per token
  Activation activation = Activation::swiglu;
  bool renormalize = true;      // renormalise the k softmax weights to sum to 1 (Mixtral) or not
  double capacity_factor = 0;   // 0 = dropless; else capacity per (source rank, expert) =
                                //   ceil(capacity_factor * T * k / E)
  DropPolicy drop_policy = DropPolicy::latest_tokens;
  DType dtype = DType::f32;     // storage type of activations and weights (f32 or bf16)
  int32_t world = 1;            // W: ranks; rank r owns experts [r*E/W, (r+1)*E/W)
  double aux_loss_coef = 0;     // weight of the load-balancing loss in the backward pass
  double z_loss_coef = 0;       // weight of the router z-loss in the backward pass

  // Throws dmoe::Error naming the field, its value and the rule broken.
  void validate() const;

  bool dropless() const { return capacity_factor == 0; }
  // Rows one source rank may send to one expert, min(ceil(cf·T·k/E), T) (at least 1); -1 when dropless.
  int64_t capacity() const;
  int32_t experts_per_rank() const { return experts / world; }
  int32_t expert_owner(int32_t expert) const { return expert / experts_per_rank(); }
  int32_t first_expert(int32_t rank) const { return rank * experts_per_rank(); }
  // FLOPs of the expert FFNs for one rank's tokens if every routed row is kept: 2*m*T*k*H*I.
  double expert_flops() const;
  // One line: "T=… H=… I=… E=… k=… swiglu bf16 W=… dropless".
  std::string summary() const;
};

bool operator==(const MoeConfig& a, const MoeConfig& b);

}  // namespace dmoe
