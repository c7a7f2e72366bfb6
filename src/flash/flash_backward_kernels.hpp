// flash/flash_backward_kernels.hpp — the Flash backward's own kernels (flash_backward.cu), launched by
// cuda::flash_backward (flash_backward.cpp). Host C++ (cuda_bf16.h for the row type).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/flash_protocol.hpp"

namespace dmoe::cuda {

struct BackwardArgs {
  int32_t rank, world;
  int64_t hidden;                     // H (elements of one row)
  const char* symmetric;              // this rank's symmetric region
  const char* local;                  // this rank's local region (peers table, Control with the forward's epoch)
  flash::SymmetricLayout sl;
  flash::LocalLayout ll;
  unsigned long long timeout_ns;      // every wait's limit
  void* wait_record;                  // DeviceWaitRecord (host-mapped)
};

// signal(epoch, 1) into word `rank` of every rank's signal array at symmetric offset `offset`, after a system
// fence (it announces the stores of the launches before it on the stream).
void flash_signal_peers(const BackwardArgs& a, size_t offset, cudaStream_t stream);
// Waits, bounded, until every word of this rank's signal array at `offset` carries the forward's epoch; past the
// limit the record names `what` (flash::WaitWhat) and the source, and the kernel traps.
void flash_wait_signals(const BackwardArgs& a, size_t offset, int32_t what, cudaStream_t stream);
// Rows of the home's tokens as the backward addresses them: ids / slot / dest_row [T, k] (the forward's routing:
// slot −1 for a dropped choice; the row each kept one took in its expert's rank's recv).
struct CombineBackwardArgs {
  const __nv_bfloat16* dy;      // [T, H]
  const __nv_bfloat16* out;     // [T·k, H] the forward's expert outputs (symmetric `out`)
  const float* weights;         // [T, k]
  const int32_t* ids;
  const int32_t* slot;
  const int32_t* dest_row;
  float* dweights;              // [T, k]
  int64_t tokens;
  int32_t top_k, local_experts;
};
// dweights[t,j] = <dy[t], out[t·k+j]>; owner(ids[t,j]).grad_recv[dest_row[t,j]] = weights[t,j]·dy[t] (bf16), kept
// choices only; the backend's combine_backward's arithmetic.
void flash_combine_backward(const BackwardArgs& a, const CombineBackwardArgs& c, cudaStream_t stream);

struct ScatterBackArgs {
  const int32_t* ids;
  const int32_t* slot;
  const int32_t* dest_row;
  const float* dx_router;       // [T, H]
  __nv_bfloat16* dx;            // [T, H]
  int64_t tokens;
  int32_t top_k, local_experts;
};
// dx[t] = Σ_j owner(ids[t,j]).dx_rows[dest_row[t,j]] + dx_router[t] (kept j in order, f32, rounded once): the
// backend's scatter_back with the experts' rows read in place.
void flash_scatter_back(const BackwardArgs& a, const ScatterBackArgs& c, cudaStream_t stream);

}  // namespace dmoe::cuda
