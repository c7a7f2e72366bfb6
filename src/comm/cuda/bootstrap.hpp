// bootstrap.hpp — bring up NVSHMEM and NCCL for the ranks described by a ProcessEnv.
//
// How the ranks find each other depends on who started them:
//   dmoe launch   NVSHMEM's unique-id bootstrap: rank 0 writes the id into $DMOE_RENDEZVOUS (a
//                 directory every rank of the launch shares), the others read it from there.
//   mpirun        NVSHMEM's own MPI bootstrap (NVSHMEM_BOOTSTRAP=MPI unless set; the plugin initialises
//                 and finalises MPI itself).
//   srun, pmi     NVSHMEM's PMI bootstrap (NVSHMEM_BOOTSTRAP=PMI unless set).
//   single        the unique-id bootstrap inside the one process.
// NCCL's unique id goes through the $DMOE_RENDEZVOUS directory under dmoe launch and through an NVSHMEM
// broadcast elsewhere (NVSHMEM is then initialised first, with a small heap, if it is not yet). Where the
// process registered a bootstrap exchange (comm/bootstrap_exchange.hpp: the Python module's torch.distributed
// group), both ids take it instead of the directory.
//
// NVSHMEM is initialised with nvshmemx_hostlib_init_attr: dmoe uses NVSHMEM's host API only (puts and
// collectives on streams), which lives in libnvshmem_host.so; nvshmem_init()/nvshmemx_init_attr() are
// inline wrappers that also need the device library (libnvshmem_device.a, a device-link step).
//
// NOTE: initialisation and finalisation are collective: every rank calls them, in the same order.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/process_env.hpp"

namespace dmoe {

// Makes choose_device(env, visible GPU count) the current CUDA device of the calling thread and returns
// it. Throws when no GPU is visible.
int32_t select_device(const ProcessEnv& env);

// Initialises NVSHMEM once per process for env.world PEs with a symmetric heap of at least
// `symmetric_heap_bytes` (sets NVSHMEM_SYMMETRIC_SIZE unless the user did; the user's value wins).
// Later calls only check that the heap is big enough: NVSHMEM cannot grow it once initialised. Also
// sets NVSHMEM_DISABLE_NVLS=1 unless set. Checks nvshmem_my_pe()/nvshmem_n_pes() against env.
// Call select_device first. Throws dmoe::Error when DMOE was built without NVSHMEM.
void init_nvshmem(const ProcessEnv& env, size_t symmetric_heap_bytes);

bool nvshmem_is_initialized();

// The symmetric heap size NVSHMEM was initialised with (0 when not initialised or not known).
size_t nvshmem_heap_bytes();

// Finalises NVSHMEM (collective) if it was initialised; no-op otherwise. Free every symmetric buffer
// (destroy every NvshmemComm) first.
void finalize_nvshmem();

// Creates an NCCL communicator of env.world ranks on the current device. Every rank must have a GPU of
// its own (NCCL refuses two ranks on one GPU; the caller decides, see gpu_comm.hpp).
ncclComm_t init_nccl(const ProcessEnv& env);

// Parses a byte size as NVSHMEM reads NVSHMEM_SYMMETRIC_SIZE: an integer with an optional K/M/G/T
// suffix (powers of 1024, any case, optionally followed by B, i or iB; core/env.hpp's parse_byte_count). Returns 0
// when the text does not parse (or passes 2^64).
size_t parse_byte_size(const std::string& text);

}  // namespace dmoe
