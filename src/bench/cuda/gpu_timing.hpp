// gpu_timing.hpp — the one GPU timing helper every benchmark uses, and the two ceilings results are
// compared with (measured in the same run, on the same GPU).
//
// Timing: `warmup` untimed calls; then repeated calls, each preceded by an L2 flush (a memset of twice
// the L2 size, outside the timed region) and bracketed by CUDA events on the stream; repeat until at
// least `min_iterations` calls and `min_total_ms` of timed work (capped at `max_iterations`). Work that
// synchronises with the host inside the region (the EP engine reads counts) is timed as the device
// timeline sees it: idle gaps count, as they do for the user.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

#include "bench/stats.hpp"

namespace dmoe::bench {

struct TimingOptions {
  int warmup = 5;
  int min_iterations = 20;
  int max_iterations = 2000;
  double min_total_ms = 300;
  bool flush_l2 = true;
  // Ranks timing collective work must run the same number of iterations, or one waits forever in a
  // collective the others never enter. When set, it is called once after the warm-up with this rank's
  // wanted count and returns the count every rank uses (e.g. rank 0's, broadcast).
  std::function<int(int)> agree_iterations;
};

class GpuTimer {
 public:
  explicit GpuTimer(cudaStream_t stream);
  ~GpuTimer();
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  Stats time(const std::function<void()>& fn, const TimingOptions& options = {});
  // Several pieces of work timed in rounds, one call of each per round, so that a drift of the GPU's
  // clocks over the run (it heats up under sustained tensor-core load) is shared by all of them instead
  // of favouring whichever runs first. The rounds count covers min_total_ms for all of them together.
  std::vector<Stats> time_interleaved(const std::vector<std::function<void()>>& fns, const TimingOptions& options = {});

 private:
  float time_once(const std::function<void()>& fn, bool flush, int salt);
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  void* flush_ = nullptr;
  size_t flush_bytes_ = 0;
};

struct Ceilings {
  double gemm_flop_per_s = 0;  // bf16 8192×8192×8192 cuBLAS GEMM, fp32 accumulation, random data
  double copy_byte_per_s = 0;  // device-to-device copy of 2 GiB, bytes read + bytes written
  Stats gemm, copy;
};

Ceilings measure_ceilings(cudaStream_t stream);

// One rank's side of the link ceiling the all-to-all is compared with: `bytes` pushed from this GPU (the
// current device) into memory on `peer_device` (allocated here; NVLink or PCIe peer access), once by the
// copy engine (cudaMemcpyPeerAsync) and once by an SM kernel storing into the peer's memory. Every rank
// runs it at the same time, each to another GPU, so links carry traffic both ways as in an exchange;
// `start_together` enqueues on `stream` a wait for all ranks (a one-element all-reduce) before each timed
// push, and is called the same number of times on every rank. CUDA events on `stream`; 3 warm-ups.
struct PeerPushTimes {
  Stats copy_engine, sm_store;
};

PeerPushTimes time_peer_push(int peer_device, size_t bytes, cudaStream_t stream,
                             const std::function<void()>& start_together, int iterations = 20);

// The GEMM ceiling's product (bf16 8192×8192×8192 through cuBLAS, fp32 accumulation) as a piece of work,
// to be timed in the same rounds as other work (GpuTimer::time_interleaved): a ceiling at the clocks the
// work itself runs at, where measure_ceilings runs first, on a GPU that has not yet warmed up.
class CeilingGemm {
 public:
  explicit CeilingGemm(cudaStream_t stream);
  ~CeilingGemm();
  CeilingGemm(const CeilingGemm&) = delete;
  CeilingGemm& operator=(const CeilingGemm&) = delete;
  void run();
  static double flop() { return 2.0 * kN * double(kN) * kN; }

 private:
  static constexpr int kN = 8192;
  cudaStream_t stream_;
  void *a_ = nullptr, *b_ = nullptr, *d_ = nullptr;
  void* handle_ = nullptr;  // cublasHandle_t
};

// Fills a device buffer with uniform values in [-scale, scale) from a counter-based hash of (seed, i):
// the same on every GPU and run; never zeros (zeros run faster than real data on tensor cores).
void fill_uniform_f32(float* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
void fill_uniform_bf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace dmoe::bench
