#include "options.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "data_dir.hpp"
#include "model/config_io.hpp"

namespace dmoe::cli {

void add_config_options(CLI::App& app, ConfigOptions& o, bool config_required) {
  auto* c = app.add_option("--config", o.config_path,
                           "MoE config: a dmoe JSON file, a Hugging Face Mixtral config.json or model "
                           "directory (its config.json), or a named config from bench/configs (flags below "
                           "override its fields)");
  if (config_required) c->required();
  app.add_option("--tokens", o.tokens, "tokens per rank (T)");
  app.add_option("--hidden", o.hidden, "model width (H)");
  app.add_option("--ffn", o.ffn, "expert FFN width (I)");
  app.add_option("--experts", o.experts, "experts in total (E)");
  app.add_option("--top-k", o.top_k, "experts per token (k)");
  app.add_option("--activation", o.activation, "relu | gelu | swiglu");
  app.add_option("--capacity-factor", o.capacity_factor, "0 = dropless; else capacity per (rank, expert) = ceil(cf*T*k/E)");
  app.add_option("--drop-policy", o.drop_policy, "latest-tokens | lowest-weight");
  app.add_option("--dtype", o.dtype, "f32 | bf16");
  app.add_option("--world", o.world, "ranks (W); rank r owns experts [r*E/W, (r+1)*E/W)");
  app.add_option("--aux-loss-coef", o.aux_loss_coef, "load-balancing loss weight in backward");
  app.add_option("--z-loss-coef", o.z_loss_coef, "router z-loss weight in backward");
  app.add_flag("--no-renormalize", o.no_renormalize, "keep the top-k softmax weights as they are");
}

void check_option_values(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    if (option->get_type_size_max() == 0 || !option->nonpositional()) continue;  // flags, positionals
    const std::string type = option->get_type_name();
    const bool is_uint = type.rfind("UINT", 0) == 0, is_int = !is_uint && type.rfind("INT", 0) == 0;
    const bool is_real = type.rfind("FLOAT", 0) == 0;
    bool ranged = false;
    try {
      ranged = option->get_validator(kRangeValidatorName) != nullptr;
    } catch (const CLI::OptionNotFound&) {
    }
    // Unnamed, so --help shows the type as before.
    // transform, not check: CLI11 hands a check a copy of the value, and the leading zeros are dropped in place.
    option->transform(CLI::Validator(
        [is_uint, is_int, is_real, ranged](std::string& value) -> std::string {
          if (value.empty()) return "the value is empty; give a value, or leave the option out for its default";
          if (is_uint && value.find('-') != std::string::npos) {
            const ParsedNumber n = parse_integer(value);
            if (!n.problem.empty() || n.value != 0) return "'" + value + "' is negative; expected an integer >= 0";
            value = "0";  // "-0" is zero, not negative
          }
          if (is_real) {
            // CLI11 said "Could not convert: --lr = abc" (the option and the value, not what is allowed), and read a
            // number past double's range silently: strtold's long double cast to double, 1e-400 becoming 0 (a
            // --capacity-factor that asked for a tiny capacity ran dropless, a tiny --clip turned clipping off).
            const ParsedNumber n = parse_real_number(value);
            // "nan" is left to the command's own rule, which names it with the rule ("need lr > 0 (is nan)").
            char* end = nullptr;
            const bool is_nan = !std::isspace((unsigned char)value[0]) && std::isnan(std::strtold(value.c_str(), &end)) &&
                                end == value.c_str() + value.size();
            if (!n.problem.empty() && !is_nan)
              return ranged ? std::string() : n.problem + "; allowed: a number (such as 0.5, 3e-4 or -2)";
            if (n.value != 0 && double(n.value) == 0)
              return "'" + value + "' is too small for a double and would be read as 0 (the smallest magnitude is "
                     "about 4.9e-324); allowed: 0, or a number of at least that magnitude";
            if (std::isfinite(n.value) && std::isinf(double(n.value)))
              return "'" + value + "' is too large for a double and would be read as infinity (the largest is about "
                     "1.8e308); allowed: a number of at most that magnitude";
          }
          if (is_int || is_uint) {
            const ParsedNumber n = parse_integer(value, is_uint);
            // A ranged option's Range says it with the range (this transform runs first).
            if (!n.problem.empty()) return ranged ? std::string() : n.problem + "; allowed: an integer";
            // CLI11 converts with base 0: leading zeros would make the value octal ("010" = 8). Drop them.
            const size_t sign = value[0] == '-' || value[0] == '+' ? 1 : 0;
            if (value.size() > sign + 1 && (value[sign + 1] == 'x' || value[sign + 1] == 'X')) return std::string();
            const size_t first = value.find_first_not_of('0', sign);
            value.erase(sign, (first == std::string::npos ? value.size() - 1 : first) - sign);
          }
          return std::string();
        },
        ""));
  }
}

