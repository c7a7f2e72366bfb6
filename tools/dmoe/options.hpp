// options.hpp — the MoE-shape options shared by subcommands: a JSON config (dmoe or Hugging Face
// Mixtral), overridden field by field by flags.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/config.hpp"

namespace dmoe::cli {

struct ConfigOptions {
  std::string config_path;
  std::optional<int64_t> tokens, hidden, ffn;
  std::optional<int32_t> experts, top_k, world;
  std::optional<std::string> activation, drop_policy, dtype;
  std::optional<double> capacity_factor, aux_loss_coef, z_loss_coef;
  bool no_renormalize = false;
};

// Adds --config and the per-field flags to `app`.
void add_config_options(CLI::App& app, ConfigOptions& options, bool config_required = false);

// Adds to every option of `app` that takes a value a check that refuses what CLI11 would otherwise take
// silently: an empty value (read as "not given", or as 0) and, for integers, a value past 64 bits (clamped)
// or, for unsigned ones, a negative value (wrapped around).
void check_option_values(CLI::App& app);

// The file's config (or defaults), with the flags applied on top. Does not validate.
MoeConfig resolve_config(const ConfigOptions& options, const MoeConfig& defaults = MoeConfig{});

// Named benchmark configs live in bench/configs/NAME.json; a --config that is not a file is looked up
// there under $DMOE_HOME, the install's share/dmoe beside the executable, then the source tree the binary
// was built from (data_dir.hpp); the error for a name found nowhere lists each place.
std::string find_config_file(const std::string& name_or_path);
// The same for whole-model configs (HF Mixtral config.json) in bench/models/NAME.json.
std::string find_model_config_file(const std::string& name_or_path);

// Before the CPU engine starts: refuses a job whose memory estimate (core/host_resources.hpp) exceeds what
// this machine has, and prints a note with the estimate when `forward_calls` forwards and `backward_calls`
// forward+backward calls would take more than ~10 s (at a rate measured on the CI machine).
void check_cpu_engine_cost(const MoeConfig& config, int forward_calls, int backward_calls);

// --prefix is glued to the tensor names ("P" + "gate.weight"): it must be empty or end in '.'.
void require_prefix_ends_with_dot(const std::string& prefix);

}  // namespace dmoe::cli
