// The CPU reference engine: W simulated ranks against one rank holding everything, a direct per-token
// computation (independent of dispatch/combine), and whole-layer finite differences.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "core/random.hpp"
#include "cpu/kernels.hpp"
#include "engine/reference.hpp"
#include "fd_util.hpp"

namespace dmoe {
namespace {

MoeConfig small_config(Activation act, int32_t world, int64_t tokens) {
  MoeConfig c;
  c.tokens = tokens;
  c.hidden = 16;
  c.ffn = 24;
  c.experts = 8;
  c.top_k = 2;
  c.activation = act;
  c.world = world;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

using test::expect_identical;

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - b[i]));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

struct Case {
  Activation act;
  int32_t world;
};

class EngineRanks : public ::testing::TestWithParam<Case> {};

// Dropless: W ranks must give exactly the single-rank result for all W*T tokens. Every expert's batch is
// in the same canonical order (source rank, token) = global token order, rows are independent, and
// weight gradients sum rows in that order, so y, dx and expert gradients match bit for bit.
// The router's weight gradient is the one exception: each rank sums its own tokens in fp64 and the
// ranks' partial sums are then added, a different association from one sequential sum; the fp64
// difference (~1e-16 relative) can flip the last bit of the f32 result, so it gets a 1e-6 tolerance.
TEST_P(EngineRanks, DroplessEqualsSingleRank) {
  const auto [act, world] = GetParam();
  const int64_t T = 12;
  MoeConfig multi = small_config(act, world, T);
  MoeConfig single = small_config(act, 1, T * world);
  const MoeWeights w = random_moe_weights(single, 7);
  Rng rng(11 + world);
  const auto x = rng.normal_vector(size_t(world * T * multi.hidden), 1.0);
  const auto dy = rng.normal_vector(x.size(), 1.0);

  const LayerResult a = run_cpu_layer(single, w, x, &dy);
  const LayerResult b = run_cpu_layer(multi, w, x, &dy);
  expect_identical(a.expert_ids, b.expert_ids, "expert_ids");
  expect_identical(a.expert_weights, b.expert_weights, "expert_weights");
  expect_identical(a.y, b.y, "y");
  expect_identical(a.dx, b.dx, "dx");
  expect_identical(a.grads.w1, b.grads.w1, "grad w1");
  expect_identical(a.grads.w2, b.grads.w2, "grad w2");
  expect_identical(a.grads.w3, b.grads.w3, "grad w3");
  EXPECT_LE(max_rel_diff(b.grads.gate, a.grads.gate), 1e-6) << "gate gradient (see comment above)";
  EXPECT_NEAR(a.losses.load_balance, b.losses.load_balance, 1e-12);
  EXPECT_NEAR(a.losses.z_loss, b.losses.z_loss, 1e-12);
  expect_identical(a.routed, b.routed, "routed counts");
  EXPECT_EQ(b.dropped(), 0);
}

INSTANTIATE_TEST_SUITE_P(AllActivationsAndWorlds, EngineRanks,
                         ::testing::Values(Case{Activation::swiglu, 1}, Case{Activation::swiglu, 2},
                                           Case{Activation::swiglu, 4}, Case{Activation::swiglu, 8},
                                           Case{Activation::relu, 2}, Case{Activation::relu, 8},
                                           Case{Activation::gelu, 4}, Case{Activation::gelu, 8}),
                         [](const auto& info) {
                           return std::string(activation_name(info.param.act)) + "_W" +
                                  std::to_string(info.param.world);
                         });

// Independent of the dispatch machinery: y[t] = Σ_j kept(t,j) · w[t,j] · FFN_{e(t,j)}(x[t]), with the
// kept set taken from an independently built send plan of each source rank.
void check_against_direct(const MoeConfig& config, const MoeWeights& w, const std::vector<float>& x) {
  const LayerResult r = run_cpu_layer(config, w, x, nullptr);
  const int64_t T = config.tokens, H = config.hidden, I = config.ffn, k = config.top_k;
  std::vector<float> pre1(I), pre3(I), h(I), out(H);
  for (int32_t rank = 0; rank < config.world; ++rank) {
    const SendPlan plan = build_send_plan(r.expert_ids.data() + rank * T * k, r.expert_weights.data() + rank * T * k,
                                          T, config.top_k, config.experts, config.capacity(), config.drop_policy);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t g = rank * T + t;
      std::vector<double> y(H, 0.0);
      for (int64_t j = 0; j < k; ++j) {
        if (plan.slot[t * k + j] < 0) continue;
        const int32_t e = r.expert_ids[g * k + j];
        cpu::expert_ffn_forward(x.data() + g * H, w.w1_of(e), w.w3_of(e), w.w2_of(e), pre1.data(),
                                config.activation == Activation::swiglu ? pre3.data() : nullptr, h.data(),
                                out.data(), 1, H, I, config.activation, DType::f32);
        for (int64_t c = 0; c < H; ++c) y[c] += double(r.expert_weights[g * k + j]) * out[c];
      }
      for (int64_t c = 0; c < H; ++c)
        ASSERT_NEAR(r.y[g * H + c], y[c], 1e-5 * (1 + std::abs(y[c])))  // f32 rounding of a k-term sum
            << "rank " << rank << " token " << t << " column " << c;
    }
  }
}

