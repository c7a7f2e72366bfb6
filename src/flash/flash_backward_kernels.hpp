// flash/flash_backward_kernels.hpp — the small kernels of the Flash backward (flash_backward.cu), launched by
// cuda::flash_backward (flash_backward.cpp). Plain host C++.
#pragma once

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

// choice_slot[i] = i where slot[i] >= 0, else -1 (the combine's row of each (t, j) in out / grad_out / dx_out).
void flash_choice_slots(const int32_t* slot, int32_t* choice_slot, int64_t n, cudaStream_t stream);
// signal(epoch, 1) into word `rank` of every rank's signal array at symmetric offset `offset`, after a system
// fence (it announces the stores of the launches before it on the stream).
void flash_signal_peers(const BackwardArgs& a, size_t offset, cudaStream_t stream);
// Waits, bounded, until every word of this rank's signal array at `offset` carries the forward's epoch; past the
// limit the record names `what` (flash::WaitWhat) and the source, and the kernel traps.
void flash_wait_signals(const BackwardArgs& a, size_t offset, int32_t what, cudaStream_t stream);
// For the n received rows (meta order): pull = true: rows[i] = home(meta[i]).grad_out[token_choice];
// pull = false: home(meta[i]).dx_out[token_choice] = rows[i]. rows [n, H] bf16.
void flash_move_rows(const BackwardArgs& a, const flash::RowMeta* meta, void* rows, int64_t n, bool pull,
                     cudaStream_t stream);

}  // namespace dmoe::cuda
