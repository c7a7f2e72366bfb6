// config_io.cpp — JSON <-> MoeConfig, with errors that name the key, the expected type and the file.
#include "model/config_io.hpp"

#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.hpp"
#include "core/output_file.hpp"

namespace dmoe {
namespace {

using nlohmann::json;

constexpr const char* kDmoeKeys[] = {"tokens",      "hidden",          "ffn",          "experts",
                                     "top_k",       "activation",      "renormalize",  "capacity_factor",
                                     "drop_policy", "dtype",           "world",        "aux_loss_coef",
                                     "z_loss_coef"};

std::string dmoe_keys() {
  std::string s;
  for (const char* k : kDmoeKeys) s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return fmt::format("{} {}", v.type_name(), s);
}

// An integer in [lo, hi]; a float such as 8.0 is refused too, since it usually means a typo upstream.
int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE(v.is_number_integer(), "{}: key '{}' must be an integer (found {})", what, key, shown(v));
  if (v.is_number_unsigned())
    DMOE_REQUIRE(v.get<uint64_t>() <= uint64_t(hi), "{}: key '{}' = {} is out of range [{}, {}]", what, key,
                 v.get<uint64_t>(), lo, hi);
  const int64_t x = v.get<int64_t>();
  DMOE_REQUIRE(x >= lo && x <= hi, "{}: key '{}' = {} is out of range [{}, {}]", what, key, x, lo, hi);
  return x;
}

double get_number(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE(v.is_number(), "{}: key '{}' must be a number (found {})", what, key, shown(v));
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE(v.is_boolean(), "{}: key '{}' must be a boolean (found {})", what, key, shown(v));
  return v.get<bool>();
}

std::string get_string(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE(v.is_string(), "{}: key '{}' must be a string (found {})", what, key, shown(v));
  return v.get<std::string>();
}

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();

MoeConfig from_dmoe_json(const json& j) {
  const char* what = "config";
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* k : kDmoeKeys) known = known || key == k;
    DMOE_REQUIRE(known, "config: unknown key '{}'; allowed keys: {}", key, dmoe_keys());
  }
  MoeConfig c;
  // Range checks here only keep values representable; validate() applies the real rules.
  if (j.contains("tokens")) c.tokens = get_int(j, "tokens", -kI64Max, kI64Max, what);
  if (j.contains("hidden")) c.hidden = get_int(j, "hidden", -kI64Max, kI64Max, what);
  if (j.contains("ffn")) c.ffn = get_int(j, "ffn", -kI64Max, kI64Max, what);
  if (j.contains("experts")) c.experts = int32_t(get_int(j, "experts", kI32Min, kI32Max, what));
  if (j.contains("top_k")) c.top_k = int32_t(get_int(j, "top_k", kI32Min, kI32Max, what));
  if (j.contains("world")) c.world = int32_t(get_int(j, "world", kI32Min, kI32Max, what));
  if (j.contains("activation")) c.activation = parse_activation(get_string(j, "activation", what));
  if (j.contains("renormalize")) c.renormalize = get_bool(j, "renormalize", what);
  if (j.contains("capacity_factor")) c.capacity_factor = get_number(j, "capacity_factor", what);
  if (j.contains("drop_policy")) c.drop_policy = parse_drop_policy(get_string(j, "drop_policy", what));
  if (j.contains("dtype")) c.dtype = parse_dtype(get_string(j, "dtype", what));
  if (j.contains("aux_loss_coef")) c.aux_loss_coef = get_number(j, "aux_loss_coef", what);
  if (j.contains("z_loss_coef")) c.z_loss_coef = get_number(j, "z_loss_coef", what);
  return c;
}

MoeConfig from_mixtral_json(const json& j) {
  const char* what = "Mixtral config.json";
  for (const char* key : {"hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"})
    DMOE_REQUIRE(j.contains(key), "{}: required key '{}' is missing (needed: hidden_size, intermediate_size, "
                 "num_local_experts, num_experts_per_tok)", what, key);
  MoeConfig c;
  c.hidden = get_int(j, "hidden_size", 1, kI64Max, what);
  c.ffn = get_int(j, "intermediate_size", 1, kI64Max, what);
  c.experts = int32_t(get_int(j, "num_local_experts", 1, kI32Max, what));
  c.top_k = int32_t(get_int(j, "num_experts_per_tok", 1, kI32Max, what));
  // Mixtral experts are SwiGLU (w2(silu(w1 x) * w3 x)); hidden_act names the gate's nonlinearity.
  const std::string act = j.contains("hidden_act") ? get_string(j, "hidden_act", what) : "silu";
  if (act == "silu" || act == "swiglu") {
    c.activation = Activation::swiglu;
  } else if (act == "gelu") {  // erf GELU, like ours
    c.activation = Activation::gelu;
  } else if (act == "relu") {
    c.activation = Activation::relu;
  } else {
    DMOE_FAIL("{}: hidden_act '{}' is not supported; allowed: silu (SwiGLU experts), gelu, relu", what, act);
  }
  c.renormalize = true;  // Mixtral renormalises the top-k softmax weights
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (j.contains(key) && j.at(key).is_string()) {
      c.dtype = j.at(key).get<std::string>() == "bfloat16" ? DType::bf16 : DType::f32;
      break;
    }
  }
  return c;
}

}  // namespace

MoeConfig config_from_json(const json& j) {
  DMOE_REQUIRE(j.is_object(), "config: JSON must be an object (found {})", j.type_name());
  if (j.contains("num_local_experts") || j.contains("hidden_size")) return from_mixtral_json(j);
  return from_dmoe_json(j);
}

json config_to_json(const MoeConfig& c) {
  return json{{"tokens", c.tokens},
              {"hidden", c.hidden},
              {"ffn", c.ffn},
              {"experts", c.experts},
              {"top_k", c.top_k},
              {"activation", activation_name(c.activation)},
              {"renormalize", c.renormalize},
              {"capacity_factor", c.capacity_factor},
              {"drop_policy", drop_policy_name(c.drop_policy)},
              {"dtype", dtype_name(c.dtype)},
              {"world", c.world},
              {"aux_loss_coef", c.aux_loss_coef},
              {"z_loss_coef", c.z_loss_coef}};
}

MoeConfig load_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DMOE_REQUIRE(in.good(), "config file '{}': cannot be opened for reading", path);
  std::stringstream text;
  text << in.rdbuf();
  DMOE_REQUIRE(!in.bad(), "config file '{}': read error", path);
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::exception& e) {
    DMOE_FAIL("config file '{}': not valid JSON: {}", path, e.what());
  }
  try {
    return config_from_json(j);
  } catch (const Error& e) {
    DMOE_FAIL("config file '{}': {}", path, e.what());
  }
}

void save_config_file(const MoeConfig& config, const std::string& path) {
  write_file_atomically(path, config_to_json(config).dump(2) + "\n");
}

}  // namespace dmoe
