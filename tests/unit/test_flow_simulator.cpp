// test_flow_simulator.cpp — Flow's priority rule (src/flow/comm_queue.*) and the discrete-event simulator
// (src/flow/simulator.*): the rule step by step, analytic step times (vanilla = sum of costs, a two-stream
// pipeline by hand), the bounds every schedule must respect, the per-communicator orders under random
// timings, the paper's property (backward with chunked AR under the rule is never slower than backward
// followed by the same all-reduce) on many random cost sets, the trace JSON and the cost file's errors.
//
// Run: dmoe_unit_tests --gtest_filter='FlowCommQueue*:FlowSimulator*'
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include <nlohmann/json.hpp>

#include "flow_test_util.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "flow/ablation.hpp"
#include "flow/comm_queue.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/simulator.hpp"

namespace dmoe::flow {
namespace {

using nlohmann::json;

using test::error_of;
using test::spec_of;

int32_t find(const TaskGraph& g, const std::string& name) {
  for (const Task& t : g.tasks)
    if (g.describe(t.id) == name) return t.id;
  ADD_FAILURE() << "no task " << name;
  return -1;
}

// ---- the priority rule ---------------------------------------------------------------------------------

TEST(FlowCommQueue, StrictPriorityNonPreemptiveFixedOrder) {
  // L = 2, R = 1, 1 MiB per layer in chunks of 512 KiB: layer 1's two chunks are ready after AT'[l=1].
  const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, 2, 1, 1 << 20, 512 << 10));
  ASSERT_EQ(g.allreduce_order.size(), 4u);
  for (LinkModel link : {LinkModel::exclusive, LinkModel::separate}) {
    CommQueue q(g, link);
    std::vector<uint8_t> done(g.tasks.size(), 0);
    // Nothing is ready at the start.
    EXPECT_EQ(q.pick(done).alltoall, -1);
    EXPECT_EQ(q.pick(done).allreduce, -1);
    // Run every task up to and including AT'[l=1] (forward, layer 1's backward), through the queue.
    const int32_t at_bwd_1 = find(g, "AT'[l=1,r=0]");
    for (int32_t id = 0; id <= at_bwd_1; ++id) {
      if (g.tasks[size_t(id)].stream == Stream::alltoall) {
        ASSERT_EQ(q.pick(done).alltoall, id) << g.describe(id);
        q.started(id);
        q.finished(id);
      }
      done[size_t(id)] = 1;
    }
    // C'[l=0] and chunk 0 are both ready: the all-to-all goes, the chunk does not.
    const int32_t c0 = find(g, "C'[l=0,r=0]"), d0 = find(g, "D'[l=0,r=0]");
    CommQueue::Pick p = q.pick(done);
    EXPECT_EQ(p.alltoall, c0);
    EXPECT_EQ(p.allreduce, -1);
    q.started(c0);
    EXPECT_EQ(q.pick(done).allreduce, -1) << "a chunk must not start while an all-to-all runs";
    q.finished(c0);
    done[size_t(c0)] = 1;
    // D'[l=0] waits for E'[l=0]: nothing all-to-all is ready or running, so chunk 0 starts.
    p = q.pick(done);
    EXPECT_EQ(p.alltoall, -1);
    EXPECT_EQ(p.allreduce, g.allreduce_order[0]);
    q.started(g.allreduce_order[0]);
    EXPECT_EQ(q.pick(done).allreduce, -1) << "one chunk at a time";
    // E'[l=0] completes while the chunk runs: D'[l=0] is ready.
    done[size_t(find(g, "E'[l=0,r=0]"))] = 1;
    p = q.pick(done);
    EXPECT_EQ(p.allreduce, -1);
    if (link == LinkModel::exclusive) {
      EXPECT_EQ(p.alltoall, -1) << "non-preemptive: the chunk keeps the link";
      q.finished(g.allreduce_order[0]);
      p = q.pick(done);
      EXPECT_EQ(p.alltoall, d0);
      EXPECT_EQ(p.allreduce, -1) << "chunk 1 is ready but the all-to-all goes first";
    } else {
      EXPECT_EQ(p.alltoall, d0) << "on its own communicator the all-to-all never waits for a chunk";
      q.finished(g.allreduce_order[0]);
    }
    // Issuing out of the static order is refused.
    EXPECT_NE(error_of([&] { q.started(g.allreduce_order[2]); }).find("out of order"), std::string::npos);
    EXPECT_NE(error_of([&] { q.finished(g.allreduce_order[3]); }).find("not running"), std::string::npos);
  }
}

// ---- the simulator ---------------------------------------------------------------------------------------

