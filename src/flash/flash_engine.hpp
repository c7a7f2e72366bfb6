// flash/flash_engine.hpp — FlashEngine: the MoE layer forward of one rank as one persistent kernel
// (flash/flash_kernel.cu) over the Flash protocol (core/flash_protocol.hpp, docs/flash.md).
//
//   FlashEngine engine(config, comm);          // collective when W > 1 (symmetric memory, config check)
//   engine.set_weights(shard);                 // gate [E, H] and this rank's experts
//   engine.forward(x, y, stream);              // bf16 device pointers; one kernel launch, no host sync
//   engine.check(stream);                      // later: waits (bounded) and throws on a flagged error
//   FlashEngine trainer(config, comm, /*train=*/true);   // forwards keep what the backward reads
//   trainer.forward(x, y, stream); trainer.backward(dy, dx, grads, backend, stream);   // the same forward's
//
// W = 1 runs in plain device memory; W > 1 takes its symmetric region from NVSHMEM's heap (an NvshmemComm
// must exist: it initialises NVSHMEM) and needs every peer load/store reachable (one node). Forwards may be
// issued back to back, on one stream or captured in a CUDA graph: each kernel advances its own epoch. All
// ranks must issue the same number of forwards.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "comm/cuda/symmetric.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/flash_protocol.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

class Backend;
struct RouterLosses;

// Where a backward adds this rank's gradients (f32 device memory): the gate's part [E, H] (the caller sums it
// over ranks) and this rank's experts, w1/w3 [Le, I, H] (w3 null unless SwiGLU), w2 [Le, H, I].
struct FlashGradViews {
  void* gate = nullptr;
  void* w1 = nullptr;
  void* w3 = nullptr;
  void* w2 = nullptr;
  bool experts_bf16 = false;  // w1/w3/w2 bf16, written (backward with accumulate = false only); the gate's f32
};

class FlashEngine {
 public:
  // config.world == comm.world(); config.dtype bf16. Throws naming the field when Flash cannot run the
  // config (flash_unusable_reason), and when the ranks disagree on it.
  // train: forwards also keep the router's probabilities and the pre-activations, and the backward's buffers
  // exist (more memory: flash::local_layout), so that backward() can follow each forward.
  FlashEngine(const MoeConfig& config, Comm& comm, bool train = false);
  ~FlashEngine();
  FlashEngine(const FlashEngine&) = delete;
  FlashEngine& operator=(const FlashEngine&) = delete;

  // Gate [E, H] (all experts) and this rank's experts (weights.first_expert == config.first_expert(rank)).
  void set_weights(const MoeWeights& weights);
  // The same weights borrowed from the caller instead of copied: bf16 device memory, 16-byte aligned, gate
  // [E, H], w1 and w3 [Le, I, H] (w3 null unless SwiGLU), w2 [Le, H, I]. The engine never writes or frees them;
  // the caller keeps them alive and unchanged while a forward that reads them runs.
  void set_weight_views(const void* gate, const void* w1, const void* w3, const void* w2);
  // x, y: [T, H] bf16 device memory, 16-byte aligned. One cooperative kernel launch on `stream`.
  void forward(const void* x, void* y, cudaStream_t stream);
  // Test aid (tests/gpu/test_flash.cpp): the kernel's consumers that skip a task's rows run with warps 1-3 late by
  // this much at every slot, so that the skip path must hold its warps together. 0 (the default) in real use.
  void set_skip_lag_for_tests(uint32_t ns) {
    DMOE_REQUIRE(ns <= 1000000u, "FlashEngine::set_skip_lag_for_tests: {} ns; allowed: 0 to 1000000", ns);
    skip_lag_ns_ = ns;
  }
  // Waits for `stream` (bounded, DMOE_COMM_TIMEOUT_S) and throws if a forward flagged an error (a token whose
  // router logits hold a NaN: no expert can be chosen, its row is dropped).
  void check(cudaStream_t stream);
  // The backward of the last forward (train engines only; once per forward, before the next forward; every
  // rank runs it): dy, dx [T, H] bf16 device memory; the gate's gradient and the experts' are added to `grads`
  // (accumulate = false overwrites the experts' instead, zeros for experts without rows). `backend` is a bf16
  // CUDA backend whose stream is `stream`: the arithmetic runs on its kernels (cuda::flash_backward). Reads the
  // forward's row counts on the host (one wait for `stream`).
  void backward(const void* dy, void* dx, const FlashGradViews& grads, bool accumulate, Backend& backend,
                cudaStream_t stream);
  bool trains() const { return shape_.train; }
  // Reads the last forward's count inbox on the host (waits for `stream`) for that forward's backward, which then
  // issues its launches without a wait of its own: for callers that wait for a train forward anyway (its losses).
  void read_counts(cudaStream_t stream);
  // With stage timing on, each backward records device events at its stage boundaries
  // (flash::backward_stage_name); backward_stage_ms reads the last one's, ms per stage (waits for `stream`).
  void set_backward_timing(bool on);
  std::vector<double> backward_stage_ms(cudaStream_t stream);
  // Device pointers of the last train forward's router outputs, [T, E] and [T] f32, and ids [T, k].
  const float* probs() const;
  const float* lse() const;
  const int32_t* ids() const;

