// projection.cpp — per-task costs from a model, a batch and a cluster (see projection.hpp for the formulas).
#include "flow/projection.hpp"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "flow/cpu_executor.hpp"
#include "flow/json_fields.hpp"
#include "model/config_io.hpp"

namespace dmoe::flow {

using nlohmann::json;

ClusterModel parse_cluster_model(const json& j, const std::string& where) {
  only_keys(j,
            {"name", "flop_per_s", "nvlink_gbytes_per_s", "net_gbytes_per_s", "gpus_per_node", "compute_fixed_ms",
             "alltoall_fixed_ms", "allreduce_alpha_ms", "notes"},
            where);
  ClusterModel c;
  for (const char* key : {"name", "notes"})  // free text, but text: a number here was dropped without a word
    DMOE_REQUIRE_INPUT(!j.contains(key) || j.at(key).is_string(), "{}.{}: must be a string (got {})", where, key,
                       j.at(key).dump());
  c.name = j.contains("name") ? j.at("name").get<std::string>() : where;
  const double flop = number_at(j, "flop_per_s", where), nvlink = number_at(j, "nvlink_gbytes_per_s", where),
               net = number_at(j, "net_gbytes_per_s", where);
  // Ranges of real machines with room to spare: values far past them (alltoall_fixed_ms 1e30, net 1e-300 GB/s) printed
  // step times of 300 digits, rc 0 (G20 of the sixteenth bad-input pass).
  DMOE_REQUIRE_INPUT(flop >= 1e6 && flop <= 1e19, "{}.flop_per_s = {}: must be in [1e6, 1e19] (an H200's bf16 GEMM is "
                     "~7e14)", where, flop);
  for (const auto& [key, v] : {std::pair<const char*, double>{"nvlink_gbytes_per_s", nvlink}, {"net_gbytes_per_s", net}})
    DMOE_REQUIRE_INPUT(v >= 1e-3 && v <= 1e6, "{}.{} = {}: must be in [0.001, 1e6] GB/s", where, key, v);
  c.flop_per_s = flop;
  c.nvlink_bytes_per_s = nvlink * 1e9;
  c.net_bytes_per_s = net * 1e9;
  // Its own rule only: number_at's "must be finite and >= 0" for -1 said 0 was allowed, which this refuses (F10 of the
  // eighteenth bad-input pass).
  DMOE_REQUIRE_INPUT(j.contains("gpus_per_node"), "{}: missing key 'gpus_per_node'", where);
  DMOE_REQUIRE_INPUT(j.at("gpus_per_node").is_number(), "{}.gpus_per_node: must be a number (got {})", where,
                     j.at("gpus_per_node").dump());
  const double g = j.at("gpus_per_node").get<double>();
  DMOE_REQUIRE_INPUT(g >= 1 && g <= 1024 && g == std::floor(g), "{}.gpus_per_node = {}: must be an integer in "
                     "[1, 1024]", where, g);
  c.gpus_per_node = int32_t(g);
  c.compute_fixed_ms = number_at(j, "compute_fixed_ms", where);
  c.alltoall_fixed_ms = number_at(j, "alltoall_fixed_ms", where);
  c.allreduce_alpha_ms = number_at(j, "allreduce_alpha_ms", where);
  for (const auto& [key, v] : {std::pair<const char*, double>{"compute_fixed_ms", c.compute_fixed_ms},
                               {"alltoall_fixed_ms", c.alltoall_fixed_ms}, {"allreduce_alpha_ms", c.allreduce_alpha_ms}})
    DMOE_REQUIRE_INPUT(v >= 0 && v <= 1e4, "{}.{} = {}: must be in [0, 1e4] ms (a call's fixed cost; measured ones are "
                       "0.01 to 0.2 ms)", where, key, v);
  return c;
}

ClusterModel load_cluster_model(const std::string& path) {
  return parse_cluster_model(read_json_file(path, "--cluster"), path);
}

CostModel project_costs(const ProjectionSpec& s, const ClusterModel& cl) {
  const MixtralConfig& m = s.model;
  const int32_t P = s.gpus, g = std::min(cl.gpus_per_node, s.gpus);
  DMOE_REQUIRE_INPUT(P >= 1, "project: --gpus {}: must be >= 1", P);
  DMOE_REQUIRE_INPUT(m.num_local_experts % P == 0, "project: {} experts do not split over {} GPUs (give --experts, a "
                     "multiple of {})", m.num_local_experts, P, P);
  DMOE_REQUIRE_INPUT(P <= cl.gpus_per_node || P % cl.gpus_per_node == 0, "project: {} GPUs are not whole nodes of {} "
                     "({})", P, cl.gpus_per_node, cl.name);
  DMOE_REQUIRE_INPUT(s.batch >= 1 && s.seq >= 1, "project: --batch {} and --seq {} must be >= 1", s.batch, s.seq);
  DMOE_REQUIRE_INPUT(s.act_bytes == 2 || s.act_bytes == 4, "project: {} bytes per activation (allowed: 2, 4)",
                     s.act_bytes);
  const double T = double(s.batch) * double(s.seq), H = double(m.hidden_size), Q = double(m.q_size()),
               KV = double(m.kv_size()), I = double(m.intermediate_size), E = double(m.num_local_experts),
               k = double(m.num_experts_per_tok), D = double(m.head_size());
  const double flop_per_ms = cl.flop_per_s / 1e3;
  // The same terms as MixtralConfig::forward_flop (full seq² attention), split into the graph's two compute tasks.
  const double at_flop = 2 * T * H * (Q + 2 * KV) + 2 * T * Q * H +
                         2 * double(s.batch) * m.num_attention_heads * double(s.seq) * double(s.seq) * D +
                         2 * T * H * E;
  const double e_flop = 2 * T * k * 3 * H * I;
  // Each GPU sends (and receives) T·k rows; (g − 1)/P of them within the node, (P − g)/P across nodes.
  const double rows_bytes = T * k * H * double(s.act_bytes);
  const double intra = rows_bytes * double(g - 1) / double(P), inter = rows_bytes * double(P - g) / double(P);
  const double a2a_ms = std::max(intra / (cl.nvlink_bytes_per_s / 1e3), inter / (cl.net_bytes_per_s / 1e3));

  CostModel c;
  c.layers = m.num_hidden_layers;
  c.dense_grad_bytes_per_layer = mixtral_dense_grad_bytes_per_layer(m);
  c.head_grad_bytes = mixtral_head_grad_bytes(m);  // final norm + lm_head, replicated like the layers' dense part
  c.embed_grad_bytes = mixtral_embed_grad_bytes(m);
  auto set = [&](TaskKind kind, double fixed, double batch) { c[kind] = TaskCost{fixed, batch}; };
  set(TaskKind::attention_fwd, cl.compute_fixed_ms, at_flop / flop_per_ms);
  set(TaskKind::expert_fwd, cl.compute_fixed_ms, e_flop / flop_per_ms);
  set(TaskKind::expert_bwd, cl.compute_fixed_ms, 2 * e_flop / flop_per_ms);
  set(TaskKind::attention_bwd, cl.compute_fixed_ms, 2 * at_flop / flop_per_ms);
  const double a2a_fixed = P > 1 ? cl.alltoall_fixed_ms : 0.0;
  for (TaskKind kind : {TaskKind::dispatch_fwd, TaskKind::combine_fwd, TaskKind::combine_bwd, TaskKind::dispatch_bwd})
    set(kind, a2a_fixed, a2a_ms);
  // Ring all-reduce: 2(P−1)/P of the bytes over the ring's slowest link.
  const double ring_bw = (P > cl.gpus_per_node ? cl.net_bytes_per_s : cl.nvlink_bytes_per_s) / 1e3;
  c.ar_alpha_ms = P > 1 ? cl.allreduce_alpha_ms : 0.0;
  c.ar_bytes_per_ms = P > 1 ? ring_bw / (2.0 * double(P - 1) / double(P)) : 1e15;  // W = 1: nothing to send
  // Finite cluster numbers can still give costs that overflow (flop_per_s 1e-300: inf ms): the cluster's fault.
  for (int t = 0; t < 8; ++t)
    DMOE_REQUIRE_INPUT(std::isfinite(c.tasks[size_t(t)].batch_ms), "project: task {} would take {} ms with cluster "
                       "'{}' (flop_per_s {}, nvlink {} GB/s, net {} GB/s): give a cluster with sizes that give finite "
                       "times", task_kind_name(TaskKind(t)), c.tasks[size_t(t)].batch_ms, cl.name, cl.flop_per_s,
                       cl.nvlink_bytes_per_s / 1e9, cl.net_bytes_per_s / 1e9);
  validate(c);
  return c;
}

}  // namespace dmoe::flow
