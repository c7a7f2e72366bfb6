#include "core/dispatch_plan.hpp"

#include <algorithm>
#include <numeric>

#include "core/error.hpp"

namespace dmoe {

int64_t SendPlan::dropped() const {
  int64_t total = 0;
  for (int32_t e = 0; e < experts; ++e) total += routed[e] - counts[e];
  return total;
}

int64_t SendPlan::rank_count(int32_t dest, int32_t experts_per_rank) const {
  return offsets[(dest + 1) * experts_per_rank] - offsets[dest * experts_per_rank];
}

int64_t SendPlan::rank_offset(int32_t dest, int32_t experts_per_rank) const {
  return offsets[dest * experts_per_rank];
}

SendPlan build_send_plan(const int32_t* ids, const float* weights, int64_t tokens, int32_t top_k,
                         int32_t experts, int64_t capacity, DropPolicy policy) {
  SendPlan plan;
  plan.tokens = tokens;
  plan.top_k = top_k;
  plan.experts = experts;
  plan.routed.assign(experts, 0);
  plan.counts.assign(experts, 0);
  plan.offsets.assign(experts + 1, 0);
  plan.slot.assign(tokens * top_k, -1);

  // Assignments per expert, in token order (a token picks an expert at most once).
  std::vector<std::vector<int64_t>> per_expert(experts);  // flat assignment index t*k + j
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[t * top_k + j];
      DMOE_REQUIRE(e >= 0 && e < experts, "routing: token {} choice {} has expert id {}; allowed [0, {})",
                   t, j, e, experts);
      for (int32_t i = 0; i < j; ++i)
        DMOE_REQUIRE(ids[t * top_k + i] != e, "routing: token {} picks expert {} twice (choices {} and {}); "
                     "a token's k experts must be distinct", t, e, i, j);
      per_expert[e].push_back(t * top_k + j);
    }

  for (int32_t e = 0; e < experts; ++e) {
    auto& list = per_expert[e];
    plan.routed[e] = int64_t(list.size());
    if (capacity >= 0 && int64_t(list.size()) > capacity) {
      if (policy == DropPolicy::lowest_weight) {
        // Keep the `capacity` heaviest assignments (ties: earlier token), then restore token order.
        std::stable_sort(list.begin(), list.end(),
                         [&](int64_t a, int64_t b) { return weights[a] > weights[b]; });
      }
      list.resize(capacity);
      std::sort(list.begin(), list.end());
    }
    plan.counts[e] = int64_t(list.size());
    plan.offsets[e + 1] = plan.offsets[e] + plan.counts[e];
  }

  plan.row_token.resize(plan.rows());
  plan.row_choice.resize(plan.rows());
  for (int32_t e = 0; e < experts; ++e) {
    int64_t row = plan.offsets[e];
    for (int64_t a : per_expert[e]) {
      plan.slot[a] = int32_t(row);
      plan.row_token[row] = int32_t(a / top_k);
      plan.row_choice[row] = int32_t(a % top_k);
      ++row;
    }
  }
  return plan;
}

ExpertBatchLayout build_expert_batch_layout(const int64_t* counts, int32_t world, int32_t local_experts,
                                            int32_t row_multiple) {
  DMOE_REQUIRE(row_multiple >= 1, "dispatch: row_multiple = {} is invalid; must be >= 1", row_multiple);
  ExpertBatchLayout layout;
  layout.row_multiple = row_multiple;
  layout.world = world;
  layout.local_experts = local_experts;
  const int64_t n = int64_t(world) * local_experts;
  layout.counts.assign(counts, counts + n);
  layout.recv_offsets.assign(n, 0);
  layout.batch_offsets.assign(n, 0);
  layout.expert_offsets.assign(local_experts + 1, 0);
  layout.source_counts.assign(world, 0);
  layout.source_offsets.assign(world + 1, 0);

  int64_t row = 0;  // source-major
  for (int32_t r = 0; r < world; ++r) {
    for (int32_t e = 0; e < local_experts; ++e) {
      const int64_t c = counts[r * local_experts + e];
      DMOE_REQUIRE(c >= 0, "dispatch: negative row count {} from rank {} for local expert {}", c, r, e);
      layout.recv_offsets[r * local_experts + e] = row;
      row += c;
      layout.source_counts[r] += c;
    }
    layout.source_offsets[r + 1] = row;
  }
  row = 0;  // expert-major, sources in rank order inside an expert
  for (int32_t e = 0; e < local_experts; ++e) {
    for (int32_t r = 0; r < world; ++r) {
      layout.batch_offsets[r * local_experts + e] = row;
      row += counts[r * local_experts + e];
    }
    row = layout.expert_offsets[e] + (row - layout.expert_offsets[e] + row_multiple - 1) / row_multiple * row_multiple;
    layout.expert_offsets[e + 1] = row;
  }
  return layout;
}

std::vector<Tile> ExpertBatchLayout::tiles(int32_t tile_rows) const {
  DMOE_REQUIRE(tile_rows >= 1, "tiles: tile_rows = {} is invalid; must be >= 1", tile_rows);
  std::vector<Tile> out;
  for (int32_t e = 0; e < local_experts; ++e)
    for (int64_t r = expert_offsets[e]; r < expert_offsets[e + 1]; r += tile_rows)
      out.push_back(Tile{e, int32_t(std::min<int64_t>(tile_rows, expert_offsets[e + 1] - r)), r});
  return out;
}

DispatchPlan build_dispatch_plan(const MoeConfig& config, const std::vector<const int32_t*>& ids,
                                 const std::vector<const float*>& weights) {
  config.validate();
  DMOE_REQUIRE(int32_t(ids.size()) == config.world && int32_t(weights.size()) == config.world,
               "dispatch plan: got routing for {} ranks; world is {}", ids.size(), config.world);
  DispatchPlan plan;
  for (int32_t r = 0; r < config.world; ++r)
    plan.send.push_back(build_send_plan(ids[r], weights[r], config.tokens, config.top_k, config.experts,
                                        config.capacity(), config.drop_policy));
  const int32_t le = config.experts_per_rank();
  for (int32_t d = 0; d < config.world; ++d) {
    std::vector<int64_t> counts(int64_t(config.world) * le);
    for (int32_t r = 0; r < config.world; ++r)
      for (int32_t e = 0; e < le; ++e) counts[r * le + e] = plan.send[r].counts[d * le + e];
    plan.recv.push_back(build_expert_batch_layout(counts.data(), config.world, le));
  }
  return plan;
}

}  // namespace dmoe