TEST(Engine, MatchesDirectPerTokenComputationWithCapacity) {
  for (int32_t world : {1, 2, 4}) {
    MoeConfig c = small_config(Activation::swiglu, world, 16);
    c.capacity_factor = 0.5;  // C = ceil(0.5*16*2/8) = 2 per (source rank, expert): many drops
    const MoeWeights w = random_moe_weights(c, 3);
    Rng rng(5);
    const auto x = rng.normal_vector(size_t(world * c.tokens * c.hidden), 1.0);
    check_against_direct(c, w, x);
    const LayerResult r = run_cpu_layer(c, w, x, nullptr);
    EXPECT_GT(r.dropped(), 0) << "the test must actually drop tokens";
    for (int32_t e = 0; e < c.experts; ++e) EXPECT_LE(r.kept[e], c.capacity() * world);
  }
}

TEST(Engine, MatchesDirectPerTokenComputationDropless) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu}) {
    MoeConfig c = small_config(act, 4, 10);
    const MoeWeights w = random_moe_weights(c, 9);
    Rng rng(2);
    check_against_direct(c, w, rng.normal_vector(size_t(4 * 10 * c.hidden), 1.0));
  }
}

// Gate row 0 aligned with every token: all tokens go to expert 0 (k = 1); the other experts get nothing.
TEST(Engine, AllTokensToOneExpert) {
  MoeConfig multi = small_config(Activation::swiglu, 4, 9);
  multi.top_k = 1;
  MoeConfig single = multi;
  single.world = 1;
  single.tokens = 36;
  MoeWeights w = random_moe_weights(single, 4);
  Rng rng(8);
  auto x = rng.normal_vector(size_t(36 * multi.hidden), 1.0);
  for (auto& v : x) v = std::abs(v) + 0.1f;
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  std::fill(w.gate.begin(), w.gate.begin() + multi.hidden, 1.f);
  const auto dy = rng.normal_vector(x.size(), 1.0);
  const LayerResult a = run_cpu_layer(single, w, x, &dy);
  const LayerResult b = run_cpu_layer(multi, w, x, &dy);
  EXPECT_EQ(b.kept[0], 36);
  for (int e = 1; e < 8; ++e) EXPECT_EQ(b.kept[e], 0);
  expect_identical(a.y, b.y, "y");
  expect_identical(a.dx, b.dx, "dx");
  expect_identical(a.grads.w1, b.grads.w1, "grad w1");
  for (size_t i = multi.ffn * multi.hidden; i < b.grads.w1.size(); ++i) ASSERT_EQ(b.grads.w1[i], 0.f);
}

