// The Flash protocol on the CPU: the task table (every tile once, dependencies before dependants), the
// buffer layouts, and the CPU twin of the kernel with W ranks as threads against the reference engine —
// outputs bit for bit, rows placed exactly (payload = source row), back-to-back forwards with no
// barrier between them, and a rank that never comes reported within the time limit.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "core/error.hpp"
#include "core/flash_protocol.hpp"
#include "core/random.hpp"
#include "engine/flash_reference.hpp"
#include "engine/reference.hpp"

namespace dmoe {
namespace {

// Uniform integer in [lo, hi].
int64_t uniform_int(Rng& rng, int64_t lo, int64_t hi) { return lo + int64_t(rng.next() % uint64_t(hi - lo + 1)); }

TEST(FlashProtocol, SignalWordPacksEpochAndValue) {
  const uint64_t s = flash::make_signal(0x89abcdefu, 0xfedcba98u);
  EXPECT_EQ(flash::signal_epoch(s), 0x89abcdefu);
  EXPECT_EQ(flash::signal_value(s), 0xfedcba98u);
  EXPECT_EQ(flash::signal_epoch(flash::make_signal(1, 0)), 1u);
  EXPECT_EQ(flash::signal_value(flash::make_signal(1, 0)), 0u);
}

// Every (kind, expert, row tile, column tile) exactly once, up tiles first, decode inverts the numbering.
TEST(FlashProtocol, TaskTableCoversEveryTileOnceInDependencyOrder) {
  Rng rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t Le = 1 + int32_t(uniform_int(rng, 0, 9));
    const int32_t up_cols = 1 + int32_t(uniform_int(rng, 0, 4)), down_cols = 1 + int32_t(uniform_int(rng, 0, 4));
    std::vector<int32_t> rows(static_cast<size_t>(Le));
    for (auto& r : rows) r = uniform_int(rng, 0, 3) == 0 ? 0 : int32_t(uniform_int(rng, 1, 600));
    std::vector<int32_t> offsets(size_t(2 * Le + 1)), base(size_t(Le + 1));
    flash::build_task_table(rows.data(), Le, up_cols, down_cols, offsets.data(), base.data());
    // The per-entry form the kernel uses gives the same table.
    std::vector<int32_t> prefix(size_t(Le + 1), 0), offsets2(offsets.size(), -7), base2(base.size(), -7);
    for (int32_t e = 0; e < Le; ++e) prefix[size_t(e + 1)] = prefix[size_t(e)] + flash::row_tiles(rows[size_t(e)]);
    for (int32_t e = 0; e <= Le; ++e)
      flash::task_table_entry(e, prefix.data(), Le, up_cols, down_cols, offsets2.data(), base2.data());
    ASSERT_EQ(offsets2, offsets);
    ASSERT_EQ(base2, base);
    int32_t expected_total = 0;
    for (auto r : rows) expected_total += flash::row_tiles(r) * (up_cols + down_cols);
    ASSERT_EQ(offsets[2 * Le], expected_total);
    std::set<std::tuple<int, int, int, int>> seen;
    int32_t last_up = -1, first_down = expected_total;
    for (int32_t t = 0; t < expected_total; ++t) {
      const flash::Task task = flash::decode_task(offsets.data(), base.data(), rows.data(), Le, t);
      ASSERT_GE(task.expert, 0);
      ASSERT_LT(task.expert, Le);
      ASSERT_GT(rows[task.expert], 0) << "a task of an expert without rows";
      ASSERT_LT(task.m_tile, flash::row_tiles(rows[task.expert]));
      ASSERT_LT(task.n_tile, task.down ? down_cols : up_cols);
      ASSERT_EQ(task.row_tile, base[task.expert] + task.m_tile);
      ASSERT_TRUE(seen.insert({task.down, task.expert, task.m_tile, task.n_tile}).second) << "task " << t << " twice";
      if (task.down) first_down = std::min(first_down, t);
      else last_up = t;
    }
    EXPECT_EQ(int32_t(seen.size()), expected_total);
    EXPECT_LT(last_up, first_down) << "an up tile after a down tile: a down tile could wait on a later task";
    EXPECT_EQ(base[Le], [&] { int32_t n = 0; for (auto r : rows) n += flash::row_tiles(r); return n; }());
  }
}

TEST(FlashProtocol, LayoutsAreAlignedDisjointAndSizedByTheirFormulas) {
  MoeConfig c;
  c.tokens = 100;
  c.hidden = 64;
  c.ffn = 96;
  c.experts = 8;
  c.top_k = 2;
  c.world = 4;
  c.dtype = DType::bf16;
  const flash::Shape s = flash::make_shape(c, 7);
  EXPECT_EQ(s.recv_rows(), 4 * 100 * 2);
  const flash::SymmetricLayout sl = flash::symmetric_layout(s);
  const std::vector<std::pair<size_t, size_t>> parts = {
      {sl.recv, 2 * 800 * 64 * 2}, {sl.meta, 2 * 800 * 8}, {sl.out, 200 * 64 * 2},
      {sl.counts, 2 * 4 * 8 * 8}, {sl.ready, 2 * 4 * 8}, {sl.arrived, 8}};
  size_t end = 0;
  for (auto [at, bytes] : parts) {
    EXPECT_EQ(at % 256, 0u);
    EXPECT_GE(at, end) << "parts overlap";
    end = at + bytes;
  }
  EXPECT_GE(sl.bytes, end);
  const flash::LocalLayout ll = flash::local_layout(s);
  EXPECT_EQ(ll.control % 256, 0u);
  EXPECT_GE(ll.bytes, ll.control + sizeof(flash::Control));
  EXPECT_GE(ll.up_done - ll.block_counts, size_t(7 * 8 * 4)) << "block_counts holds G x E";
  // Inference shapes carry no backward buffers; train shapes carve them after the forward's, disjoint too.
  EXPECT_EQ(sl.grad_recv, sl.dx_rows);
  EXPECT_EQ(ll.probs, ll.dx_router);
  flash::Shape t = s;
  t.train = true;
  const flash::SymmetricLayout st = flash::symmetric_layout(t);
  const flash::LocalLayout lt = flash::local_layout(t);
  EXPECT_EQ(st.out, sl.out) << "the forward's parts keep their places";
  const std::vector<std::pair<size_t, size_t>> train_sym = {
      {st.arrived, 8}, {st.grad_recv, 800 * 64 * 2}, {st.dx_rows, 800 * 64 * 2}, {st.grad_ready, 4 * 8},
      {st.dx_ready, 4 * 8}};
  const std::vector<std::pair<size_t, size_t>> train_local = {
      {lt.control, sizeof(flash::Control)}, {lt.probs, 100 * 8 * 4}, {lt.lse, 100 * 4}, {lt.pre1, 800 * 96 * 2},
      {lt.pre3, 800 * 96 * 2}, {lt.dest_row, 200 * 4}, {lt.dweights, 200 * 4},
      {lt.choice_slot, 200 * 4}, {lt.dlogits, 100 * 8 * 4}, {lt.dx_router, 100 * 64 * 4}};
  for (const auto* parts_of : {&train_sym, &train_local}) {
    size_t last = 0;
    for (auto [at, bytes] : *parts_of) {
      EXPECT_EQ(at % 256, 0u);
      EXPECT_GE(at, last) << "parts overlap";
      last = at + bytes;
    }
    EXPECT_GE(parts_of == &train_sym ? st.bytes : lt.bytes, last);
  }
  // Capacity bounds the receive buffer: W·Le·C rows when that is smaller.
  c.capacity_factor = 1.0;  // C = ceil(100·2/8) = 25
  EXPECT_EQ(flash::make_shape(c, 1).recv_rows(), 4 * 2 * 25);
}

MoeConfig flash_config(Activation act, int32_t world, DType dtype, double cf) {
  MoeConfig c;
  c.tokens = 37;  // not a multiple of anything
  c.hidden = 16;
  c.ffn = 24;
  c.experts = 8;
  c.top_k = 2;
  c.activation = act;
  c.world = world;
  c.dtype = dtype;
  c.capacity_factor = cf;
  return c;
}

std::vector<float> random_input(const MoeConfig& c, uint64_t seed) {
  Rng rng(seed);
  auto x = rng.normal_vector(size_t(c.world * c.tokens * c.hidden), 1.0);
  if (c.dtype == DType::bf16)
    for (auto& v : x) v = round_to_bf16(v);
  return x;
}

void expect_bitwise_equal(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(float)), 0) << what << " differs at " << i << ": " << a[i] << " vs " << b[i];
}

