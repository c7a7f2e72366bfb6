// run_gpu.hpp — `dmoe run --engine ep|flash`: the layer on this process's GPU (one rank).
#pragma once

#include <vector>

#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"

namespace dmoe::cli {

// Same inputs and result as run_cpu_layer, on the GPU through make_moe_engine(kind) (ep or flash); config.world
// must be 1. With dy, a train forward and the backward (both engines); without, Flash runs an inference forward,
// so r.losses stays zero (losses_computed false). Throws dmoe::Error when this build has no CUDA or no GPU is
// visible.
struct GpuLayerResult {
  LayerResult layer;
  bool losses_computed = false;
};
GpuLayerResult run_gpu_layer(EngineKind kind, const MoeConfig& config, const MoeWeights& weights,
                             const std::vector<float>& x, const std::vector<float>* dy);

}  // namespace dmoe::cli
