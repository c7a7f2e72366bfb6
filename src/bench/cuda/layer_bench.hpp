// layer_bench.hpp — times one MoE layer engine on a GPU and derives the figures every result shows.
//
//   F (FLOP, forward)   = 2·m·T·k·H·I     m = 3 for SwiGLU, else 2 (router excluded; ≈ 2·T·H·E more)
//   bytes (forward)     = Lt·m·H·I·s + 2·T·H·s   weights of the Lt local experts that received rows
//                                               (at most Le) + x read + y written, once
//   roofline            = max(F / GEMM ceiling, bytes / copy ceiling), ceilings measured in the same run
//                         (first, on a cool GPU; and the GEMM ceiling again in the forwards' rounds)
//   TFLOP/s             = F / time;   % of roofline = roofline / time
//   communication bytes = rows sent to other ranks · H · s, per direction
//   all-to-all bandwidth = those bytes (spread evenly over the peers) / time of one all-to-all alone
//   link ceiling        = bytes / time of one GPU pushing them into the next rank's GPU, all GPUs at once
//   tokens/s            = W·T / time (all ranks)
// s = bytes per element of the storage dtype. Correctness: a sample of tokens is recomputed on the CPU
// in fp64 from the same (bf16-valued) weights, with the engine's routing, and compared.
#pragma once

#include <string>
#include <vector>

#include "bench/cuda/gpu_timing.hpp"
#include "comm/comm.hpp"
#include "core/config.hpp"
#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "engine/moe_engine.hpp"

namespace dmoe::bench {

struct LayerBenchResult {
  std::string engine;
  MoeConfig config;
  Stats forward;           // ForwardMode::inference: what a served layer costs (the PyTorch peers keep nothing either)
  Stats forward_train;     // ForwardMode::train: also stores what the backward pass needs
  Stats forward_backward;  // zero_grads + train forward + backward; iterations = 0 when not measured
  Stats alltoall;          // the all-to-all alone (LayerBenchOptions::time_alltoall); iterations = 0 if not
  double alltoall_bytes = 0;  // bytes one rank sends to the other ranks in that all-to-all
  // The link ceiling beside it (LayerBenchOptions::link_ceiling): every GPU pushing into the next rank's
  // GPU at once, by copy engine and by SM stores; the slowest rank's median, at the exchange's bytes and
  // at 256 MiB. Empty when not measured (one node with a GPU per rank and peer access needed).
  struct LinkCeiling {
    double bytes = 0, copy_engine_ms = 0, sm_store_ms = 0;
  };
  std::vector<LinkCeiling> link;
  double flop = 0, bytes = 0, roofline_ms = 0, comm_bytes = 0;
  // The GEMM ceiling timed in the same rounds as the forwards (CeilingGemm), and the roofline from it.
  double gemm_ceiling_same_rounds = 0, roofline_same_rounds_ms = 0;
  double max_rel_error = 0;  // worst per-token ‖y − y_ref‖ / ‖y_ref‖ over the sample
  int checked_tokens = 0;
  int32_t touched_experts = 0;  // Lt: local experts that received rows (their weights are read)
  // LayerBenchOptions::flash: the Flash kernel's forward, timed in the same rounds as EP's (iterations = 0
  // when not measured), its sampled error and routing agreement with EP.
  Stats flash_forward;
  double flash_max_rel_error = 0;
  int32_t flash_grid = 0;
  bool flash_routing_equal = false;
  std::vector<uint64_t> flash_profile;  // one profiled forward (FlashEngine::profile), [grid, kProfileSlots]
  // With backward: Flash's training step (zero_grads, train forward, backward through MoeEngine) timed in the
  // same rounds as EP's (forward_backward is then from those rounds too), and how far Flash's dx and expert
  // gradients are from EP's (relative error of the norms).
  Stats flash_forward_backward;
  double flash_dx_rel_diff = 0, flash_dw_rel_diff = 0;
  std::vector<std::pair<std::string, double>> flash_backward_stages;  // one profiled backward: (stage, ms)
  double flash_percent_of_roofline() const { return 100.0 * roofline_ms / flash_forward.median_ms; }
  double tflops() const { return flop / (forward.median_ms * 1e-3) * 1e-12; }
  double percent_of_roofline() const { return 100.0 * roofline_ms / forward.median_ms; }
  double percent_of_roofline_same_rounds() const { return 100.0 * roofline_same_rounds_ms / forward.median_ms; }
  double tokens_per_s() const { return double(config.world) * config.tokens / (forward.median_ms * 1e-3); }
};

// What the peers (bench/peers.py) need to run on the same data: host copies (rank 0, W = 1).
struct LayerBenchData {
  std::vector<float> x, y, expert_weights;
  std::vector<int32_t> expert_ids;
};

struct LayerBenchOptions {
  TimingOptions timing;
  bool backward = false;
  int check_tokens = 8;
  uint64_t seed = 1;
  // W > 1: also time one all-to-all alone, uniform over the peers, moving the bytes the layer's dispatch
  // sends to other ranks (its bandwidth per GPU is what the issue-4 runs compare with NVLink's).
  bool time_alltoall = false;
  // With time_alltoall: also measure the link ceiling (LayerBenchResult::link). Set only when all ranks
  // run on this node (devices are exchanged between ranks and must be peers of one another).
  bool link_ceiling = false;
  EpOptions engine;
  // Also run the Flash kernel (FlashEngine, bf16) on the same weights and inputs, interleaved with EP's
  // forwards, and with `backward` Flash's training step beside EP's (a second, train FlashEngine: its region
  // too). W > 1 needs the NVSHMEM communicator with room for Flash's symmetric regions in its heap.
  bool flash = false;
  // The engine timed (make_moe_engine): ep, or flash alone (`flash` beside must then be off).
  EngineKind kind = EngineKind::ep;
};

// Runs the engine `options.kind` (over `backend` and `comm`) on hashed weights and inputs.
LayerBenchResult bench_ep_layer(const MoeConfig& config, Backend& backend, Comm& comm, const Ceilings& ceilings,
                                const LayerBenchOptions& options, LayerBenchData* keep = nullptr);

}  // namespace dmoe::bench
