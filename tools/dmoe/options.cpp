#include "options.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "data_dir.hpp"
#include "model/config_io.hpp"

namespace dmoe::cli {

void add_config_options(CLI::App& app, ConfigOptions& o, bool config_required) {
  auto* c = app.add_option("--config", o.config_path,
                           "MoE config: a dmoe JSON file, a Hugging Face Mixtral config.json, or a named "
                           "config from bench/configs (flags below override its fields)");
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
    // Unnamed, so --help shows the type as before.
    option->check(CLI::Validator(
        [is_uint, is_int](std::string& value) -> std::string {
          if (value.empty()) return "the value is empty; give a value, or leave the option out for its default";
          if (is_uint && value.find('-') != std::string::npos)
            return "'" + value + "' is negative; expected an integer >= 0";
          if (is_int || is_uint) {
            errno = 0;
            char* end = nullptr;
            if (is_uint) {
              (void)std::strtoull(value.c_str(), &end, 0);
            } else {
              (void)std::strtoll(value.c_str(), &end, 0);
            }
            if (errno == ERANGE) return "'" + value + "' does not fit in a 64-bit integer";
          }
          return std::string();
        },
        ""));
  }
}

std::string find_config_file(const std::string& name) { return find_named_json(name, "bench/configs", "config"); }

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
  const double seconds = flop / (kFlopPerSecondPerCore * std::min<double>(c.world, cores)) +
                         per_call_w2 * (forward_calls + 3.0 * backward_calls);
  if (seconds > 10)
    std::fprintf(stderr,
                 "note: the CPU engine may need up to ~%.0f s here: %.3g GFLOP (%d forward, %d forward+backward calls "
                 "of %s) at >= 1 GFLOP/s per core on %u of %u cores, and about %s of memory\n",
                 seconds, flop * 1e-9, forward_calls, backward_calls, c.summary().c_str(),
                 unsigned(std::min<double>(c.world, cores)), cores,
                 format_bytes(backward_calls > 0 ? both.bytes : fwd.bytes).c_str());
}

void require_prefix_ends_with_dot(const std::string& prefix) {
  DMOE_REQUIRE_INPUT(prefix.empty() || prefix.back() == '.',
                     "--prefix '{}' must end with '.': tensor names are the prefix followed by 'gate.weight', "
                     "'experts.0.w1.weight', ... (e.g. --prefix {}.)", prefix, prefix);
}

std::string find_model_config_file(const std::string& name) {
  namespace fs = std::filesystem;
  if (fs::is_directory(name)) {  // a Hugging Face model directory
    const fs::path p = fs::path(name) / "config.json";
    DMOE_REQUIRE_INPUT(fs::exists(p), "model config '{}' is a directory without a config.json", name);
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

}  // namespace dmoe::cli
