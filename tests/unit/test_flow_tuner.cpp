// test_flow_tuner.cpp — the GP (Matérn-5/2, Cholesky in fp64, marginal-likelihood fit), expected improvement
// and the (Sp, R) tuner (src/flow/tuner.*): interpolation of noiseless observations, EI ~0 at observed points
// and positive elsewhere, determinism, a synthetic objective and the simulator itself as objectives.
//
// Run: dmoe_unit_tests --gtest_filter='FlowTuner*:FlowGp*'
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "flow_test_util.hpp"
#include "core/error.hpp"
#include "flow/ablation.hpp"
#include "flow/simulator.hpp"
#include "flow/tuner.hpp"

namespace dmoe::flow {
namespace {

using test::error_of;

TEST(FlowGp, MaternAndExpectedImprovementFormulas) {
  EXPECT_DOUBLE_EQ(matern52(0), 1.0);
  const double r = 0.7, s5 = std::sqrt(5.0);
  EXPECT_NEAR(matern52(r), (1 + s5 * r + 5.0 / 3.0 * r * r) * std::exp(-s5 * r), 1e-15);
  // EI at z = 0: σ φ(0); with no uncertainty: the plain improvement.
  EXPECT_NEAR(expected_improvement(1.0, 2.0, 1.0), 2.0 / std::sqrt(2 * M_PI), 1e-12);
  EXPECT_DOUBLE_EQ(expected_improvement(0.5, 0.0, 1.0), 0.5);
  EXPECT_DOUBLE_EQ(expected_improvement(1.5, 0.0, 1.0), 0.0);
  // A value by hand: mean 1, σ 0.5, best 1.2: z = 0.4, EI = 0.2 Φ(0.4) + 0.5 φ(0.4).
  EXPECT_NEAR(expected_improvement(1.0, 0.5, 1.2), 0.2 * 0.65542174161 + 0.5 * 0.36827014030, 1e-9);
}

TEST(FlowGp, InterpolatesNoiselessObservations) {
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (int i = 0; i < 7; ++i) {
    const double a = i / 6.0, b = (i * 3 % 7) / 6.0;
    x.push_back({a, b});
    y.push_back(std::sin(4 * a) + b * b + 3.0);
  }
  GaussianProcess gp;
  gp.fit_fixed(x, y, GpHyper{{0.3, 0.3}, 1.0, 1e-10});
  for (size_t i = 0; i < x.size(); ++i) {
    const auto p = gp.predict(x[i]);
    EXPECT_NEAR(p.mean, y[i], 1e-6) << "point " << i;
    EXPECT_LT(p.variance, 1e-8) << "point " << i;
  }
  // Away from the data the model is uncertain.
  EXPECT_GT(gp.predict({0.08, 0.95}).variance, 1e-3);
  // The marginal-likelihood fit on the grid picks the smallest noise for noiseless smooth data and also
  // interpolates; its likelihood is at least that of any grid point (here: one of them).
  GaussianProcess fitted;
  fitted.fit(x, y);
  EXPECT_DOUBLE_EQ(fitted.hyper().noise_var, 1e-6);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(fitted.predict(x[i]).mean, y[i], 1e-3 * std::abs(y[i]));
  GaussianProcess other;
  other.fit_fixed(x, y, GpHyper{{1.6, 0.05}, 2.0, 1e-2});
  EXPECT_GE(fitted.log_marginal_likelihood(), other.log_marginal_likelihood());
  EXPECT_NE(error_of([&] { other.fit_fixed(x, {1.0}, GpHyper{{0.3, 0.3}, 1.0, 0}); }).find("7 points and 1 values"),
            std::string::npos);
}

TEST(FlowTuner, ExpectedImprovementZeroAtObservedPositiveElsewhere) {
  // Noiseless observations: the GP's noise fixed at the grid's smallest (the default grid would be free to
  // explain them as noise, which leaves EI > 0 at an observed point).
  TunerOptions o;
  o.grid.noise_var = {1e-6};
  FlowTuner t(o);
  const TunePoint pts[] = {{17.0, 1}, {20.0, 2}, {22.5, 4}, {24.0, 8}, {19.0, 8}};
  const double ys[] = {5.0, 3.0, 3.5, 6.0, 4.0};
  for (int i = 0; i < 5; ++i) t.observe(pts[i], ys[i]);
  const std::vector<double> ei = t.expected_improvements();
  double max_ei = 0;
  for (double e : ei) max_ei = std::max(max_ei, e);
  ASSERT_GT(max_ei, 0.1);  // far above the observed points' EI
  int positive = 0;
  for (size_t i = 0; i < ei.size(); ++i) {
    bool observed = false;
    for (const TunePoint& p : pts)
      observed |= std::abs(p.log2_chunk_bytes - t.candidates()[i].log2_chunk_bytes) < 1e-12 &&
                  p.micro_batches == t.candidates()[i].micro_batches;
    if (observed)  // σ there is ~sqrt(σn²)·std(y) = 1e-3·1.1, so EI <= φ(0)·σ ≈ 4.4e-4 (y's std is 1.13)
      EXPECT_LT(ei[i], 1e-3) << "observed candidate " << i;
    else
      positive += ei[i] > 0;
  }
  EXPECT_EQ(positive, int(ei.size()) - 5);
  EXPECT_EQ(t.best().micro_batches, 2);
  EXPECT_DOUBLE_EQ(t.best_value(), 3.0);
  EXPECT_NE(error_of([&] { t.observe({16.0, 2}, 1.0); }).find("log2_chunk_bytes 16 outside [17, 24]"), std::string::npos);
  EXPECT_NE(error_of([&] { t.observe({20.0, 3}, 1.0); }).find("micro_batches 3 is not one of"), std::string::npos);
  EXPECT_NE(error_of([&] { t.observe({20.0, 2}, NAN); }).find("must be finite"), std::string::npos);
  EXPECT_NE(error_of([] { TunerOptions o; o.micro_batches = {3}; FlowTuner bad(o); }).find("power of two"),
            std::string::npos);
}

// Runs the tuner for n samples on f; returns the best value found.
template <typename F>
double tune(FlowTuner& t, F&& f, int n, std::vector<TunePoint>* trail = nullptr) {
  for (int i = 0; i < n; ++i) {
    const TunePoint p = t.suggest();
    if (trail) trail->push_back(p);
    t.observe(p, f(p));
  }
  return t.best_value();
}

TEST(FlowTuner, FindsTheOptimumOfASyntheticObjective) {
  // Quadratic in log2 Sp, minimum 10 at log2 Sp = 20.7 (≈ 1.6 MiB) and R = 4; within 1 % after 10 samples
  // (about 8 of the 228 grid points are: 10 random draws would hit one in ~30 % of the seeds).
  auto f = [](const TunePoint& p) {
    const double r_term[] = {2.0, 0.6, 0.0, 0.9};
    const double s = p.log2_chunk_bytes - 20.7;
    return 10.0 + 0.4 * s * s + r_term[int(std::log2(p.micro_batches))];
  };
  for (uint64_t seed : {1, 2, 3}) {
    TunerOptions o;
    o.seed = seed;
    FlowTuner t(o);
    const double best = tune(t, f, 10);
    EXPECT_LE(best, 10.0 * 1.01) << "seed " << seed << ": best " << t.best().log2_chunk_bytes << " R "
                                 << t.best().micro_batches;
  }
  // Deterministic for a seed; another seed starts elsewhere.
  std::vector<TunePoint> a, b, c;
  TunerOptions o;
  FlowTuner ta(o), tb(o);
  tune(ta, f, 6, &a);
  tune(tb, f, 6, &b);
  o.seed = 99;
  FlowTuner tc(o);
  tune(tc, f, 6, &c);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].log2_chunk_bytes, b[i].log2_chunk_bytes);
    EXPECT_EQ(a[i].micro_batches, b[i].micro_batches);
    differs |= a[i].log2_chunk_bytes != c[i].log2_chunk_bytes || a[i].micro_batches != c[i].micro_batches;
  }
  EXPECT_TRUE(differs);
  EXPECT_EQ(a[0].log2_chunk_bytes, 20.0);  // the paper's default first
  EXPECT_EQ(a[0].micro_batches, 2);
}

