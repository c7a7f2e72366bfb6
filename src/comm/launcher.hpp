// launcher.hpp — `dmoe launch`: start N local ranks of one command, one process each.
//
//   dmoe launch -n 4 [--gpus 0,1] [--no-mps] -- dmoe_gpu_tests --gtest_filter=GpuComm*
//
// Every child gets DMOE_RANK, DMOE_WORLD, DMOE_LOCAL_RANK, DMOE_LOCAL_WORLD (one node: local = global),
// DMOE_RENDEZVOUS (a fresh directory for bootstrap files, removed at the end), and, when GPUs exist,
// DMOE_DEVICE (GPUs dealt round-robin from --gpus, default every GPU `nvidia-smi -L` lists, or the
// CUDA_VISIBLE_DEVICES entries when that is set) and
// DMOE_SHARED_GPUS (1 when any GPU hosts two or more ranks, else 0: every rank sees the same value, so
// all pick the same communicator). NCCL_NVLS_ENABLE=0 and NVSHMEM_DISABLE_NVLS=1 unless already set
// (house rule: no NVLink multicast).
//
// Ranks sharing a GPU: NCCL refuses them, NVSHMEM's host collectives need MPS with an active-thread
// percentage per process (docs: DEVICE.md). So when some GPU hosts two or more ranks, the launcher sets
// NVSHMEM_DISABLE_NCCL=1 and, unless --no-mps, MPS is on PATH, and the caller runs no daemon of its own
// (CUDA_MPS_PIPE_DIRECTORY unset), it starts a private MPS daemon (pipe and log directories in the
// launch's temp directory, exported to the children), gives each child
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = floor(100 / ranks on its GPU), and stops the daemon at the end.
//
// Output: each child's stdout and stderr come back line by line prefixed "[rank R] ", on the launcher's
// stdout and stderr. Children read /dev/null as stdin and run in process groups of their own, so a
// signal reaches a whole rank (a shell and what it started).
//
// Failure: when a child exits non-zero or by a signal, the launcher reports the rank, its exit code or
// signal and its last stderr lines, sends SIGTERM to the other ranks, SIGKILL after a grace period, and
// returns that rank's exit code (128 + signal for a signal). A terminating signal to the launcher (SIGINT, SIGTERM,
// SIGHUP, and SIGQUIT, SIGUSR1/2, SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU, SIGIO, SIGPWR, SIGSTKFLT, SIGRTMIN..SIGRTMAX where
// at their default disposition) is forwarded to the ranks, with SIGTERM after a grace period to a rank still running
// and SIGKILL after a second; it then returns 128 + that signal, or with end_by_signal (the dmoe tool) ends by that
// signal once its directory is removed. A signal that arrives ignored (nohup's SIGHUP, a background job's SIGINT) stays
// ignored, in the launcher and in its ranks, as for a bare process. 0 only when every rank exits 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmoe {

struct LaunchOptions {
  int32_t num_ranks = 1;
  std::vector<int32_t> gpus;          // device indices to deal out; empty: all GPUs nvidia-smi lists
  bool use_mps = true;                // start a private MPS daemon when ranks share a GPU
  std::vector<std::string> command;   // program (searched on PATH) and its arguments
  double kill_grace_seconds = 5.0;    // SIGTERM -> SIGKILL delay when tearing the ranks down
  int32_t failure_tail_lines = 10;    // stderr lines of a failed rank repeated in the report
  int out_fd = 1;                     // where prefixed child stdout goes
  int err_fd = 2;                     // where prefixed child stderr and the launcher's messages go
  bool end_by_signal = false;         // after a forwarded signal and the teardown, end by it (raise) instead of returning
};

// Runs the ranks to completion; returns the exit status for the launcher (see above). Throws
// dmoe::Error for bad options or when the command, the temp directory or MPS cannot be set up.
int launch(const LaunchOptions& options);

// For tests (G22B-2): `hook` runs in each rank's child right after fork, before its signal dispositions are reset
// (async-signal-safe work only); nullptr removes it.
void set_after_fork_hook_for_tests(void (*hook)());

// For tests (G23B-4): before each rank's fork, `hook(rank)`; a non-zero result is the errno the fork fails with (as
// EAGAIN under ulimit -u). nullptr removes it.
void set_fork_failure_for_tests(int (*hook)(int32_t rank));

// Number of GPUs `nvidia-smi -L` lists (lines starting "GPU "); 0 when nvidia-smi is missing or fails.
int32_t count_gpus_with_nvidia_smi();

// GPUs the children will see: the entries of CUDA_VISIBLE_DEVICES when it is set (DMOE_DEVICE indexes
// that list), else count_gpus_with_nvidia_smi().
int32_t count_visible_gpus();

// GPU of each rank: gpus[r % gpus.size()]; empty when there are no GPUs.
std::vector<int32_t> assign_devices(int32_t num_ranks, const std::vector<int32_t>& gpus);

}  // namespace dmoe