// Whole-layer finite differences of L = Σ y·R (+ aux losses) w.r.t. x and the gate, in f32 storage.
// Routing must not flip under the perturbation: eps is small and the test checks the ids are unchanged.
TEST(Engine, WholeLayerFiniteDifferences) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu}) {
    MoeConfig c = small_config(act, 2, 5);
    c.hidden = 6;
    c.ffn = 7;
    c.experts = 4;
    const MoeWeights w = random_moe_weights(c, 21);
    Rng rng(31);
    const auto x = rng.normal_vector(size_t(2 * 5 * 6), 1.0);
    const auto R = rng.normal_vector(x.size(), 1.0);
    auto loss = [&](const std::vector<float>& xs, const MoeWeights& ws, std::vector<int32_t>* ids) {
      LayerResult r = run_cpu_layer(c, ws, xs, nullptr);
      if (ids) *ids = r.expert_ids;
      double l = 0;
      for (size_t i = 0; i < r.y.size(); ++i) l += double(r.y[i]) * R[i];
      return l + c.aux_loss_coef * r.losses.load_balance + c.z_loss_coef * r.losses.z_loss;
    };
    const LayerResult g = run_cpu_layer(c, w, x, &R);
    std::vector<int32_t> base_ids, ids;
    loss(x, w, &base_ids);
    const float eps = 1e-3f;
    // Tolerance: central differences in f32 storage with eps 1e-3 leave O(eps^2) truncation and
    // O(1e-7/eps) rounding error, well under 2e-3 relative to the gradient's scale.
    for (size_t i = 0; i < x.size(); i += 3) {
      auto xp = x, xm = x;
      xp[i] += eps;
      xm[i] -= eps;
      const double fd = (loss(xp, w, &ids) - loss(xm, w, nullptr)) / (2 * eps);
      if (ids != base_ids) continue;  // a routing flip makes the loss non-differentiable here
      EXPECT_NEAR(g.dx[i], fd, 2e-3 * (1 + std::abs(fd))) << activation_name(act) << " dx[" << i << "]";
    }
    for (size_t i = 0; i < w.gate.size(); i += 2) {
      MoeWeights wp = w, wm = w;
      wp.gate[i] += eps;
      wm.gate[i] -= eps;
      const double fd = (loss(x, wp, &ids) - loss(x, wm, nullptr)) / (2 * eps);
      if (ids != base_ids) continue;
      EXPECT_NEAR(g.grads.gate[i], fd, 2e-3 * (1 + std::abs(fd))) << activation_name(act) << " dgate[" << i << "]";
    }
  }
}

TEST(Engine, RejectsMismatchedInputs) {
  MoeConfig c = small_config(Activation::relu, 2, 4);
  const MoeWeights w = random_moe_weights(c, 1);
  std::vector<float> x(10);
  EXPECT_THROW(run_cpu_layer(c, w, x, nullptr), Error);
  MoeConfig bad = c;
  bad.experts = 7;  // not divisible by world
  EXPECT_THROW(run_cpu_layer(bad, w, std::vector<float>(2 * 4 * 16), nullptr), Error);
}

