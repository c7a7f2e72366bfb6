// projection.hpp — per-task costs for the simulator from first principles: a model's shapes, tokens per GPU,
// P GPUs in nodes of g, and a cluster description (throughput, link bandwidths, fixed costs), for steps no
// machine here can run (the FlowMoE paper's 16-GPU setups, 64-1024 H200s). `dmoe flow project` prints the
// ablation on these costs; docs/flow.md has the formulas, the cluster files' sources and what is assumed.
//
// Per GPU and layer, for the whole batch of T = batch · seq tokens of this GPU (the cost model's batch_ms; each
// task also pays a fixed cost per call, fixed_ms):
//   AT   attention + gate forward   (2·T·H·(Q + 2·KV) + 2·T·Q·H + 2·batch·heads·seq²·D + 2·T·H·E) / flop_per_s
//   E    experts forward            2·T·k·3·H·I / flop_per_s      (SwiGLU; balanced routing: T·k rows per GPU)
//   AT', E'  twice their forward (the two products of a backward)
//   D, C, C', D'  each GPU sends T·k rows of H values (act_bytes each) and receives as many; of them the share
//        (g − 1)/P stays in the node (NVLink), (P − g)/P leaves it (the network); both links run at once:
//        max(intra / nvlink_bytes_per_s, inter / net_bytes_per_s)
//   AR   a ring all-reduce of the replicated gradients (per layer dense_grad_bytes_per_layer; the head's and the
//        embedding's, head_grad_bytes and embed_grad_bytes, in their own chunks; f32): 2·(P−1)/P of the
//        bytes over the slowest link of the ring (the network when P > g, else NVLink): ar_bytes_per_ms is that
//        link's bandwidth divided by 2·(P−1)/P; alpha per call.
// The model is the paper's: symmetric ranks, no stragglers or routing skew, a non-blocking network.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "flow/simulator.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe::flow {

struct ClusterModel {
  std::string name;
  double flop_per_s = 0;          // sustained matmul throughput per GPU in the run's dtype (FLOP/s)
  double nvlink_bytes_per_s = 0;  // per GPU and direction, inside a node
  double net_bytes_per_s = 0;     // per GPU and direction, between nodes
  int32_t gpus_per_node = 8;
  double compute_fixed_ms = 0;    // per compute task (launches, small kernels)
  double alltoall_fixed_ms = 0;   // per all-to-all call (latency, the count exchange, synchronisation)
  double allreduce_alpha_ms = 0;  // per all-reduce call
};

// {"name": "...", "flop_per_s": 4e14, "nvlink_gbytes_per_s": 270, "net_gbytes_per_s": 50, "gpus_per_node": 8,
//  "compute_fixed_ms": 0.05, "alltoall_fixed_ms": 0.03, "allreduce_alpha_ms": 0.02, "notes": "..."}
// Every number is required ("notes" is free text); unknown keys and non-positive sizes are errors naming the key.
ClusterModel parse_cluster_model(const nlohmann::json& j, const std::string& where = "cluster");
ClusterModel load_cluster_model(const std::string& path);

struct ProjectionSpec {
  MixtralConfig model;
  int64_t batch = 8;       // sequences per GPU
  int64_t seq = 1024;
  int32_t gpus = 16;       // P; the model's experts are spread over them (num_local_experts % P == 0)
  int32_t act_bytes = 2;   // bytes per activation value on the wire (2: bf16, 4: f32)
};

// The cost model of one GPU's step (layers = the model's). Errors name what is inconsistent (experts not
// divisible by P, P not a multiple of gpus_per_node when larger than a node, ...).
CostModel project_costs(const ProjectionSpec& spec, const ClusterModel& cluster);

}  // namespace dmoe::flow