std::string explain_conversion_error(CLI::App& app, const std::string& message) {
  // CLI11: "Could not convert: NAME = VALUE[,VALUE...]".
  const std::string head = "Could not convert: ";
  const size_t eq = message.find(" = ");
  if (message.rfind(head, 0) != 0 || eq == std::string::npos) return std::string();
  const std::string name = message.substr(head.size(), eq - head.size()), values = message.substr(eq + 3);
  // The option of the command being parsed (a flag's value is converted while its command's arguments are read, before
  // the command counts as parsed: then the first command with the option, which has the same type in every command).
  CLI::Option* option = nullptr;
  for (const bool parsed_only : {true, false})
    for (CLI::App* sub : app.get_subcommands({}))
      if (option == nullptr && (sub->parsed() || !parsed_only))
        for (CLI::Option* o : sub->get_options())
          if (o->get_name() == name) option = o;
  if (option == nullptr) return std::string();
  if (option->get_expected_max() == 0)  // a flag (it takes no value of its own) given "=VALUE"
    return fmt::format("{}: '{}' is not a value for a flag; allowed: {} alone (on), or {}=true|false (also 1|0, yes|no, "
                       "on|off)", name, values, name, name);
  const std::string type = option->get_type_name();
  if (type.rfind("INT", 0) != 0 && type.rfind("UINT", 0) != 0) return std::string();
  // check_option_values let the value through as a 64-bit integer, so the option's variable is narrower: 32 bits.
  const bool is_uint = type.rfind("UINT", 0) == 0;
  std::stringstream list(values);
  for (std::string value; std::getline(list, value, ',');) {
    const ParsedNumber n = parse_integer(value, is_uint);
    if (!n.problem.empty()) continue;
    const bool fits = is_uint ? n.value <= (long double)UINT32_MAX
                              : n.value >= (long double)INT32_MIN && n.value <= (long double)INT32_MAX;
    if (!fits)
      return is_uint ? fmt::format("{}: {} does not fit in a 32-bit integer; allowed: integers in range 0 to {}", name,
                                   value, UINT32_MAX)
                     : fmt::format("{}: {} does not fit in a 32-bit integer; allowed: integers in range {} to {}", name,
                                   value, INT32_MIN, INT32_MAX);
  }
  return std::string();
}

ParsedNumber parse_integer(const std::string& value, bool is_unsigned) {
  ParsedNumber n;
  const size_t sign = !value.empty() && (value[0] == '-' || value[0] == '+') ? 1 : 0;
  const bool hex = value.size() > sign + 2 && value[sign] == '0' && (value[sign + 1] == 'x' || value[sign + 1] == 'X');
  const size_t first = sign + (hex ? 2 : 0);
  const bool digits = value.size() > first &&
                      value.find_first_not_of(hex ? "0123456789abcdefABCDEF" : "0123456789", first) == std::string::npos;
  if (!digits) {
    n.problem = "'" + value + "' is not an integer";
    if (value.find_first_of(".eE", sign) != std::string::npos && parse_real_number(value).problem.empty())
      n.problem += " (write it without a fraction or an exponent)";
    return n;
  }
  errno = 0;
  const int base = hex ? 16 : 10;
  const char* text = value.c_str() + first;
  const long double magnitude = is_unsigned ? (long double)std::strtoull(text, nullptr, base)
                                            : (long double)std::strtoll(text, nullptr, base);
  if (errno == ERANGE) {
    n.problem = "'" + value + "' does not fit in a 64-bit integer";
    return n;
  }
  n.value = value[0] == '-' ? -magnitude : magnitude;
  return n;
}

