// env.cpp — see env.hpp.
#include "core/env.hpp"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "core/error.hpp"

namespace dmoe {

double host_wait_timeout_seconds() {
  const char* text = std::getenv("DMOE_COMM_TIMEOUT_S");
  if (!text) return 600.0;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  // At most 1e9 s (~32 years): a deadline of now + v must fit the clocks' 64-bit nanoseconds (inf would not).
  // At least 10 ms: below that a wait gives up before a peer thread or process can arrive, so the run fails (or
  // passes) by timing alone, with a time-out message that reads like a hang.
  DMOE_REQUIRE_INPUT(end != text && *end == '\0' && v >= 0.01 && v <= 1e9,
                     "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds in [0.01, 1e9] (below 10 ms every wait "
                     "would give up before its peers can arrive)", text);
  return v;
}

bool defer_routing_reads_allowed() {
  const char* text = std::getenv("DMOE_DEFER_ROUTING");
  if (!text || !*text) return true;
  const std::string v = text;
  DMOE_REQUIRE_INPUT(v == "0" || v == "1", "DMOE_DEFER_ROUTING='{}' is invalid: allowed 1 (defer the routing "
                     "counts' host read where a forward can, the default) or 0 (read them in every forward)", v);
  return v == "1";
}

std::string env_choice(const char* name, std::initializer_list<const char*> allowed, const char* fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  std::string list;
  for (const char* a : allowed) {
    if (std::string(a) == text) return text;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  DMOE_FAIL_INPUT("{}='{}' is not allowed; allowed: {} (unset or empty: {})", name, text, list, fallback);
}

int64_t env_integer(const char* name, int64_t lo, int64_t hi, int64_t fallback, const char* unit) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  const std::string range = fmt::format("allowed: a decimal integer from {} to {}{}{}", lo, hi, *unit ? " " : "", unit);
  const char* digits = text[0] == '-' ? text + 1 : text;
  bool ok = *digits != '\0';
  for (const char* p = digits; *p; ++p) ok = ok && *p >= '0' && *p <= '9';
  DMOE_REQUIRE_INPUT(ok, "{}='{}' is not a decimal integer; {}", name, text, range);
  errno = 0;
  const long long v = std::strtoll(text, nullptr, 10);
  DMOE_REQUIRE_INPUT(errno != ERANGE && v >= lo && v <= hi, "{}='{}' is out of range; {}", name, text, range);
  return v;
}

void check_environment() {
  if (std::getenv("DMOE_COMM_TIMEOUT_S")) (void)host_wait_timeout_seconds();
  (void)defer_routing_reads_allowed();
  (void)env_choice("DMOE_EXPERT_GEMM", {"auto", "grouped", "loop", "streams", "own"}, "auto");
  (void)env_integer("DMOE_EXPERT_GEMM_STREAMS", 1, kMaxExpertGemmStreams, kMaxExpertGemmStreams, "streams");
  (void)env_choice("DMOE_WGRAD", {"auto", "own", "sm90", "mma", "cublas"}, "auto");
  (void)env_choice("DMOE_DGRAD", {"auto", "own", "cublas"}, "auto");
  (void)env_choice("DMOE_SM90_BLOCK_N", {"128", "256"}, "256");
  (void)env_choice("DMOE_SM90_SCHEDULE", {"dynamic", "static"}, "dynamic");
  (void)env_choice("DMOE_SM90_EPILOGUE", {"direct", "staged"}, "direct");
  (void)env_choice("DMOE_SM90_WGRAD_ACCUMULATE", {"load", "red"}, "load");
  (void)env_integer("DMOE_GPU_WAIT_TIMEOUT_MS", 1, kMaxGpuWaitTimeoutMs, 10000, "milliseconds");
  (void)env_choice("DMOE_ATTENTION", {"auto", "own", "cudnn"}, "auto");
  (void)env_choice("DMOE_FLOW_AR_COMM", {"auto", "own", "model"}, "auto");
  (void)env_integer("DMOE_FLASH_GRID", 1, (int64_t(1) << 31) - 1, 0, "blocks");
  (void)env_choice("DMOE_SHARED_GPUS", {"0", "1"}, "as dmoe launch sets it");
}

}  // namespace dmoe