TEST(Engine, Bf16StorageRoundsOutputs) {
  MoeConfig c = small_config(Activation::swiglu, 2, 6);
  c.dtype = DType::bf16;
  const MoeWeights w = random_moe_weights(c, 1);
  Rng rng(3);
  const LayerResult r = run_cpu_layer(c, w, rng.normal_vector(size_t(2 * 6 * 16), 1.0), nullptr);
  for (float v : r.y) ASSERT_EQ(v, round_to_bf16(v));
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

// Capacity mode on a padded wire (Megatron/Tutel style) must give exactly the results of exact-size
// rows: padding rows are zeros, the experts map them to zeros (no biases), and adding exact zeros to
// the fp64 weight-gradient sums changes nothing. Only the traffic and the rows computed differ.
TEST(Engine, PaddedCapacityWireGivesTheSameResults) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (int32_t world : {1, 2, 4}) {
      MoeConfig c = small_config(act, world, 16);
      c.capacity_factor = 0.75;  // C = ceil(0.75*16*2/8) = 3 per (source rank, expert)
      const MoeWeights w = random_moe_weights(c, 13);
      Rng rng(17);
      const auto x = rng.normal_vector(size_t(world * c.tokens * c.hidden), 1.0);
      const auto dy = rng.normal_vector(x.size(), 1.0);
      EpOptions exact;
      exact.pad_to_capacity = false;
      const LayerResult a = run_cpu_layer(c, w, x, &dy, exact);
      const LayerResult b = run_cpu_layer(c, w, x, &dy);  // default: padded in capacity mode
      expect_identical(a.y, b.y, "y");
      expect_identical(a.dx, b.dx, "dx");
      expect_identical(a.grads.w1, b.grads.w1, "grad w1");
      expect_identical(a.grads.w2, b.grads.w2, "grad w2");
      expect_identical(a.grads.w3, b.grads.w3, "grad w3");
      expect_identical(a.grads.gate, b.grads.gate, "grad gate");
      const int64_t C = c.capacity();
      EXPECT_EQ(b.rows_sent, int64_t(world) * c.experts * C) << "every (rank, expert) segment is C rows";
      EXPECT_EQ(b.rows_received, int64_t(world) * c.experts * C);
      int64_t kept = 0;
      for (auto n : a.kept) kept += n;
      EXPECT_EQ(a.rows_sent, kept) << "exact mode sends only kept rows";
      EXPECT_LT(a.rows_sent, b.rows_sent) << "the test must have padding";
    }
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

// Tile padding of the experts' batches (zero rows up to a multiple of the tile height) must not change
// any result: the padding rows are zero, map to zero, and add exact zeros to the gradient sums.
TEST(Engine, TilePaddedExpertBatchesGiveTheSameResults) {
  int padded_cases = 0;  // (a batch of 12 rows is already a multiple of 4: not every case pads)
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (int32_t world : {1, 2, 4})
      for (double cf : {0.0, 0.75})
        for (int32_t multiple : {4, 128}) {
          MoeConfig c = small_config(act, world, 14);
          c.capacity_factor = cf;
          const MoeWeights w = random_moe_weights(c, 23);
          Rng rng(29);
          const auto x = rng.normal_vector(size_t(world * c.tokens * c.hidden), 1.0);
          const auto dy = rng.normal_vector(x.size(), 1.0);
          const LayerResult a = run_cpu_layer(c, w, x, &dy);
          EpOptions tiles;
          tiles.batch_row_multiple = multiple;
          const LayerResult b = run_cpu_layer(c, w, x, &dy, tiles);
          SCOPED_TRACE(std::string(activation_name(act)) + " W=" + std::to_string(world) + " cf=" +
                       std::to_string(cf) + " multiple=" + std::to_string(multiple));
          expect_identical(a.y, b.y, "y");
          expect_identical(a.dx, b.dx, "dx");
          expect_identical(a.grads.w1, b.grads.w1, "grad w1");
          expect_identical(a.grads.w2, b.grads.w2, "grad w2");
          expect_identical(a.grads.w3, b.grads.w3, "grad w3");
          expect_identical(a.grads.gate, b.grads.gate, "grad gate");
          EXPECT_GE(b.rows_received, a.rows_received);
          padded_cases += b.rows_received > a.rows_received;
          for (int64_t rows : b.expert_rows) EXPECT_EQ(rows % multiple, 0) << "every expert's batch is padded";
          EXPECT_EQ(a.rows_sent, b.rows_sent) << "tile padding is local: the wire is unchanged";
        }
  EXPECT_GE(padded_cases, 30) << "of 36 cases, most must actually pad";
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

TEST(Engine, RanksThatDisagreeOnTheConfigFailTogether) {
  std::atomic<int> failed{0};
  EXPECT_THROW(run_thread_ranks(3,
                                [&](int32_t rank, Comm& comm) {
                                  MoeConfig c = small_config(Activation::relu, 3, rank == 1 ? 5 : 4);
                                  c.experts = 6;
                                  auto backend = make_cpu_backend(c.dtype);
                                  try {
                                    EpEngine engine(c, *backend, comm);
                                  } catch (const Error& e) {
                                    if (std::string(e.what()).find("do not all use the same") != std::string::npos)
                                      ++failed;
                                    throw;
                                  }
                                }),
               Error);
  EXPECT_EQ(failed.load(), 3) << "every rank must see the mismatch, none may wait for the others";
}

TEST(Engine, CapacityIsBoundedByTokensPerRank) {
  MoeConfig c = small_config(Activation::relu, 2, 16);
  for (double cf : {8.0, 1e6, 1.8e16, 1e300}) {
    c.capacity_factor = cf;
    EXPECT_EQ(c.capacity(), 16) << cf;
  }
  c.capacity_factor = 1e300;
  const MoeWeights w = random_moe_weights(c, 2);
  Rng rng(1);
  const LayerResult r = run_cpu_layer(c, w, rng.normal_vector(size_t(2 * 16 * c.hidden), 1.0), nullptr);
  EXPECT_EQ(r.dropped(), 0) << "a huge capacity drops nothing";
  EXPECT_EQ(r.rows_sent, int64_t(2) * c.experts * 16);
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

// Gradient accumulation: zero_grads() (also called by set_weights) leaves the experts' gradients to be
// written by the next backward instead of added to zeros; later backwards add. So: grads() right after
// set_weights is all zeros; a second backward on the same data gives exactly twice the first (x + x is
// exact); after zero_grads() the next backward gives the first result again, bit for bit. With 16 experts
// and 2 × 3 tokens × top-2 = 12 routed rows, at least 4 experts get no rows: their gradients must read 0
// in every case (the overwriting backward writes zeros there, it does not skip them).
TEST(Engine, GradientsAccumulateUntilZeroGrads) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const int32_t world = 2;
    MoeConfig c = small_config(Activation::swiglu, world, 3);
    c.experts = 16;
    c.dtype = dtype;
    std::atomic<int> empty_experts{0};
    const MoeWeights w = random_moe_weights(c, 41);
    Rng rng(43);
    const auto x = rng.normal_vector(size_t(world * c.tokens * c.hidden), 1.0);
    const auto dy = rng.normal_vector(x.size(), 1.0);
    run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
      auto backend = make_cpu_backend(c.dtype);
      EpEngine engine(c, *backend, comm);
      const int32_t Le = c.experts_per_rank();
      engine.set_weights(slice_experts(w, c.first_expert(rank), Le));
      const int64_t n = c.tokens * c.hidden;
      std::vector<float> xl(x.begin() + rank * n, x.begin() + (rank + 1) * n), y(n), dx(n);
      std::vector<float> dyl(dy.begin() + rank * n, dy.begin() + (rank + 1) * n);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " rank " + std::to_string(rank));
      auto step = [&] {
        engine.forward(xl.data(), y.data(), ForwardMode::train);
        engine.backward(dyl.data(), dx.data());
      };
      const MoeWeights g0 = engine.grads();
      for (const auto* v : {&g0.gate, &g0.w1, &g0.w2, &g0.w3})
        for (float e : *v) ASSERT_EQ(e, 0.f) << "gradients right after set_weights must be zero";
      step();
      const MoeWeights g1 = engine.grads();
      step();
      const MoeWeights g2 = engine.grads();
      for (auto [a, b] : {std::pair{&g1.w1, &g2.w1}, std::pair{&g1.w2, &g2.w2}, std::pair{&g1.w3, &g2.w3}}) {
        std::vector<float> twice(*a);
        for (float& e : twice) e *= 2.f;
        expect_identical(*b, twice, "expert gradient after two backwards");
      }
      engine.zero_grads();
      step();
      const MoeWeights g3 = engine.grads();
      expect_identical(g3.w1, g1.w1, "w1 gradient after zero_grads");
      expect_identical(g3.w2, g1.w2, "w2 gradient after zero_grads");
      expect_identical(g3.w3, g1.w3, "w3 gradient after zero_grads");
      expect_identical(g3.gate, g1.gate, "gate gradient after zero_grads");
      const std::vector<int64_t>& offsets = engine.layout().expert_offsets;
      const int64_t per_expert = c.ffn * c.hidden;
      for (int32_t e = 0; e < Le; ++e) {
        if (offsets[e + 1] > offsets[e]) continue;
        ++empty_experts;
        for (const MoeWeights* g : {&g1, &g2, &g3})
          for (const auto* v : {&g->w1, &g->w2, &g->w3})
            for (int64_t i = 0; i < per_expert; ++i)
              ASSERT_EQ((*v)[e * per_expert + i], 0.f) << "local expert " << e << " has no rows";
      }
    });
    EXPECT_GE(empty_experts.load(), 4) << "the case meant to have experts without rows has none";
  }
}

