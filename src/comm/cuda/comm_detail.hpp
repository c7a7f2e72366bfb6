// comm_detail.hpp — internals shared by the GPU communicators and their bootstrap (not a public API):
// NCCL/NVSHMEM status checks and the bounded wait on a stream.
//
// Host C++ only (g++): it uses fmt through core/error.hpp, which nvcc cannot compile (cuda/check.hpp).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "core/error.hpp"

// DMOE_CHECK_NCCL(call): throws dmoe::Error with the call, NCCL's error string and its last message.
#define DMOE_CHECK_NCCL(call)                                                                          \
  do {                                                                                                 \
    const ncclResult_t dmoe_nccl_status_ = (call);                                                     \
    if (dmoe_nccl_status_ != ncclSuccess)                                                              \
      DMOE_FAIL("NCCL call `{}` failed: {} ({})", #call, ncclGetErrorString(dmoe_nccl_status_),        \
                ncclGetLastError(nullptr));                                                            \
  } while (0)

// DMOE_CHECK_NVSHMEM(call): NVSHMEM calls return 0 on success; anything else throws with the status.
#define DMOE_CHECK_NVSHMEM(call)                                                                       \
  do {                                                                                                 \
    const int dmoe_nvshmem_status_ = (call);                                                           \
    if (dmoe_nvshmem_status_ != 0)                                                                     \
      DMOE_FAIL("NVSHMEM call `{}` failed with status {} (set NVSHMEM_DEBUG=INFO for details)", #call, \
                dmoe_nvshmem_status_);                                                                 \
  } while (0)

// Same for CUDA runtime calls, from host C++ files that use fmt (cuda/check.hpp is the nvcc-safe twin).
#define DMOE_COMM_CHECK_CUDA(call)                                                                     \
  do {                                                                                                 \
    const cudaError_t dmoe_comm_cuda_status_ = (call);                                                 \
    if (dmoe_comm_cuda_status_ != cudaSuccess)                                                         \
      DMOE_FAIL("CUDA call `{}` failed: {} ({})", #call, cudaGetErrorString(dmoe_comm_cuda_status_),   \
                cudaGetErrorName(dmoe_comm_cuda_status_));                                             \
  } while (0)

namespace dmoe::comm_detail {

// Seconds a collective may take before a wait gives up: DMOE_COMM_TIMEOUT_S, default 600.
double comm_timeout_seconds();

// Waits until the work queued on `stream` has finished: cuda::wait_stream (bounded polling: a peer that
// died leaves a collective waiting forever), with `nccl` (optional) checked for asynchronous errors
// between polls. `what` names the operation for the messages. Throws on timeout or error.
void wait_stream(cudaStream_t stream, const std::string& what, ncclComm_t nccl = nullptr);

// For a non-blocking NCCL communicator: waits (bounded) until the calls issued so far have been
// enqueued (ncclCommGetAsyncError leaves ncclInProgress). On error or timeout the communicator is
// aborted (it cannot be used afterwards) and dmoe::Error is thrown.
void wait_nccl_ready(ncclComm_t comm, const std::string& what);

}  // namespace dmoe::comm_detail
