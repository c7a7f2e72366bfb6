// gpu_comm.hpp — the GPU communicators, one process per rank: NcclComm and NvshmemComm.
//
//   ProcessEnv env = detect_process_env();
//   auto comm = make_gpu_comm(env, CommKind::automatic, /*max_bytes_per_peer=*/64 << 20, stream);
//
// Which one (CommKind::automatic), decided by every rank alike without talking to the others:
//   - NVSHMEM when GPUs are shared (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"; NVSHMEM
//     supports it under MPS);
//   - NVSHMEM when all ranks run on one node (local_world == world) and every pair of the GPUs this rank
//     sees can reach each other peer-to-peer: measured faster than NCCL on every named config at W = 2 on
//     NVLink (docs/perf.md, fifth session: forward 1.03-1.65x, training step 1.03-1.32x);
//   - NCCL otherwise: ranks on several nodes (NCCL's network transports are the robust choice there), or a
//     rank that sees a single GPU of a multi-rank node (per-rank CUDA_VISIBLE_DEVICES: connectivity cannot
//     be checked, so the communicator that handles every topology).
// Whether GPUs are shared:
//   - DMOE_SHARED_GPUS=0|1 when set: dmoe launch sets it (1 when any GPU hosts two or more of its ranks);
//     users may set it themselves under mpirun/srun;
//   - otherwise shared exactly when local_world > the number of visible GPUs (then two ranks of this node
//     must meet on one GPU). NOTE: with per-rank CUDA_VISIBLE_DEVICES (each rank sees 1 GPU) this says
//     "shared" although it is not: set DMOE_SHARED_GPUS=0 for such runs.
//
// Both communicators take device-memory buffers (plain cudaMalloc is fine) and issue everything on the
// stream passed to each call; a call returns once the work is queued (barrier() waits for it). Creating
// and destroying a communicator is collective. Both must be created after select_device (make_gpu_comm
// does it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string_view>

#include "comm/comm.hpp"
#include "comm/process_env.hpp"

namespace dmoe {

enum class CommKind { automatic, nccl, nvshmem };

// "auto" | "automatic" | "nccl" | "nvshmem"; throws dmoe::Error naming the allowed values otherwise.
CommKind parse_comm_kind(std::string_view text);
const char* comm_kind_name(CommKind kind);

// Whether two or more ranks of this job run on one GPU (rules above). `why` (optional) receives the
// reason in words, for messages.
bool gpus_are_shared(const ProcessEnv& env, int32_t visible_devices, std::string* why = nullptr);

// What CommKind::automatic resolves to (rules above); an explicit kind is returned as it is. `one_node`:
// local_world == world; `peers_connected`: this rank sees two or more GPUs and every pair can access
// the other's memory peer-to-peer.
CommKind resolve_comm_kind(CommKind requested, bool gpus_shared, bool one_node, bool peers_connected);

// Selects this rank's GPU (select_device), decides the kind (automatic: see above) and creates the
// communicator. `max_bytes_per_peer` bounds one alltoallv segment (bytes this rank sends to one peer, or
// receives from one): NvshmemComm reserves symmetric memory for it, NcclComm ignores it. `stream` is used
// for set-up work. Explicit nccl on shared GPUs is an error explaining why.
std::unique_ptr<Comm> make_gpu_comm(const ProcessEnv& env, CommKind kind, size_t max_bytes_per_peer,
                                    cudaStream_t stream);

// The two implementations, for callers that choose themselves (the current device must be set).
std::unique_ptr<Comm> make_nccl_comm(const ProcessEnv& env);
std::unique_ptr<Comm> make_nvshmem_comm(const ProcessEnv& env, size_t max_bytes_per_peer, cudaStream_t stream);

// Symmetric heap an NvshmemComm of `world` ranks and `max_bytes_per_peer` asks NVSHMEM for (its buffers
// plus NVSHMEM's own reserve).
size_t nvshmem_comm_heap_bytes(int32_t world, size_t max_bytes_per_peer);

}  // namespace dmoe
