// config_io.cpp — JSON <-> MoeConfig, with errors that name the key, the expected type and the file.
#include "model/config_io.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

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
  if (v.is_null()) return "null";  // not "null null"
  return fmt::format("{} {}", v.type_name(), s);
}

// An integer in [lo, hi]; a float such as 8.0 is refused too, since it usually means a typo upstream.
int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi, const char* what) {
  const json& v = j.at(key);
  // An integer past 64 bits (2^64) is parsed as a double, and was called "not an integer" (G22B-7 (c)): out of range.
  DMOE_REQUIRE_INPUT(!(v.is_number_float() && std::fabs(v.get<double>()) >= 0x1p63 &&
                       v.get<double>() == std::floor(v.get<double>())),
                     "{}: key '{}' = {} is out of range [{}, {}] (an integer past 64 bits)", what, key, v.dump(), lo, hi);
  DMOE_REQUIRE_INPUT(v.is_number_integer(), "{}: key '{}' must be an integer (found {})", what, key, shown(v));
  if (v.is_number_unsigned())
    DMOE_REQUIRE_INPUT(v.get<uint64_t>() <= uint64_t(hi), "{}: key '{}' = {} is out of range [{}, {}]", what, key,
                       v.get<uint64_t>(), lo, hi);
  const int64_t x = v.get<int64_t>();
  DMOE_REQUIRE_INPUT(x >= lo && x <= hi, "{}: key '{}' = {} is out of range [{}, {}]", what, key, x, lo, hi);
  return x;
}

double get_number(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE_INPUT(v.is_number(), "{}: key '{}' must be a number (found {})", what, key, shown(v));
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE_INPUT(v.is_boolean(), "{}: key '{}' must be a boolean (found {})", what, key, shown(v));
  return v.get<bool>();
}

std::string get_string(const json& j, const char* key, const char* what) {
  const json& v = j.at(key);
  DMOE_REQUIRE_INPUT(v.is_string(), "{}: key '{}' must be a string (found {})", what, key, shown(v));
  return v.get<std::string>();
}

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();

MoeConfig from_dmoe_json(const json& j, const MoeConfig& defaults) {
  const char* what = "config";
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* k : kDmoeKeys) known = known || key == k;
    DMOE_REQUIRE_INPUT(known, "config: unknown key '{}'; allowed keys: {}", key, dmoe_keys());
  }
  MoeConfig c = defaults;
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

// The flag that sets a dmoe key, for errors that point to it.
std::string flag_of(std::string_view key) {
  if (key == "renormalize") return "--no-renormalize";
  std::string flag = "--" + std::string(key);
  for (char& ch : flag)
    if (ch == '_') ch = '-';
  return flag;
}

}  // namespace

void require_float_mixtral_classes(const json& j, std::string_view what) {
  if (j.contains("quantization_config") && !j.at("quantization_config").is_null()) {
    const json& q = j.at("quantization_config");
    const std::string method = q.is_object() && q.contains("quant_method") && q.at("quant_method").is_string()
                                   ? q.at("quant_method").get<std::string>()
                                   : std::string("not given");
    DMOE_FAIL_INPUT("{}: quantization_config (quant_method {}) is not supported: dmoe reads unquantized float32 or "
                    "bfloat16 weights (w1/w2/w3 .weight tensors); use the model's unquantized checkpoint and config",
                    what, method);
  }
  if (j.contains("architectures") && j.at("architectures").is_array() && !j.at("architectures").empty()) {
    bool mixtral = false;
    for (const json& a : j.at("architectures"))
      mixtral = mixtral || (a.is_string() && a.get<std::string>().rfind("Mixtral", 0) == 0);
    DMOE_REQUIRE_INPUT(mixtral, "{}: architectures {} names no Mixtral class; dmoe reads Mixtral models "
                       "(architectures [\"MixtralForCausalLM\"], model_type 'mixtral')", what, shown(j.at("architectures")));
  }
}