TEST(FlowTuner, TunesTheSimulatedStep) {
  // The simulator with fixed costs as the objective: the tuner's best after 10 samples against the best of
  // the whole grid (4 × 57 simulations).
  CostModel c;
  const double fixed[] = {0.08, 0.15, 0.06, 0.15, 0.15, 0.06, 0.15, 0.08};
  const double batch[] = {3.0, 2.5, 4.0, 2.5, 2.5, 8.0, 2.5, 6.0};
  for (int k = 0; k < 8; ++k) c.tasks[size_t(k)] = {fixed[k], batch[k]};
  c.ar_alpha_ms = 0.12;
  c.ar_bytes_per_ms = 5e6;
  c.dense_grad_bytes_per_layer = 24 << 20;
  auto step = [&](const TunePoint& p) {
    GraphSpec s;
    s.layers = 4;
    s.micro_batches = p.micro_batches;
    s.schedule = Schedule::tuned;
    s.dense_grad_bytes_per_layer = c.dense_grad_bytes_per_layer;
    s.chunk_bytes = p.chunk_bytes();
    return simulate(build_task_graph(s), c).step_ms;
  };
  FlowTuner grid;
  double best = INFINITY, worst = 0;
  for (const TunePoint& p : grid.candidates()) {
    const double v = step(p);
    best = std::min(best, v);
    worst = std::max(worst, v);
  }
  ASSERT_GT(worst, 1.2 * best) << "the objective should not be flat";
  FlowTuner t;
  const double found = tune(t, step, 10);
  EXPECT_LE(found, best * 1.03) << "found " << found << " at log2 Sp " << t.best().log2_chunk_bytes << " R "
                                << t.best().micro_batches << "; grid best " << best;
}

