#include "bench/cuda/gpu_timing.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "cuda/check.hpp"

namespace dmoe::bench {

namespace {

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * 0x1p-24f * 2.f - 1.f;  // [-1, 1)
}

__global__ void fill_uniform_f32_kernel(float* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = scale * hash_uniform(seed, uint64_t(i));
}

__global__ void fill_uniform_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(scale * hash_uniform(seed, uint64_t(i)));
}

int fill_grid(int64_t n) { return int(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

}  // namespace

void fill_uniform_f32(float* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_uniform_f32_kernel<<<fill_grid(n), 256, 0, stream>>>(p, n, seed, scale);
  DMOE_CHECK_LAUNCH();
}

void fill_uniform_bf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_uniform_bf16_kernel<<<fill_grid(n), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  DMOE_CHECK_LAUNCH();
}

GpuTimer::GpuTimer(cudaStream_t stream) : stream_(stream) {
  DMOE_CHECK_CUDA(cudaEventCreate(&start_));
  DMOE_CHECK_CUDA(cudaEventCreate(&stop_));
  int device = 0, l2 = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  flush_bytes_ = size_t(std::max(l2, 1 << 20)) * 2;
  DMOE_CHECK_CUDA(cudaMalloc(&flush_, flush_bytes_));
}

GpuTimer::~GpuTimer() {
  cuda::free_quietly(flush_);
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
}

float GpuTimer::time_once(const std::function<void()>& fn, bool flush, int salt) {
  if (flush) DMOE_CHECK_CUDA(cudaMemsetAsync(flush_, salt & 0xff, flush_bytes_, stream_));
  DMOE_CHECK_CUDA(cudaEventRecord(start_, stream_));
  fn();
  DMOE_CHECK_CUDA(cudaEventRecord(stop_, stream_));
  DMOE_CHECK_CUDA(cudaEventSynchronize(stop_));
  float t = 0;
  DMOE_CHECK_CUDA(cudaEventElapsedTime(&t, start_, stop_));
  return t;
}

std::vector<Stats> GpuTimer::time_interleaved(const std::vector<std::function<void()>>& fns, const TimingOptions& o) {
  for (const auto& fn : fns)
    for (int i = 0; i < o.warmup; ++i) fn();
  cuda::wait_stream(stream_, "benchmark: warm-up");
  // The round count from one timed call of each: enough rounds for min_total_ms of all of them together.
  double round_ms = 0;
  for (size_t i = 0; i < fns.size(); ++i) round_ms += time_once(fns[i], o.flush_l2, int(i));
  int rounds = std::clamp(int(o.min_total_ms / std::max(round_ms, 1e-3)) + 1, o.min_iterations, o.max_iterations);
  if (o.agree_iterations) rounds = o.agree_iterations(rounds);
  std::vector<std::vector<double>> ms(fns.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < fns.size(); ++i) ms[i].push_back(time_once(fns[i], o.flush_l2, r));
  std::vector<Stats> out;
  for (auto& v : ms) out.push_back(summarize(std::move(v)));
  return out;
}

Stats GpuTimer::time(const std::function<void()>& fn, const TimingOptions& o) {
  for (int i = 0; i < o.warmup; ++i) fn();
  cuda::wait_stream(stream_, "benchmark: warm-up");
  std::vector<double> ms;
  double total = 0;
  int fixed = -1;  // with agree_iterations: the count all ranks run
  if (o.agree_iterations) {
    // Estimate the count from one timed call, then agree on it.
    const float t = time_once(fn, false, 0);
    const int wanted = std::clamp(int(o.min_total_ms / std::max(t, 1e-3f)) + 1, o.min_iterations, o.max_iterations);
    fixed = o.agree_iterations(wanted);
  }
  while (fixed >= 0 ? int(ms.size()) < fixed
                    : int(ms.size()) < o.max_iterations &&
                          (int(ms.size()) < o.min_iterations || total < o.min_total_ms)) {
    const float t = time_once(fn, o.flush_l2, int(ms.size()));
    ms.push_back(t);
    total += t;
  }
  return summarize(ms);
}

CeilingGemm::CeilingGemm(cudaStream_t stream) : stream_(stream) {
  for (void** p : {&a_, &b_, &d_}) DMOE_CHECK_CUDA(cudaMalloc(p, size_t(kN) * kN * 2));
  fill_uniform_bf16(a_, int64_t(kN) * kN, 1, 1.f, stream);
  fill_uniform_bf16(b_, int64_t(kN) * kN, 2, 1.f, stream);
  cublasHandle_t handle;
  DMOE_CHECK_CUBLAS(cublasCreate(&handle));
  DMOE_CHECK_CUBLAS(cublasSetStream(handle, stream));
  handle_ = handle;
}

