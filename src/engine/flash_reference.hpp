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
  std::vector<FlashCpuRankState> ranks; // after the last forward
};

// Runs xs.size() forwards back to back (each rank goes on to the next as soon as its own forward is
// done); xs[i] is [W*T, H]. weights holds all experts. timeout_ns bounds every wait.
FlashCpuResult run_cpu_flash_layer(const MoeConfig& config, const MoeWeights& weights,
                                   const std::vector<std::vector<float>>& xs,
                                   unsigned long long timeout_ns = 10'000'000'000ull);

}  // namespace dmoe