TEST(FlowTuner, StopsOnceEveryPointOfItsGridIsSampled) {
  // `flow tune --samples 1000` on the 228-point grid ran ~2.5 h, its last ~770 samples repeating the best point (each
  // refitting a larger model). A grid of 9 points (R = 1, log2 Sp 17 … 18 by 1/8): 20 samples asked, 9 taken, each
  // point once, and the best is the grid's.
  CostModel c;
  for (TaskCost& t : c.tasks) t = {0.05, 1.0};
  c.ar_alpha_ms = 0.1;
  c.ar_bytes_per_ms = 5e6;
  c.dense_grad_bytes_per_layer = 1066496;
  TunerOptions o;
  o.micro_batches = {1};
  o.log2_chunk_min = 17;
  o.log2_chunk_max = 18;
  ASSERT_EQ(FlowTuner(o).candidates().size(), 9u);
  const TuneRun run = tune_on_simulator(2, c, 20, o);
  ASSERT_EQ(run.samples.size(), 9u);
  std::set<double> seen;
  double best = INFINITY;
  for (const TuneSample& s : run.samples) {
    EXPECT_TRUE(seen.insert(s.point.log2_chunk_bytes).second) << "sampled twice: " << s.point.log2_chunk_bytes;
    best = std::min(best, s.step_ms);
  }
  EXPECT_EQ(run.best_step_ms, best);
  EXPECT_EQ(tune_on_simulator(2, c, 5, o).samples.size(), 5u);  // fewer than the grid: as asked
}

TEST(FlowTuner, GridOnTheSimulatorKeepsToGraphsThatCanBeBuilt) {
  // At many layers (or a large dense gradient) some of the grid's (Sp, R) make graphs past kMaxTasks: `flow simulate
  // --layers 100000` failed in its tuned row after seconds of work, naming "chunk_bytes 7692387 ..., micro_batches 8",
  // a point the user never gave, and `flow tune` after 100 s in its grid. The grid is cut to the points that build.
  CostModel c;
  for (TaskCost& t : c.tasks) t = {0.05, 1.0};
  c.ar_alpha_ms = 0.1;
  c.ar_bytes_per_ms = 5e6;
  c.dense_grad_bytes_per_layer = 1066496;  // bench/flow/example.json's
  auto all_build = [&](int32_t layers, const TunerOptions& o) -> ::testing::AssertionResult {
    const FlowTuner tuner(o);
    for (const TunePoint& p : tuner.candidates()) {
      GraphSpec s;
      s.layers = layers;
      s.micro_batches = p.micro_batches;
      s.schedule = Schedule::tuned;
      s.dense_grad_bytes_per_layer = c.dense_grad_bytes_per_layer;
      s.chunk_bytes = p.chunk_bytes();
      const std::string e = error_of([&] { validate(s); });
      if (e != "(no error)") return ::testing::AssertionFailure() << e;
    }
    return ::testing::AssertionSuccess();
  };
  EXPECT_FALSE(all_build(100000, TunerOptions{}));  // R = 8 is 6.4 M tasks
  const TunerOptions cut = tuner_options_within_task_limit(100000, c, TunerOptions{});
  EXPECT_EQ(cut.micro_batches, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_TRUE(all_build(100000, cut));
  // A dense gradient of 2^40 bytes per layer: every R stays, small chunks go (12 layers at 128 KiB: 100 M AR chunks).
  c.dense_grad_bytes_per_layer = int64_t(1) << 40;
  const TunerOptions big = tuner_options_within_task_limit(12, c, TunerOptions{});
  EXPECT_EQ(big.micro_batches, (std::vector<int32_t>{1, 2, 4, 8}));
  EXPECT_GT(big.log2_chunk_min, 21.5);
  EXPECT_TRUE(all_build(12, big));
  // Where nothing fits: refused naming the layers.
  EXPECT_NE(error_of([&] { tuner_options_within_task_limit(100000, c, TunerOptions{}); }).find("give fewer --layers"),
            std::string::npos);
  // A small model keeps the whole grid.
  c.dense_grad_bytes_per_layer = 1066496;
  const TunerOptions whole = tuner_options_within_task_limit(12, c, TunerOptions{});
  EXPECT_EQ(whole.micro_batches, TunerOptions{}.micro_batches);
  EXPECT_EQ(whole.log2_chunk_min, TunerOptions{}.log2_chunk_min);
}

}  // namespace
}  // namespace dmoe::flow