ParsedNumber parse_real_number(const std::string& value) {
  ParsedNumber n;
  errno = 0;
  char* end = nullptr;
  const long double v = value.empty() ? 0 : std::strtold(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size() || std::isspace((unsigned char)value[0]) || std::isnan(v)) {
    n.problem = "'" + value + "' is not a number";
    return n;
  }
  n.value = v;
  return n;
}

std::string find_config_file(const std::string& name) {
  namespace fs = std::filesystem;
  // A model directory, as eval/train take for --config: its config.json holds the layer's shapes (read as that
  // config.json given by its path is). It was "config file 'DIR' is a directory; expected a JSON file".
  std::error_code ec;
  const fs::path model_config = fs::path(name) / "config.json";
  if (!name.empty() && fs::is_directory(name, ec) && fs::is_regular_file(model_config, ec)) return model_config.string();
  return find_named_json(name, "bench/configs", "config");
}

void check_cpu_engine_cost(const MoeConfig& c, int forward_calls, int backward_calls) {
  const CpuLayerEstimate fwd = estimate_cpu_layer(c, false), both = estimate_cpu_layer(c, true);
  require_host_memory(backward_calls > 0 ? both.bytes : fwd.bytes, fmt::format("the CPU engine on {}", c.summary()));
  // The CPU kernels are plain loops with fp64 accumulation, one thread per simulated rank; measured on the
  // 2-core CI machine: 4.6 GFLOP/s per core at T=128 H=256 I=512 E=8 k=2 f32, 1.1 at the decode config
  // (H=4096, bf16 emulated). The slower rate makes the estimate an upper one.
  constexpr double kFlopPerSecondPerCore = 1e9;
  const double flop = fwd.flop * forward_calls + both.flop * backward_calls;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  // Plus what grows with W² whatever the shapes (every rank visits every peer in each exchange, holds
  // the whole gate, wakes at each barrier): measured ~1.9 s per forward at W = E = 2048, T = 1, H = I = 8.
  const double per_call_w2 = 5e-7 * double(c.world) * double(c.world);
  // And a floor per call at W > 1, whatever the shapes: the ranks' threads start and wake each other at every
  // exchange; measured ~4 ms per call at W = 2..8 on the 2-core CI machine, ~7 ms at W = 16. Without it `bench
  // --repeat 1000000 -n 4` of a tiny layer was estimated at ~430 s and took over 2 h.
  const double per_call_fixed = c.world > 1 ? 4e-3 * std::max(1.0, double(c.world) / (4.0 * cores)) : 0.0;
  const double seconds = flop / (kFlopPerSecondPerCore * std::min<double>(c.world, cores)) +
                         (per_call_w2 + per_call_fixed) * (forward_calls + 3.0 * backward_calls);
  if (seconds > 10)
    std::fprintf(stderr,
                 "note: the CPU engine may need up to ~%.0f s here: %.3g GFLOP (%d forward, %d forward+backward calls "
                 "of %s) at >= 1 GFLOP/s per core on %u of %u cores, and about %s of memory\n",
                 seconds, flop * 1e-9, forward_calls, backward_calls, c.summary().c_str(),
                 unsigned(std::min<double>(c.world, cores)), cores,
                 format_bytes(backward_calls > 0 ? both.bytes : fwd.bytes).c_str());
}

std::string model_engine(const std::string& given, const char* option) {
  if (given == "cpu" || given == "cuda") return given;
  if (given == "gpu" || given == "ep") return "cuda";
  DMOE_REQUIRE_INPUT(given != "flash", "{} flash: the whole model runs its MoE layers on the EP engine (cuda); Flash "
                     "runs single layers (dmoe run / bench layer --engine flash, dmoe.MoELayer(engine='flash')); "
                     "allowed: cpu, cuda (aliases ep, gpu)", option);
  DMOE_FAIL_INPUT("{} '{}' is not an engine; allowed: cpu, cuda (aliases ep, gpu)", option, given);
}

