// cuda/kernels.cuh — host launchers of the CUDA kernels: the twins of src/cpu/kernels.hpp.
//
// Each launcher has the name and the arguments of its CPU twin, with device pointers, plus the stream
// (or a CudaContext, for stages that call cuBLAS or need scratch memory) last. Differences, all forced
// by the device:
//   - T is the storage type (float or __nv_bfloat16); it replaces the CPU's `DType storage` argument,
//     since the buffers themselves hold bf16 here. Routing tensors, gate weights, logits and their
//     gradients stay f32; indices int32.
//   - Weight-gradient accumulators are f32 (the CPU's are fp64).
//   - expert_ffn_forward/backward run all local experts at once (grouped GEMM), with the expert row
//     offsets as a host array, like Backend::expert_ffn_*; the CPU twin runs one expert.
//   - Sums accumulate in f32 (the CPU's fp64), in a fixed order: results are deterministic run to run.
//   - Host-side tables (segment offsets, expert offsets, expert_fraction) stay host arrays, as on the CPU;
//     the launcher passes them in kernel parameters (segment tables) or uploads what the device needs
//     into the context's workspace (gate-gradient table, grouped-GEMM pointer arrays).
// Every launcher checks its launch; none synchronises unless it returns results in host memory
// (plan_send, router_aux_partials), which it says; their *_on_device variants leave the same results in a
// device block (core/routing_block.hpp) and do not wait.
//
// This header is plain host C++ (no device code): the backend (.cpp) and the tests include it.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cuda {

using bf16 = __nv_bfloat16;

// Grow-only device scratch memory for the stages issued on one stream.
// NOTE: a stage lays out its sub-buffers from offset 0 after reserve(); stages on the same stream run in
// order, so one stage's scratch never overlaps the next one's use. Growing synchronises the stream first,
// because queued work may still read the old block.
class Workspace {
 public:
  Workspace() = default;
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  // At least `bytes` of device memory (256-byte aligned), valid until the next reserve() that grows it.
  void* reserve(size_t bytes, cudaStream_t stream);
  size_t capacity() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Grow-only pinned host memory for small device-to-host reads (counts, statistics). A copy into pageable
// memory blocks inside cudaMemcpyAsync until the GPU is done, with no time limit; into pinned memory it
// returns at once and the read waits in wait_stream (check.hpp), which has one.
// NOTE: the contents are valid after the wait that follows the copy, until the next copy into it.
class HostStaging {
 public:
  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  // At least `bytes` of pinned host memory; growing waits for `stream` first (a copy may target the old block).
  void* reserve(size_t bytes, cudaStream_t stream);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Copies `bytes` from device memory to `host` on `stream` and waits for it (time-limited); through
// `staging` when given (in chunks of up to 8 MiB), else straight into `host` (then a pageable `host`
// blocks inside the copy, without a limit).
void download_bounded(void* host, const void* device, size_t bytes, cudaStream_t stream, HostStaging* staging,
                      const char* what);

// Byte offsets of sub-buffers carved from one workspace block, each 256-byte aligned.
class ScratchLayout {
 public:
  size_t add(size_t bytes) {
    const size_t offset = total_;
    total_ += (bytes + 255) / 256 * 256;
    return offset;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

// What a stage needs beyond a stream: cuBLAS, scratch memory and pinned staging for reads.
struct CudaContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;  // bound to `stream`, CUBLAS_DEFAULT_MATH (no TF32)
  Workspace* workspace = nullptr;
  HostStaging* host_staging = nullptr;  // optional: bounded waits for the stages' small reads
};

// ---- conversions ---------------------------------------------------------------------------------

// out[i] = T(in[i]) (round to nearest even for bf16) and back; count elements.
template <typename T>
void convert_from_f32(const float* in, T* out, int64_t count, cudaStream_t stream);
template <typename T>
void convert_to_f32(const T* in, float* out, int64_t count, cudaStream_t stream);

// ---- router --------------------------------------------------------------------------------------

// logits [T, E] f32 = x [T, H] · wg [E, H]^T (cuBLAS, fp32 accumulation).
template <typename T>
void router_logits(const T* x, const T* wg, float* logits, int64_t tokens, int64_t hidden, int32_t experts,
                   const CudaContext& ctx);

// One thread per token: softmax_row<float>, topk_row, gate_weights_row<float> from core/routing.hpp.
void router_topk(const float* logits, float* probs, int32_t* ids, float* weights, float* lse, int64_t tokens,
                 int32_t experts, int32_t top_k, bool renormalize, cudaStream_t stream);

// Outputs are HOST arrays (prob_sum [E], assigned [E], z_sum [1]); synchronises the stream.
void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                         int32_t experts, int32_t top_k, double* prob_sum, double* assigned, double* z_sum,
                         const CudaContext& ctx);

// The same sums left in device memory, without a host wait: stats is a device block of
// AuxPartialsBlock::bytes(E) (core/routing_block.hpp), its bad word set where an expert id is outside [0, E).
void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                   int32_t experts, int32_t top_k, void* stats, const CudaContext& ctx);

// aux.expert_fraction is a host array [E] (or null), aux.lse a device array [T] (or null).
void router_topk_backward(const float* probs, const int32_t* ids, const float* weights, const float* dweights,
                          float* dlogits, int64_t tokens, int32_t experts, int32_t top_k, bool renormalize,
                          const cpu::RouterAuxGrad& aux, const CudaContext& ctx);

// dx [T, H] f32 += dlogits [T, E] · wg [E, H];  dwg [E, H] f32 += dlogits^T · x.
template <typename T>
void router_logits_backward(const T* x, const T* wg, const float* dlogits, float* dx, float* dwg,
                            int64_t tokens, int64_t hidden, int32_t experts, const CudaContext& ctx);

// ---- dispatch plan -------------------------------------------------------------------------------

// The send plan of core build_send_plan with DropPolicy::latest_tokens (capacity < 0: dropless), built
// on the device: slot [T*k], row_token and row_choice (first S entries). routed_host and counts_host
// are HOST arrays [E] (assignments per expert before and after capacity); synchronises the stream.
// Throws dmoe::Error naming the first assignment whose expert id is outside [0, E).
void plan_send(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
               int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* routed_host,
               int64_t* counts_host, const CudaContext& ctx);

// The same plan without a host wait: the counts go to `counts`, a device block of PlanCountsBlock::bytes(E)
// (core/routing_block.hpp: routed, kept, the send buffer's expert offsets, the first bad assignment).
void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                         int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* counts,
                         const CudaContext& ctx);

