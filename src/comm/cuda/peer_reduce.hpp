// comm/cuda/peer_reduce.hpp — the all-reduce step of NvshmemComm between PEs whose memory this process can load and
// store (one node: the same GPU under MPS, or GPUs with peer access): a kernel that sums a slice of every PE's
// buffer, read in place through nvshmem_ptr addresses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dmoe {

constexpr int kPeerReduceMaxPes = 64;

struct PeerPointers {
  const void* pe[kPeerReduceMaxPes];  // [world] the same buffer on every PE, in this process's address space
};

// dst[i] = Σ_{p = 0 .. world-1} peers.pe[p][i] for i in [begin, end), summed in PE order (so every PE computing a
// slice gets the same bits, and the result does not depend on which PE computes it). f32, f64, i32, i64.
void peer_reduce_slice(const PeerPointers& peers, int32_t world, void* dst, int64_t begin, int64_t end, DType dtype,
                       cudaStream_t stream);

}  // namespace dmoe