// ForwardMode::inference keeps nothing for the backward pass but must compute the same outputs, bit for
// bit (the pre-activations go through scratch instead of the kept buffers); backward and losses() then
// refuse.
TEST(Engine, InferenceForwardMatchesTrainForward) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (DType dtype : {DType::f32, DType::bf16}) {
      const int32_t world = 2;
      MoeConfig c = small_config(act, world, 12);
      c.dtype = dtype;
      const MoeWeights w = random_moe_weights(c, 31);
      Rng rng(37);
      const auto x = rng.normal_vector(size_t(world * c.tokens * c.hidden), 1.0);
      const auto dy = rng.normal_vector(x.size(), 1.0);
      std::atomic<int> refused{0};
      run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
        auto backend = make_cpu_backend(c.dtype);
        EpEngine engine(c, *backend, comm);
        const int32_t Le = c.experts_per_rank();
        engine.set_weights(slice_experts(w, c.first_expert(rank), Le));
        const int64_t n = c.tokens * c.hidden;
        std::vector<float> xl(x.begin() + rank * n, x.begin() + (rank + 1) * n), y_inf(n), y_train(n), dx(n);
        std::vector<float> dyl(dy.begin() + rank * n, dy.begin() + (rank + 1) * n);
        backend->upload_f32(xl.data(), xl.data(), n);
        engine.forward(xl.data(), y_inf.data(), ForwardMode::inference);
        try {
          engine.backward(dyl.data(), dx.data());
        } catch (const Error& e) {
          refused += std::string(e.what()).find("ForwardMode::inference") != std::string::npos;
        }
        try {
          (void)engine.losses();
        } catch (const Error& e) {
          refused += std::string(e.what()).find("ForwardMode::inference") != std::string::npos;
        }
        engine.forward(xl.data(), y_train.data(), ForwardMode::train);
        engine.backward(dyl.data(), dx.data());  // allowed again
        SCOPED_TRACE(std::string(activation_name(act)) + " " + dtype_name(dtype) + " rank " + std::to_string(rank));
        expect_identical(y_inf, y_train, "y");
      });
      EXPECT_EQ(refused.load(), 2 * world)
          << "backward and losses after an inference forward must fail with a clear error";
    }
}

}  // namespace
}  // namespace dmoe

