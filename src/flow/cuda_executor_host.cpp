// cuda_executor_host.cpp — the GPU executor's host-only parts (built without CUDA too, unit-tested in CI).
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/env.hpp"
#include "core/error.hpp"
#include "flow/cuda_executor.hpp"

namespace dmoe::flow {

int64_t cuda_mixtral_dense_grad_bytes_per_layer(const MixtralConfig& c) {
  const int64_t H = c.hidden_size;
  return 4 * (2 * H + 2 * c.q_size() * H + 2 * c.kv_size() * H + int64_t(c.num_local_experts) * H);
}

std::vector<int32_t> merged_issue_order(const TaskGraph& g) {
  std::vector<uint8_t> issued(g.tasks.size(), 0);
  auto ready = [&](int32_t id) {
    for (int32_t d : g.tasks[size_t(id)].deps)
      if (!issued[size_t(d)]) return false;
    return true;
  };
  std::vector<int32_t> order;
  order.reserve(g.compute_order.size() + g.alltoall_order.size());
  size_t ci = 0, ai = 0;
  while (ci < g.compute_order.size() || ai < g.alltoall_order.size()) {
    int32_t next = -1;
    if (ai < g.alltoall_order.size() && ready(g.alltoall_order[ai]))
      next = g.alltoall_order[ai++];
    else if (ci < g.compute_order.size() && ready(g.compute_order[ci]))
      next = g.compute_order[ci++];
    DMOE_REQUIRE(next >= 0, "flow: the graph's compute and all-to-all orders cannot be merged (a dependency on an AR "
                 "task or a cycle): next compute {}, next all-to-all {}",
                 ci < g.compute_order.size() ? g.describe(g.compute_order[ci]) : "none",
                 ai < g.alltoall_order.size() ? g.describe(g.alltoall_order[ai]) : "none");
    issued[size_t(next)] = 1;
    order.push_back(next);
  }
  return order;
}

const char* ar_comm_name(ArComm mode) { return mode == ArComm::model ? "model" : "own"; }

ArComm choose_ar_comm(const char* env_value, int32_t world, bool gpus_shared, const std::string& model_comm_name) {
  const std::string v = env_value ? env_value : "";
  if (v == "own") return ArComm::own;
  if (v == "model") return ArComm::model;
  DMOE_REQUIRE_INPUT(v.empty() || v == "auto", "DMOE_FLOW_AR_COMM='{}' is invalid: allowed: auto, own, model", v);
  if (world > 1 && (gpus_shared || model_comm_name == "nvshmem")) return ArComm::model;
  return ArComm::own;
}

int32_t chunks_per_gap_from_env(const char* env_value) {
  // The other integer knobs' reader: 99999999999999999999 was "invalid: a decimal integer >= 0", which it is; now it
  // is too large, with the maximum (G19-9 of the nineteenth bad-input pass).
  return int32_t(env_integer_value("DMOE_FLOW_CHUNKS_PER_GAP", env_value, 0, (int64_t(1) << 31) - 1, 1,
                                   "AR chunks per compute task (0: no limit)"));
}

std::vector<int32_t> single_comm_issue_order(const TaskGraph& g, int32_t chunks_per_gap) {
  DMOE_REQUIRE(chunks_per_gap >= 0, "chunks_per_gap {}: must be >= 0", chunks_per_gap);
  std::vector<uint8_t> issued(g.tasks.size(), 0);
  auto ready = [&](int32_t id) {
    for (int32_t d : g.tasks[size_t(id)].deps)
      if (!issued[size_t(d)]) return false;
    return true;
  };
  const std::vector<int32_t>&cs = g.compute_order, &as = g.alltoall_order, &ks = g.allreduce_order;
  std::vector<int32_t> order;
  order.reserve(g.tasks.size());
  size_t ci = 0, ai = 0, ki = 0;
  int64_t chunks_since_compute = 0;
  while (order.size() < g.tasks.size()) {
    int32_t next = -1;
    const bool chunk_ready = ki < ks.size() && ready(ks[ki]);
    if (ai < as.size() && ready(as[ai])) {
      next = as[ai++];
    } else if (chunk_ready && (chunks_per_gap == 0 || chunks_since_compute < chunks_per_gap)) {
      next = ks[ki++];
      ++chunks_since_compute;
    } else if (ci < cs.size() && ready(cs[ci])) {
      next = cs[ci++];
      chunks_since_compute = 0;
    } else if (chunk_ready && ci == cs.size() && ai == as.size()) {
      next = ks[ki++];
    }
    DMOE_REQUIRE(next >= 0, "flow: the graph's orders cannot be merged into one issue order (a cycle, or a task that "
                 "waits for an AR chunk): next compute {}, next all-to-all {}, next chunk {}",
                 ci < cs.size() ? g.describe(cs[ci]) : "none", ai < as.size() ? g.describe(as[ai]) : "none",
                 ki < ks.size() ? g.describe(ks[ki]) : "none");
    issued[size_t(next)] = 1;
    order.push_back(next);
  }
  return order;
}

}  // namespace dmoe::flow
