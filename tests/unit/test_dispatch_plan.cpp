// test_dispatch_plan.cpp — core/dispatch_plan: send plans (counts, offsets, slots, dropped rows under
// both drop policies), the receive-side expert batch layout and its tiles, all against plans worked out
// by hand; plus one W = 2 end-to-end move of tagged rows through the plan.
//
// Run: dmoe_unit_tests --gtest_filter='DispatchPlan*'
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/config.hpp"
#include "core/dispatch_plan.hpp"
#include "core/error.hpp"
#include "cpu/kernels.hpp"

namespace dmoe {
namespace {

using I32 = std::vector<int32_t>;
using I64 = std::vector<int64_t>;

// T = 6, k = 2, E = 3. Flat assignment index a = t*k + j in brackets:
//   expert 0: t0[0] t1[2] t2[5] t3[6] t4[9] t5[10]   (6 routed)
//   expert 1: t0[1] t2[4] t3[7]                      (3 routed)
//   expert 2: t1[3] t4[8] t5[11]                     (3 routed)
const I32 kIds6 = {0, 1, /*t1*/ 0, 2, /*t2*/ 1, 0, /*t3*/ 0, 1, /*t4*/ 2, 0, /*t5*/ 0, 2};
// Expert 0's weights: t0 .6, t1 .3, t2 .45, t3 .7, t4 .5, t5 .45 (the plan does not need sorted rows).
const std::vector<float> kWeights6 = {0.6f, 0.4f, 0.3f, 0.7f, 0.55f, 0.45f,
                                      0.7f, 0.3f, 0.5f, 0.5f, 0.45f, 0.55f};

MoeConfig make_config(int64_t tokens, int32_t experts, int32_t top_k, int32_t world, double cf) {
  MoeConfig c;
  c.tokens = tokens;
  c.hidden = 4;
  c.ffn = 4;
  c.experts = experts;
  c.top_k = top_k;
  c.world = world;
  c.capacity_factor = cf;
  return c;
}

void expect_consistent(const SendPlan& p) {
  // Every kept assignment's row points back at it, and rows of an expert are in token order.
  for (int64_t a = 0; a < p.tokens * p.top_k; ++a) {
    const int32_t row = p.slot[a];
    if (row < 0) continue;
    EXPECT_EQ(p.row_token[row], a / p.top_k) << "row " << row;
    EXPECT_EQ(p.row_choice[row], a % p.top_k) << "row " << row;
  }
  for (int32_t e = 0; e < p.experts; ++e)
    for (int64_t r = p.offsets[e] + 1; r < p.offsets[e + 1]; ++r)
      EXPECT_LT(p.row_token[r - 1], p.row_token[r]) << "expert " << e << " row " << r;
}

TEST(DispatchPlanSend, CapacityDropsLatestTokens) {
  // cf = 1: C = ceil(1 · 6 · 2 / 3) = 4; expert 0 keeps t0..t3 and drops t4 (a9) and t5 (a10).
  const MoeConfig c = make_config(6, 3, 2, 1, 1.0);
  ASSERT_EQ(c.capacity(), 4);
  const SendPlan p = build_send_plan(kIds6.data(), kWeights6.data(), 6, 2, 3, c.capacity(),
                                     DropPolicy::latest_tokens);
  EXPECT_EQ(p.routed, (I64{6, 3, 3}));
  EXPECT_EQ(p.counts, (I64{4, 3, 3}));
  EXPECT_EQ(p.offsets, (I64{0, 4, 7, 10}));
  EXPECT_EQ(p.rows(), 10);
  EXPECT_EQ(p.dropped(), 2);
  EXPECT_EQ(p.slot, (I32{0, 4, 1, 7, 5, 2, 3, 6, 8, -1, -1, 9}));
  EXPECT_EQ(p.row_token, (I32{0, 1, 2, 3, /*e1*/ 0, 2, 3, /*e2*/ 1, 4, 5}));
  EXPECT_EQ(p.row_choice, (I32{0, 0, 1, 0, /*e1*/ 1, 0, 1, /*e2*/ 1, 0, 1}));
  expect_consistent(p);
}

TEST(DispatchPlanSend, CapacityDropsLowestWeight) {
  // Expert 0 by weight: t3 .7, t0 .6, t4 .5, t2 .45, t5 .45, t1 .3 → keeps t0, t2, t3, t4 (t2 beats
  // t5 on the tie by being earlier) and drops t1 (a2) and t5 (a10); rows stay in token order.
  const SendPlan p =
      build_send_plan(kIds6.data(), kWeights6.data(), 6, 2, 3, 4, DropPolicy::lowest_weight);
  EXPECT_EQ(p.routed, (I64{6, 3, 3}));
  EXPECT_EQ(p.counts, (I64{4, 3, 3}));
  EXPECT_EQ(p.offsets, (I64{0, 4, 7, 10}));
  EXPECT_EQ(p.dropped(), 2);
  EXPECT_EQ(p.slot, (I32{0, 4, -1, 7, 5, 1, 2, 6, 8, 3, -1, 9}));
  EXPECT_EQ(p.row_token, (I32{0, 2, 3, 4, /*e1*/ 0, 2, 3, /*e2*/ 1, 4, 5}));
  EXPECT_EQ(p.row_choice, (I32{0, 1, 0, 1, /*e1*/ 1, 0, 1, /*e2*/ 1, 0, 1}));
  expect_consistent(p);
}

TEST(DispatchPlanSend, LowestWeightWithEqualWeightsIsLatestTokens) {
  const std::vector<float> equal(12, 0.5f);
  const SendPlan a = build_send_plan(kIds6.data(), equal.data(), 6, 2, 3, 4, DropPolicy::lowest_weight);
  const SendPlan b = build_send_plan(kIds6.data(), equal.data(), 6, 2, 3, 4, DropPolicy::latest_tokens);
  EXPECT_EQ(a.slot, b.slot);
  EXPECT_EQ(a.row_token, b.row_token);
}

TEST(DispatchPlanSend, DroplessKeepsEverything) {
  for (DropPolicy policy : {DropPolicy::latest_tokens, DropPolicy::lowest_weight}) {
    const SendPlan p = build_send_plan(kIds6.data(), kWeights6.data(), 6, 2, 3, -1, policy);
    EXPECT_EQ(p.routed, (I64{6, 3, 3}));
    EXPECT_EQ(p.counts, (I64{6, 3, 3}));
    EXPECT_EQ(p.offsets, (I64{0, 6, 9, 12}));
    EXPECT_EQ(p.dropped(), 0);
    EXPECT_EQ(p.slot, (I32{0, 6, 1, 9, 7, 2, 3, 8, 10, 4, 5, 11}));
    EXPECT_EQ(p.row_token, (I32{0, 1, 2, 3, 4, 5, /*e1*/ 0, 2, 3, /*e2*/ 1, 4, 5}));
    expect_consistent(p);
  }
  // A capacity at least the largest routed count keeps everything too.
  const SendPlan p = build_send_plan(kIds6.data(), kWeights6.data(), 6, 2, 3, 6, DropPolicy::latest_tokens);
  EXPECT_EQ(p.dropped(), 0);
  EXPECT_EQ(p.slot, (I32{0, 6, 1, 9, 7, 2, 3, 8, 10, 4, 5, 11}));
}

TEST(DispatchPlanSend, AllTokensToOneExpert) {
  // T = 5, k = 1, E = 4, everything to expert 2; experts 0, 1, 3 receive nothing.
  const I32 ids(5, 2);
  const std::vector<float> w = {0.1f, 0.9f, 0.5f, 0.9f, 0.2f};
  SendPlan p = build_send_plan(ids.data(), w.data(), 5, 1, 4, -1, DropPolicy::latest_tokens);
  EXPECT_EQ(p.routed, (I64{0, 0, 5, 0}));
  EXPECT_EQ(p.counts, (I64{0, 0, 5, 0}));
  EXPECT_EQ(p.offsets, (I64{0, 0, 0, 5, 5}));
  EXPECT_EQ(p.slot, (I32{0, 1, 2, 3, 4}));
  EXPECT_EQ(p.row_token, (I32{0, 1, 2, 3, 4}));
  EXPECT_EQ(p.row_choice, (I32{0, 0, 0, 0, 0}));

  p = build_send_plan(ids.data(), w.data(), 5, 1, 4, 2, DropPolicy::latest_tokens);
  EXPECT_EQ(p.counts, (I64{0, 0, 2, 0}));
  EXPECT_EQ(p.offsets, (I64{0, 0, 0, 2, 2}));
  EXPECT_EQ(p.dropped(), 3);
  EXPECT_EQ(p.slot, (I32{0, 1, -1, -1, -1}));
  EXPECT_EQ(p.row_token, (I32{0, 1}));

  p = build_send_plan(ids.data(), w.data(), 5, 1, 4, 2, DropPolicy::lowest_weight);
  EXPECT_EQ(p.slot, (I32{-1, 0, -1, 1, -1}));  // the two 0.9s
  EXPECT_EQ(p.row_token, (I32{1, 3}));
}

TEST(DispatchPlanSend, RejectsInvalidExpertId) {
  const std::vector<float> w(4, 0.5f);
  for (int32_t bad : {3, -1}) {
    const I32 ids = {0, 1, 2, bad};
    try {
      build_send_plan(ids.data(), w.data(), 2, 2, 3, -1, DropPolicy::latest_tokens);
      ADD_FAILURE() << "expert id " << bad << " accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token 1 choice 1 has expert id " + std::to_string(bad)), std::string::npos) << msg;
    }
  }
}