std::vector<double> random_costs(const TaskGraph& g, Rng& rng, double zero_fraction = 0.1) {
  std::vector<double> c(g.tasks.size());
  for (double& x : c) x = rng.uniform() < zero_fraction ? 0.0 : 2.0 * rng.uniform();
  return c;
}

double critical_path(const TaskGraph& g, const std::vector<double>& c) {
  std::vector<double> finish(g.tasks.size(), 0);  // deps have smaller ids (the builder's creation order)
  double best = 0;
  for (const Task& t : g.tasks) {
    double s = 0;
    for (int32_t d : t.deps) s = std::max(s, finish[size_t(d)]);
    finish[size_t(t.id)] = s + c[size_t(t.id)];
    best = std::max(best, finish[size_t(t.id)]);
  }
  return best;
}

TEST(FlowSimulator, VanillaStepIsTheSumOfCosts) {
  Rng rng(7);
  for (int L : {1, 3})
    for (int R : {1, 2, 4}) {
      const TaskGraph g = build_task_graph(spec_of(Schedule::vanilla, L, R));
      const std::vector<double> c = random_costs(g, rng);
      const SimResult r = simulate(g, c);
      const double sum = std::accumulate(c.begin(), c.end(), 0.0);
      EXPECT_NEAR(r.step_ms, sum, 1e-9 * sum);
      EXPECT_NEAR(r.compute_busy_ms + r.alltoall_busy_ms + r.allreduce_busy_ms, sum, 1e-9 * sum);
      // One task at a time: each starts when the previous one ends.
      for (size_t i = 1; i < r.events.size(); ++i) EXPECT_EQ(r.events[i].start_ms, r.events[i - 1].end_ms);
    }
}

TEST(FlowSimulator, TwoStreamPipelineByHand) {
  // L = 1, R = 2, every forward task 1 ms, backward and AR free:
  //   compute  AT0 [0,1] AT1 [1,2] E0 [2,3] E1 [3,4]
  //   link            D0 [1,2] D1 [2,3] C0 [3,4] C1 [4,5]      -> 5 ms (vanilla: 8)
  const TaskGraph g = build_task_graph(spec_of(Schedule::pipe_attn, 1, 2, 0));
  std::vector<double> c(g.tasks.size(), 0.0);
  for (int32_t i = 0; i < g.num_forward_tasks; ++i) c[size_t(i)] = 1.0;
  const SimResult r = simulate(g, c);
  EXPECT_DOUBLE_EQ(r.step_ms, 5.0);
  EXPECT_DOUBLE_EQ(r.forward_end_ms, 5.0);
  EXPECT_DOUBLE_EQ(r.compute_busy_ms, 4.0);
  EXPECT_DOUBLE_EQ(r.alltoall_busy_ms, 4.0);
  for (const TraceEvent& e : r.events)
    if (g.describe(e.task) == "C[l=0,r=1]") EXPECT_DOUBLE_EQ(e.start_ms, 4.0);
  const TaskGraph v = build_task_graph(spec_of(Schedule::vanilla, 1, 2, 0));
  std::vector<double> cv(v.tasks.size(), 0.0);
  for (int32_t i = 0; i < v.num_forward_tasks; ++i) cv[size_t(i)] = 1.0;
  EXPECT_DOUBLE_EQ(simulate(v, cv).step_ms, 8.0);
  // pipe-moe: AT on the whole batch (2 ms), then the MoE pipeline: D0 [2,3] E0 [3,4] D1 [3,4] E1 [4,5]
  // C0 [4,5] C1 [5,6] -> 6 ms.
  const TaskGraph m = build_task_graph(spec_of(Schedule::pipe_moe, 1, 2, 0));
  std::vector<double> cm(m.tasks.size(), 0.0);
  for (int32_t i = 0; i < m.num_forward_tasks; ++i) cm[size_t(i)] = m.tasks[size_t(i)].micro_batch < 0 ? 2.0 : 1.0;
  EXPECT_DOUBLE_EQ(simulate(m, cm).step_ms, 6.0);
}

