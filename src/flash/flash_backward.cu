// flash/flash_backward.cu — the Flash backward's own kernels (flash/flash_backward.cpp runs the protocol's steps;
// flash_backward_kernels.hpp says what each does): the combine backward that stores each row gradient straight
// into its expert's rank, the scatter back that reads the experts' dx rows in place, and the signals with the
// forward's epoch between the ranks, every wait bounded (the record names the rank, the backward role, the
// awaited signal and its source, as the forward kernel's).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/flash_protocol.hpp"
#include "cuda/check.hpp"
#include "cuda/device_utils.cuh"
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

// The combine backward fused with the row gradients' dispatch: one warp per token t, for each kept (t, j):
// dweights[t,j] = <dy[t], out[t·k+j]> and owner(e).grad_recv[dest_row[t,j]] = w[t,j]·dy[t], stored straight into
// the expert's rank. Each lane owns 8 consecutive columns per step and sums in the order of the backend's
// combine_backward kernel (cuda/permute.cu), so dweights and the rows are that kernel's bits.
__global__ void __launch_bounds__(256) combine_backward_kernel(const __grid_constant__ BackwardArgs a, const __grid_constant__ CombineBackwardArgs c) {
#ifdef DMOE_SM90A_DEVICE
  constexpr int N = 8;
  const int lane = int(threadIdx.x % 32);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t H = a.hidden;
  for (int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < c.tokens; t += warps) {
    const __nv_bfloat16* dy_t = c.dy + t * H;
    for (int32_t j = 0; j < c.top_k; ++j) {
      const int64_t q = t * c.top_k + j;
      if (c.slot[q] < 0) {  // dropped: the weight did not contribute to y
        if (lane == 0) c.dweights[q] = 0.f;
        continue;
      }
      const float w = c.weights[q];
      const __nv_bfloat16* row = c.out + q * H;
      __nv_bfloat16* drow = reinterpret_cast<__nv_bfloat16*>(peer_of(a, c.ids[q] / c.local_experts) + a.sl.grad_recv) +
                            int64_t(c.dest_row[q]) * H;
      float dot = 0.f;
      for (int64_t col = int64_t(lane) * N; col < H; col += int64_t(32) * N) {
        float g[N], v[N], o[N];
        load_f32<N>(dy_t + col, g);
        load_f32<N>(row + col, v);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          dot = fmaf(g[i], v[i], dot);
          o[i] = w * g[i];
        }
        store_f32<N>(drow + col, o);
      }
      dot = warp_sum(dot);
      if (lane == 0) c.dweights[q] = dot;
    }
  }
#endif
}

// The scatter back fused with the dx rows' return: one warp per token, dx[t] = Σ_j owner(e).dx_rows[dest_row[t,j]]
// (kept j in order) + dx_router[t], the experts' rows read in place through L2 (another GPU or process wrote them);
// the order of the backend's combine kernel with unit weights (cuda/permute.cu), so the same bits.
__global__ void __launch_bounds__(256) scatter_back_kernel(const __grid_constant__ BackwardArgs a, const __grid_constant__ ScatterBackArgs c) {
#ifdef DMOE_SM90A_DEVICE
  constexpr int N = 8;
  const int lane = int(threadIdx.x % 32);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t H = a.hidden;
  for (int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < c.tokens; t += warps) {
    for (int64_t col = int64_t(lane) * N; col < H; col += int64_t(32) * N) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.f;
#pragma unroll 1
      for (int32_t j = 0; j < c.top_k; ++j) {
        const int64_t q = t * c.top_k + j;
        if (c.slot[q] < 0) continue;
        const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(peer_of(a, c.ids[q] / c.local_experts) +
                                                                          a.sl.dx_rows) + int64_t(c.dest_row[q]) * H + col;
        const uint4 bits = __ldcg(reinterpret_cast<const uint4*>(src));
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&bits);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = fmaf(1.f, __bfloat162float(v[i]), acc[i]);
      }
      float r[N];
      load_f32<N>(c.dx_router + t * H + col, r);
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] += r[i];
      store_f32<N>(c.dx + t * H + col, acc);
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

void flash_signal_peers(const BackwardArgs& a, size_t offset, cudaStream_t stream) {
  signal_peers_kernel<<<1, signal_threads(a.world), 0, stream>>>(a, offset);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_wait_signals(const BackwardArgs& a, size_t offset, int32_t what, cudaStream_t stream) {
  wait_signals_kernel<<<1, signal_threads(a.world), 0, stream>>>(a, offset, what);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_combine_backward(const BackwardArgs& a, const CombineBackwardArgs& c, cudaStream_t stream) {
  if (c.tokens <= 0) return;
  combine_backward_kernel<<<blocks_for(c.tokens, 8), 256, 0, stream>>>(a, c);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

void flash_scatter_back(const BackwardArgs& a, const ScatterBackArgs& c, cudaStream_t stream) {
  if (c.tokens <= 0) return;
  scatter_back_kernel<<<blocks_for(c.tokens, 8), 256, 0, stream>>>(a, c);
  DMOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dmoe::cuda