namespace {

MoeConfig from_mixtral_json(const json& j, const MoeConfig& defaults) {
  // Why the file is read as Hugging Face's, for the errors below (a dmoe config with a stray HF key
  // would otherwise be told it "is a Hugging Face config.json").
  const char* hf_key = j.contains("model_type") ? "model_type" : j.contains("hidden_size") ? "hidden_size"
                                                                                             : "num_local_experts";
  const std::string what_text = fmt::format("Hugging Face config.json (read as one because it has '{}')", hf_key);
  const char* what = what_text.c_str();
  if (j.contains("model_type")) {
    const std::string type = get_string(j, "model_type", what);
    DMOE_REQUIRE_INPUT(type == "mixtral",
                       "{}: model_type '{}' is not supported; dmoe reads the MoE layer of model_type 'mixtral' "
                       "(num_local_experts, num_experts_per_tok, SwiGLU experts w1/w2/w3), or a dmoe JSON config with "
                       "keys {}",
                       what, type, dmoe_keys());
  }
  require_float_mixtral_classes(j, what);
  // A dmoe key here would be silently dropped ("dtype" is also Hugging Face's newer name for torch_dtype).
  for (const char* key : kDmoeKeys)
    DMOE_REQUIRE_INPUT(std::string_view(key) == "dtype" || !j.contains(key),
                       "{}: key '{}' is a dmoe config key, which a Hugging Face config.json does not carry; pass it "
                       "as {} or use a dmoe JSON config",
                       what, key, flag_of(key));
  for (const char* key : {"hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"})
    DMOE_REQUIRE_INPUT(j.contains(key), "{}: required key '{}' is missing (needed: hidden_size, intermediate_size, "
                       "num_local_experts, num_experts_per_tok)", what, key);
  MoeConfig c = defaults;
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
    DMOE_FAIL_INPUT("{}: hidden_act '{}' is not supported; allowed: silu (SwiGLU experts), gelu, relu", what, act);
  }
  c.renormalize = true;  // Mixtral renormalises the top-k softmax weights
  if (j.contains("torch_dtype") && !j.at("torch_dtype").is_null() && j.contains("dtype") && !j.at("dtype").is_null())
    DMOE_REQUIRE_INPUT(j.at("torch_dtype") == j.at("dtype"),
                       "{}: torch_dtype {} and dtype {} disagree (dtype is the newer name of torch_dtype); give one",
                       what, j.at("torch_dtype").dump(), j.at("dtype").dump());
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (!j.contains(key) || j.at(key).is_null()) continue;
    const std::string dtype = get_string(j, key, what);
    if (dtype == "bfloat16") {
      c.dtype = DType::bf16;
    } else if (dtype == "float32") {
      c.dtype = DType::f32;
    } else {
      DMOE_FAIL_INPUT("{}: {} '{}' is not supported; dmoe stores weights and activations as float32 or bfloat16 "
                      "(allowed: float32, bfloat16)", what, key, dtype);
    }
    break;
  }
  // The router losses' weights (HF adds the load-balancing loss when output_router_logits is set; dmoe's
  // backward always applies the coefficients it is given).
  if (j.contains("router_aux_loss_coef")) c.aux_loss_coef = get_number(j, "router_aux_loss_coef", what);
  if (j.contains("router_z_loss_coef")) c.z_loss_coef = get_number(j, "router_z_loss_coef", what);
  // HF's training-time router noise: dmoe's router has none, so a nonzero value cannot take effect.
  if (j.contains("router_jitter_noise") && !j.at("router_jitter_noise").is_null())
    DMOE_REQUIRE_INPUT(get_number(j, "router_jitter_noise", what) == 0,
                       "{}: router_jitter_noise = {} is not supported (only 0 or null: dmoe's router is deterministic)",
                       what, j.at("router_jitter_noise").dump());
  return c;
}

}  // namespace