TEST(FlowSimulator, BoundsOrdersAndRuleOnRandomCosts) {
  Rng rng(11);
  for (int trial = 0; trial < 60; ++trial)
    for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar}) {
      const int L = 1 + int(rng.next() % 3), R = 1 << (rng.next() % 3);
      const TaskGraph g = build_task_graph(spec_of(s, L, R, 1 << 20, int64_t(64 << 10) << (rng.next() % 5)));
      const std::vector<double> c = random_costs(g, rng);
      const SimResult r = simulate(g, c);
      SCOPED_TRACE(::testing::Message() << schedule_name(s) << " L=" << L << " R=" << R << " trial " << trial);
      ASSERT_EQ(r.events.size(), g.tasks.size());
      const double sum = std::accumulate(c.begin(), c.end(), 0.0), eps = 1e-9 * (1 + sum);
      EXPECT_LE(r.step_ms, sum + eps);
      EXPECT_GE(r.step_ms + eps, critical_path(g, c));
      EXPECT_GE(r.step_ms + eps, r.compute_busy_ms);
      EXPECT_GE(r.step_ms + eps, r.alltoall_busy_ms + r.allreduce_busy_ms);  // one link (exclusive)
      std::vector<double> start(g.tasks.size()), end(g.tasks.size());
      for (const TraceEvent& e : r.events) start[size_t(e.task)] = e.start_ms, end[size_t(e.task)] = e.end_ms;
      for (const Task& t : g.tasks)
        for (int32_t d : t.deps) EXPECT_GE(start[size_t(t.id)], end[size_t(d)]) << g.describe(t.id);
      // Each stream starts its tasks in the graph's order, whatever the costs: every rank, with its own
      // timings, issues the same sequence on each communicator.
      for (Stream st : {Stream::compute, Stream::alltoall, Stream::allreduce})
        EXPECT_EQ(r.start_order(g, st), g.order(st)) << stream_name(st);
      // The link carries one collective at a time, and a chunk starts only when the next all-to-all is not
      // ready (some dependency still running).
      // (events are in start order; zero-cost tasks may share a start time with the next one).
      const TraceEvent* previous_link = nullptr;
      for (size_t i = 0; i < r.events.size(); ++i) {
        const TraceEvent& e = r.events[i];
        const Stream st = g.tasks[size_t(e.task)].stream;
        if (st == Stream::compute) continue;
        if (previous_link) EXPECT_GE(e.start_ms, previous_link->end_ms) << g.describe(e.task);
        previous_link = &e;
        if (st != Stream::allreduce || e.end_ms == e.start_ms) continue;  // a chunk that takes no time holds nothing
        for (size_t k = i + 1; k < r.events.size(); ++k)
          if (g.tasks[size_t(r.events[k].task)].stream == Stream::alltoall) {  // the next all-to-all issued
            const int32_t a = r.events[k].task;
            bool waiting = false;
            for (int32_t d : g.tasks[size_t(a)].deps) waiting |= end[size_t(d)] > e.start_ms;
            EXPECT_TRUE(waiting) << g.describe(e.task) << " started at " << e.start_ms << " while "
                                 << g.describe(a) << " was ready";
            break;
          }
      }
    }
}

TEST(FlowSimulator, ChunkedAllReduceNeverSlowerThanAllReduceAfterBackward) {
  // FlowMoE's property, on random cost sets: with the priority rule, backward with the AR chunks interleaved
  // ends no later than backward alone followed by the same chunks back to back; with alpha = 0 that is
  // the whole AR after backward (pipe-attn).
  Rng rng(2026);
  int strictly_better = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int L = 1 + int(rng.next() % 4), R = 1 << (rng.next() % 3);
    const int64_t dense = int64_t(1 + rng.next() % (4 << 20));
    const int64_t chunk = int64_t(64 << 10) << (rng.next() % 6);
    CostModel costs;
    for (int k = 0; k < 8; ++k) {
      costs.tasks[size_t(k)].fixed_ms = rng.uniform() < 0.3 ? 0.0 : 0.2 * rng.uniform();
      costs.tasks[size_t(k)].batch_ms = rng.uniform() < 0.1 ? 0.0 : 3.0 * rng.uniform();
    }
    const bool no_alpha = trial % 2 == 0;
    costs.ar_alpha_ms = no_alpha ? 0.0 : 0.1 * rng.uniform();
    costs.ar_bytes_per_ms = 1e5 + 2e6 * rng.uniform();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " L=" << L << " R=" << R << " dense=" << dense
                                      << " chunk=" << chunk);
    const TaskGraph chunked = build_task_graph(spec_of(Schedule::chunked_ar, L, R, dense, chunk));
    const TaskGraph alone = build_task_graph(spec_of(Schedule::chunked_ar, L, R, 0, chunk));
    const SimResult with_ar = simulate(chunked, costs), without = simulate(alone, costs);
    EXPECT_LE(with_ar.step_ms, without.step_ms + with_ar.allreduce_busy_ms + 1e-9 * with_ar.step_ms);
    // The same bound when the chunks are issued as the executors do (separate communicators) and share the
    // link's bandwidth with a concurrent all-to-all instead of excluding it.
    const SimResult with_shared = simulate(chunked, costs, LinkModel::shared);
    EXPECT_LE(with_shared.step_ms, without.step_ms + with_shared.allreduce_busy_ms + 1e-9 * with_shared.step_ms);
    if (no_alpha) {
      const TaskGraph whole = build_task_graph(spec_of(Schedule::pipe_attn, L, R, dense, chunk));
      const SimResult after = simulate(whole, costs);
      EXPECT_LE(with_ar.step_ms, after.step_ms + 1e-9 * after.step_ms);
      strictly_better += with_ar.step_ms < after.step_ms - 1e-9;
    }
  }
  EXPECT_GT(strictly_better, 50) << "the overlap should usually help, not only tie";
}

