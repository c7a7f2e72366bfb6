// cuda_executor_host.cpp — the GPU executor's host-only parts (built without CUDA too, unit-tested in CI).
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

}  // namespace dmoe::flow
