// backend.hpp — what an engine needs from a device: memory, copies, and the MoE stages as kernels.
//
// The vanilla EP engine (engine/ep_engine.hpp) is written once against this interface; CpuBackend runs
// the stages with the CPU kernels (src/cpu/), CudaBackend with the CUDA twins (src/cuda/). Every
// pointer argument of a stage points into this backend's memory. Activation and weight buffers hold
// storage_dtype() elements (the CPU backend stores f32 and, for a bf16 config, rounds to bf16 values;
// the CUDA backend stores bf16). Routing, gradients of gate weights and logits are always f32; indices
// int32; weight-gradient accumulators f32 on the device (fp64 on the CPU, see grad_accum_dtype()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "core/config.hpp"
#include "core/dispatch_plan.hpp"
#include "cpu/kernels.hpp"

namespace dmoe {

// Device-side view of one rank's send plan (built by Backend::plan_send).
struct SendPlanBuffers {
  int32_t* slot = nullptr;        // [T*k] send-buffer row of assignment (t, j); -1 dropped
  int32_t* row_token = nullptr;   // [T*k] (first S used) token of each send row
  int32_t* row_choice = nullptr;  // [T*k] (first S used) choice j of each send row
};

// A copy from backend memory to the host that the host collects later: start() queues it behind the work
// issued so far, wait() blocks (bounded, naming `what`) until that copy is done — not until the stream is idle,
// so the work queued after it keeps the device busy — and returns the bytes, valid until the next start().
// The CPU backend copies in start().
class HostReadback {
 public:
  virtual ~HostReadback() = default;
  virtual void start(const void* src, size_t bytes) = 0;
  virtual const void* wait(const char* what) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual bool on_device() const = 0;
  virtual DType storage_dtype() const = 0;
  virtual DType grad_accum_dtype() const = 0;  // element type of weight-gradient accumulators
  virtual Stream stream() = 0;
  // Whether stream() is capturing a CUDA graph now (never on the CPU): a forward captured there may queue only
  // stream work — no host waits, no allocations, no events a later host wait would need (EpEngine::forward_route).
  virtual bool stream_capturing() { return false; }

  // ---- memory (bytes) ----
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) noexcept = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;        // within backend memory
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;     // host -> backend
  virtual void download(void* host, const void* src, size_t bytes) = 0;   // backend -> host (syncs)
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // upload/download issued on `stream` instead of stream(): for engine phases that run on another stream
  // than the backend's (EpEngine's exchange phases, Flow's all-to-all stream). download_on waits for `stream`
  // only. The CPU backend has one order and ignores the stream.
  virtual void upload_on(void* dst, const void* host, size_t bytes, Stream stream) { upload(dst, host, bytes); }
  virtual void download_on(void* host, const void* src, size_t bytes, Stream stream) { download(host, src, bytes); }

  // Host f32 <-> storage dtype buffers (upload converts to storage_dtype, download converts back).
  virtual void upload_f32(void* dst, const float* host, int64_t count) = 0;
  virtual void download_f32(float* host, const void* src, int64_t count) = 0;