TEST(FlowSimulator, SharedLinkSplitsBandwidthBetweenOverlappingTransfers) {
  // LinkModel::shared on random cost sets: the link is work-conserving — the wall time during which some transfer
  // is in flight equals the summed transfer costs (one at full speed or two at half), where `separate` lets them
  // overlap for free (shorter) — and no step is shorter than with free overlap. The issue order is separate's.
  Rng rng(77);
  int overlapped = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int L = 1 + int(rng.next() % 3), R = 1 << (rng.next() % 3);
    CostModel costs;
    for (int k = 0; k < 8; ++k) {
      costs.tasks[size_t(k)].fixed_ms = 0.2 * rng.uniform();
      costs.tasks[size_t(k)].batch_ms = 0.1 + 3.0 * rng.uniform();
    }
    costs.ar_alpha_ms = 0.05 * rng.uniform();
    costs.ar_bytes_per_ms = 1e5 + 2e6 * rng.uniform();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " L=" << L << " R=" << R);
    const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, L, R, 1 << 20, 128 << 10));
    const SimResult shared = simulate(g, costs, LinkModel::shared), free = simulate(g, costs, LinkModel::separate);
    auto link_union = [&](const SimResult& r) {  // measure of the union of the transfers' intervals
      std::vector<std::pair<double, double>> spans;
      for (const TraceEvent& e : r.events)
        if (g.tasks[size_t(e.task)].stream != Stream::compute) spans.emplace_back(e.start_ms, e.end_ms);
      std::sort(spans.begin(), spans.end());
      double total = 0, lo = 0, hi = -1;
      for (const auto& [a, b] : spans) {
        if (a > hi) {
          total += std::max(0.0, hi - lo);
          lo = a;
          hi = b;
        } else {
          hi = std::max(hi, b);
        }
      }
      return total + std::max(0.0, hi - lo);
    };
    const double work = shared.alltoall_busy_ms + shared.allreduce_busy_ms;
    EXPECT_NEAR(link_union(shared), work, 1e-9 * work);
    EXPECT_GE(shared.step_ms, free.step_ms - 1e-9 * free.step_ms);
    for (const TraceEvent& e : shared.events) EXPECT_GE(e.end_ms - e.start_ms, 0);
    overlapped += link_union(free) < work - 1e-9 * work;
  }
  EXPECT_GT(overlapped, 20) << "the cases should include transfers that overlap under the separate model";
  // By hand: vanilla has no overlap (the whole AR after backward), so sharing changes nothing.
  CostModel c;
  for (int k = 0; k < 8; ++k) c.tasks[size_t(k)].batch_ms = 1.0 + k;
  const TaskGraph v = build_task_graph(spec_of(Schedule::vanilla, 2, 1, 1 << 20, 1 << 20));
  EXPECT_DOUBLE_EQ(simulate(v, c, LinkModel::shared).step_ms, simulate(v, c, LinkModel::separate).step_ms);
  EXPECT_THROW(simulate_ranks(v, {task_costs_ms(v, c)}, LinkModel::shared), Error);
}

TEST(FlowSimulator, OneCommunicatorRunsItsFixedOrder) {
  // ArComm::model on the simulator: the all-to-alls and chunks go one at a time in single_comm_issue_order's order
  // (the GPU executor's, flow/cuda_executor.hpp), each after its dependencies; compute keeps its own order. On
  // random costs, at every chunks-per-gap setting.
  Rng rng(31);
  for (int trial = 0; trial < 100; ++trial) {
    const int L = 1 + int(rng.next() % 3), R = 1 << (rng.next() % 3);
    const int32_t per_gap = int32_t(rng.next() % 3);
    const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, L, R, 1 << 20, 256 << 10));
    std::vector<double> cost(g.tasks.size());
    for (double& c : cost) c = 0.05 + rng.uniform();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " L=" << L << " R=" << R << " per gap " << per_gap);
    const std::vector<int32_t> order = single_comm_issue_order(g, per_gap);
    const SimResult r = simulate_one_communicator(g, cost, order);
    std::vector<double> start(g.tasks.size(), -1), end(g.tasks.size(), -1);
    for (const TraceEvent& e : r.events) start[size_t(e.task)] = e.start_ms, end[size_t(e.task)] = e.end_ms;
    double link_free = 0;
    for (int32_t id : order) {
      if (g.tasks[size_t(id)].stream == Stream::compute) continue;
      EXPECT_GE(start[size_t(id)], link_free - 1e-12) << g.describe(id) << " overlaps the previous operation";
      link_free = end[size_t(id)];
    }
    double compute_free = 0;
    for (int32_t id : g.compute_order) {
      EXPECT_GE(start[size_t(id)], compute_free - 1e-12) << g.describe(id);
      compute_free = end[size_t(id)];
    }
    for (const Task& t : g.tasks)
      for (int32_t d : t.deps) EXPECT_GE(start[size_t(t.id)], end[size_t(d)] - 1e-12) << g.describe(t.id);
  }
  // An order that is not the graph's collectives, each once, is refused.
  const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, 2, 2, 1 << 20, 256 << 10));
  std::vector<int32_t> order = single_comm_issue_order(g, 1);
  order.erase(std::find(order.begin(), order.end(), g.allreduce_order.back()));
  EXPECT_NE(error_of([&] { simulate_one_communicator(g, std::vector<double>(g.tasks.size(), 1.0), order); })
                .find("must be the graph's alltoall_order and allreduce_order"),
            std::string::npos);
}

