// test_flow_task_graph.cpp — Flow's static task graph (src/flow/task_graph.*): every true dependency present
// and nothing else, no cycles (dependencies + stream orders), vanilla = the sequential order, the per-stream
// issue orders of each schedule, the AR chunks' bytes and readiness, and the errors for bad input.
//
// Run: dmoe_unit_tests --gtest_filter='FlowTaskGraph*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <tuple>

#include "flow_test_util.hpp"
#include "core/error.hpp"
#include "flow/task_graph.hpp"

namespace dmoe::flow {
namespace {

using test::error_of;
using test::spec_of;

std::vector<std::string> names(const TaskGraph& g, const std::vector<int32_t>& ids) {
  std::vector<std::string> v;
  for (int32_t i : ids) v.push_back(g.describe(i));
  return v;
}

const Schedule kAll[] = {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar,
                         Schedule::tuned};

// The true dependencies, restated here from the issue text independently of the builder: the id of the task
// (kind, l, r), with whole-batch tasks found at any r.
struct Index {
  std::map<std::tuple<int, int, int>, int32_t> at;
  explicit Index(const TaskGraph& g) {
    for (const Task& t : g.tasks)
      if (t.layer >= 0) {
        if (t.micro_batch < 0)
          for (int r = 0; r < g.spec.micro_batches; ++r) at[{int(t.kind), t.layer, r}] = t.id;
        else
          at[{int(t.kind), t.layer, t.micro_batch}] = t.id;
      }
  }
  int32_t operator()(TaskKind k, int l, int r) const { return at.at({int(k), l, r}); }
};

TEST(FlowTaskGraph, EveryTrueDependencyPresentAndNoOther) {
  for (Schedule s : kAll)
    for (int L : {1, 2, 3})
      for (int R : {1, 2, 4}) {
        SCOPED_TRACE(::testing::Message() << schedule_name(s) << " L=" << L << " R=" << R);
        const TaskGraph g = build_task_graph(spec_of(s, L, R));
        EXPECT_NO_THROW(check_task_graph(g));
        const Index id(g);
        EXPECT_EQ(int(g.tasks.size()) - int(g.allreduce_order.size()),
                  s == Schedule::pipe_moe ? L * (6 * R + 2) : 8 * L * R);
        for (const Task& t : g.tasks) {
          std::vector<int32_t> want;  // the true dependencies of t
          const int l = t.layer, r = std::max(t.micro_batch, 0);
          auto each_r = [&](TaskKind k, int layer) {
            if (t.micro_batch >= 0) return want.push_back(id(k, layer, r));
            for (int q = 0; q < R; ++q) want.push_back(id(k, layer, q));
          };
          switch (t.kind) {
            case TaskKind::attention_fwd: if (l > 0) each_r(TaskKind::combine_fwd, l - 1); break;
            case TaskKind::dispatch_fwd: want.push_back(id(TaskKind::attention_fwd, l, r)); break;
            case TaskKind::expert_fwd: want.push_back(id(TaskKind::dispatch_fwd, l, r)); break;
            case TaskKind::combine_fwd: want.push_back(id(TaskKind::expert_fwd, l, r)); break;
            case TaskKind::combine_bwd:
              want.push_back(l == L - 1 ? id(TaskKind::combine_fwd, l, r) : id(TaskKind::attention_bwd, l + 1, r));
              break;
            case TaskKind::expert_bwd: want.push_back(id(TaskKind::combine_bwd, l, r)); break;
            case TaskKind::dispatch_bwd: want.push_back(id(TaskKind::expert_bwd, l, r)); break;
            case TaskKind::attention_bwd: each_r(TaskKind::dispatch_bwd, l); break;
            case TaskKind::allreduce: break;  // checked in AllReduceChunks
          }
          if (t.kind == TaskKind::allreduce) continue;
          if (s == Schedule::vanilla && t.id > 0) want.push_back(t.id - 1);  // the sequential order
          std::sort(want.begin(), want.end());
          want.erase(std::unique(want.begin(), want.end()), want.end());
          EXPECT_EQ(t.deps, want) << g.describe(t.id);
          EXPECT_EQ(t.stream, stream_of(t.kind));
        }
      }
}

TEST(FlowTaskGraph, VanillaIsTheSequentialOrder) {
  const TaskGraph g = build_task_graph(spec_of(Schedule::vanilla, 2, 2));
  // Each task depends on the one before it, so the only topological order is the id order ...
  for (size_t i = 1; i < g.tasks.size(); ++i)
    EXPECT_TRUE(std::binary_search(g.tasks[i].deps.begin(), g.tasks[i].deps.end(), int32_t(i - 1)))
        << g.describe(int32_t(i));
  // ... which is: forward of micro-batch 0, of 1, backward of 0, of 1, then the whole AR.
  std::vector<int32_t> all(g.tasks.size());
  std::iota(all.begin(), all.end(), 0);
  const std::vector<std::string> want = {
      "AT[l=0,r=0]",  "D[l=0,r=0]",  "E[l=0,r=0]",  "C[l=0,r=0]",  "AT[l=1,r=0]",  "D[l=1,r=0]",  "E[l=1,r=0]",
      "C[l=1,r=0]",   "AT[l=0,r=1]", "D[l=0,r=1]",  "E[l=0,r=1]",  "C[l=0,r=1]",   "AT[l=1,r=1]", "D[l=1,r=1]",
      "E[l=1,r=1]",   "C[l=1,r=1]",  "C'[l=1,r=0]", "E'[l=1,r=0]", "D'[l=1,r=0]",  "AT'[l=1,r=0]", "C'[l=0,r=0]",
      "E'[l=0,r=0]",  "D'[l=0,r=0]", "AT'[l=0,r=0]", "C'[l=1,r=1]", "E'[l=1,r=1]", "D'[l=1,r=1]", "AT'[l=1,r=1]",
      "C'[l=0,r=1]",  "E'[l=0,r=1]", "D'[l=0,r=1]", "AT'[l=0,r=1]", "AR[chunk 0, 6291456 B]"};
  EXPECT_EQ(names(g, all), want);
  EXPECT_EQ(g.num_forward_tasks, 16);
}

TEST(FlowTaskGraph, StreamIssueOrders) {
  const TaskGraph g = build_task_graph(spec_of(Schedule::pipe_attn, 2, 2));
  EXPECT_EQ(names(g, g.compute_order),
            (std::vector<std::string>{"AT[l=0,r=0]", "AT[l=0,r=1]", "E[l=0,r=0]", "E[l=0,r=1]", "AT[l=1,r=0]",
                                      "AT[l=1,r=1]", "E[l=1,r=0]", "E[l=1,r=1]", "E'[l=1,r=0]", "E'[l=1,r=1]",
                                      "AT'[l=1,r=0]", "AT'[l=1,r=1]", "E'[l=0,r=0]", "E'[l=0,r=1]", "AT'[l=0,r=0]",
                                      "AT'[l=0,r=1]"}));
  EXPECT_EQ(names(g, g.alltoall_order),
            (std::vector<std::string>{"D[l=0,r=0]", "D[l=0,r=1]", "C[l=0,r=0]", "C[l=0,r=1]", "D[l=1,r=0]",
                                      "D[l=1,r=1]", "C[l=1,r=0]", "C[l=1,r=1]", "C'[l=1,r=0]", "C'[l=1,r=1]",
                                      "D'[l=1,r=0]", "D'[l=1,r=1]", "C'[l=0,r=0]", "C'[l=0,r=1]", "D'[l=0,r=0]",
                                      "D'[l=0,r=1]"}));
  EXPECT_EQ(names(g, g.allreduce_order), (std::vector<std::string>{"AR[chunk 0, 6291456 B]"}));
  const TaskGraph m = build_task_graph(spec_of(Schedule::pipe_moe, 1, 2));
  EXPECT_EQ(names(m, m.compute_order), (std::vector<std::string>{"AT[l=0,all]", "E[l=0,r=0]", "E[l=0,r=1]",
                                                                 "E'[l=0,r=0]", "E'[l=0,r=1]", "AT'[l=0,all]"}));
  // A pure function of the spec: built again (another rank), every order and every dependency list is equal.
  for (Schedule s : kAll) {
    const TaskGraph a = build_task_graph(spec_of(s, 3, 4, 5 << 20, 700000));
    const TaskGraph b = build_task_graph(spec_of(s, 3, 4, 5 << 20, 700000));
    EXPECT_EQ(a.compute_order, b.compute_order);
    EXPECT_EQ(a.alltoall_order, b.alltoall_order);
    EXPECT_EQ(a.allreduce_order, b.allreduce_order);
    for (size_t i = 0; i < a.tasks.size(); ++i) EXPECT_EQ(a.tasks[i].deps, b.tasks[i].deps);
  }
}

TEST(FlowTaskGraph, AllReduceChunks) {
  // L = 3 layers of 3 MiB, Sp = 2 MiB: backward produces layer 2, 1, 0; a chunk waits for the AT' of every layer
  // it holds bytes of, for every micro-batch.
  const TaskGraph g = build_task_graph(spec_of(Schedule::chunked_ar, 3, 2, 3 << 20, 2 << 20));
  const Index id(g);
  ASSERT_EQ(g.allreduce_order.size(), 5u);
  const std::vector<std::vector<int>> want_layers = {{2}, {2, 1}, {1}, {0}, {0}};
  int64_t sum = 0;
  for (size_t k = 0; k < 5; ++k) {
    const Task& t = g.tasks[size_t(g.allreduce_order[k])];
    EXPECT_EQ(t.chunk, int32_t(k));
    EXPECT_EQ(t.bytes, k < 4 ? (2 << 20) : (1 << 20));
    EXPECT_EQ(t.offset, sum);
    sum += t.bytes;
    std::vector<int32_t> want;
    for (int l : want_layers[k])
      for (int r : {0, 1}) want.push_back(id(TaskKind::attention_bwd, l, r));
    std::sort(want.begin(), want.end());
    EXPECT_EQ(t.deps, want) << g.describe(t.id);
  }
  EXPECT_EQ(sum, g.total_dense_bytes());
  // Without chunking: one AR of everything, after the whole backward (every layer's AT' of every r).
  for (Schedule s : {Schedule::pipe_moe, Schedule::pipe_attn}) {
    const TaskGraph w = build_task_graph(spec_of(s, 3, 2, 3 << 20, 2 << 20));
    ASSERT_EQ(w.allreduce_order.size(), 1u);
    const Task& t = w.tasks[size_t(w.allreduce_order[0])];
    EXPECT_EQ(t.bytes, 9 << 20);
    const Index wid(w);
    std::vector<int32_t> want;
    for (int l = 0; l < 3; ++l)
      for (int r : {0, 1}) want.push_back(wid(TaskKind::attention_bwd, l, r));
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    EXPECT_EQ(t.deps, want);
  }
  // No dense gradients: no AR task.
  EXPECT_TRUE(build_task_graph(spec_of(Schedule::chunked_ar, 2, 2, 0)).allreduce_order.empty());
  // One chunk that spans every layer.
  const TaskGraph big = build_task_graph(spec_of(Schedule::chunked_ar, 3, 1, 100, 1 << 20));
  ASSERT_EQ(big.allreduce_order.size(), 1u);
  EXPECT_EQ(big.tasks[size_t(big.allreduce_order[0])].bytes, 300);
}

// The head's and the embedding's gradients in the layout (head, layers L−1 … 0, embedding): every chunk covers the
// bytes the layout gives it and depends on exactly the tasks that write any of them — C'[L−1, r] for the head's
// (its prelude runs the head's backward), AT'[l, r] for layer l's, AT'[0, r] for the embedding's, every r — restated
// here byte range by byte range, for every schedule and for Sp that cut inside the head, at its end, inside a layer.
TEST(FlowTaskGraph, HeadChunksFirstEmbeddingLastEachWaitingForItsWriters) {
  const int64_t head = 5000, G = 3000, embed = 4400;
  for (Schedule s : kAll)
    for (int L : {1, 3})
      for (int R : {1, 2, 4})
        for (int64_t sp : {int64_t(1200), int64_t(5000), int64_t(6000), int64_t(1) << 20}) {
          SCOPED_TRACE(::testing::Message() << schedule_name(s) << " L=" << L << " R=" << R << " Sp=" << sp);
          GraphSpec spec = spec_of(s, L, R, G, sp);
          spec.head_grad_bytes = head;
          spec.embed_grad_bytes = embed;
          const TaskGraph g = build_task_graph(spec);
          const Index id(g);
          const int64_t total = head + L * G + embed;
          EXPECT_EQ(g.total_dense_bytes(), total);
          const bool chunked = s == Schedule::chunked_ar || s == Schedule::tuned;
          ASSERT_EQ(int64_t(g.allreduce_order.size()), chunked ? (total + sp - 1) / sp : 1);
          // The writers of each region of the layout, in layout order.
          struct Region {
            int64_t begin, end;
            std::vector<int32_t> writers;
          };
          std::vector<Region> regions;
          auto every_r = [&](TaskKind k, int l) {
            std::vector<int32_t> v;
            for (int r = 0; r < R; ++r) v.push_back(id(k, l, r));
            return v;
          };
          regions.push_back({0, head, every_r(TaskKind::combine_bwd, L - 1)});
          for (int i = 0; i < L; ++i)
            regions.push_back({head + i * G, head + (i + 1) * G, every_r(TaskKind::attention_bwd, L - 1 - i)});
          regions.push_back({head + L * G, total, every_r(TaskKind::attention_bwd, 0)});
          int64_t at = 0;
          for (size_t k = 0; k < g.allreduce_order.size(); ++k) {
            const Task& t = g.tasks[size_t(g.allreduce_order[k])];
            EXPECT_EQ(t.chunk, int32_t(k));
            EXPECT_EQ(t.offset, at);
            EXPECT_EQ(t.bytes, chunked ? std::min(sp, total - at) : total);
            std::vector<int32_t> want;
            for (const Region& reg : regions)
              if (reg.begin < t.offset + t.bytes && t.offset < reg.end)
                want.insert(want.end(), reg.writers.begin(), reg.writers.end());
            if (s == Schedule::vanilla) want.push_back(t.id - 1);  // the sequential order
            std::sort(want.begin(), want.end());
            want.erase(std::unique(want.begin(), want.end()), want.end());
            EXPECT_EQ(t.deps, want) << g.describe(t.id);
            at += t.bytes;
          }
          EXPECT_EQ(at, total);
          if (!chunked) continue;
          // The first chunk holds the head's first bytes: it waits for the last layer's C' and no AT' (vanilla aside,
          // where everything is sequential) — it can go while layer L−1's experts backward still runs.
          const Task& first = g.tasks[size_t(g.allreduce_order[0])];
          if (sp <= head && s != Schedule::vanilla)
            for (int32_t d : first.deps) EXPECT_EQ(g.tasks[size_t(d)].kind, TaskKind::combine_bwd) << g.describe(d);
          // The last chunk holds the embedding's last bytes: it waits for AT'[0, r] of every r.
          const Task& last = g.tasks[size_t(g.allreduce_order.back())];
          for (int r = 0; r < R; ++r)
            EXPECT_TRUE(std::binary_search(last.deps.begin(), last.deps.end(), id(TaskKind::attention_bwd, 0, r)));
        }
  // The head alone (no layer bytes) still gets its chunks, with its writers.
  GraphSpec only_head = spec_of(Schedule::chunked_ar, 2, 2, 0, 64);
  only_head.head_grad_bytes = 100;
  const TaskGraph h = build_task_graph(only_head);
  ASSERT_EQ(h.allreduce_order.size(), 2u);
  const Index hid(h);
  EXPECT_EQ(h.tasks[size_t(h.allreduce_order[1])].deps,
            (std::vector<int32_t>{hid(TaskKind::combine_bwd, 1, 0), hid(TaskKind::combine_bwd, 1, 1)}));
  GraphSpec bad = spec_of(Schedule::chunked_ar, 2, 2);
  bad.head_grad_bytes = -4;
  EXPECT_NE(error_of([&] { build_task_graph(bad); }).find("head_grad_bytes -4"), std::string::npos);
  bad.head_grad_bytes = 0;
  bad.embed_grad_bytes = -4;
  EXPECT_NE(error_of([&] { build_task_graph(bad); }).find("embed_grad_bytes -4"), std::string::npos);
  // same_spec compares every field.
  GraphSpec a = spec_of(Schedule::chunked_ar, 2, 2), b = a;
  EXPECT_TRUE(same_spec(a, b));
  b.embed_grad_bytes = 4;
  EXPECT_FALSE(same_spec(a, b));
  b = a;
  b.head_grad_bytes = 4;
  EXPECT_FALSE(same_spec(a, b));
}

TEST(FlowTaskGraph, CheckFindsBrokenGraphs) {
  TaskGraph g = build_task_graph(spec_of(Schedule::pipe_attn, 2, 2));
  TaskGraph reversed = g;  // E before AT on the compute stream: E waits for D, D for AT, AT behind E
  std::reverse(reversed.compute_order.begin(), reversed.compute_order.end());
  EXPECT_NE(error_of([&] { check_task_graph(reversed); }).find("cycle"), std::string::npos);
  TaskGraph bad_dep = g;
  bad_dep.tasks[3].deps.push_back(9999);
  EXPECT_NE(error_of([&] { check_task_graph(bad_dep); }).find("dependency 9999"), std::string::npos);
  TaskGraph missing = g;
  missing.alltoall_order.pop_back();
  EXPECT_NE(error_of([&] { check_task_graph(missing); }).find("in no stream order"), std::string::npos);
  TaskGraph wrong_stream = g;
  std::swap(wrong_stream.compute_order[0], wrong_stream.alltoall_order[0]);
  EXPECT_NE(error_of([&] { check_task_graph(wrong_stream); }).find("listed in the"), std::string::npos);
}

TEST(FlowTaskGraph, BadInputNamesTheField) {
  EXPECT_NE(error_of([] { build_task_graph(spec_of(Schedule::pipe_attn, 0, 2)); }).find("layers 0: must be in"),
            std::string::npos);
  EXPECT_NE(error_of([] { build_task_graph(spec_of(Schedule::pipe_attn, 2, 0)); }).find("micro_batches 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { build_task_graph(spec_of(Schedule::chunked_ar, 2, 2, 1 << 20, 0)); }).find("chunk_bytes 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { build_task_graph(spec_of(Schedule::chunked_ar, 2, 2, int64_t(1) << 36, 1)); })
                .find("more than the"),
            std::string::npos);
  EXPECT_NE(error_of([] { build_task_graph(spec_of(Schedule::pipe_attn, 2, 2, -1)); }).find("dense_grad_bytes_per_layer -1"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_schedule("fast"); }).find("allowed: vanilla, pipe-moe"), std::string::npos);
  EXPECT_EQ(parse_schedule("chunked-ar"), Schedule::chunked_ar);
  // pipe-attn does not chunk, so its Sp is not checked.
  EXPECT_NO_THROW(build_task_graph(spec_of(Schedule::pipe_attn, 2, 2, 1 << 20, 0)));
}

// G20-3 (twentieth bad-input pass): Sp near INT64_MAX wrapped the chunk count's (total + Sp - 1) / Sp negative, so
// the graph had no all-reduce task and `train --world 2 --schedule chunked-ar` trained its ranks apart, rc 0. The
// count is an overflow-free ceiling now, and Sp above 2^40 is refused; Sp = 2^40 is one chunk of everything.
TEST(FlowTaskGraph, ChunkBytesNearInt64MaxIsRefusedAndTheLargestIsOneChunk) {
  constexpr int64_t kMax = INT64_MAX;
  EXPECT_EQ(ceil_div(0, 7), 0);
  EXPECT_EQ(ceil_div(14, 7), 2);
  EXPECT_EQ(ceil_div(15, 7), 3);
  EXPECT_EQ(ceil_div(9 << 20, kMax - 3), 1);
  EXPECT_EQ(ceil_div(kMax, 1), kMax);
  EXPECT_EQ(ceil_div(kMax, kMax), 1);
  for (Schedule s : {Schedule::chunked_ar, Schedule::tuned}) {
    const std::string e = error_of([&] { build_task_graph(spec_of(s, 3, 2, 3 << 20, kMax - 3)); });
    EXPECT_NE(e.find("chunk_bytes 9223372036854775804: must be in [1, 2^40]"), std::string::npos) << e;
    const TaskGraph g = build_task_graph(spec_of(s, 3, 2, 3 << 20, kMaxChunkBytes));
    ASSERT_EQ(g.allreduce_order.size(), 1u) << schedule_name(s);
    EXPECT_EQ(g.tasks[size_t(g.allreduce_order[0])].bytes, 9 << 20);
    EXPECT_EQ(g.tasks[size_t(g.allreduce_order[0])].offset, 0);
  }
}

}  // namespace
}  // namespace dmoe::flow