// The twin equals the reference engine bit for bit (same CPU kernels over the same rows in the same order),
// for every activation, both storages, dropless and capacity, W = 1, 2, 4, three forwards back to back.
TEST(FlashCpuTwin, EqualsReferenceEngineBitForBit) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (DType dtype : {DType::f32, DType::bf16})
      for (double cf : {0.0, 1.0})
        for (int32_t W : {1, 2, 4}) {
          const MoeConfig c = flash_config(act, W, dtype, cf);
          const std::string what = c.summary();
          const MoeWeights w = random_moe_weights(c, 11);
          std::vector<std::vector<float>> xs;
          for (uint64_t i = 0; i < 3; ++i) xs.push_back(random_input(c, 100 + i));
          const FlashCpuResult flash = run_cpu_flash_layer(c, w, xs);
          for (size_t i = 0; i < xs.size(); ++i) {
            const LayerResult ref = run_cpu_layer(c, w, xs[i], nullptr);
            expect_bitwise_equal(flash.y[i], ref.y, what + " forward " + std::to_string(i));
          }
        }
}

// The backward twin (cpu::flash_backward) equals the reference engine's backward bit for bit: dx, every
// expert's dW1/dW3/dW2 and the gate's gradient (the ranks' parts summed in rank order, as ThreadComm's sum
// adds them), with both auxiliary terms on, for every activation, both storages, dropless and capacity,
// W = 1, 2, 4. Two train forwards back to back, each followed by its backward: the first overwrites the
// experts' gradients, the second adds to them, as EpEngine's zero_grads / backward do.
TEST(FlashCpuTwin, BackwardEqualsReferenceEngineBitForBit) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (DType dtype : {DType::f32, DType::bf16})
      for (double cf : {0.0, 1.0})
        for (int32_t W : {1, 2, 4}) {
          MoeConfig c = flash_config(act, W, dtype, cf);
          c.aux_loss_coef = 0.01;
          c.z_loss_coef = 0.001;
          const std::string what = c.summary();
          const MoeWeights w = random_moe_weights(c, 12);
          std::vector<std::vector<float>> xs, dys;
          for (uint64_t i = 0; i < 2; ++i) {
            xs.push_back(random_input(c, 200 + i));
            dys.push_back(random_input(c, 300 + i));
          }
          const FlashCpuResult flash = run_cpu_flash_layer(c, w, xs, 10'000'000'000ull, &dys);
          ASSERT_EQ(flash.dx.size(), xs.size());
          MoeWeights sum;
          for (size_t i = 0; i < xs.size(); ++i) {
            const LayerResult ref = run_cpu_layer(c, w, xs[i], &dys[i]);
            expect_bitwise_equal(flash.y[i], ref.y, what + " train forward " + std::to_string(i));
            expect_bitwise_equal(flash.dx[i], ref.dx, what + " dx " + std::to_string(i));
            if (i == 0) {
              sum = ref.grads;
            } else {  // two backwards: the reference's per-backward gradients added in f32 (see below)
              for (size_t j = 0; j < sum.w1.size(); ++j) sum.w1[j] += ref.grads.w1[j];
              for (size_t j = 0; j < sum.w2.size(); ++j) sum.w2[j] += ref.grads.w2[j];
              for (size_t j = 0; j < sum.w3.size(); ++j) sum.w3[j] += ref.grads.w3[j];
              for (size_t j = 0; j < sum.gate.size(); ++j) sum.gate[j] += ref.grads.gate[j];
            }
          }
          // One backward: bit for bit. Two: the twin sums in f64 and rounds once, the reference's two results
          // were each rounded, so they agree to f32 rounding of the sum (relative 1e-6 of the magnitude).
          auto close = [&](const std::vector<float>& a, const std::vector<float>& b, const char* name) {
            ASSERT_EQ(a.size(), b.size()) << what << " " << name;
            double scale = 0;
            for (float v : b) scale = std::max(scale, double(std::fabs(v)));
            for (size_t j = 0; j < a.size(); ++j)
              ASSERT_NEAR(a[j], b[j], 1e-6 * scale + 1e-30) << what << " " << name << " at " << j;
          };
          close(flash.grads.w1, sum.w1, "dw1");
          close(flash.grads.w2, sum.w2, "dw2");
          close(flash.grads.w3, sum.w3, "dw3");
          close(flash.grads.gate, sum.gate, "dgate");
          // One train forward and backward: every gradient bit for bit.
          const std::vector<std::vector<float>> dy0{dys[0]};
          const FlashCpuResult one = run_cpu_flash_layer(c, w, {xs[0]}, 10'000'000'000ull, &dy0);
          const LayerResult ref = run_cpu_layer(c, w, xs[0], &dys[0]);
          expect_bitwise_equal(one.grads.w1, ref.grads.w1, what + " dw1");
          expect_bitwise_equal(one.grads.w2, ref.grads.w2, what + " dw2");
          expect_bitwise_equal(one.grads.w3, ref.grads.w3, what + " dw3");
          expect_bitwise_equal(one.grads.gate, ref.grads.gate, what + " dgate");
        }
}

// Data movement is exact: every received row is the source's x row its metadata names, each expert's
// rows come in the canonical order (source rank, then token), and the counts equal the reference's.
TEST(FlashCpuTwin, RowsLandWhereTheMetadataSaysInCanonicalOrder) {
  for (double cf : {0.0, 0.5}) {
    const MoeConfig c = flash_config(Activation::swiglu, 4, DType::f32, cf);
    const MoeWeights w = random_moe_weights(c, 5);
    const auto x = random_input(c, 9);
    const FlashCpuResult flash = run_cpu_flash_layer(c, w, {x});
    const LayerResult ref = run_cpu_layer(c, w, x, nullptr);
    const int32_t Le = c.experts_per_rank();
    const int64_t H = c.hidden;
    for (int32_t r = 0; r < c.world; ++r) {
      const FlashCpuRankState& st = flash.ranks[r];
      int64_t row = 0;
      for (int32_t le = 0; le < Le; ++le) {
        EXPECT_EQ(st.expert_rows[le], ref.kept[r * Le + le]) << "rank " << r << " expert " << le;
        std::pair<int32_t, int32_t> prev{-1, -1};
        for (int64_t i = 0; i < st.expert_rows[le]; ++i, ++row) {
          const flash::RowMeta m = st.meta[row];
          ASSERT_GE(m.source, 0);
          ASSERT_LT(m.source, c.world);
          const int32_t t = m.token_choice / c.top_k, j = m.token_choice % c.top_k;
          EXPECT_EQ(ref.expert_ids[size_t(m.source * c.tokens + t) * c.top_k + j], r * Le + le);
          ASSERT_EQ(std::memcmp(st.recv.data() + row * H, x.data() + (m.source * c.tokens + t) * H, H * sizeof(float)),
                    0) << "row " << row << " is not source " << m.source << "'s token " << t;
          const std::pair<int32_t, int32_t> key{m.source, t};
          EXPECT_LT(prev, key) << "rows out of canonical order";
          prev = key;
        }
      }
    }
  }
}

// A rank that never starts: the others stop within the time limit with an error naming the wait.
TEST(FlashCpuTwin, MissingRankIsReportedWithinTheTimeLimit) {
  const MoeConfig c = flash_config(Activation::relu, 2, DType::f32, 0.0);
  const MoeWeights w = random_moe_weights(c, 1);
  flash::Shape shape = flash::make_shape(c, 1);
  shape.element_bytes = 4;
  const flash::SymmetricLayout sl = flash::symmetric_layout(shape);
  const flash::LocalLayout ll = flash::local_layout(shape);
  std::vector<uint64_t> sym0(sl.bytes / 8 + 1), sym1(sl.bytes / 8 + 1), loc0(ll.bytes / 8 + 1);
  auto* peers = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(loc0.data()) + ll.peers);
  peers[0] = reinterpret_cast<uint64_t>(sym0.data());
  peers[1] = reinterpret_cast<uint64_t>(sym1.data());  // rank 1 never runs
  const auto x = random_input(c, 2);
  std::vector<float> y(size_t(c.tokens * c.hidden));
  const MoeWeights shard = slice_experts(w, 0, c.experts_per_rank());
  flash::Params p;
  p.shape = shape;
  p.rank = 0;
  p.x = x.data();
  p.gate = w.gate.data();
  p.w1 = shard.w1.data();
  p.w2 = shard.w2.data();
  p.y = y.data();
  p.symmetric = reinterpret_cast<char*>(sym0.data());
  p.local = reinterpret_cast<char*>(loc0.data());
  p.timeout_ns = 200'000'000ull;  // 0.2 s
  const auto start = std::chrono::steady_clock::now();
  try {
    cpu::flash_forward(p);
    FAIL() << "expected a time-out";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
    EXPECT_NE(m.find("count exchange"), std::string::npos) << m;
    EXPECT_NE(m.find("source rank"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(FlashCpuTwin, RefusesLowestWeightDropPolicy) {
  MoeConfig c = flash_config(Activation::relu, 1, DType::f32, 1.0);
  c.drop_policy = DropPolicy::lowest_weight;
  const MoeWeights w = random_moe_weights(c, 1);
  EXPECT_THROW(run_cpu_flash_layer(c, w, {random_input(c, 1)}), Error);
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

// The split gate's items and partial-logit buffer (flash_kernel.cu: split_gate_partials, gate_role): a block per
// (64-token chunk, 64-column chunk) pair; the buffer [column chunks, T, E] f32 exists only for a split shape, after
// every other part, so that nothing else moves.
TEST(FlashProtocol, SplitGateItemsAndPartialBuffer) {
  MoeConfig c;
  c.tokens = 65;
  c.hidden = 4096;
  c.ffn = 1536;
  c.experts = 64;
  c.top_k = 8;
  c.dtype = DType::bf16;
  flash::Shape s = flash::make_shape(c, 132);
  EXPECT_EQ(s.gate_column_chunks(), 64);
  EXPECT_EQ(s.split_gate_items(), 2 * 64);  // T = 65: two token chunks
  s.tokens = 1;
  EXPECT_EQ(s.split_gate_items(), 64);
  s.hidden = 4100;  // a partial column chunk counts
  EXPECT_EQ(s.gate_column_chunks(), 65);
  s.hidden = 4096;
  const flash::LocalLayout block = flash::local_layout(s);
  EXPECT_EQ(block.gate_partial, block.bytes) << "no buffer without the split gate";
  flash::Shape split = s;
  split.split_gate = true;
  const flash::LocalLayout ll = flash::local_layout(split);
  EXPECT_EQ(ll.control, block.control);
  EXPECT_EQ(ll.dx_router, block.dx_router);
  EXPECT_GE(ll.gate_partial, block.dx_router);
  EXPECT_GE(ll.bytes, ll.gate_partial + size_t(64) * 1 * 64 * sizeof(float));
  static_assert(sizeof(flash::Control) == 64);
}

// The combine's work items (flash::combine_items, the kernel's loop run here for every block and warp): each
// (token, 16-byte chunk) of the rank's tokens is summed by exactly one warp, whole rows by the token's own block
// without spread_combine; with it, slices spread so that at T = 1 more than one block works.
TEST(FlashProtocol, CombineItemsCoverEveryChunkOnce) {
  struct Case {
    int64_t tokens, hidden;
    int32_t grid;
  };
  for (const Case& cs : {Case{1, 4096, 132}, Case{1, 256, 132}, Case{37, 1024, 132}, Case{129, 4096, 132},
                         Case{300, 1000, 7}, Case{8192, 4096, 132}, Case{5, 4096, 1}, Case{3, 8, 132}}) {
    for (const bool spread : {false, true}) {
      flash::Shape s;
      s.tokens = cs.tokens;
      s.hidden = cs.hidden;
      s.grid = cs.grid;
      s.spread_combine = spread;
      const int64_t chunks = s.hidden / 8, per = (s.tokens + s.grid - 1) / s.grid;
      std::vector<int> seen(size_t(s.tokens * chunks), 0);
      std::vector<char> block_worked(size_t(s.grid), 0);
      for (int64_t b = 0; b < s.grid; ++b) {
        const int64_t t_begin = std::min(s.tokens, b * per), t_end = std::min(s.tokens, t_begin + per);
        for (int32_t w = 0; w < flash::kCombineWarps; ++w) {
          const flash::CombineItems items = flash::combine_items(s, b, s.grid, w, t_begin, t_end);
          const int64_t slices = items.slices(chunks);
          for (int64_t i = items.first; i < items.end; i += items.step) {
            const int64_t t = i / slices, c_lo = (i % slices) * items.slice;
            const int64_t c_hi = std::min(chunks, c_lo + items.slice);
            ASSERT_LT(t, s.tokens);
            if (!spread) ASSERT_TRUE(t >= t_begin && t < t_end) << "a block sums its own tokens";
            for (int64_t c = c_lo; c < c_hi; ++c) ++seen[size_t(t * chunks + c)];
            block_worked[size_t(b)] |= char(c_hi > c_lo);
          }
        }
      }
      const std::string tag = "T " + std::to_string(cs.tokens) + ", H " + std::to_string(cs.hidden) + ", grid " +
                              std::to_string(cs.grid) + (spread ? ", spread" : "");
      for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << tag << ": chunk " << i;
      const int64_t blocks = std::count(block_worked.begin(), block_worked.end(), char(1));
      if (spread && cs.tokens == 1 && cs.hidden == 4096 && cs.grid == 132) EXPECT_EQ(blocks, 16) << tag;  // 16 items
      if (!spread && cs.tokens == 1) EXPECT_EQ(blocks, 1) << tag;
    }
  }
}

}  // namespace
}  // namespace dmoe