TEST(FlowSimulator, RanksWithDifferentTimingsNeverDeadlockWithTwoCommunicators) {
  // docs/flow.md's argument, on W ranks whose costs differ (each rank its own random costs): with the
  // all-to-alls and the AR chunks on communicators of their own every run completes and every rank issues
  // the graph's order on each communicator; with one serial communication engine per rank and the same
  // dynamic rule, some runs deadlock (a rank holds a chunk its peer will not join while the peer holds an
  // all-to-all the first will not join). With equal costs on every rank the serial engine completes too.
  Rng rng(5);
  int serial_deadlocks = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int W = 2 + int(rng.next() % 3), L = 1 + int(rng.next() % 3), R = 1 << (rng.next() % 3);
    const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, L, R, 1 << 20, int64_t(128 << 10) << (rng.next() % 3)));
    std::vector<std::vector<double>> costs(static_cast<size_t>(W));
    for (auto& c : costs) {
      c.resize(g.tasks.size());
      for (double& x : c) x = 0.05 + rng.uniform();
    }
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " W=" << W << " L=" << L << " R=" << R);
    const RanksResult sep = simulate_ranks(g, costs, LinkModel::separate);
    ASSERT_FALSE(sep.deadlocked) << sep.deadlock;
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(sep.alltoall_issue[size_t(r)], g.alltoall_order);
      EXPECT_EQ(sep.allreduce_issue[size_t(r)], g.allreduce_order);
    }
    const RanksResult serial = simulate_ranks(g, costs, LinkModel::exclusive);
    serial_deadlocks += serial.deadlocked;
    const std::vector<std::vector<double>> same(static_cast<size_t>(W), costs[0]);
    const RanksResult symmetric = simulate_ranks(g, same, LinkModel::exclusive);
    EXPECT_FALSE(symmetric.deadlocked) << symmetric.deadlock;
    // Symmetric ranks: the one-rank simulator's timeline is the step.
    EXPECT_NEAR(symmetric.step_ms, simulate(g, costs[0]).step_ms, 1e-9 * symmetric.step_ms);
  }
  EXPECT_GT(serial_deadlocks, 0) << "the hazard that motivates AR's own communicator did not show up";
}

// Known costs for the calibration tests: per task kind fixed_ms and batch_ms uniform in [lo, lo + span), the AR's
// alpha and rate, 3 MiB of dense gradients per layer.
struct Range {
  double lo, span;
};
CostModel random_costs(Rng& rng, Range fixed, Range batch, double ar_alpha_ms, double ar_bytes_per_ms, int32_t layers) {
  CostModel c;
  for (int k = 0; k < 8; ++k)
    c.tasks[size_t(k)] = {fixed.lo + fixed.span * rng.uniform(), batch.lo + batch.span * rng.uniform()};
  c.ar_alpha_ms = ar_alpha_ms;
  c.ar_bytes_per_ms = ar_bytes_per_ms;
  c.dense_grad_bytes_per_layer = 3 << 20;
  c.layers = layers;
  return c;
}

