// host_resources.cpp — see host_resources.hpp.
#include "core/host_resources.hpp"

#include <sys/resource.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"

namespace dmoe {

std::optional<uint64_t> host_memory_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // reported in kB
  }
  return std::nullopt;
}

std::optional<uint64_t> disk_free_bytes(const std::string& directory) {
  struct statvfs s {};
  if (::statvfs(directory.c_str(), &s) != 0) return std::nullopt;
  return uint64_t(s.f_bavail) * uint64_t(s.f_frsize);
}

std::optional<uint64_t> disk_free_inodes(const std::string& directory) {
  struct statvfs s {};
  if (::statvfs(directory.c_str(), &s) != 0 || s.f_files == 0) return std::nullopt;  // f_files 0: not counted (btrfs)
  return uint64_t(s.f_favail);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

CpuLayerEstimate estimate_cpu_layer(const MoeConfig& c, bool backward) {
  const double W = c.world, T = double(c.tokens), H = double(c.hidden), I = double(c.ffn), E = c.experts,
               k = c.top_k, m = expert_matrices(c.activation);
  CpuLayerEstimate e;
  e.flop = W * (2 * m * T * k * H * I + 2 * T * H * E) * (backward ? 3 : 1);
  // Bytes (f32 = 4 each):
  //   weights: the caller's copy, every rank's slice (W copies of the gate [E, H], one of the experts),
  //     and with backward the same again for the gradients: (1 + bwd)·(E·m·I·H·2 + E·H·(1 + W))
  //   activations per rank, in the engine and in the result: x, y (and dx, dy) [T, H]; gathered,
  //     received and returned rows [T·k, H] twice each; the experts' pre-activations and h [T·k, I]·m;
  //     logits, probabilities [T, E]: T·(4 + 2·bwd)·H + 6·T·k·H + (m + 1)·T·k·I·(1 + bwd) + 2·T·E
  const double bwd = backward ? 1 : 0;
  const double weights = (1 + bwd) * (E * m * I * H * 2 + E * H * (1 + W));
  const double per_rank =
      T * (4 + 2 * bwd) * H + 6 * T * k * H + (m + 1) * T * k * I * (1 + bwd) + 2 * T * E;
  // Per (rank, peer or expert) bookkeeping (counts, offsets, layouts, the exchange's pointers): measured
  // ~230 bytes per W·max(W, E) at W = E = 4096 (4.4 GB with T = 1, H = I = 8).
  const double bookkeeping = 256 * W * std::max(W, E);
  e.bytes = 4 * (weights + W * per_rank) + bookkeeping;
  return e;
}

void require_file_size_allowed(double bytes, const std::string& what) {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  DMOE_REQUIRE_INPUT(bytes <= double(limit.rlim_cur), "{} would be a file of about {}, but this process may write "
                     "files of at most {} (ulimit -f); raise the limit or make the problem smaller", what,
                     format_bytes(bytes), format_bytes(double(limit.rlim_cur)));
}

void require_file_descriptors(int64_t needed, const std::string& what) {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  std::error_code ec;
  int64_t open = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) ++open;
  if (ec || open == 0) return;  // not Linux, or /proc not mounted: nothing known
  open -= 1;  // the iterator's own descriptor
  // The advice is a limit that fits (it said "ulimit -n 1024" also where 1024 was too few: launch -n 600).
  int64_t enough = 1024;
  while (enough < open + needed) enough *= 2;
  DMOE_REQUIRE_INPUT(open + needed <= int64_t(limit.rlim_cur), "{} needs up to {} file descriptors more than the {} "
                     "this process has open, and may have at most {} (ulimit -n); raise the limit (e.g. ulimit -n "
                     "{})", what, needed, open, uint64_t(limit.rlim_cur), enough);
}

void require_output_space(double bytes, const std::string& path, const std::string& option, const std::string& what) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  const std::string dir = parent.empty() ? std::string(".") : parent;
  const std::optional<uint64_t> free = disk_free_bytes(dir);
  DMOE_REQUIRE_INPUT(!free || bytes <= double(*free), "{} '{}' would be a file of about {} ({}), and the file system "
                     "of '{}' has {} free; free some space or write it elsewhere", option, path, format_bytes(bytes),
                     what, dir, format_bytes(double(*free)));
  require_free_inodes(1, dir, fmt::format("{} '{}' ({})", option, path, what));
  require_file_size_allowed(bytes, fmt::format("{} '{}' ({})", option, path, what));
}

void require_free_inodes(uint64_t files, const std::string& directory, const std::string& what) {
  const std::optional<uint64_t> inodes = disk_free_inodes(directory);
  DMOE_REQUIRE_INPUT(!inodes || files <= *inodes, "{} creates {} {} at once, and the file system of '{}' has {} free "
                     "inode{} (df -i '{}'): no free inodes for {}, whatever space is free (a file system can run out of "
                     "files before bytes: a tmpfs's nr_inodes, many small files); remove files there or write "
                     "elsewhere", what, files, files == 1 ? "file" : "files", directory, *inodes, *inodes == 1 ? "" : "s",
                     directory, files == 1 ? "it" : "them");
}

std::optional<uint64_t> address_space_left_bytes() {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
  std::ifstream in("/proc/self/status");
  uint64_t in_use = 0;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmSize:", 0) == 0) in_use = std::stoull(line.substr(7)) * 1024;  // reported in kB
  return uint64_t(limit.rlim_cur) > in_use ? uint64_t(limit.rlim_cur) - in_use : 0;
}

void fail_thread_start(const std::system_error& e, const std::string& what) {
  const std::optional<uint64_t> left = address_space_left_bytes();
  DMOE_FAIL_INPUT("could not start {}: {}; each thread reserves its stack in the address space (ulimit -s, 8 MiB by "
                  "default){}: use fewer simulated ranks (world), or raise this process's limits (ulimit -v, ulimit -u)",
                  what, e.what(), left ? fmt::format(", and ulimit -v leaves this process {}", format_bytes(double(*left)))
                                       : std::string());
}

void require_host_memory(double bytes, const std::string& what, const std::string& sizes) {
  const std::optional<uint64_t> left = address_space_left_bytes();
  DMOE_REQUIRE_INPUT(!left || bytes <= double(*left),
                     "{} would allocate about {}, but this process may take only {} more address space (ulimit -v){}",
                     what, format_bytes(bytes), format_bytes(double(*left)),
                     sizes.empty() ? "; raise the limit" : "; raise the limit or make the problem smaller (" + sizes + ")");
  const std::optional<uint64_t> available = host_memory_available_bytes();
  if (!available) return;
  DMOE_REQUIRE_INPUT(bytes <= double(*available),
                     "{} would allocate about {}, but this machine has {} available (MemAvailable in "
                     "/proc/meminfo){}",
                     what, format_bytes(bytes), format_bytes(double(*available)),
                     sizes.empty() ? "" : "; make the problem smaller (" + sizes + ")");
}

}  // namespace dmoe