TEST(DispatchPlanFull, ThreeRanksWithCapacity) {
  // W = 3, E = 3 (one expert per rank), T = 6, k = 2, cf = 1 → C = 4 per (source rank, expert).
  const MoeConfig c = make_config(6, 3, 2, 3, 1.0);
  ASSERT_EQ(c.capacity(), 4);
  const I32 ids1 = {1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2};  // nothing to expert 0
  const I32 ids2 = {2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0};  // nothing to expert 1
  const std::vector<float> w(12, 0.5f);
  const DispatchPlan plan = build_dispatch_plan(c, {kIds6.data(), ids1.data(), ids2.data()},
                                                {kWeights6.data(), w.data(), w.data()});
  ASSERT_EQ(plan.send.size(), 3u);
  ASSERT_EQ(plan.recv.size(), 3u);

  EXPECT_EQ(plan.send[0].counts, (I64{4, 3, 3}));
  EXPECT_EQ(plan.send[0].slot, (I32{0, 4, 1, 7, 5, 2, 3, 6, 8, -1, -1, 9}));
  for (int32_t d = 0; d < 3; ++d) {
    EXPECT_EQ(plan.send[0].rank_count(d, 1), (I64{4, 3, 3})[d]);
    EXPECT_EQ(plan.send[0].rank_offset(d, 1), (I64{0, 4, 7})[d]);
  }

  EXPECT_EQ(plan.send[1].routed, (I64{0, 6, 6}));
  EXPECT_EQ(plan.send[1].counts, (I64{0, 4, 4}));
  EXPECT_EQ(plan.send[1].offsets, (I64{0, 0, 4, 8}));
  EXPECT_EQ(plan.send[1].dropped(), 4);
  EXPECT_EQ(plan.send[1].slot, (I32{0, 4, 1, 5, 2, 6, 3, 7, -1, -1, -1, -1}));

  EXPECT_EQ(plan.send[2].counts, (I64{4, 0, 4}));
  EXPECT_EQ(plan.send[2].offsets, (I64{0, 4, 4, 8}));
  EXPECT_EQ(plan.send[2].slot, (I32{4, 0, 5, 1, 6, 2, 7, 3, -1, -1, -1, -1}));
  EXPECT_EQ(plan.send[2].row_token, (I32{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(plan.send[2].row_choice, (I32{1, 1, 1, 1, 0, 0, 0, 0}));

  // Receive side: rank d holds expert d, fed by sources 0, 1, 2.
  const std::vector<I64> recv_counts = {{4, 0, 4}, {3, 4, 0}, {3, 4, 4}};
  const std::vector<I64> recv_offsets = {{0, 4, 4}, {0, 3, 7}, {0, 3, 7}};
  const I64 totals = {8, 7, 11};
  for (int32_t d = 0; d < 3; ++d) {
    const ExpertBatchLayout& l = plan.recv[d];
    EXPECT_EQ(l.counts, recv_counts[d]) << "dest " << d;
    EXPECT_EQ(l.recv_offsets, recv_offsets[d]) << "dest " << d;
    EXPECT_EQ(l.batch_offsets, recv_offsets[d]) << "dest " << d << ": one local expert, same order";
    EXPECT_EQ(l.source_counts, recv_counts[d]) << "dest " << d;
    EXPECT_EQ(l.expert_offsets, (I64{0, totals[d]})) << "dest " << d;
    EXPECT_EQ(l.rows(), totals[d]);
  }
}

TEST(DispatchPlanFull, RejectsWrongRankCount) {
  const MoeConfig c = make_config(6, 3, 2, 3, 0);
  EXPECT_THROW(build_dispatch_plan(c, {kIds6.data()}, {kWeights6.data()}), Error);
}

TEST(DispatchPlanLayout, TwoRanksTwoLocalExperts) {
  // counts [W=2, Le=2]: rank 0 sends 2 rows to local expert 0 and 3 to expert 1; rank 1 sends 1 and 4.
  const I64 counts = {2, 3, 1, 4};
  const ExpertBatchLayout l = build_expert_batch_layout(counts.data(), 2, 2);
  // Receive buffer, source-major: [r0e0: 0..1][r0e1: 2..4][r1e0: 5][r1e1: 6..9].
  EXPECT_EQ(l.recv_offsets, (I64{0, 2, 5, 6}));
  EXPECT_EQ(l.source_counts, (I64{5, 5}));
  EXPECT_EQ(l.source_offsets, (I64{0, 5, 10}));
  // Batch, expert-major and (source rank) inside: [e0: r0 0..1, r1 2][e1: r0 3..5, r1 6..9].
  EXPECT_EQ(l.batch_offsets, (I64{0, 3, 2, 6}));
  EXPECT_EQ(l.expert_offsets, (I64{0, 3, 10}));
  EXPECT_EQ(l.rows(), 10);
  EXPECT_EQ(l.expert_rows(0), 3);
  EXPECT_EQ(l.expert_rows(1), 7);
}

TEST(DispatchPlanLayout, RejectsNegativeCount) {
  const I64 counts = {2, -1};
  EXPECT_THROW(build_expert_batch_layout(counts.data(), 1, 2), Error);
}

// Rows tagged (source rank, token, column) travel: gather → all-to-all (concatenate each source's
// segment for the destination) → receive buffer → expert batch, which must list each expert's rows in
// (source rank, token) order; the reverse permutation must restore the receive buffer exactly.
TEST(DispatchPlanLayout, TwoRanksEndToEnd) {
  const MoeConfig c = make_config(4, 4, 2, 2, 0);  // dropless
  const I32 ids0 = {0, 2, 3, 0, 1, 0, 2, 3};
  const I32 ids1 = {1, 3, 0, 1, 3, 2, 0, 2};
  const std::vector<float> w(8, 0.5f);
  const DispatchPlan plan = build_dispatch_plan(c, {ids0.data(), ids1.data()}, {w.data(), w.data()});
  EXPECT_EQ(plan.send[0].counts, (I64{3, 1, 2, 2}));
  EXPECT_EQ(plan.send[1].counts, (I64{2, 2, 2, 2}));
  EXPECT_EQ(plan.send[0].rank_count(1, 2), 4);
  EXPECT_EQ(plan.send[0].rank_offset(1, 2), 4);
  EXPECT_EQ(plan.recv[0].counts, (I64{3, 1, 2, 2}));
  EXPECT_EQ(plan.recv[0].recv_offsets, (I64{0, 3, 4, 6}));
  EXPECT_EQ(plan.recv[0].batch_offsets, (I64{0, 5, 3, 6}));
  EXPECT_EQ(plan.recv[0].expert_offsets, (I64{0, 5, 8}));
  EXPECT_EQ(plan.recv[1].recv_offsets, (I64{0, 2, 4, 6}));
  EXPECT_EQ(plan.recv[1].batch_offsets, (I64{0, 4, 2, 6}));
  EXPECT_EQ(plan.recv[1].expert_offsets, (I64{0, 4, 8}));

  const int64_t hidden = 2;
  auto tag = [](int32_t rank, int32_t token, int64_t col) { return float(rank * 1000 + token * 10 + col); };
  std::vector<std::vector<float>> send(2);
  for (int32_t r = 0; r < 2; ++r) {
    std::vector<float> x(c.tokens * hidden);
    for (int32_t t = 0; t < c.tokens; ++t)
      for (int64_t i = 0; i < hidden; ++i) x[t * hidden + i] = tag(r, t, i);
    send[r].resize(plan.send[r].rows() * hidden);
    cpu::gather_rows(x.data(), plan.send[r].row_token.data(), send[r].data(), plan.send[r].rows(), hidden);
  }
  // Expected (source rank, token) of each batch row, experts 0, 1 on rank 0 and 2, 3 on rank 1.
  const std::vector<std::vector<std::pair<int32_t, int32_t>>> expected = {
      {{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 3}, /*e1*/ {0, 2}, {1, 0}, {1, 1}},
      {{0, 0}, {0, 3}, {1, 2}, {1, 3}, /*e3*/ {0, 1}, {0, 3}, {1, 0}, {1, 2}}};
  for (int32_t d = 0; d < 2; ++d) {
    const ExpertBatchLayout& l = plan.recv[d];
    std::vector<float> recv;
    for (int32_t r = 0; r < 2; ++r) {
      const int64_t begin = plan.send[r].rank_offset(d, 2) * hidden;
      recv.insert(recv.end(), send[r].begin() + begin,
                  send[r].begin() + begin + plan.send[r].rank_count(d, 2) * hidden);
    }
    ASSERT_EQ(int64_t(recv.size()), l.rows() * hidden);
    std::vector<float> batch(recv.size(), -1.0f);
    cpu::permute_segments(recv.data(), batch.data(), l.recv_offsets.data(), l.batch_offsets.data(),
                          l.counts.data(), 4, hidden);
    for (int64_t row = 0; row < l.rows(); ++row)
      for (int64_t i = 0; i < hidden; ++i)
        EXPECT_EQ(batch[row * hidden + i], tag(expected[d][row].first, expected[d][row].second, i))
            << "dest " << d << " batch row " << row;
    std::vector<float> back(recv.size(), -1.0f);
    cpu::permute_segments(batch.data(), back.data(), l.batch_offsets.data(), l.recv_offsets.data(),
                          l.counts.data(), 4, hidden);
    EXPECT_EQ(back, recv) << "dest " << d;
  }
}

TEST(DispatchPlanTiles, TileHeights) {
  // Three local experts with 5, 0 and 2 rows.
  const I64 counts = {5, 0, 2};
  const ExpertBatchLayout l = build_expert_batch_layout(counts.data(), 1, 3);
  auto as_tuples = [](const std::vector<Tile>& tiles) {
    std::vector<std::array<int64_t, 3>> out;
    for (const Tile& t : tiles) out.push_back({t.local_expert, t.rows, t.row_begin});
    return out;
  };
  using Tiles = std::vector<std::array<int64_t, 3>>;
  EXPECT_EQ(as_tuples(l.tiles(1)),
            (Tiles{{0, 1, 0}, {0, 1, 1}, {0, 1, 2}, {0, 1, 3}, {0, 1, 4}, {2, 1, 5}, {2, 1, 6}}));
  EXPECT_EQ(as_tuples(l.tiles(3)), (Tiles{{0, 3, 0}, {0, 2, 3}, {2, 2, 5}}));
  EXPECT_EQ(as_tuples(l.tiles(64)), (Tiles{{0, 5, 0}, {2, 2, 5}}));  // taller than any batch
  EXPECT_THROW(l.tiles(0), Error);
  const I64 none = {0, 0};
  EXPECT_TRUE(build_expert_batch_layout(none.data(), 1, 2).tiles(4).empty());
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

TEST(DispatchPlanTilePadding, ExpertBatchesArePaddedToTheRowMultiple) {
  // W = 2 sources, 3 local experts: rows (source 0, source 1) = (2, 3), (0, 0), (4, 1).
  const std::vector<int64_t> counts{2, 0, 4, 3, 0, 1};
  const ExpertBatchLayout l = build_expert_batch_layout(counts.data(), 2, 3, 4);
  EXPECT_EQ(l.expert_offsets, (std::vector<int64_t>{0, 8, 8, 16}));   // 5 -> 8, 0 -> 0, 5 -> 8
  EXPECT_EQ(l.batch_offsets, (std::vector<int64_t>{0, 8, 8, 2, 8, 12}));  // [r * Le + e]
  EXPECT_EQ(l.source_offsets, (std::vector<int64_t>{0, 6, 10}));       // the receive side is unchanged
  EXPECT_TRUE(l.padded());
  EXPECT_EQ(l.rows(), 16);
  EXPECT_THROW(build_expert_batch_layout(counts.data(), 2, 3, 0), Error);
}

}  // namespace
}  // namespace dmoe
