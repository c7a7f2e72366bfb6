// bootstrap_exchange.hpp — how rank 0's bootstrap bytes (the NCCL and NVSHMEM unique ids) reach the other ranks
// when an embedding application already has a channel between its processes: the Python module registers one
// that goes through a torch.distributed process group (dmoe.init_from_process_group), so ranks need neither a
// shared rendezvous directory (dmoe launch, torchrun on one node) nor MPI/PMI.
//
// Host only, no CUDA: the CPU build carries it too (nothing there calls it).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace dmoe {

// Called collectively, in the same order on every rank, with a name unique to the call (e.g. "nccl-id-0"):
// on rank 0 `data` holds the `bytes` bytes to send; on the others the exchange fills it in. It throws (any
// exception) when the bytes cannot be delivered.
using BootstrapExchange = std::function<void(const std::string& name, void* data, size_t bytes)>;

// Registers the exchange for this process; an empty function returns to the directory rendezvous.
void set_bootstrap_exchange(BootstrapExchange exchange);

// A copy of the registered exchange (empty when none).
BootstrapExchange bootstrap_exchange();

}  // namespace dmoe