  // Routing of the last forward (waits for `stream`).
  std::vector<int32_t> expert_ids(cudaStream_t stream);
  std::vector<float> expert_weights(cudaStream_t stream);
  // Rows this rank received per local expert in the last forward (waits for `stream`).
  std::vector<int64_t> expert_rows(cudaStream_t stream);

  // Where the time goes: with profiling on, each forward records per-block phase times (ProfileSlot);
  // profile() reads the last forward's (waits for `stream`), [grid, kProfileSlots].
  void set_profiling(bool on);
  std::vector<uint64_t> profile(cudaStream_t stream);

  const MoeConfig& config() const { return config_; }
  const flash::Shape& shape() const { return shape_; }
  int32_t grid() const { return shape_.grid; }
  size_t symmetric_bytes() const { return symmetric_.bytes; }
  size_t local_bytes() const { return local_bytes_; }

 private:
  void release_weights();
  flash::Params params(const void* x, void* y) const;  // this rank's buffers and weights around x, y

  MoeConfig config_;
  int32_t rank_ = 0;
  flash::Shape shape_;
  flash::SymmetricLayout sl_;
  flash::LocalLayout ll_;
  SymmetricRegion symmetric_;
  char* local_ = nullptr;
  size_t local_bytes_ = 0;
  void* gate_ = nullptr;
  void* w1_ = nullptr;
  void* w3_ = nullptr;
  void* w2_ = nullptr;
  bool has_weights_ = false;
  bool owns_weights_ = false;  // gate_ .. w2_ were allocated by set_weights (not set_weight_views)
  uint64_t* profile_ = nullptr;  // [grid, kProfileSlots] when profiling
  uint32_t skip_lag_ns_ = 0;     // set_skip_lag_for_tests
  uint64_t forwards_ = 0;
  const void* last_x_ = nullptr;   // the last forward's x (the router backward reads it)
  bool backward_pending_ = false;  // a train forward whose backward has not run
  std::vector<cudaEvent_t> stage_events_;  // kBackwardStages + 1 when timing the backward
  std::vector<uint64_t> host_inbox_;       // read_counts: the inbox of forward host_inbox_forward_
  uint64_t host_inbox_forward_ = 0;
};

// The router's auxiliary losses of `engine`'s last train forward issued on `stream` (EpEngine's formulas: the
// partial sums of this rank's tokens on `backend`, summed over `comm`'s ranks in f64). Waits for the forward and
// also reads its counts for the backward (read_counts). Collective when W > 1.
RouterLosses flash_train_losses(FlashEngine& engine, Backend& backend, Comm& comm, cudaStream_t stream);

// The phases of one profiled forward over the blocks: median and max duration of each (ms), the kernel's span,
// and how busy the processors were (the share of the span between a block's first task and its last).
struct FlashPhase {
  const char* name;
  double median_ms, max_ms;
};
struct FlashProfileSummary {
  std::vector<FlashPhase> phases;
  double span_ms = 0;           // first block start to last block end
  double processors_busy = 0;   // Σ over blocks of (tasks done − first task) / (grid · span)
  double producer_wait_median_ms = 0, producer_wait_max_ms = 0;
  double tasks_per_block_median = 0;
};
FlashProfileSummary summarize_flash_profile(const std::vector<uint64_t>& profile, int32_t grid);

}  // namespace dmoe
