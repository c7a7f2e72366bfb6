// cuda/cuda_backend.hpp — the CUDA backend: dmoe::Backend on one GPU, running the kernels of src/cuda/.
//
// Owns a non-blocking stream (or runs on a caller's, see set_cuda_backend_stream), a cuBLAS handle bound to it
// (CUBLAS_DEFAULT_MATH: no TF32) and a grow-only scratch block. Memory comes from cudaMalloc (never managed
// memory). Every stage is issued on the stream and returns without waiting, except the ones that hand results to
// the host (download, plan_send, router_aux_partials), which synchronise the stream; their *_on_device variants
// and a readback's start() do not, and HostReadback::wait waits for its copy's event only. Buffers of activations and
// weights hold bf16 (__nv_bfloat16) for a bf16 backend and f32 otherwise; weight-gradient accumulators are f32.
//
// Only compiled when CUDA is found (DMOE_WITH_CUDA).
#pragma once

#include <memory>

#include "engine/backend.hpp"

namespace dmoe {

// `storage` f32 or bf16; `device` the CUDA device index (made current for the calling thread).
std::unique_ptr<Backend> make_cuda_backend(DType storage, int device = 0);

// Issues the backend's work (its kernels, copies, cuBLAS calls, and the communicator calls an engine makes on
// Backend::stream()) on `stream`, a cudaStream_t of the caller, from now on — e.g. PyTorch's current stream,
// which may be the legacy default stream (null). The backend never destroys it. Work already queued on the
// previous stream is ordered before the new stream's (an event), so buffers can pass from one to the other.
// `backend` must come from make_cuda_backend (throws otherwise).
void set_cuda_backend_stream(Backend& backend, Stream stream);
// Back to the backend's own stream (same ordering).
void use_own_cuda_backend_stream(Backend& backend);

}  // namespace dmoe