  // ---- stages (see src/cpu/kernels.hpp for the exact semantics of each) ----
  // logits, probs [T, E] f32; ids [T, k] i32; weights [T, k] f32; lse [T] f32.
  virtual void router_forward(const void* x, const void* wg, float* logits, float* probs, int32_t* ids,
                              float* weights, float* lse, int64_t tokens, int64_t hidden,
                              int32_t experts, int32_t top_k, bool renormalize) = 0;
  // Per-expert routed/kept counts (host, [E] each) and the device plan; same result as build_send_plan.
  virtual void plan_send(const int32_t* ids, const float* weights, int64_t tokens, int32_t top_k,
                         int32_t experts, int64_t capacity, DropPolicy policy,
                         const SendPlanBuffers& plan, int64_t* routed_host, int64_t* counts_host) = 0;
  // Auxiliary-loss partial sums (host doubles: prob_sum [E], assigned [E], z_sum [1]).
  virtual void router_aux_partials(const float* probs, const float* lse, const int32_t* ids,
                                   int64_t tokens, int32_t experts, int32_t top_k, double* prob_sum,
                                   double* assigned, double* z_sum) = 0;
  virtual void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n, int64_t hidden) = 0;
  // Segment tables are host arrays (segments entries each).
  virtual void permute_segments(const void* src, void* dst, const int64_t* src_offsets,
                                const int64_t* dst_offsets, const int64_t* counts, int64_t segments,
                                int64_t hidden) = 0;
  virtual void combine(const void* rows, const int32_t* slot, const float* weights, void* y,
                       int64_t tokens, int32_t top_k, int64_t hidden) = 0;
  // Grouped expert FFN over the local experts: rows of expert e are [expert_offsets[e],
  // expert_offsets[e+1]) of x (host array, Le+1 entries). w1, w3 [Le, I, H]; w2 [Le, H, I];
  // pre1, pre3, h [N, I]; out [N, H]. w3 and pre3 are null unless SwiGLU. pre1 and pre3 null: inference
  // (the pre-activations are not kept; the backend uses scratch where it needs them).
  virtual void expert_ffn_forward(const void* x, const void* w1, const void* w3, const void* w2,
                                  void* pre1, void* pre3, void* h, void* out,
                                  const int64_t* expert_offsets, int32_t local_experts, int64_t hidden,
                                  int64_t ffn, Activation activation) = 0;

  // ---- the routing without a host wait (core/routing_block.hpp; EpEngine's deferred routing reads) ----
  // plan_send's plan with its counts left in backend memory: counts is a PlanCountsBlock of `experts` (routed,
  // kept, the send buffer's expert offsets, the bad word). DropPolicy::latest_tokens (or dropless).
  virtual void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts,
                                   int64_t capacity, const SendPlanBuffers& plan, int64_t* counts) = 0;
  // router_aux_partials' sums left in backend memory: stats is an AuxPartialsBlock of `experts`.
  virtual void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids,
                                             int64_t tokens, int32_t experts, int32_t top_k, void* stats) = 0;
  // expert_ffn_forward with expert_offsets in backend memory ([Le + 1], offsets[0] = 0, offsets[Le] = rows):
  // only where expert_ffn_forward_takes_device_offsets says so for the same arguments.
  virtual bool expert_ffn_forward_takes_device_offsets(const void* x, const void* w1, const void* w3,
                                                       const void* w2, const void* pre1, const void* pre3,
                                                       const void* h, const void* out, int64_t rows,
                                                       int32_t local_experts, int64_t hidden, int64_t ffn,
                                                       Activation activation) = 0;
  virtual void expert_ffn_forward_device_offsets(const void* x, const void* w1, const void* w3, const void* w2,
                                                 void* pre1, void* pre3, void* h, void* out,
                                                 const int64_t* expert_offsets, int64_t rows, int32_t local_experts,
                                                 int64_t hidden, int64_t ffn, Activation activation) = 0;
  virtual std::unique_ptr<HostReadback> make_readback() = 0;

  // ---- backward stages ----
  virtual void combine_backward(const void* dy, const void* rows, const int32_t* slot,
                                const float* weights, void* drows, float* dweights, int64_t tokens,
                                int32_t top_k, int64_t hidden) = 0;
  // dx [N, H] overwritten; dw1, dw3 [Le, I, H], dw2 [Le, H, I] (grad_accum_dtype()) accumulate, or with
  // accumulate = false are overwritten for every local expert (zeros for experts without rows): the first
  // backward after zero_grads then writes the gradients instead of reading zeros back (EpEngine).
  // dw_dtype: grad_accum_dtype(), or the storage dtype bf16 on a device backend with accumulate = false (the
  // f32 products rounded once as they are stored: half the bytes of f32 gradients, and no separate cast, for
  // callers whose parameters are bf16, e.g. the PyTorch module).
  virtual void expert_ffn_backward(const void* x, const void* w1, const void* w3, const void* w2,
                                   const void* pre1, const void* pre3, const void* h, const void* dout,
                                   void* dx, void* dw1, void* dw3, void* dw2,
                                   const int64_t* expert_offsets, int32_t local_experts,
                                   int64_t hidden, int64_t ffn, Activation activation, bool accumulate,
                                   DType dw_dtype) = 0;
  // Router backward: dlogits [T, E] f32 (overwritten) from dweights [T, k] and the auxiliary terms
  // (aux.expert_fraction: host [E] or null; aux.lse: backend [T] or null); dx_router [T, H] f32
  // (overwritten) = dlogits · wg; dwg [E, H] (grad_accum_dtype) += dlogits^T · x.
  virtual void router_backward(const void* x, const void* wg, const float* probs, const int32_t* ids,
                               const float* weights, const float* dweights, const cpu::RouterAuxGrad& aux,
                               float* dlogits, float* dx_router, void* dwg, int64_t tokens, int64_t hidden,
                               int32_t experts, int32_t top_k, bool renormalize) = 0;
  // dx [T, H] (storage) = Σ_j dsend[slot[t, j]] over j in order (dsend in storage dtype), then
  // + dx_router [T, H] f32 when non-null.
  virtual void scatter_back(const void* dsend, const int32_t* slot, const void* dx_router, void* dx,
                            int64_t tokens, int32_t top_k, int64_t hidden) = 0;
};

// The CPU backend (always available). `storage` f32 or bf16 (bf16 emulated by rounding).
std::unique_ptr<Backend> make_cpu_backend(DType storage);

}  // namespace dmoe
