#include "core/config.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace dmoe {

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::relu: return "relu";
    case Activation::gelu: return "gelu";
    case Activation::swiglu: return "swiglu";
  }
  return "?";
}

const char* drop_policy_name(DropPolicy p) {
  switch (p) {
    case DropPolicy::latest_tokens: return "latest-tokens";
    case DropPolicy::lowest_weight: return "lowest-weight";
  }
  return "?";
}

Activation parse_activation(std::string_view name) {
  if (name == "relu") return Activation::relu;
  if (name == "gelu") return Activation::gelu;
  if (name == "swiglu" || name == "silu") return Activation::swiglu;
  DMOE_FAIL_INPUT("activation '{}' is not supported; allowed: relu, gelu, swiglu (alias silu)", name);
}

DropPolicy parse_drop_policy(std::string_view name) {
  if (name == "latest-tokens") return DropPolicy::latest_tokens;
  if (name == "lowest-weight") return DropPolicy::lowest_weight;
  DMOE_FAIL_INPUT("drop_policy '{}' is not supported; allowed: latest-tokens, lowest-weight", name);
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "F32") return DType::f32;
  if (name == "bf16" || name == "bfloat16" || name == "BF16") return DType::bf16;
  DMOE_FAIL_INPUT("dtype '{}' is not supported; allowed: f32 (float32), bf16 (bfloat16)", name);
}

void MoeConfig::validate() const {
  DMOE_REQUIRE_INPUT(tokens >= 1, "config: tokens = {} is invalid; tokens per rank must be >= 1", tokens);
  DMOE_REQUIRE_INPUT(hidden >= 1, "config: hidden = {} is invalid; hidden size must be >= 1", hidden);
  DMOE_REQUIRE_INPUT(ffn >= 1, "config: ffn = {} is invalid; expert FFN width must be >= 1", ffn);
  DMOE_REQUIRE_INPUT(experts >= 1, "config: experts = {} is invalid; must be >= 1", experts);
  DMOE_REQUIRE_INPUT(top_k >= 1 && top_k <= experts,
                     "config: top_k = {} is invalid; must satisfy 1 <= top_k <= experts ({})", top_k, experts);
  DMOE_REQUIRE_INPUT(world >= 1, "config: world = {} is invalid; must be >= 1", world);
  DMOE_REQUIRE_INPUT(experts % world == 0,
                     "config: experts = {} is not divisible by world = {}; each rank must own E/W experts",
                     experts, world);
  DMOE_REQUIRE_INPUT(std::isfinite(capacity_factor) && capacity_factor >= 0,
                     "config: capacity_factor = {} is invalid; use 0 for dropless or a positive number",
                     capacity_factor);
  DMOE_REQUIRE_INPUT(dtype == DType::f32 || dtype == DType::bf16,
                     "config: dtype = {} is invalid; allowed: f32, bf16", dtype_name(dtype));
  // [0, 1e6], as a model config's router_aux_loss_coef (F5 of the eighteenth pass): finite in double let 1e39 through,
  // inf as float, and run computed the whole layer, then blamed it ("the layer overflowed float"; G22B-5).
  DMOE_REQUIRE_INPUT(aux_loss_coef >= 0 && aux_loss_coef <= 1e6, "config: aux_loss_coef = {} must be in [0, 1e6] (the "
                     "load-balancing loss's weight; the loss and its gradients are float32; Mixtral's is 0.02)",
                     aux_loss_coef);
  DMOE_REQUIRE_INPUT(z_loss_coef >= 0 && z_loss_coef <= 1e6, "config: z_loss_coef = {} must be in [0, 1e6] (the router "
                     "z-loss's weight; the loss and its gradients are float32; ST-MoE's is 0.001)", z_loss_coef);
  // Row counts and element offsets are int64; keep every buffer's element count far from overflow.
  const double biggest = double(tokens) * double(world) * double(top_k) * double(std::max(hidden, ffn));
  DMOE_REQUIRE_INPUT(biggest < 0x1p52,
                     "config: tokens*world*top_k*max(hidden, ffn) = {:.3g} is too large; must be < 2^52",
                     biggest);
  DMOE_REQUIRE_INPUT(double(tokens) * double(world) * double(top_k) < 0x1p31,
                     "config: tokens*world*top_k = {} is too large; row indices are int32 (< 2^31)",
                     tokens * world * top_k);
}

int64_t MoeConfig::capacity() const {
  if (dropless()) return -1;
  // One source rank can send an expert at most T rows (a token picks an expert at most once), so a
  // larger capacity only pads; clamping before the cast also keeps huge factors out of int64 overflow.
  const double c = std::ceil(capacity_factor * double(tokens) * double(top_k) / double(experts));
  return std::clamp<int64_t>(int64_t(std::min(c, double(tokens))), 1, tokens);
}

double MoeConfig::expert_flops() const {
  const double m = activation == Activation::swiglu ? 3 : 2;
  return 2 * m * double(tokens) * top_k * double(hidden) * double(ffn);
}

std::string MoeConfig::summary() const {
  std::string cap = dropless() ? std::string("dropless") : fmt::format("cf={:g}", capacity_factor);
  return fmt::format("T={} H={} I={} E={} k={} {} {} W={} {}", tokens, hidden, ffn, experts, top_k,
                     activation_name(activation), dtype_name(dtype), world, cap);
}

bool operator==(const MoeConfig& a, const MoeConfig& b) {
  return a.tokens == b.tokens && a.hidden == b.hidden && a.ffn == b.ffn && a.experts == b.experts &&
         a.top_k == b.top_k && a.activation == b.activation && a.renormalize == b.renormalize &&
         a.capacity_factor == b.capacity_factor && a.drop_policy == b.drop_policy &&
         a.dtype == b.dtype && a.world == b.world && a.aux_loss_coef == b.aux_loss_coef &&
         a.z_loss_coef == b.z_loss_coef;
}

}  // namespace dmoe