// ---- data movement -------------------------------------------------------------------------------

template <typename T>
void gather_rows(const T* x, const int32_t* rows, T* out, int64_t n, int64_t hidden, cudaStream_t stream);

// Segment tables are host arrays (segments entries each).
template <typename T>
void permute_segments(const T* src, T* dst, const int64_t* src_offsets, const int64_t* dst_offsets,
                      const int64_t* counts, int64_t segments, int64_t hidden, cudaStream_t stream);

// weights and addend (f32 [T, H]) may be null.
template <typename T>
void combine(const T* rows, const int32_t* slot, const float* weights, const float* addend, T* y,
             int64_t tokens, int32_t top_k, int64_t hidden, cudaStream_t stream);

// weights may be null (weight 1).
template <typename T>
void combine_backward(const T* dy, const T* rows, const int32_t* slot, const float* weights, T* drows,
                      float* dweights, int64_t tokens, int32_t top_k, int64_t hidden, cudaStream_t stream);

// ---- grouped NN product --------------------------------------------------------------------------

// C[r, :] = A[r, :]·B_g (+ A2[r, :]·B2_g) over each group's rows (cpu/kernels.hpp), bf16, on dmoe's own
// Hopper kernel (sm90_grouped_gemm_nn in common.hpp), scratch from the context's workspace; fails with a
// message where the kernel cannot run (sm90_grouped_gemm_nn_usable). row_offsets is a host array.
void grouped_gemm_nn(const bf16* a, const bf16* b, const bf16* a2, const bf16* b2, bf16* c,
                     const int64_t* row_offsets, int32_t groups, int64_t n, int64_t k, const CudaContext& ctx);

// ---- expert FFN ----------------------------------------------------------------------------------

// All local experts: rows of expert e are [expert_offsets[e], expert_offsets[e+1]) (host array, Le+1
// entries). x [N, H]; w1, w3 [Le, I, H]; w2 [Le, H, I]; pre1, pre3, h [N, I]; out [N, H]
// (N = expert_offsets[Le]). w3 and pre3 are null unless SwiGLU. pre1 (and pre3) null: inference, the
// pre-activations are not kept (the backward pass needs them).
template <typename T>
void expert_ffn_forward(const T* x, const T* w1, const T* w3, const T* w2, T* pre1, T* pre3, T* h, T* out,
                        const int64_t* expert_offsets, int32_t local_experts, int64_t hidden, int64_t ffn,
                        Activation activation, const CudaContext& ctx);

// expert_ffn_forward (bf16) with expert_offsets in DEVICE memory ([Le + 1], offsets[0] = 0, offsets[Le] = rows):
// nothing is read on the host, so a forward whose counts stay on the device needs no host wait. Runs on dmoe's
// own Hopper grouped GEMM only; expert_ffn_forward_takes_device_offsets says where it can (and where the policy
// in gemm.cpp prefers it to reading the counts for cuBLAS).
bool expert_ffn_forward_takes_device_offsets(const void* x, const void* w1, const void* w3, const void* w2,
                                             const void* pre1, const void* pre3, const void* h, const void* out,
                                             int64_t rows, int32_t local_experts, int64_t hidden, int64_t ffn,
                                             Activation activation);
void expert_ffn_forward_device_offsets(const bf16* x, const bf16* w1, const bf16* w3, const bf16* w2, bf16* pre1,
                                       bf16* pre3, bf16* h, bf16* out, const int64_t* expert_offsets, int64_t rows,
                                       int32_t local_experts, int64_t hidden, int64_t ffn, Activation activation,
                                       const CudaContext& ctx);

// dx [N, H] overwritten; dw1, dw3 [Le, I, H], dw2 [Le, H, I] f32 accumulate (+=), or with accumulate =
// false are overwritten for every local expert (zeros where an expert has no rows). dw_bf16 (T = bf16,
// accumulate = false only): the gradients are bf16, each f32 product rounded once as cuBLAS stores it (the own
// weight-gradient kernels store f32 only, so DMOE_WGRAD does not apply).
template <typename T>
void expert_ffn_backward(const T* x, const T* w1, const T* w3, const T* w2, const T* pre1, const T* pre3,
                         const T* h, const T* dout, T* dx, void* dw1, void* dw3, void* dw2, bool dw_bf16,
                         const int64_t* expert_offsets, int32_t local_experts, int64_t hidden, int64_t ffn,
                         Activation activation, bool accumulate, const CudaContext& ctx);

}  // namespace dmoe::cuda
