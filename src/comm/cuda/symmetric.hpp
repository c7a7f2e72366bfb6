// symmetric.hpp — device memory that peers write into directly: one region per rank, the same size on
// every rank, with every rank's region mapped into this process (Flash's receive buffers and signals).
//
// W = 1: plain cudaMalloc. W > 1: NVSHMEM's symmetric heap (nvshmem_malloc, collective), so NVSHMEM must
// be initialised (an NvshmemComm exists) and its heap large enough (DMOE_NVSHMEM_MIN_HEAP or
// NVSHMEM_SYMMETRIC_SIZE, named in the error); every peer must be load/store reachable (nvshmem_ptr: one
// node, peer-to-peer or the same GPU under MPS). The region is zeroed on every rank before this returns
// (a collective barrier follows the zeroing), so no peer's first write can meet stale bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dmoe {

struct SymmetricRegion {
  char* local = nullptr;        // this rank's region
  std::vector<char*> peers;     // [W] every rank's region as this process addresses it (own included)
  size_t bytes = 0;
  bool from_nvshmem = false;
};

// Collective over the W ranks when world > 1; `what` names the region in errors.
SymmetricRegion allocate_symmetric(int32_t rank, int32_t world, size_t bytes, const char* what);
// Collective when the region came from NVSHMEM. Never throws.
void free_symmetric(SymmetricRegion& region) noexcept;

}  // namespace dmoe