MoeConfig config_from_json(const json& j, const MoeConfig& defaults) {
  DMOE_REQUIRE_INPUT(j.is_object(), "config: JSON must be an object (found {})", j.type_name());
  if (j.contains("num_local_experts") || j.contains("hidden_size") || j.contains("model_type"))
    return from_mixtral_json(j, defaults);
  return from_dmoe_json(j, defaults);
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

namespace {

// nlohmann's DOM builder (its SAX interface: json::parse with a callback, the way dmoe found duplicate keys before,
// scans the parent object at every end of an object for values the callback discarded, so a safetensors header of
// 40000 tensor entries took 23-41 s and 200000 past any timeout), plus what its parser lets through: a duplicate key
// (the last one won), nesting past kMaxJsonDepth (dump() and the error messages that show a value recurse once per
// level: 100000 nested arrays crashed dmoe with SIGSEGV), and a number that underflows to 0 (nlohmann reads
// "capacity_factor": 1e-400 as 0.0, which is dropless). The first problem stops the parse.
class StrictJsonSax : public nlohmann::detail::json_sax_dom_parser<json> {
  using Base = nlohmann::detail::json_sax_dom_parser<json>;

 public:
  StrictJsonSax(json& result, StrictJsonProblem& problem) : Base(result, true), problem_(problem) {}

  bool start_object(std::size_t n) { return enter() && (keys_.emplace_back(), Base::start_object(n)); }
  bool end_object() {
    --depth_;
    if (!keys_.empty()) keys_.pop_back();
    return Base::end_object();
  }
  bool start_array(std::size_t n) { return enter() && Base::start_array(n); }
  bool end_array() {
    --depth_;
    return Base::end_array();
  }
  bool key(string_t& k) {
    if (!keys_.empty() && !keys_.back().insert(k).second) {
      problem_.kind = StrictJsonProblem::duplicate_key;
      problem_.key = k;
      problem_.depth = depth_;
      problem_.message = fmt::format("key '{}' appears more than once in one object; each key may be given once", k);
      return false;
    }
    return Base::key(k);
  }
  bool number_float(number_float_t v, const string_t& text) {
    const size_t exponent = text.find_first_of("eE");
    if (v == 0 && text.substr(0, exponent).find_first_of("123456789") != std::string::npos) {
      problem_.kind = StrictJsonProblem::underflow;
      problem_.message = fmt::format("the number {} is too small for a double and would be read as 0 (the smallest "
                                     "magnitude is about 4.9e-324); write 0 if 0 is meant", text);
      return false;
    }
    return Base::number_float(v, text);
  }

 private:
  bool enter() {
    if (++depth_ <= kMaxJsonDepth) return true;
    problem_.kind = StrictJsonProblem::too_deep;
    problem_.depth = depth_;
    problem_.message = fmt::format("objects and arrays nest deeper than {} levels; dmoe reads JSON nested up to {} deep",
                                   kMaxJsonDepth, kMaxJsonDepth);
    return false;
  }
  StrictJsonProblem& problem_;
  size_t depth_ = 0;
  std::vector<std::set<std::string>> keys_;  // keys seen in each open object, innermost last
};

}  // namespace

nlohmann::json parse_json_strictly(std::string_view text, StrictJsonProblem& problem) {
  problem = StrictJsonProblem{};
  json j;
  StrictJsonSax sax(j, problem);
  const bool complete = json::sax_parse(text, &sax);
  DMOE_REQUIRE(complete || problem.kind != StrictJsonProblem::none, "the JSON parser stopped without saying why");
  return j;
}

std::string json_error_text(const std::exception& e) {
  const std::string text = e.what();
  // The tag is "[json.exception.<kind>.<id>] ", followed by the description in plain words.
  if (text.rfind("[json.exception.", 0) == 0) {
    const size_t end = text.find("] ");
    if (end != std::string::npos) return text.substr(end + 2);
  }
  return text;
}

nlohmann::json read_json_file(const std::string& path, std::string_view what) {
  // Only a regular file: a FIFO or /dev/zero would block or never end.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  DMOE_REQUIRE_INPUT(!std::filesystem::is_directory(status), "{} '{}' is a directory; expected a JSON file", what,
                     path);
  DMOE_REQUIRE_INPUT(ec || !std::filesystem::exists(status) || std::filesystem::is_regular_file(status),
                     "{} '{}' is not a regular file (a FIFO, device or socket); expected a JSON file", what, path);
  std::error_code size_ec;
  const uintmax_t size = std::filesystem::file_size(path, size_ec);
  DMOE_REQUIRE_INPUT(size_ec || size <= kMaxJsonFileBytes, "{} '{}' is {} bytes, more than a JSON file dmoe reads may "
                     "be (limit {} bytes: configs, indexes, cost and tuning files are kilobytes); not a JSON file?", what,
                     path, size, kMaxJsonFileBytes);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  // With the reason (G20-12 of the twentieth pass: a mode-000 config said only "cannot be opened for reading").
  DMOE_REQUIRE_INPUT(in.good(), "{} '{}': cannot be opened for reading{}", what, path,
                     errno != 0 ? std::string(": ") + std::strerror(errno) : std::string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  DMOE_REQUIRE_INPUT(!in.bad(), "{} '{}': read error", what, path);
  const std::string text = buffer.str();
  // nlohmann's lexer ends its input at a NUL byte: what followed was ignored ("{...}\0garbage" was read).
  const size_t nul = text.find('\0');
  DMOE_REQUIRE_INPUT(nul == std::string::npos, "{} '{}': byte {} of the file is NUL (0x00); a JSON file is text "
                     "(no NUL bytes)", what, path, nul);
  json j;
  StrictJsonProblem problem;
  try {
    j = parse_json_strictly(text, problem);
  } catch (const json::exception& e) {
    DMOE_FAIL_INPUT("{} '{}': not valid JSON: {}", what, path, json_error_text(e));
  }
  DMOE_REQUIRE_INPUT(problem.kind == StrictJsonProblem::none, "{} '{}': {}", what, path, problem.message);
  return j;
}

MoeConfig load_config_file(const std::string& path, const MoeConfig& defaults) {
  const json j = read_json_file(path, "config file");
  try {
    return config_from_json(j, defaults);
  } catch (const Error& e) {
    DMOE_FAIL_INPUT("config file '{}': {}", path, e.what());
  }
}

void save_config_file(const MoeConfig& config, const std::string& path) {
  write_file_atomically(path, config_to_json(config).dump(2) + "\n");
}

}  // namespace dmoe