TEST(FlowSimulator, CalibrationRecoversTheCostsFromTimelines) {
  // Timelines made by the simulator from known costs: the fit must give those costs back, and the fitted model
  // must predict a third configuration exactly. Then noise of ±2 % per task: the prediction stays within 3 %.
  Rng rng(3);
  const CostModel truth = random_costs(rng, {0.05, 0.2}, {0.5, 4}, 0.07, 4e6, 3);
  const TaskGraph a = build_task_graph(spec_of(Schedule::chunked_ar, 3, 2, 3 << 20, 2 << 20));  // chunks 2 MiB + 1 MiB
  const TaskGraph b = build_task_graph(spec_of(Schedule::chunked_ar, 3, 4, 3 << 20, 2 << 20));
  const CostModel fit = fit_cost_model({{&a, simulate(a, truth).events}, {&b, simulate(b, truth).events}});
  for (int k = 0; k < 8; ++k) {
    EXPECT_NEAR(fit.tasks[size_t(k)].fixed_ms, truth.tasks[size_t(k)].fixed_ms, 1e-9) << task_kind_name(TaskKind(k));
    EXPECT_NEAR(fit.tasks[size_t(k)].batch_ms, truth.tasks[size_t(k)].batch_ms, 1e-9) << task_kind_name(TaskKind(k));
  }
  EXPECT_NEAR(fit.ar_alpha_ms, truth.ar_alpha_ms, 1e-9);
  EXPECT_NEAR(fit.ar_bytes_per_ms / truth.ar_bytes_per_ms, 1.0, 1e-9);
  const TaskGraph c = build_task_graph(spec_of(Schedule::chunked_ar, 3, 8, 3 << 20, 1 << 20));
  EXPECT_NEAR(simulate(c, fit).step_ms, simulate(c, truth).step_ms, 1e-9 * simulate(c, truth).step_ms);
  auto noisy = [&](const TaskGraph& g) {
    std::vector<TraceEvent> ev = simulate(g, truth).events;
    for (TraceEvent& e : ev) e.end_ms = e.start_ms + (e.end_ms - e.start_ms) * (0.98 + 0.04 * rng.uniform());
    return ev;
  };
  const CostModel rough = fit_cost_model({{&a, noisy(a)}, {&b, noisy(b)}, {&a, noisy(a)}, {&b, noisy(b)}});
  EXPECT_NEAR(simulate(c, rough).step_ms / simulate(c, truth).step_ms, 1.0, 0.03);
  // Round trip through the cost file's JSON.
  const CostModel back = parse_cost_model(cost_model_json(fit));
  EXPECT_EQ(back.tasks[3].batch_ms, fit.tasks[3].batch_ms);
  EXPECT_DOUBLE_EQ(back.ar_bytes_per_ms, fit.ar_bytes_per_ms);  // through GB/s: x/1e6·1e6 may move the last bit
  EXPECT_EQ(back.layers, 3);
  // AR calls of one size only: their mean time is alpha, the bytes cost nothing.
  const TaskGraph w2 = build_task_graph(spec_of(Schedule::pipe_attn, 3, 2, 3 << 20));
  const TaskGraph w4 = build_task_graph(spec_of(Schedule::pipe_attn, 3, 4, 3 << 20));
  const CostModel whole = fit_cost_model({{&w2, simulate(w2, truth).events}, {&w4, simulate(w4, truth).events}});
  EXPECT_NEAR(whole.ar_alpha_ms, truth.ar_alpha_ms + double(9 << 20) / truth.ar_bytes_per_ms, 1e-9);
  EXPECT_EQ(whole.ar_bytes_per_ms, kUnmeasuredBytesPerMs);
  // One value of R cannot separate fixed from per-batch cost.
  EXPECT_NE(error_of([&] { fit_cost_model({{&a, simulate(a, truth).events}}); }).find("measure two values of R"),
            std::string::npos);
}

