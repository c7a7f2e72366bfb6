// dmoe/engine.hpp — public: the expert-parallel MoE layer (EpEngine) over a Backend and a Comm, the CPU
// backend, the CPU reference engine (run_cpu_layer: W simulated ranks as threads), and MoeEngine, the one
// interface over the engines (make_moe_engine: cpu, ep, flash). In a CUDA build
// (DMOE_WITH_CUDA) also the CUDA backend and the Flash engine.
#pragma once

#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "model/moe_weights.hpp"

#if defined(DMOE_WITH_CUDA)
#include "cuda/cuda_backend.hpp"
#include "flash/flash_engine.hpp"
#endif
