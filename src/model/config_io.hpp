// config_io.hpp — MoeConfig from and to JSON: dmoe's own format and Hugging Face Mixtral config.json.
//
// dmoe format: {"tokens", "hidden", "ffn", "experts", "top_k", "activation", "renormalize",
// "capacity_factor", "drop_policy", "dtype", "world", "aux_loss_coef", "z_loss_coef"}; a missing key keeps
// the value in `defaults`, an unknown key or a wrong JSON type is an error naming the key.
// Hugging Face format (detected by "num_local_experts", "hidden_size" or "model_type"): model_type must be
// "mixtral" when present; hidden_size, intermediate_size, num_local_experts, num_experts_per_tok,
// hidden_act, torch_dtype (or dtype: float32 | bfloat16, float16 refused), router_aux_loss_coef and
// router_z_loss_coef are read; a dmoe key (other than dtype) is an error pointing to its flag; tokens,
// world, capacity_factor and drop_policy keep `defaults`. Files with a key repeated in one object are
// refused. Neither function calls validate(): callers do, once tokens are known.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "core/config.hpp"

namespace dmoe {

MoeConfig config_from_json(const nlohmann::json& j, const MoeConfig& defaults = MoeConfig{});
// dmoe format with every key; config_from_json(config_to_json(c)) == c.
nlohmann::json config_to_json(const MoeConfig& config);
// Reads and parses a JSON file in either format; errors name the file.
MoeConfig load_config_file(const std::string& path, const MoeConfig& defaults = MoeConfig{});

// For a Hugging Face config.json (a layer's or a whole model's): refuses what dmoe cannot read and would otherwise
// have read as a float Mixtral without a word: a quantization_config (GPTQ, AWQ, bitsandbytes, FP8 checkpoints),
// and an architectures list without a Mixtral class (another model spelled with Mixtral's keys).
void require_float_mixtral_classes(const nlohmann::json& j, std::string_view what);

// A JSON file as every dmoe reader takes it: a regular file (not a directory, FIFO or device), valid JSON without a
// NUL byte, no key twice in one object, nested at most kMaxJsonDepth deep, no number that underflows to 0; errors
// name `what` (e.g. "config file") and the path.
inline constexpr size_t kMaxJsonDepth = 128;  // serde_json's limit, which the Rust safetensors reader inherits
// And at most this many bytes, checked before reading: the file was read whole, so a 3 GiB file of NULs (or of
// spaces) took 25 s and 6 GiB of memory before its error, and a larger one ran out of memory. dmoe's JSON files
// (configs, indexes, cost, cluster, tuning and trainer state files) are kilobytes; safetensors headers have the same
// limit (SafetensorsFile::kMaxHeaderBytes).
inline constexpr uint64_t kMaxJsonFileBytes = 100ull << 20;

// What parse_json_strictly stopped at (kind none: nothing); depth is the nesting level, 1 for the top-level object.
struct StrictJsonProblem {
  enum Kind { none, duplicate_key, too_deep, underflow } kind = none;
  std::string key;  // the duplicate key
  size_t depth = 0;
  std::string message;
};
// JSON text to a DOM under read_json_file's rules, in time linear in the text; the first problem ends the parse and is
// returned in `problem` (the result is then partial). Invalid JSON throws nlohmann's parse_error.
nlohmann::json parse_json_strictly(std::string_view text, StrictJsonProblem& problem);
nlohmann::json read_json_file(const std::string& path, std::string_view what);
// An nlohmann exception's text without its "[json.exception.parse_error.101] " tag, for a user's message ("parse error
// at line 1, column 1: syntax error while parsing value - invalid literal; last read: 'N'").
std::string json_error_text(const std::exception& e);
// Writes config_to_json(config), pretty-printed.
void save_config_file(const MoeConfig& config, const std::string& path);

}  // namespace dmoe
