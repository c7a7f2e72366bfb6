// symmetric.cpp — see symmetric.hpp.
#include "comm/cuda/symmetric.hpp"

#include <cuda_runtime.h>

#include <cstdlib>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"

#if defined(DMOE_WITH_NVSHMEM)
#include <nvshmem_host.h>
#endif

namespace dmoe {

SymmetricRegion allocate_symmetric(int32_t rank, int32_t world, size_t bytes, const char* what) {
  SymmetricRegion r;
  r.bytes = bytes;
  if (world == 1) {
    void* p = cuda::device_malloc(bytes, what);
    DMOE_COMM_CHECK_CUDA(cudaMemset(p, 0, bytes));
    DMOE_COMM_CHECK_CUDA(cudaDeviceSynchronize());
    r.local = static_cast<char*>(p);
    r.peers = {r.local};
    return r;
  }
#if defined(DMOE_WITH_NVSHMEM)
  DMOE_REQUIRE(nvshmem_is_initialized(),
               "rank {}: the {} ({} bytes per rank) lives in NVSHMEM's symmetric heap at W = {}, and NVSHMEM is not "
               "initialised: create the NVSHMEM communicator first (--comm nvshmem, or auto on one node)",
               rank, what, bytes, world);
  void* p = nvshmem_malloc(bytes);
  DMOE_REQUIRE(p != nullptr,
               "rank {}: nvshmem_malloc of {} bytes for the {} failed: the symmetric heap ({} bytes) is too small; "
               "raise DMOE_NVSHMEM_MIN_HEAP (or NVSHMEM_SYMMETRIC_SIZE) to at least {} plus what the communicator "
               "uses", rank, bytes, what, nvshmem_heap_bytes(), bytes);
  r.local = static_cast<char*>(p);
  r.from_nvshmem = true;
  r.peers.assign(size_t(world), nullptr);
  for (int32_t pe = 0; pe < world; ++pe) {
    r.peers[pe] = pe == rank ? r.local : static_cast<char*>(nvshmem_ptr(p, pe));
    DMOE_REQUIRE(r.peers[pe] != nullptr,
                 "rank {}: rank {}'s memory is not load/store reachable from here (another node, or GPUs without "
                 "peer access): the {} needs direct stores into every peer; NVSHMEM device puts for that case are "
                 "not built — run the EP engine (--engine ep) there", rank, pe, what);
  }
  DMOE_COMM_CHECK_CUDA(cudaMemset(p, 0, bytes));
  DMOE_COMM_CHECK_CUDA(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // every region is zero before any rank's first write into a peer
  return r;
#else
  DMOE_FAIL("rank {}: the {} at W = {} needs NVSHMEM, and this dmoe was built without it", rank, what, world);
#endif
}

void free_symmetric(SymmetricRegion& r) noexcept {
  if (r.local == nullptr) return;
  if (!r.from_nvshmem) {
    cuda::free_quietly(r.local);
  } else {
#if defined(DMOE_WITH_NVSHMEM)
    // nvshmem_free is collective: not when this rank gave up on its peers (they may never come).
    if (nvshmem_is_initialized() && cuda::synchronize_device_quietly()) {
      nvshmem_free(r.local);  // collective
    }
#endif
  }
  r.local = nullptr;
  r.peers.clear();
}

}  // namespace dmoe
