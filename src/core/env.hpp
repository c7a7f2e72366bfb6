// env.hpp — settings from the environment that more than one layer reads.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dmoe {

// Limit, in seconds, of every host-side wait on the GPU or on peer ranks (DMOE_COMM_TIMEOUT_S, default
// 600): a wait that runs past it fails with an error that names what it waited for, instead of hanging.
double host_wait_timeout_seconds();

// DMOE_DEFER_ROUTING = 1 (default) | 0: whether EpEngine may defer a train forward's host read of its routing
// counts (EpOptions::defer_routing_reads; 0 turns it off everywhere, e.g. to measure what it saves).
bool defer_routing_reads_allowed();

// The value of the environment variable `name`: `fallback` when it is unset or empty, else one of `allowed`
// exactly (no spaces, case as written); anything else is an input error naming the variable, the value and the
// allowed words. The GPU knobs (DMOE_EXPERT_GEMM, DMOE_WGRAD, ...) are read through it.
std::string env_choice(const char* name, std::initializer_list<const char*> allowed, const char* fallback);

// The decimal integer in the environment variable `name`: `fallback` when it is unset or empty, else digits only
// (an optional leading '-'), in [lo, hi]; anything else (spaces, a sign '+', a fraction, a value past 64 bits) is an
// input error naming the variable, the value and the range. `unit` ("milliseconds") is said in the message.
int64_t env_integer(const char* name, int64_t lo, int64_t hi, int64_t fallback, const char* unit);
// As env_integer, for a value already read (`text`, nullptr or "" for unset); `name` is the variable the errors name.
// A value past hi (or past 64 bits) is "too large: the maximum is hi", one below lo "too small: the minimum is lo".
int64_t env_integer_value(const char* name, const char* text, int64_t lo, int64_t hi, int64_t fallback,
                          std::string_view unit);

// A byte count, as NVSHMEM reads NVSHMEM_SYMMETRIC_SIZE's whole numbers: decimal digits with an optional K/M/G/T
// suffix (powers of 1024), in any case and optionally followed by B, i or iB ("512MiB", "1G", "1gib", "1Gi", "64kB"),
// or B alone ("7B"); nullopt when it does not parse or passes 2^64.
std::optional<uint64_t> parse_byte_count(const std::string& text);

// A byte count in the environment variable `name` as parse_byte_count reads it ("1073741824", "1G", "512MiB", "1gib":
// powers of 1024): `fallback` when unset or empty; anything else, or a value past 2^64, is an input error naming the
// variable and the spellings allowed.
uint64_t env_byte_size(const char* name, uint64_t fallback);

// Upper bounds of the knobs read through env_integer, shared by their readers and check_environment().
constexpr int64_t kMaxExpertGemmStreams = 16;             // DMOE_EXPERT_GEMM_STREAMS
constexpr int64_t kMaxGpuWaitTimeoutMs = 1000000000000;   // DMOE_GPU_WAIT_TIMEOUT_MS (~31 years; ns fit 64 bits)

// Every DMOE_* setting dmoe reads with a fixed set of values (the README's environment knobs, the GPU ones
// included), checked when a command starts: a malformed value is refused before any work, whatever the engine
// (a GPU knob was read only where its path ran, so a typo passed silently on the others, and its error ended in a
// source location). Well-formed values of knobs the command does not use are accepted and have no effect.
void check_environment();

// A warning for each DMOE_* name in `environment` (an environ-style array) that dmoe does not read, with the known
// name it most likely misspells; check_environment() prints them to standard error.
std::vector<std::string> unknown_dmoe_variables(char** environment);

}  // namespace dmoe