void require_one_process(const std::string& command, const std::string& consequence, const std::string& instead) {
  const ProcessEnv job = detect_process_env();
  DMOE_REQUIRE_INPUT(job.world == 1, "{} on the CPU engine runs its ranks as threads of one process, but this is one of "
                     "{} processes ({}): each would {}; run it alone{}", command, job.world, job.launcher, consequence,
                     instead.empty() ? "" : ", or " + instead);
}

void require_not_under_launcher(const std::string& command, const std::string& writes) {
  const ProcessEnv job = detect_process_env();
  DMOE_REQUIRE_INPUT(job.world == 1, "{} writes files and runs no ranks, but this is one of {} processes ({}): each "
                     "would write {}, over each other's; run it once, outside the launcher (then start the job that "
                     "reads them)", command, job.world, job.launcher, writes);
}

void require_prefix_ends_with_dot(const std::string& prefix) {
  DMOE_REQUIRE_INPUT(prefix.empty() || prefix.back() == '.',
                     "--prefix '{}' must end with '.': tensor names are the prefix followed by 'gate.weight', "
                     "'experts.0.w1.weight', ... (e.g. --prefix {}.)", prefix, prefix);
  // Tensor names go into a safetensors header, a JSON text, which holds UTF-8 only: init --prefix of other bytes
  // generated every weight, then ended in the writer's "tensor name is not valid UTF-8", naming no option; run said the
  // gate was missing (G22A-8, G22B-4 of the twenty-second pass). Refused here, before anything is generated or read.
  if (!is_utf8(prefix)) {
    size_t valid = prefix.size();
    while (valid > 0 && !is_utf8(std::string_view(prefix).substr(0, valid))) --valid;
    DMOE_FAIL_INPUT("--prefix '{}' is not valid UTF-8 (byte {} is 0x{:02X}): tensor names are the prefix followed by "
                    "'gate.weight', ..., and a safetensors header is JSON text, which holds UTF-8 only; allowed: a UTF-8 "
                    "prefix ending in '.'", prefix, valid + 1, unsigned(static_cast<unsigned char>(prefix[valid])));
  }
}

void require_layer_or_prefix(const std::optional<int>& layer, const std::string& prefix) {
  // --prefix replaced --layer without a word (`--layer 5 --prefix model.layers.0.block_sparse_moe.` read layer 0).
  DMOE_REQUIRE_INPUT(!layer || prefix.empty(), "--layer {} and --prefix '{}' both say where the layer's tensors are "
                     "(--layer L is the prefix model.layers.L.block_sparse_moe.); give one of them", *layer, prefix);
}

std::string find_model_config_file(const std::string& name) {
  namespace fs = std::filesystem;
  // The error_code forms: a symbolic link loop (the name, or the directory's config.json) threw filesystem_error and
  // ended eval, train, init-model and flow measure/project in "unexpected error: filesystem error: status: Too many
  // levels of symbolic links", rc 2.
  std::error_code ec;
  if (fs::is_directory(name, ec)) {  // a Hugging Face model directory
    const fs::path p = fs::path(name) / "config.json";
    std::error_code config_ec;
    // A directory that merely has a named model's name (one made for the outputs) hid the named model: said.
    const std::string named = named_json_shadowed_by(name, "bench/models");
    DMOE_REQUIRE_INPUT(fs::exists(p, config_ec), "model config '{}' is a directory without a config.json{}{}", name,
                       config_ec ? " (" + p.string() + ": " + config_ec.message() + ")" : "",
                       named.empty() ? std::string()
                                     : "; it is read before the named models, and the named model config '" + name +
                                           "' is " + named + ": give that path to use it");
    return p.string();
  }
  return find_named_json(name, "bench/models", "model config");
}

