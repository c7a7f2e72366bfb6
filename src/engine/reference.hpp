// reference.hpp — the CPU reference engine: one MoE layer on W simulated ranks (threads + ThreadComm),
// each holding only its own tokens and experts, running the same EpEngine as the GPU path.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/config.hpp"
#include "engine/ep_engine.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

struct LayerResult {
  std::vector<float> y;                 // [W*T, H], ranks' tokens in rank order
  std::vector<int32_t> expert_ids;      // [W*T, k]
  std::vector<float> expert_weights;    // [W*T, k]
  std::vector<float> dx;                // [W*T, H] when dy was given
  MoeWeights grads;                     // all experts + gate, when dy was given
  RouterLosses losses;
  std::vector<int64_t> routed;          // [E] assignments per expert, summed over ranks
  std::vector<int64_t> kept;            // [E] rows kept per expert, summed over ranks
  int64_t rows_received = 0;            // expert batch rows over all ranks (padding included)
  std::vector<int64_t> expert_rows;     // [E] batch rows of each expert on its owner (padding included)
  int64_t rows_sent = 0;                // rows on the wire over all ranks (padding included)
  int64_t dropped() const;
};

// Runs forward (and backward when dy is non-null) of the layer on config.world simulated ranks.
// weights holds all experts; x (and dy) are [world * tokens, hidden], rank r's tokens at rows
// [r*T, (r+1)*T).
// `options` chooses how rows travel (see EpOptions); rows_received/rows_sent report it.
LayerResult run_cpu_layer(const MoeConfig& config, const MoeWeights& weights, const std::vector<float>& x,
                          const std::vector<float>* dy, const EpOptions& options = {});

}  // namespace dmoe
