// flash/flash_backward.cu — the data-movement kernels of the Flash backward (flash/flash_backward.cpp runs the
// protocol's steps; flash_backward_kernels.hpp says what each does): each received row's gradient pulled from
// its home through the peers table, each dx row stored straight into its home's symmetric dx_out, and the
// signals with the forward's epoch between the ranks, every wait bounded (the record names the rank, the
// backward role, the awaited signal and its source, as the forward kernel's).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/flash_protocol.hpp"
#include "cuda/check.hpp"
#include "cuda/sm90_primitives.cuh"
#include "flash/flash_backward_kernels.hpp"

namespace dmoe::cuda {

namespace {

#ifdef DMOE_SM90A_DEVICE

__device__ __forceinline__ char* peer_of(const BackwardArgs& a, int32_t d) {
  return reinterpret_cast<char*>(reinterpret_cast<const uint64_t*>(a.local + a.ll.peers)[d]);
}
__device__ __forceinline__ uint32_t forward_epoch(const BackwardArgs& a) {
  return *reinterpret_cast<const volatile uint32_t*>(&reinterpret_cast<const flash::Control*>(a.local + a.ll.control)->epoch);
}

#endif

__global__ void choice_slots_kernel(const int32_t* slot, int32_t* choice_slot, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    choice_slot[i] = slot[i] >= 0 ? int32_t(i) : -1;
}

// One thread per rank d: signal(epoch, 1) into d's word `r` of the signal array at `offset`. Launched after the
// kernels whose stores it announces (stream order), it fences at system scope first.
__global__ void signal_peers_kernel(const __grid_constant__ BackwardArgs a, size_t offset) {
#ifdef DMOE_SM90A_DEVICE
  const int32_t d = int32_t(threadIdx.x);
  if (d >= a.world) return;
  fence_acq_rel_sys();
  st_release_sys(reinterpret_cast<uint64_t*>(peer_of(a, d) + offset) + a.rank, flash::make_signal(forward_epoch(a), 1));
#endif
}

// One thread per source s: waits (bounded) until word s of this rank's signal array at `offset` carries the epoch.
__global__ void wait_signals_kernel(const __grid_constant__ BackwardArgs a, size_t offset, int32_t what) {
#ifdef DMOE_SM90A_DEVICE
  const int32_t src = int32_t(threadIdx.x);
  if (src >= a.world) return;
  const uint32_t epoch = forward_epoch(a);
  const uint64_t* word = reinterpret_cast<const uint64_t*>(a.symmetric + offset) + src;
  uint64_t v = ld_acquire_sys(word);
  if (flash::signal_epoch(v) == epoch) return;
  const unsigned long long start = global_time_ns();
  for (;;) {
    v = ld_acquire_sys(word);
    if (flash::signal_epoch(v) == epoch) return;
    const unsigned long long waited = global_time_ns() - start;
    if (waited > a.timeout_ns)
      report_wait_timeout(static_cast<DeviceWaitRecord*>(a.wait_record), kWaitFlash, flash::kRoleBackward, a.rank,
                          what, src, 0, flash::make_signal(epoch, 1), v, waited);
  }
#endif
}

// One warp per received row i (meta order): pull = true copies home(meta[i]).grad_out[token_choice] into
// rows[i]; pull = false stores rows[i] into home(meta[i]).dx_out[token_choice]. 16-byte vectors (H·2 bytes is a
// multiple of 32: H % 16 == 0); the peer's side through L2 (written by another GPU or process).
__global__ void move_rows_kernel(const __grid_constant__ BackwardArgs a, const flash::RowMeta* meta,
                                 __nv_bfloat16* rows, int64_t n, bool pull) {
#ifdef DMOE_SM90A_DEVICE
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = int(threadIdx.x % 32);
  const int64_t vecs = a.hidden / 8;
  for (int64_t i = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; i < n; i += warps) {
    const int2 m = __ldcg(reinterpret_cast<const int2*>(meta + i));
    uint4* local_row = reinterpret_cast<uint4*>(rows + i * a.hidden);
    char* home = peer_of(a, m.x);
    if (pull) {
      const uint4* src = reinterpret_cast<const uint4*>(home + a.sl.grad_out) + int64_t(m.y) * vecs;
      for (int64_t v = lane; v < vecs; v += 32) local_row[v] = __ldcg(src + v);
    } else {
      uint4* dst = reinterpret_cast<uint4*>(home + a.sl.dx_out) + int64_t(m.y) * vecs;
      for (int64_t v = lane; v < vecs; v += 32) dst[v] = local_row[v];
    }
  }
#endif
}

int blocks_for(int64_t work, int per_block) {
  const int64_t b = (work + per_block - 1) / per_block;
  return int(std::max<int64_t>(1, std::min<int64_t>(b, 4096)));
}

int signal_threads(int32_t world) { return 32 * ((world + 31) / 32); }

}  // namespace

void flash_choice_slots(const int32_t* slot, int32_t* choice_slot, int64_t n, cudaStream_t stream) {
  choice_slots_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(slot, choice_slot, n);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_signal_peers(const BackwardArgs& a, size_t offset, cudaStream_t stream) {
  signal_peers_kernel<<<1, signal_threads(a.world), 0, stream>>>(a, offset);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_wait_signals(const BackwardArgs& a, size_t offset, int32_t what, cudaStream_t stream) {
  wait_signals_kernel<<<1, signal_threads(a.world), 0, stream>>>(a, offset, what);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_move_rows(const BackwardArgs& a, const flash::RowMeta* meta, void* rows, int64_t n, bool pull,
                     cudaStream_t stream) {
  if (n <= 0) return;
  move_rows_kernel<<<blocks_for(n, 8), 256, 0, stream>>>(a, meta, static_cast<__nv_bfloat16*>(rows), n, pull);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dmoe::cuda