TEST(FlowSimulator, CalibrationChargesIssueGapsWhenAsked) {
  // A GPU executor's timeline: each task's kernels take `dur`, but the host issues it `gap` after it could have
  // started (a wait for routing counts). Made here by simulating with dur + gap and then moving every start `gap`
  // later. Fitting the measured durations misses the gaps (the simulated step comes out short); charging each task
  // from when it could start recovers dur + gap, and predicts a third configuration exactly.
  Rng rng(5);
  const CostModel dur = random_costs(rng, {0.02, 0.1}, {0.5, 2}, 0.05, 5e6, 2);
  std::array<double, 8> gap{};
  for (int k = 0; k < 8; ++k) gap[size_t(k)] = 0.01 + 0.05 * rng.uniform();
  CostModel total = dur;  // what each task costs its stream: the gap before it and its kernels
  for (int k = 0; k < 8; ++k) total.tasks[size_t(k)].fixed_ms += gap[size_t(k)];
  auto measured = [&](const TaskGraph& g) {
    std::vector<TraceEvent> ev = simulate(g, total, LinkModel::separate).events;
    for (TraceEvent& e : ev)
      if (g.tasks[size_t(e.task)].kind != TaskKind::allreduce) e.start_ms += gap[size_t(g.tasks[size_t(e.task)].kind)];
    return ev;
  };
  for (const Schedule s : {Schedule::pipe_attn, Schedule::chunked_ar}) {  // (pipe-moe: AT on the whole batch at every R)
    SCOPED_TRACE(schedule_name(s));
    const TaskGraph a = build_task_graph(spec_of(s, 2, 1)), b = build_task_graph(spec_of(s, 2, 2));
    const TaskGraph c = build_task_graph(spec_of(s, 2, 4));
    const std::vector<MeasuredRun> runs{{&a, measured(a)}, {&b, measured(b)}};
    const double truth = simulate(c, total, LinkModel::separate).step_ms;
    const CostModel plain = fit_cost_model(runs);
    FitOptions o;
    o.charge_issue_gaps = true;
    const CostModel charged = fit_cost_model(runs, o);
    EXPECT_LT(simulate(c, plain, LinkModel::separate).step_ms, 0.99 * truth) << "the gaps were not missed";
    EXPECT_NEAR(simulate(c, charged, LinkModel::separate).step_ms, truth, 1e-9 * truth);
    EXPECT_NEAR(simulate(b, charged, LinkModel::separate).step_ms, simulate(b, total, LinkModel::separate).step_ms,
                1e-9 * truth);
  }
  // A timeline from the simulator itself has no gaps: charging them changes nothing.
  const TaskGraph a = build_task_graph(spec_of(Schedule::pipe_attn, 2, 2)), b = build_task_graph(spec_of(Schedule::pipe_attn, 2, 4));
  FitOptions o;
  o.charge_issue_gaps = true;
  const CostModel same = fit_cost_model({{&a, simulate(a, dur, LinkModel::separate).events},
                                         {&b, simulate(b, dur, LinkModel::separate).events}}, o);
  for (int k = 0; k < 8; ++k)
    EXPECT_NEAR(same.tasks[size_t(k)].fixed_ms, dur.tasks[size_t(k)].fixed_ms, 1e-9) << task_kind_name(TaskKind(k));
}

TEST(FlowSimulator, CostModelAndTrace) {
  const json j = json::parse(R"({
    "layers": 2, "dense_grad_bytes_per_layer": 2000000,
    "tasks": {"AT": {"fixed_ms": 0.1, "batch_ms": 2.0}, "D": {"batch_ms": 1.0}, "E": {"batch_ms": 3.0},
              "C": {"batch_ms": 1.0}, "C'": {"batch_ms": 1.0}, "E'": {"batch_ms": 6.0}, "D'": {"batch_ms": 1.0},
              "AT'": {"fixed_ms": 0.1, "batch_ms": 4.0}},
    "allreduce": {"alpha_ms": 0.05, "gbytes_per_s": 10}})");
  const CostModel c = parse_cost_model(j);
  EXPECT_EQ(c.layers, 2);
  EXPECT_DOUBLE_EQ(c.ar_bytes_per_ms, 1e7);
  const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, 2, 2, c.dense_grad_bytes_per_layer, 1 << 20));
  const std::vector<double> costs = task_costs_ms(g, c);
  EXPECT_DOUBLE_EQ(costs[size_t(find(g, "AT[l=0,r=1]"))], 0.1 + 2.0 / 2);
  EXPECT_DOUBLE_EQ(costs[size_t(g.allreduce_order[0])], 0.05 + double(1 << 20) / 1e7);
  const TaskGraph m = build_task_graph(spec_of(Schedule::pipe_moe, 2, 2, 0));
  EXPECT_DOUBLE_EQ(task_costs_ms(m, c)[size_t(find(m, "AT[l=1,all]"))], 0.1 + 2.0);
  const SimResult r = simulate(g, c);
  const json trace = trace_json(g, r);
  int complete = 0;
  for (const json& e : trace.at("traceEvents")) complete += e.at("ph") == "X";
  EXPECT_EQ(complete, int(g.tasks.size()));
  EXPECT_DOUBLE_EQ(trace.at("flow").at("step_ms").get<double>(), r.step_ms);

  auto err = [&](const std::function<void(json&)>& edit) {
    json b = j;
    edit(b);
    return error_of([&] { parse_cost_model(b, "costs.json"); });
  };
  EXPECT_NE(err([](json& b) { b["tasks"].erase("E'"); }).find("costs.json.tasks: missing key 'E''"), std::string::npos);
  EXPECT_NE(err([](json& b) { b["tasks"]["D"]["batch_ms"] = -1; }).find("costs.json.tasks.D.batch_ms = -1"),
            std::string::npos);
  EXPECT_NE(err([](json& b) { b["tasks"]["D"]["latency"] = 1; }).find("unknown key 'latency' (allowed: fixed_ms, batch_ms)"),
            std::string::npos);
  EXPECT_NE(err([](json& b) { b["allreduce"]["gbytes_per_s"] = 0; }).find("gbytes_per_s = 0: must be in (0, 1e300] GB/s"),
            std::string::npos);
  EXPECT_NE(err([](json& b) { b["layers"] = 0; }).find("costs.json.layers = 0"), std::string::npos);
  EXPECT_NE(err([](json& b) { b.erase("dense_grad_bytes_per_layer"); }).find("missing key 'dense_grad_bytes_per_layer'"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_cost_model("/nonexistent/costs.json"); }).find("cannot be opened for reading"), std::string::npos);
}

