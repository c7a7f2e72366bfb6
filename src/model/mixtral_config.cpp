// mixtral_config.cpp — Hugging Face Mixtral config.json <-> MixtralConfig (see mixtral_config.hpp).
#include "model/mixtral_config.hpp"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "model/config_io.hpp"

namespace dmoe {
namespace {

using nlohmann::json;

constexpr const char* kWhat = "Mixtral config";

bool present(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max()) {
  const json& v = j.at(key);
  // G23B-10: an integer past 64 bits (2^64) is parsed as a double and was called "must be an integer"; out of range,
  // with the range, as the layer config says since G22B-7 (c). 2^64 - 1 said "is too large" without a range.
  DMOE_REQUIRE_INPUT(!(v.is_number_float() && std::fabs(v.get<double>()) >= 0x1p63 &&
                       v.get<double>() == std::floor(v.get<double>())),
                     "{}: key '{}' = {} is out of range [{}, {}] (an integer past 64 bits)", kWhat, key, v.dump(), lo,
                     hi);
  DMOE_REQUIRE_INPUT(v.is_number_integer(), "{}: key '{}' must be an integer (found {} {})", kWhat, key, v.type_name(),
               v.dump());
  DMOE_REQUIRE_INPUT(!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(hi),
                     "{}: key '{}' = {} is out of range [{}, {}]", kWhat, key, v.dump(), lo, hi);
  const int64_t x = v.get<int64_t>();
  DMOE_REQUIRE_INPUT(x >= lo, "{}: key '{}' = {} must be >= {}", kWhat, key, x, lo);
  DMOE_REQUIRE_INPUT(x <= hi, "{}: key '{}' = {} is out of range [{}, {}]", kWhat, key, x, lo, hi);
  return x;
}

int32_t get_int32(const json& j, const char* key, int64_t lo) {
  return int32_t(get_int(j, key, lo, std::numeric_limits<int32_t>::max()));
}

double get_number(const json& j, const char* key) {
  const json& v = j.at(key);
  DMOE_REQUIRE_INPUT(v.is_number(), "{}: key '{}' must be a number (found {} {})", kWhat, key, v.type_name(), v.dump());
  return v.get<double>();
}

bool get_bool(const json& j, const char* key) {
  const json& v = j.at(key);
  DMOE_REQUIRE_INPUT(v.is_boolean(), "{}: key '{}' must be true or false (found {} {})", kWhat, key, v.type_name(),
               v.dump());
  return v.get<bool>();
}

}  // namespace

void MixtralConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    DMOE_REQUIRE_INPUT(v > 0, "{}: {} = {} must be positive", kWhat, key, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("num_local_experts", num_local_experts);
  positive("num_experts_per_tok", num_experts_per_tok);
  positive("max_position_embeddings", max_position_embeddings);
  DMOE_REQUIRE_INPUT(vocab_size <= std::numeric_limits<int32_t>::max(), "{}: vocab_size = {} does not fit int32 tokens",
               kWhat, vocab_size);
  // The parameter count in doubles first: past int64 (intermediate_size 2^63 - 1) it wrapped ("params=0.0582M", then
  // "unexpected error: cannot create std::vector larger than max_size()"); hidden_size 1e9 overflowed the flow
  // projection's gradient bytes. 1e15 parameters (4 PB of f32) is far past any machine.
  {
    const double H = double(hidden_size), D = head_dim > 0 ? double(head_dim) : H / double(num_attention_heads);
    const double Q = double(num_attention_heads) * D, KV = double(num_key_value_heads) * D;
    const double params = double(vocab_size) * H * 2 + double(num_hidden_layers) *
                          (2 * H * Q + 2 * H * KV + double(num_local_experts) * H * (1 + 3 * double(intermediate_size)));
    DMOE_REQUIRE_INPUT(params <= 1e15, "{}: the model would have {:.3g} parameters (vocab_size {}, hidden_size {}, "
                       "intermediate_size {}, num_hidden_layers {}, num_attention_heads {}, num_local_experts {}): past "
                       "1e15 (4 PB of f32), more than any machine holds", kWhat, params, vocab_size, hidden_size,
                       intermediate_size, num_hidden_layers, num_attention_heads, num_local_experts);
  }
  DMOE_REQUIRE_INPUT(head_dim > 0 || hidden_size % num_attention_heads == 0,
               "{}: hidden_size = {} is not divisible by num_attention_heads = {} (set head_dim to choose the head "
               "size)", kWhat, hidden_size, num_attention_heads);
  DMOE_REQUIRE_INPUT(head_size() % 2 == 0, "{}: the head size {} must be even (rotary embedding rotates pairs)", kWhat,
               head_size());
  DMOE_REQUIRE_INPUT(num_attention_heads % num_key_value_heads == 0,
               "{}: num_attention_heads = {} must be a multiple of num_key_value_heads = {}", kWhat,
               num_attention_heads, num_key_value_heads);
  DMOE_REQUIRE_INPUT(num_experts_per_tok <= num_local_experts,
               "{}: num_experts_per_tok = {} exceeds num_local_experts = {}", kWhat, num_experts_per_tok,
               num_local_experts);
  // The norms compute in float32 with float(rms_norm_eps): past float's range (1e39, 3.5e38) it became inf and every
  // norm's output 0 (uniform logits, rc 0); below it (1e-50) it became 0 (F7 of the eighteenth bad-input pass). Real
  // models use 1e-6 .. 1e-5; an eps past 1 outweighs the activations' mean square.
  // The lower bound is printed rounded up (the fewest digits, from 7, whose value is not below FLT_MIN): {:.7g} printed
  // 1.175494e-38, below the bound, so that "rms_norm_eps = 1.175494e-38 must be in [1.175494e-38, 1]" (G19-6 of the
  // nineteenth bad-input pass). Even {:.9g} (1.17549435e-38) is below it; 1.1754944e-38 is taken.
  const auto bound_up = [](double v) {
    for (int digits = 7; digits < 17; ++digits) {
      const std::string text = fmt::format("{:.{}g}", v, digits);
      if (std::strtod(text.c_str(), nullptr) >= v) return text;
    }
    return fmt::format("{:.17g}", v);
  };
  DMOE_REQUIRE_INPUT(rms_norm_eps >= double(std::numeric_limits<float>::min()) && rms_norm_eps <= 1,
                     "{}: rms_norm_eps = {} must be in [{}, 1] (the RMSNorm epsilon, used in float32: the smallest "
                     "normal float up to 1; Mixtral's is 1e-5)", kWhat, rms_norm_eps,
                     bound_up(double(std::numeric_limits<float>::min())));
  // The rotary frequencies 1 / theta^(2j/D) are computed in float32, as transformers does: a theta below 1 makes them
  // exceed 1 radian per position, and a tiny one (1e-300: 0 as a float) inf, so that a forward's attention was NaN and
  // eval or train failed in the router ("logits contain NaN") naming x or the gate; past float's range (1e300) every
  // frequency but the first is 0. Real models use 1e4 .. 1e8.
  DMOE_REQUIRE_INPUT(rope_theta >= 1 && rope_theta <= double(std::numeric_limits<float>::max()),
                     "{}: rope_theta = {} must be in [1, {:.7g}] (the RoPE base; its frequencies are computed in "
                     "float32; Mixtral's is 1e6)", kWhat, rope_theta, double(std::numeric_limits<float>::max()));
  // The loss and its gradients are float32: a coefficient of 1e39 (or 1e300) made the written loss inf with rc 0, and
  // train "trained" with a loss of 2e39 (F5 of the eighteenth bad-input pass). Real models use 0.001 .. 0.1.
  DMOE_REQUIRE_INPUT(router_aux_loss_coef >= 0 && router_aux_loss_coef <= 1e6,
                     "{}: router_aux_loss_coef = {} must be in [0, 1e6] (the load-balancing loss's weight; the loss and "
                     "its gradients are float32; Mixtral's is 0.02)", kWhat, router_aux_loss_coef);
  DMOE_REQUIRE_INPUT(sliding_window >= 0, "{}: sliding_window = {} must be null or positive", kWhat, sliding_window);
  // The standard deviation of init-model's normal draws: a negative one was accepted (it drew negated weights), one
  // past ~1e37 made the float32 weights inf (written with rc 0).
  DMOE_REQUIRE_INPUT(initializer_range >= 0 && initializer_range <= 1e37, "{}: initializer_range = {} must be in [0, "
                     "1e37] (the standard deviation of the initial weights; HF's default is 0.02)", kWhat,
                     initializer_range);
}

void MixtralConfig::check_sequence(int64_t seq, std::string_view source, int64_t min_seq) const {
  DMOE_REQUIRE_INPUT(seq >= min_seq && seq <= max_position_embeddings,
               "{} {} is outside [{}, max_position_embeddings = {}] of the model config", source, seq, min_seq,
               max_position_embeddings);
  DMOE_REQUIRE_INPUT(sliding_window == 0 || sliding_window >= seq,
               "{} {} exceeds the model config's sliding_window = {}: dmoe has no sliding-window attention mask (set "
               "sliding_window to null or >= the sequence length)", source, seq, sliding_window);
}

MoeConfig MixtralConfig::moe_config(int64_t tokens, int32_t world) const {
  MoeConfig c;
  c.tokens = tokens;
  c.hidden = hidden_size;
  c.ffn = intermediate_size;
  c.experts = num_local_experts;
  c.top_k = num_experts_per_tok;
  c.activation = Activation::swiglu;
  c.renormalize = true;
  c.capacity_factor = 0;
  c.dtype = DType::f32;
  c.world = world;
  return c;
}

double MixtralConfig::forward_flop(int64_t batch, int64_t seq) const {
  const double n = double(batch) * double(seq), H = double(hidden_size), Q = double(q_size()), KV = double(kv_size()),
               I = double(intermediate_size), E = double(num_local_experts), k = double(num_experts_per_tok),
               V = double(vocab_size), D = double(head_size());
  const double per_layer = 2 * n * H * (Q + 2 * KV) + 2 * n * Q * H + 2 * n * H * E + 2 * n * k * 3 * H * I +
                           2 * double(batch) * num_attention_heads * double(seq) * double(seq) * D;
  return per_layer * num_hidden_layers + 2 * n * H * V;
}

int64_t MixtralConfig::num_parameters() const {
  const int64_t H = hidden_size, E = num_local_experts;
  const int64_t attention = H * q_size() * 2 + H * kv_size() * 2;
  const int64_t moe = E * H + E * 3 * intermediate_size * H;
  return vocab_size * H * (tie_word_embeddings ? 1 : 2) + H + num_hidden_layers * (attention + moe + 2 * H);
}

std::string MixtralConfig::summary() const {
  return fmt::format("mixtral V={} H={} I={} L={} heads={}/{} D={} E={} k={} params={:.3g}M", vocab_size,
                     hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
                     head_size(), num_local_experts, num_experts_per_tok, double(num_parameters()) / 1e6);
}

MixtralConfig mixtral_config_from_json(const json& j) {
  DMOE_REQUIRE_INPUT(j.is_object(), "{}: JSON must be an object (found {})", kWhat, j.type_name());
  if (present(j, "model_type")) {
    DMOE_REQUIRE_INPUT(j.at("model_type").is_string() && j.at("model_type").get<std::string>() == "mixtral",
                 "{}: model_type is {}; only \"mixtral\" is supported", kWhat, j.at("model_type").dump());
  }
  require_float_mixtral_classes(j, kWhat);
  for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_local_experts", "num_experts_per_tok", "vocab_size"})
    DMOE_REQUIRE_INPUT(present(j, key), "{}: required key '{}' is missing (required: hidden_size, intermediate_size, "
                 "num_hidden_layers, num_attention_heads, num_local_experts, num_experts_per_tok, vocab_size)",
                 kWhat, key);
  MixtralConfig c;
  c.hidden_size = get_int(j, "hidden_size", 1);
  c.intermediate_size = get_int(j, "intermediate_size", 1);
  c.num_hidden_layers = get_int32(j, "num_hidden_layers", 1);
  c.num_attention_heads = get_int32(j, "num_attention_heads", 1);
  c.num_key_value_heads =
      present(j, "num_key_value_heads") ? get_int32(j, "num_key_value_heads", 1) : c.num_attention_heads;
  if (present(j, "head_dim")) c.head_dim = get_int(j, "head_dim", 1);
  c.num_local_experts = get_int32(j, "num_local_experts", 1);
  c.num_experts_per_tok = get_int32(j, "num_experts_per_tok", 1);
  c.vocab_size = get_int(j, "vocab_size", 1);
  if (present(j, "rms_norm_eps")) c.rms_norm_eps = get_number(j, "rms_norm_eps");
  if (present(j, "tie_word_embeddings")) c.tie_word_embeddings = get_bool(j, "tie_word_embeddings");
  if (present(j, "output_router_logits")) c.output_router_logits = get_bool(j, "output_router_logits");
  if (present(j, "router_aux_loss_coef")) c.router_aux_loss_coef = get_number(j, "router_aux_loss_coef");
  if (present(j, "max_position_embeddings")) c.max_position_embeddings = get_int(j, "max_position_embeddings", 1);
  if (present(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", 1);
  if (present(j, "initializer_range")) c.initializer_range = get_number(j, "initializer_range");
  if (present(j, "hidden_act")) {
    const json& act = j.at("hidden_act");
    DMOE_REQUIRE_INPUT(act.is_string() && act.get<std::string>() == "silu",
                 "{}: hidden_act is {}; only \"silu\" (SwiGLU experts, as Mixtral) is supported", kWhat, act.dump());
  }
  if (present(j, "router_jitter_noise"))
    DMOE_REQUIRE_INPUT(get_number(j, "router_jitter_noise") == 0,
                 "{}: router_jitter_noise = {} is not supported (only 0: dmoe's router is deterministic)", kWhat,
                 get_number(j, "router_jitter_noise"));
  if (present(j, "attention_dropout"))
    DMOE_REQUIRE_INPUT(get_number(j, "attention_dropout") == 0,
                       "{}: attention_dropout = {} is not supported (only 0: dmoe's attention has no dropout)", kWhat,
                       get_number(j, "attention_dropout"));
  // rope_theta: top level (transformers 4.x) and/or rope_parameters.rope_theta (5.x); both must agree.
  bool have_theta = false;
  if (present(j, "rope_theta")) {
    c.rope_theta = get_number(j, "rope_theta");
    have_theta = true;
  }
  if (present(j, "rope_parameters")) {
    const json& rp = j.at("rope_parameters");
    DMOE_REQUIRE_INPUT(rp.is_object(), "{}: rope_parameters must be an object (found {})", kWhat, rp.type_name());
    if (present(rp, "rope_type")) {
      DMOE_REQUIRE_INPUT(rp.at("rope_type").is_string() && rp.at("rope_type").get<std::string>() == "default",
                   "{}: rope_parameters.rope_type is {}; only \"default\" RoPE is supported", kWhat,
                   rp.at("rope_type").dump());
    }
    if (present(rp, "rope_theta")) {
      DMOE_REQUIRE_INPUT(rp.at("rope_theta").is_number(), "{}: rope_parameters.rope_theta must be a number", kWhat);
      const double theta = rp.at("rope_theta").get<double>();
      DMOE_REQUIRE_INPUT(!have_theta || theta == c.rope_theta,
                   "{}: rope_theta = {} and rope_parameters.rope_theta = {} disagree", kWhat, c.rope_theta, theta);
      c.rope_theta = theta;
    }
  }
  if (present(j, "rope_scaling")) {  // transformers 4.x spelling of a non-default RoPE (key "rope_type" or "type")
    const json& rs = j.at("rope_scaling");
    // rope_type (or type) is read only when it is a string: {"rope_type": 5} ended in an uncaught type_error.
    auto text = [&](const char* key) {
      return rs.is_object() && rs.contains(key) && rs.at(key).is_string() ? rs.at(key).get<std::string>() : "";
    };
    const bool is_default =
        rs.is_object() && (rs.contains("rope_type") ? text("rope_type") : text("type")) == "default";
    DMOE_REQUIRE_INPUT(is_default, "{}: rope_scaling {} is not supported (only default RoPE: rope_scaling null)", kWhat,
                 rs.dump());
  }
  c.validate();
  return c;
}

json mixtral_config_to_json(const MixtralConfig& c) {
  json j = {{"architectures", {"MixtralForCausalLM"}},
            {"model_type", "mixtral"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"num_local_experts", c.num_local_experts},
            {"num_experts_per_tok", c.num_experts_per_tok},
            {"hidden_act", "silu"},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"output_router_logits", c.output_router_logits},
            {"router_aux_loss_coef", c.router_aux_loss_coef},
            {"router_jitter_noise", 0.0},
            {"max_position_embeddings", c.max_position_embeddings},
            {"initializer_range", c.initializer_range},
            {"attention_dropout", 0.0},
            {"torch_dtype", "float32"}};
  j["head_dim"] = c.head_dim > 0 ? json(c.head_dim) : json(nullptr);
  j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  return j;
}

MixtralConfig load_mixtral_config(const std::string& path) {
  const json j = read_json_file(path, "model config");
  try {
    return mixtral_config_from_json(j);
  } catch (const Error& e) {
    DMOE_FAIL_INPUT("model config '{}': {}", path, e.what());
  }
}

void save_mixtral_config(const MixtralConfig& c, const std::string& path) {
  write_file_atomically(path, mixtral_config_to_json(c).dump(2) + "\n");
}

}  // namespace dmoe