namespace dmoe {
namespace {

// Deferred routing reads (EpOptions::defer_routing_reads): a train forward at W = 1, dropless, leaves its counts
// and router statistics in backend memory and reads them later. On the CPU backend (host memory: every call
// qualifies) the results must equal those of the forward that reads them at once, bit for bit, in every output,
// count and loss: the same kernels, only the time of the host read moves.
TEST(Engine, DeferredRoutingReadsGiveTheSameResults) {
  for (Activation act : {Activation::relu, Activation::swiglu})
    for (DType dtype : {DType::f32, DType::bf16}) {
      MoeConfig c = small_config(act, 1, 37);
      c.dtype = dtype;
      const MoeWeights w = random_moe_weights(c, 41);
      Rng rng(43);
      const auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
      const auto dy = rng.normal_vector(x.size(), 1.0);
      EpOptions at_once;
      at_once.defer_routing_reads = false;
      const LayerResult a = run_cpu_layer(c, w, x, &dy, at_once);
      const LayerResult b = run_cpu_layer(c, w, x, &dy);  // deferred (the default)
      SCOPED_TRACE(std::string(activation_name(act)) + " " + dtype_name(dtype));
      expect_identical(a.y, b.y, "y");
      expect_identical(a.dx, b.dx, "dx");
      expect_identical(a.grads.w1, b.grads.w1, "grad w1");
      expect_identical(a.grads.w2, b.grads.w2, "grad w2");
      expect_identical(a.grads.w3, b.grads.w3, "grad w3");
      expect_identical(a.grads.gate, b.grads.gate, "grad gate");
      EXPECT_EQ(a.routed, b.routed);
      EXPECT_EQ(a.kept, b.kept);
      EXPECT_EQ(a.expert_rows, b.expert_rows);
      EXPECT_EQ(a.rows_received, b.rows_received);
      EXPECT_EQ(a.rows_sent, b.rows_sent);
      EXPECT_EQ(a.losses.load_balance, b.losses.load_balance);
      EXPECT_EQ(a.losses.z_loss, b.losses.z_loss);
    }
}

// Which forwards defer: train (inference: in a CUDA-graph capture, or with defer_inference_reads), W = 1, dropless,
// no tile padding; the reads then wait until the backward, losses()
// or an accessor needs them, and the next forward settles a pending one first.
TEST(Engine, DeferredRoutingReadsOnlyWhereTheForwardNeedsNoCounts) {
  const auto pending_after = [](MoeConfig c, ForwardMode mode, EpOptions options) {
    const MoeWeights w = random_moe_weights(c, 47);
    bool pending = false;
    run_thread_ranks(c.world, [&](int32_t rank, Comm& comm) {
      auto backend = make_cpu_backend(c.dtype);
      EpEngine engine(c, *backend, comm, options);
      engine.set_weights(slice_experts(w, c.first_expert(rank), c.experts_per_rank()));
      Rng rng(53 + rank);
      auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
      std::vector<float> y(x.size());
      engine.forward(x.data(), y.data(), mode);
      if (rank == 0) pending = engine.routing_pending();
    });
    return pending;
  };
  const MoeConfig base = small_config(Activation::swiglu, 1, 16);
  EXPECT_TRUE(pending_after(base, ForwardMode::train, {}));
  EXPECT_FALSE(pending_after(base, ForwardMode::inference, {})) << "inference reads at once outside a capture";
  EpOptions inference;
  inference.defer_inference_reads = true;
  EXPECT_TRUE(pending_after(base, ForwardMode::inference, inference));
  EpOptions off;
  off.defer_routing_reads = false;
  EXPECT_FALSE(pending_after(base, ForwardMode::train, off));
  EpOptions tiles;
  tiles.batch_row_multiple = 8;
  EXPECT_FALSE(pending_after(base, ForwardMode::train, tiles)) << "tile padding needs the counts for the layout";
  MoeConfig capacity = base;
  capacity.capacity_factor = 0.75;
  EXPECT_FALSE(pending_after(capacity, ForwardMode::train, {})) << "capacity: the rows sent depend on the counts";
  EXPECT_FALSE(pending_after(small_config(Activation::swiglu, 2, 16), ForwardMode::train, {}))
      << "W > 1: the all-to-alls need the counts";

  // Settled by what needs the counts.
  run_thread_ranks(1, [&](int32_t, Comm& comm) {
    auto backend = make_cpu_backend(base.dtype);
    EpEngine engine(base, *backend, comm);
    engine.set_weights(random_moe_weights(base, 47));
    Rng rng(59);
    auto x = rng.normal_vector(size_t(base.tokens * base.hidden), 1.0);
    std::vector<float> y(x.size()), dx(x.size());
    engine.forward(x.data(), y.data());
    ASSERT_TRUE(engine.routing_pending());
    const RouterLosses l = engine.losses();
    EXPECT_FALSE(engine.routing_pending());
    EXPECT_GT(l.load_balance, 0.0);
    engine.forward(x.data(), y.data());
    ASSERT_TRUE(engine.routing_pending());
    engine.backward(y.data(), dx.data());
    EXPECT_FALSE(engine.routing_pending());
    engine.forward(x.data(), y.data());
    int64_t rows = 0;
    for (int64_t r : engine.kept_counts()) rows += r;
    EXPECT_FALSE(engine.routing_pending());
    EXPECT_EQ(rows, base.tokens * base.top_k);
  });
}

// An inference forward that defers (as it must in a CUDA-graph capture: nothing in it then waits for the device;
// here by defer_inference_reads, the CPU backend never captures): its output and counts equal those of the forward
// that reads them at once, bit for bit. (A NaN token: the CPU router refuses it at once; on the GPU its id -1 is
// reported when the counts are read, a GPU test.)
TEST(Engine, DeferredInferenceForwardEqualsReadAtOnce) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    MoeConfig c = small_config(Activation::swiglu, 1, 29);
    c.dtype = dtype;
    const MoeWeights w = random_moe_weights(c, 61);
    Rng rng(67);
    auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
    struct Out {
      std::vector<float> y;
      std::vector<int64_t> routed, kept;
      bool pending = false;
    };
    const auto run = [&](const EpOptions& options) {
      Out o;
      run_thread_ranks(1, [&](int32_t, Comm& comm) {
        auto backend = make_cpu_backend(c.dtype);
        EpEngine engine(c, *backend, comm, options);
        engine.set_weights(w);
        o.y.resize(x.size());
        engine.forward(x.data(), o.y.data(), ForwardMode::inference);
        o.pending = engine.routing_pending();
        o.routed = engine.routed_counts();
        o.kept = engine.kept_counts();
        EXPECT_FALSE(engine.routing_pending());
      });
      return o;
    };
    EpOptions at_once, deferred;
    at_once.defer_routing_reads = false;
    deferred.defer_inference_reads = true;
    const Out a = run(at_once), b = run(deferred);
    EXPECT_FALSE(a.pending);
    EXPECT_TRUE(b.pending);
    expect_identical(a.y, b.y, "y");
    EXPECT_EQ(a.routed, b.routed);
    EXPECT_EQ(a.kept, b.kept);

    // The next forward settles a pending one; the accessors after it read the new counts.
    run_thread_ranks(1, [&](int32_t, Comm& comm) {
      auto backend = make_cpu_backend(c.dtype);
      EpEngine engine(c, *backend, comm, deferred);
      engine.set_weights(w);
      std::vector<float> y(x.size());
      engine.forward(x.data(), y.data(), ForwardMode::inference);
      engine.forward(x.data(), y.data(), ForwardMode::inference);
      EXPECT_TRUE(engine.routing_pending());
      EXPECT_EQ(engine.kept_counts(), b.kept);
      EXPECT_FALSE(engine.captured()) << "the CPU backend never captures";
      EXPECT_THROW(engine.losses(), Error) << "an inference forward has no losses";
    });
  }
}

}  // namespace
}  // namespace dmoe