CeilingGemm::~CeilingGemm() {
  if (cuda::gpu_abandoned()) return;  // cublasDestroy would synchronise with hung work
  cublasDestroy(static_cast<cublasHandle_t>(handle_));
  cuda::free_quietly(a_);
  cuda::free_quietly(b_);
  cuda::free_quietly(d_);
}

void CeilingGemm::run() {
  const float one = 1.f, zero = 0.f;
  DMOE_CHECK_CUBLAS(cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_N, CUBLAS_OP_N, kN, kN, kN, &one,
                                 a_, CUDA_R_16BF, kN, b_, CUDA_R_16BF, kN, &zero, d_, CUDA_R_16BF, kN,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

Ceilings measure_ceilings(cudaStream_t stream) {
  Ceilings c;
  GpuTimer timer(stream);
  TimingOptions opts;
  opts.warmup = 3;
  opts.min_iterations = 10;
  opts.min_total_ms = 100;

  // GEMM ceiling: C[n,n] = A[n,n]·B[n,n], bf16 in, fp32 accumulate, bf16 out; FLOP = 2n³.
  {
    CeilingGemm gemm(stream);
    c.gemm = timer.time([&] { gemm.run(); }, opts);
    c.gemm_flop_per_s = gemm.flop() / (c.gemm.median_ms * 1e-3);
  }

  // Copy ceiling: 2 GiB device-to-device; bytes moved = 2 × 2 GiB (read + write).
  const size_t bytes = size_t(2) << 30;
  void *src = nullptr, *dst = nullptr;
  DMOE_CHECK_CUDA(cudaMalloc(&src, bytes));
  DMOE_CHECK_CUDA(cudaMalloc(&dst, bytes));
  fill_uniform_f32(static_cast<float*>(src), int64_t(bytes / 4), 3, 1.f, stream);
  c.copy = timer.time([&] { DMOE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); },
                      opts);
  c.copy_byte_per_s = 2.0 * double(bytes) / (c.copy.median_ms * 1e-3);
  cudaFree(src);
  cudaFree(dst);
  return c;
}

namespace {

// Grid-stride 16-byte copy; four loads in flight per thread before their stores, so a CTA keeps enough
// requests outstanding to cover the link's latency. `bytes` is a multiple of 16.
__global__ void __launch_bounds__(512) peer_store_kernel(int4* __restrict__ dst, const int4* __restrict__ src,
                                                         int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

}  // namespace

PeerPushTimes time_peer_push(int peer_device, size_t bytes, cudaStream_t stream,
                             const std::function<void()>& start_together, int iterations) {
  bytes = (bytes + 15) / 16 * 16;
  int device = 0, sms = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int can = 0;
  DMOE_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, device, peer_device));
  DMOE_CUDA_REQUIRE(device != peer_device && can, "time_peer_push: GPU %d cannot access GPU %d peer-to-peer", device,
                    peer_device);
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled)
    (void)cudaGetLastError();  // clear it: enabled already is what is wanted
  else
    DMOE_CHECK_CUDA(e);
  void *src = nullptr, *dst = nullptr;
  DMOE_CHECK_CUDA(cudaMalloc(&src, bytes));
  DMOE_CHECK_CUDA(cudaSetDevice(peer_device));
  const cudaError_t alloc = cudaMalloc(&dst, bytes);
  DMOE_CHECK_CUDA(cudaSetDevice(device));
  DMOE_CHECK_CUDA(alloc);
  fill_uniform_f32(static_cast<float*>(src), int64_t(bytes / 4), 11, 1.f, stream);
  cudaEvent_t start, stop;
  DMOE_CHECK_CUDA(cudaEventCreate(&start));
  DMOE_CHECK_CUDA(cudaEventCreate(&stop));

  PeerPushTimes t;
  for (int way = 0; way < 2; ++way) {
    std::vector<double> ms;
    for (int i = 0; i < 3 + iterations; ++i) {
      start_together();
      DMOE_CHECK_CUDA(cudaEventRecord(start, stream));
      if (way == 0) {
        DMOE_CHECK_CUDA(cudaMemcpyPeerAsync(dst, peer_device, src, device, bytes, stream));
      } else {
        peer_store_kernel<<<sms * 2, 512, 0, stream>>>(static_cast<int4*>(dst), static_cast<const int4*>(src),
                                                       int64_t(bytes / 16));
        DMOE_CHECK_LAUNCH();
      }
      DMOE_CHECK_CUDA(cudaEventRecord(stop, stream));
      DMOE_CHECK_CUDA(cudaEventSynchronize(stop));
      float elapsed = 0;
      DMOE_CHECK_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
      if (i >= 3) ms.push_back(elapsed);
    }
    (way == 0 ? t.copy_engine : t.sm_store) = summarize(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
  return t;
}

}  // namespace dmoe::bench