MoeConfig resolve_config(const ConfigOptions& o, const MoeConfig& defaults) {
  MoeConfig c = defaults;
  // Keys the file does not have (a Mixtral config.json has no tokens or world) keep the defaults; a key
  // it has, even "tokens": 0, is taken as written and validate() judges it.
  if (!o.config_path.empty()) c = load_config_file(find_config_file(o.config_path), c);
  if (o.tokens) c.tokens = *o.tokens;
  if (o.hidden) c.hidden = *o.hidden;
  if (o.ffn) c.ffn = *o.ffn;
  if (o.experts) c.experts = *o.experts;
  if (o.top_k) c.top_k = *o.top_k;
  if (o.world) c.world = *o.world;
  if (o.activation) c.activation = parse_activation(*o.activation);
  if (o.drop_policy) c.drop_policy = parse_drop_policy(*o.drop_policy);
  if (o.dtype) c.dtype = parse_dtype(*o.dtype);
  if (o.capacity_factor) c.capacity_factor = *o.capacity_factor;
  if (o.aux_loss_coef) c.aux_loss_coef = *o.aux_loss_coef;
  if (o.z_loss_coef) c.z_loss_coef = *o.z_loss_coef;
  if (o.no_renormalize) c.renormalize = false;
  return c;
}

void validate_config(const MoeConfig& c, const ConfigOptions& o, const std::map<std::string, std::string>& set_here) {
  // "config: capacity_factor = -1 is invalid" named neither the file nor the option, and a config file's value looked
  // like the user's option: the error now says where each value it names came from.
  try {
    c.validate();
  } catch (const Error& e) {
    if (!e.is_input()) throw;
    const std::string what = e.what();
    const std::pair<const char*, std::pair<const char*, bool>> fields[] = {
        {"tokens", {"--tokens", o.tokens.has_value()}},    {"hidden", {"--hidden", o.hidden.has_value()}},
        {"ffn", {"--ffn", o.ffn.has_value()}},             {"experts", {"--experts", o.experts.has_value()}},
        {"top_k", {"--top-k", o.top_k.has_value()}},       {"world", {"--world", o.world.has_value()}},
        {"dtype", {"--dtype", o.dtype.has_value()}},
        {"capacity_factor", {"--capacity-factor", o.capacity_factor.has_value()}},
        {"aux_loss_coef", {"--aux-loss-coef", o.aux_loss_coef.has_value()}},
        {"z_loss_coef", {"--z-loss-coef", o.z_loss_coef.has_value()}}};
    std::string from;
    for (const auto& [field, option] : fields) {
      if (what.find(std::string(field) + " = ") == std::string::npos) continue;
      const auto here = set_here.find(field);
      const std::string source =
          here != set_here.end() ? fmt::format("{} from {}", field, here->second)
          : option.second ? fmt::format("{} from {}", field, option.first)
          : !o.config_path.empty() ? fmt::format("{} from --config {} ({} overrides it)", field, o.config_path, option.first)
                                   : fmt::format("{} is the default ({} sets it)", field, option.first);
      from += (from.empty() ? "" : "; ") + source;
    }
    if (from.empty()) throw;
    throw Error(what + " [" + from + "]", ErrorKind::input);
  }
}

void require_routing_flags_used(const ConfigOptions& o, const MoeConfig& c, bool backward, const std::string& command,
                                const std::string& how_backward) {
  for (const auto& [given, name] : {std::pair{o.aux_loss_coef.has_value(), "--aux-loss-coef"},
                                    std::pair{o.z_loss_coef.has_value(), "--z-loss-coef"}})
    DMOE_REQUIRE_INPUT(!given || backward, "{}: {} weights a router loss in the backward only, and this run has no "
                       "backward (the forward's outputs do not depend on it): {}, or drop {}", command, name,
                       how_backward, name);
  DMOE_REQUIRE_INPUT(!o.drop_policy || c.capacity_factor > 0, "{}: --drop-policy {} chooses the tokens a full expert "
                     "drops, and this config is dropless (capacity_factor 0: no expert is ever full): give "
                     "--capacity-factor > 0, or drop --drop-policy", command, *o.drop_policy);
}

}  // namespace dmoe::cli