// The head's and the embedding's AR bytes: optional in a cost file (0 when absent), kept by cost_model_json, carried
// into the graphs the ablation simulates (their chunks simulated like the layers'), and taken by the fit from the
// measured graph, so a prediction simulates the chunks the executor ran.
TEST(FlowSimulator, HeadAndEmbeddingBytesAreSimulated) {
  json j = json::parse(R"({
    "layers": 2, "dense_grad_bytes_per_layer": 2000000,
    "tasks": {"AT": {"batch_ms": 2.0}, "D": {"batch_ms": 1.0}, "E": {"batch_ms": 3.0}, "C": {"batch_ms": 1.0},
              "C'": {"batch_ms": 1.0}, "E'": {"batch_ms": 6.0}, "D'": {"batch_ms": 1.0}, "AT'": {"batch_ms": 4.0}},
    "allreduce": {"alpha_ms": 0.05, "gbytes_per_s": 10}})");
  const CostModel plain = parse_cost_model(j);
  EXPECT_EQ(plain.head_grad_bytes, 0);
  EXPECT_EQ(plain.embed_grad_bytes, 0);
  EXPECT_FALSE(cost_model_json(plain).contains("head_grad_bytes"));
  j["head_grad_bytes"] = 3000000;
  j["embed_grad_bytes"] = 1000000;
  const CostModel c = parse_cost_model(j);
  EXPECT_EQ(c.head_grad_bytes, 3000000);
  EXPECT_EQ(c.embed_grad_bytes, 1000000);
  const CostModel back = parse_cost_model(cost_model_json(c));
  EXPECT_EQ(back.head_grad_bytes, c.head_grad_bytes);
  EXPECT_EQ(back.embed_grad_bytes, c.embed_grad_bytes);
  // Vanilla is sequential: its step grows by exactly the extra bytes' transfer time.
  const ScheduleRun v0 = run_schedule(Schedule::vanilla, 2, 1, 1 << 20, plain);
  const ScheduleRun v1 = run_schedule(Schedule::vanilla, 2, 1, 1 << 20, c);
  EXPECT_EQ(v1.spec.head_grad_bytes, 3000000);
  EXPECT_NEAR(v1.result.step_ms - v0.result.step_ms, 4000000 / 1e7, 1e-9);
  // Chunked: the head's chunks are ready after layer 1's C' and overlap the rest of the backward, so the step grows
  // by less than their transfer time.
  const ScheduleRun k0 = run_schedule(Schedule::chunked_ar, 2, 2, 1 << 20, plain);
  const ScheduleRun k1 = run_schedule(Schedule::chunked_ar, 2, 2, 1 << 20, c);
  const TaskGraph g = build_task_graph(k1.spec);
  EXPECT_EQ(g.total_dense_bytes(), 8000000);
  EXPECT_LT(k1.result.step_ms - k0.result.step_ms, 4000000 / 1e7 - 0.1);
  const int32_t first = g.allreduce_order[0];
  double first_start = -1;
  for (const TraceEvent& e : k1.result.events)
    if (e.task == first) first_start = e.start_ms;
  EXPECT_LT(first_start, k1.result.backward_end_ms);
  // The fit takes the layout from the measured graph.
  const TaskGraph g1 = build_task_graph(run_schedule(Schedule::chunked_ar, 2, 1, 1 << 20, c, 10, {}, true).spec);
  const CostModel fitted = fit_cost_model({{&g, k1.result.events}, {&g1, simulate(g1, c).events}});
  EXPECT_EQ(fitted.head_grad_bytes, 3000000);
  EXPECT_EQ(fitted.embed_grad_bytes, 1000000);
  auto err = [&](const char* key, json v) {
    json b = j;
    b[key] = v;
    return error_of([&] { parse_cost_model(b, "costs.json"); });
  };
  EXPECT_NE(err("head_grad_bytes", -1).find("costs.json.head_grad_bytes = -1"), std::string::npos);
  EXPECT_NE(err("embed_grad_bytes", 1.5).find("costs.json.embed_grad_bytes = 1.5"), std::string::npos);
}

}  // namespace
}  // namespace dmoe::flow
