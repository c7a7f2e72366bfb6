// options.hpp — the MoE-shape options shared by subcommands: a JSON config (dmoe or Hugging Face
// Mixtral), overridden field by field by flags.
#pragma once

#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

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
// silently: an empty value (read as "not given", or as 0) and, for integers, a value past 64 bits (clamped),
// for unsigned ones a negative value (wrapped around), and one with a leading zero (read as octal: it is made
// decimal); a value that is no integer is said to be none ("'abc' is not an integer; allowed: an integer").
void check_option_values(CLI::App& app);

// For CLI11's "Could not convert: --world = 2147483648" (which names the option and the value but not what is
// allowed): the message to give instead, or "" to keep CLI11's. Covers a flag given a value it cannot take
// ("--no-renormalize=maybe") and an integer that is one but does not fit the option's 32 bits.
std::string explain_conversion_error(CLI::App& app, const std::string& message);

// The integer or number a value of an option is, or why it is none: `problem` says so for a message ("'1e3' is not
// an integer ..."). Integers are decimal (an optional sign and digits, leading zeros included: "010" is ten, where
// CLI11's own conversion, strtoll with base 0, read it as octal eight) or hexadecimal with 0x.
struct ParsedNumber {
  long double value = 0;
  std::string problem;  // empty when `value` holds the value
};
ParsedNumber parse_integer(const std::string& value, bool is_unsigned = false);
ParsedNumber parse_real_number(const std::string& value);

// CLI::Range's place on numeric options: [min_val, max_val], inclusive. CLI::Range answered a value that is no
// number of the option's type ("--repeat abc", "--steps 1e3") with "Value abc not in range 1 to 1000000", naming the
// range and not the reason; this says "'abc' is not an integer; allowed: integers in range 1 to 1000000", and for a
// number outside, "0 is not in range 1 to 1000000". --help shows "INT in [1 - 1000000]" as before.
inline constexpr const char* kRangeValidatorName = "dmoe::cli::Range";
class Range : public CLI::Validator {
 public:
  template <typename T>
  Range(T min_val, T max_val) {
    name(kRangeValidatorName);  // check_option_values leaves a value that is no integer to it
    static_assert(std::is_arithmetic_v<T> && std::is_signed_v<T>, "a signed integer or floating-point range");
    constexpr bool integral = std::is_integral_v<T>;
    std::ostringstream shown;
    shown << CLI::detail::type_name<T>() << " in [" << min_val << " - " << max_val << "]";
    description(shown.str());
    const std::string range = fmt::format("in range {} to {}", min_val, max_val);
    func_ = [min_val, max_val, range](std::string& input) -> std::string {
      const ParsedNumber n = integral ? parse_integer(input) : parse_real_number(input);
      if (!n.problem.empty()) return fmt::format("{}; allowed: {} {}", n.problem, integral ? "integers" : "numbers", range);
      if (n.value < (long double)min_val || n.value > (long double)max_val)
        return fmt::format("{} is not {}", input, range);
      return std::string();
    };
  }
};

// The file's config (or defaults), with the flags applied on top. Does not validate.
MoeConfig resolve_config(const ConfigOptions& options, const MoeConfig& defaults = MoeConfig{});
// c.validate(), its error followed by where each value it names came from: "[capacity_factor from --config c.json
// (--capacity-factor overrides it)]", "[tokens from --tokens]" or "[... is the default (--top-k sets it)]".
// `set_here`: fields the command set itself, and from what (run: {"tokens", "the rows of x in --input FILE"}).
void validate_config(const MoeConfig& c, const ConfigOptions& options,
                     const std::map<std::string, std::string>& set_here = {});

// Routing flags the layer run would not use, refused naming the flag (each was taken and had no effect, rc 0):
// --aux-loss-coef / --z-loss-coef weight the router losses' gradients, so they need a backward (`backward`;
// `how_backward` says how this command gets one), and --drop-policy chooses the tokens a full expert drops, so it
// needs a capacity (capacity_factor > 0). Only the command line's flags: a config file's values are left as written.
void require_routing_flags_used(const ConfigOptions& options, const MoeConfig& config, bool backward,
                                const std::string& command, const std::string& how_backward);

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
// --layer and --prefix (init, run) both name the layer's tensors: one of them (the prefix silently won).
void require_layer_or_prefix(const std::optional<int>& layer, const std::string& prefix);

// The engine of a whole-model command (train, eval, flow measure): "cpu" or "cuda", the GPU model, whose MoE layers
// run on the EP engine — so "ep" and "gpu" name it too (one vocabulary with run, bench and the Python module); "flash"
// is refused naming where it runs. `option` is what the message calls the flag ("--engine").
std::string model_engine(const std::string& given, const char* option = "--engine");

// The CPU engine simulates its ranks as threads of one process. Run as one of a launcher's processes (dmoe launch,
// mpirun, srun: detect_process_env), each process ran the whole command and wrote its outputs: `dmoe launch -n 2 --
// dmoe train --log L` interleaved two runs' lines in L (rc 0). Refused, saying what each would do (`consequence`) and
// the engine that runs one rank per process (`instead`, may be empty).
void require_one_process(const std::string& command, const std::string& consequence, const std::string& instead);
// init and init-model write files and run no ranks: as one of a launcher's processes each process wrote them all, and
// init-model's sharded saves interleaved (an index over shards of another process's save, rc 0: F3 of the eighteenth
// bad-input pass). Refused, saying what each would write.
void require_not_under_launcher(const std::string& command, const std::string& writes);

}  // namespace dmoe::cli
