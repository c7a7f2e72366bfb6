// env.cpp — see env.hpp.
#include "core/env.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>  // environ

#include "core/error.hpp"

namespace dmoe {

double host_wait_timeout_seconds() {
  const char* text = std::getenv("DMOE_COMM_TIMEOUT_S");
  if (!text || !*text) return 600.0;  // empty is as unset, as for every other DMOE_* knob (README)
  // A decimal number only: strtod also took hexadecimal ("0x10" as 16 s) and leading white space.
  const std::string_view t = text;
  const bool decimal = !t.empty() && ((t[0] >= '0' && t[0] <= '9') || t[0] == '.') &&
                       t.find_first_not_of("0123456789.eE+-") == std::string_view::npos;
  DMOE_REQUIRE_INPUT(decimal, "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds in [0.01, 1e9] as a decimal "
                     "number (e.g. 600 or 0.5)", text);
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  // At most 1e9 s (~32 years): a deadline of now + v must fit the clocks' 64-bit nanoseconds (inf would not).
  // At least 10 ms: below that a wait gives up before a peer thread or process can arrive, so the run fails (or
  // passes) by timing alone, with a time-out message that reads like a hang.
  // "1e", "1.2.3" and "600-" pass the character check above but are no number: said so, not "below 10 ms" (G20-11).
  DMOE_REQUIRE_INPUT(end != text && *end == '\0', "DMOE_COMM_TIMEOUT_S='{}' is invalid: not a decimal number (expected "
                     "seconds in [0.01, 1e9], e.g. 600 or 0.5)", text);
  DMOE_REQUIRE_INPUT(v >= 0.01 && v <= 1e9,
                     "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds in [0.01, 1e9] ({})", text,
                     v > 1e9 ? "past 1e9 s, ~32 years, a deadline no longer fits the clocks' 64-bit nanoseconds"
                             : "below 10 ms every wait would give up before its peers can arrive");
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
  return env_integer_value(name, std::getenv(name), lo, hi, fallback, unit);
}

int64_t env_integer_value(const char* name, const char* text, int64_t lo, int64_t hi, int64_t fallback,
                          std::string_view unit) {
  if (!text || !*text) return fallback;
  const std::string range = fmt::format("allowed: a decimal integer from {} to {}{}{}", lo, hi, unit.empty() ? "" : " ",
                                        unit);
  const char* digits = text[0] == '-' ? text + 1 : text;
  bool ok = *digits != '\0';
  for (const char* p = digits; *p; ++p) ok = ok && *p >= '0' && *p <= '9';
  DMOE_REQUIRE_INPUT(ok, "{}='{}' is not a decimal integer; {}", name, text, range);
  errno = 0;
  const long long v = std::strtoll(text, nullptr, 10);
  const bool past_64_bits = errno == ERANGE, negative = text[0] == '-';
  // Which end it passed, and that end: a value past 64 bits was "out of range" or, for DMOE_FLOW_CHUNKS_PER_GAP,
  // "invalid: a decimal integer >= 0", which it is (G19-9 of the nineteenth bad-input pass).
  DMOE_REQUIRE_INPUT(!(past_64_bits ? !negative : v > hi), "{}='{}' is too large: the maximum is {}; {}", name, text,
                     hi, range);
  DMOE_REQUIRE_INPUT(!(past_64_bits ? negative : v < lo), "{}='{}' is too small: the minimum is {}; {}", name, text, lo,
                     range);
  return v;
}

namespace {

// Every DMOE_* name something of dmoe's reads: the commands and library, what `dmoe launch` sets for its ranks, the
// tests' and scripts' own knobs. A name outside it is most likely a misspelling, which would have no effect.
constexpr const char* kKnownNames[] = {
    "DMOE_ATTENTION", "DMOE_COMM_TIMEOUT_S", "DMOE_CUDNN_LIBRARY", "DMOE_DEFER_ROUTING", "DMOE_DGRAD",
    "DMOE_EXPERT_GEMM", "DMOE_EXPERT_GEMM_STREAMS", "DMOE_FAULT", "DMOE_FLASH_COMBINE", "DMOE_FLASH_GATE", "DMOE_FLASH_GRID", "DMOE_FLASH_PREFETCH", "DMOE_FLOW_AR_COMM",
    "DMOE_FLOW_CHUNKS_PER_GAP", "DMOE_GPU_WAIT_TIMEOUT_MS", "DMOE_HOME", "DMOE_JOB_ID", "DMOE_NVML_LIBRARY", "DMOE_NVSHMEM_MIN_HEAP",
    "DMOE_SM90_BLOCK_N", "DMOE_SM90_EPILOGUE", "DMOE_SM90_SCHEDULE", "DMOE_SM90_WGRAD_ACCUMULATE", "DMOE_WGRAD",
    // set by dmoe launch (and read from mpirun's / Slurm's through core/process_env)
    "DMOE_RANK", "DMOE_WORLD", "DMOE_LOCAL_RANK", "DMOE_LOCAL_WORLD", "DMOE_DEVICE", "DMOE_RENDEZVOUS",
    "DMOE_STAGE_BOARD", "DMOE_SHARED_GPUS",
    // the tests' and scripts' knobs
    "DMOE_COMM", "DMOE_TEST_VERBOSE", "DMOE_TEST_KNOB", "DMOE_PYTHON", "DMOE_PY_CUDA", "DMOE_PY_FILES"};

// Levenshtein distance, for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string> unknown_dmoe_variables(char** environment) {
  std::vector<std::string> warnings;
  for (char** e = environment; e && *e; ++e) {
    const std::string entry = *e;
    if (entry.rfind("DMOE_", 0) != 0) continue;
    const std::string name = entry.substr(0, entry.find('='));
    bool known = false;
    std::string closest;
    size_t best = 4;  // suggest only a near miss (a typo), not any name
    for (const char* k : kKnownNames) {
      if (name == k) known = true;
      const size_t d = edit_distance(name, k);
      if (d < best) best = d, closest = k;
    }
    if (known) continue;
    warnings.push_back(fmt::format("{} is set but dmoe reads no such variable; it has no effect{}", name,
                                   closest.empty() ? std::string(" (the README lists dmoe's environment knobs)")
                                                   : fmt::format(" (did you mean {}?)", closest)));
  }
  return warnings;
}

namespace {

enum class ByteCount { ok, malformed, too_large };

// parse_byte_count, telling a well-formed count past 2^64 (too_large) from text that is no count (malformed).
ByteCount read_byte_count(const std::string& t, uint64_t& out) {
  size_t i = 0;
  uint64_t value = 0;
  bool too_large = false;
  for (; i < t.size() && t[i] >= '0' && t[i] <= '9'; ++i) {
    if (value > (UINT64_MAX - uint64_t(t[i] - '0')) / 10) too_large = true;
    value = value * 10 + uint64_t(t[i] - '0');
  }
  if (i == 0) return ByteCount::malformed;
  // Any case throughout: "1g", "1GB", "1gib" and "1Gi" were K/M/G/T in either case but "iB" only as written, so "1gib"
  // and "1Gi" were refused by a message that promised "KiB too" (G19-8 of the nineteenth bad-input pass). NVSHMEM
  // takes NVSHMEM_SYMMETRIC_SIZE's first suffix letter in either case, too.
  std::string suffix = t.substr(i);
  for (char& c : suffix) c = char(std::tolower(static_cast<unsigned char>(c)));
  int shift = 0;
  if (!suffix.empty()) {
    const char unit = suffix[0];
    const std::string rest = suffix.substr(1);
    shift = unit == 'k' ? 10 : unit == 'm' ? 20 : unit == 'g' ? 30 : unit == 't' ? 40 : unit == 'b' ? 0 : -1;
    // After K/M/G/T: nothing, B, i or iB ("1G", "1GB", "1Gi", "1GiB"); B alone is bytes ("7B").
    const bool rest_ok = unit == 'b' ? rest.empty() : rest.empty() || rest == "b" || rest == "i" || rest == "ib";
    if (!rest_ok) shift = -1;
  }
  if (shift < 0) return ByteCount::malformed;
  if (too_large || (shift > 0 && value > (UINT64_MAX >> shift))) return ByteCount::too_large;
  out = value << shift;
  return ByteCount::ok;
}

}  // namespace

std::optional<uint64_t> parse_byte_count(const std::string& t) {
  uint64_t bytes = 0;
  return read_byte_count(t, bytes) == ByteCount::ok ? std::optional<uint64_t>(bytes) : std::nullopt;
}

uint64_t env_byte_size(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  uint64_t bytes = 0;
  const ByteCount read = read_byte_count(text, bytes);
  // A size past 64 bits is one, too large: it was "not a size" (as G19-9's integers were "invalid").
  DMOE_REQUIRE_INPUT(read != ByteCount::too_large, "{}='{}' is too large: the maximum is {} bytes (2^64 - 1, 16 EiB)",
                     name, text, UINT64_MAX);
  DMOE_REQUIRE_INPUT(read == ByteCount::ok, "{}='{}' is not a size; allowed: a decimal number of bytes below 2^64, "
                     "optionally with a suffix K, M, G or T (powers of 1024), in any case and optionally followed by "
                     "B, i or iB (1G, 1g, 1GB, 1Gi, 1GiB, 1gib, 512MiB, 64kB), or B alone (bytes: 7B)", name, text);
  return bytes;
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
  (void)env_choice("DMOE_FLASH_GATE", {"auto", "split", "block"}, "auto");
  (void)env_choice("DMOE_FLASH_COMBINE", {"token", "slice"}, "slice");
  (void)env_choice("DMOE_FLASH_PREFETCH", {"0", "1"}, "0");
  (void)env_byte_size("DMOE_NVSHMEM_MIN_HEAP", 0);
  (void)env_choice("DMOE_SHARED_GPUS", {"0", "1"}, "as dmoe launch sets it");
  // A misspelled name is not an error (scripts may export variables for other tools), but it is said.
  for (const std::string& w : unknown_dmoe_variables(environ)) std::fprintf(stderr, "dmoe: warning: %s\n", w.c_str());
}

}  // namespace dmoe
