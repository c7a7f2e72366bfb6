// flash_reference.hpp — the Flash protocol on the CPU: W ranks as threads, each running cpu::flash_forward
// (the twin of the Flash kernel) over host buffers laid out as on the GPU, peers addressing each other's
// regions directly. Used by the tests as the oracle of the protocol (row placement, metadata, signals,
// epochs) and to run back-to-back forwards with no barrier between them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/flash_protocol.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

struct FlashCpuRankState {
  std::vector<float> recv;              // [R, H] this rank's receive buffer of the last forward's parity
  std::vector<flash::RowMeta> meta;     // [R]
  std::vector<int64_t> expert_rows;     // [Le] rows each local expert received in the last forward
};

struct FlashCpuResult {
  std::vector<std::vector<float>> y;    // per forward: [W*T, H], ranks' tokens in rank order
  std::vector<std::vector<float>> dx;   // per forward, with dys: [W*T, H]
  MoeWeights grads;                     // with dys: all experts and the gate (summed over ranks in rank order),
                                        // accumulated over the forwards
  std::vector<FlashCpuRankState> ranks; // after the last forward
};

// Runs xs.size() forwards back to back (each rank goes on to the next as soon as its own forward is
// done); xs[i] is [W*T, H]. weights holds all experts. timeout_ns bounds every wait. With dys (one [W*T, H]
// per forward), each forward runs in train mode and is followed by its backward (cpu::flash_backward), the
// gradients of all of them added up (the first backward overwrites the experts' gradients, as EpEngine's).
FlashCpuResult run_cpu_flash_layer(const MoeConfig& config, const MoeWeights& weights,
                                   const std::vector<std::vector<float>>& xs,
                                   unsigned long long timeout_ns = 10'000'000'000ull,
                                   const std::vector<std::vector<float>>* dys = nullptr);

}  // namespace dmoe
