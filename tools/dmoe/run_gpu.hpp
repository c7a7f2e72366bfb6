// run_gpu.hpp — `dmoe run --engine cuda`: the layer on this process's GPU (one rank).
#pragma once

#include <vector>

#include "engine/reference.hpp"

namespace dmoe::cli {

// Same inputs and result as run_cpu_layer, on the GPU; config.world must be 1. Throws dmoe::Error when
// this build has no CUDA or no GPU is visible.
LayerResult run_gpu_layer(const MoeConfig& config, const MoeWeights& weights, const std::vector<float>& x,
                          const std::vector<float>* dy);

}  // namespace dmoe::cli
