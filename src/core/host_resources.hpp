// host_resources.hpp — what this machine has (memory, disk, cores) and up-front estimates of what a
// command will need, so that a job too large fails at once with the numbers instead of ending in a bare
// std::bad_alloc, a partial file, or minutes of silence.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <system_error>

#include "core/config.hpp"

namespace dmoe {

// MemAvailable from /proc/meminfo, in bytes; nullopt where it cannot be read (not Linux).
std::optional<uint64_t> host_memory_available_bytes();
// Bytes free to an unprivileged writer in the file system holding `directory`; nullopt if unknown.
std::optional<uint64_t> disk_free_bytes(const std::string& directory);
// Inodes (files) free to an unprivileged writer there (statvfs f_favail); nullopt where unknown or not counted.
std::optional<uint64_t> disk_free_inodes(const std::string& directory);
// Refuses `what`, which creates `files` new files at once in `directory`, where its file system has fewer free inodes
// (G20-5, twentieth pass: a tmpfs out of inodes with bytes free failed a checkpoint's save after the training, as "No
// space left on device"). Says "no free inodes", and df -i.
void require_free_inodes(uint64_t files, const std::string& directory, const std::string& what);
// "3.2 GiB", "512 MiB", "12 KiB", "100 B".
std::string format_bytes(double bytes);

// What `dmoe run` / `dmoe bench` on the CPU reference engine needs for one layer call (formulas in the
// .cpp; an upper estimate: every buffer counted once, scratch included).
struct CpuLayerEstimate {
  double flop = 0;   // forward, all ranks: W·(2·m·T·k·H·I + 2·T·H·E); with backward ×3
  double bytes = 0;  // peak host memory
};
CpuLayerEstimate estimate_cpu_layer(const MoeConfig& config, bool backward);

// What to make smaller when a whole model (init-model, eval, train, flow measure) does not fit.
inline constexpr const char* kModelSizes =
    "the model config's vocab_size, hidden_size, intermediate_size, num_local_experts, num_hidden_layers";

// A lower bound of the host memory of a whole model's forward and backward on the CPU engine over `tokens`
// tokens (all ranks): the logits and their gradient [tokens, vocab] and two [tokens, hidden] activations per
// layer, f32. The real need is larger; this is for refusing at once what cannot fit at all.
inline double model_activation_bytes_lower_bound(double tokens, double vocab, double hidden, double layers) {
  return 4.0 * tokens * (2.0 * vocab + 2.0 * layers * hidden);
}

// Refuses a file of about `bytes` that this process may not write under `ulimit -f` (RLIMIT_FSIZE), naming `what`
// it is; such a write failed with EFBIG (or SIGXFSZ killed dmoe) after the work, with the old file kept.
void require_file_size_allowed(double bytes, const std::string& what);

// Refuses a command that needs up to `needed` more open files at once (its log, a checkpoint's files and their
// temporaries, the data) than `ulimit -n` (RLIMIT_NOFILE) leaves; under `ulimit -n 4` train ran, then failed to save.
void require_file_descriptors(int64_t needed, const std::string& what);

// Refuses an output `path` of about `bytes` that its file system's free space (or `ulimit -f`) cannot take, naming the
// option and what the file holds: before the work, where the write failed after it (eval --output of a model's
// gradients, run --output), with the old file kept but the work lost. Also a free inode for its temporary.
void require_output_space(double bytes, const std::string& path, const std::string& option, const std::string& what);

// The address space this process may still take under `ulimit -v` (RLIMIT_AS minus VmSize), or nullopt when no
// such limit is set.
std::optional<uint64_t> address_space_left_bytes();

// For std::system_error from starting a thread (EAGAIN under ulimit -v or ulimit -u): an input error naming `what`
// the thread was for and the limits to raise. Callers catch it at the std::thread they start, where other threads
// may already run: leaving the scope with those joinable ended dmoe in std::terminate ("terminate called without an
// active exception", SIGABRT).
[[noreturn]] void fail_thread_start(const std::system_error& e, const std::string& what);

// Refuses (dmoe::Error naming what, how much and what is available) when `bytes` exceeds MemAvailable, or the
// address space left under `ulimit -v`.
// `what` says what would be allocated ("the CPU engine's buffers for T=... W=..."), `sizes` what to make smaller
// (a layer's fields by default; a whole model's are others; empty: no hint).
void require_host_memory(double bytes, const std::string& what,
                         const std::string& sizes = "tokens, hidden, ffn, experts, world");

}  // namespace dmoe
