// test_routing.cpp — the per-token routing math of core/routing.hpp and the CPU router built on it:
// top-k order and tie-breaking, k = 1 and k = E, gate-weight renormalisation, softmax and log-sum-exp.
//
// Run: dmoe_unit_tests --gtest_filter='Routing*'
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/random.hpp"
#include "core/routing.hpp"
#include "cpu/kernels.hpp"

namespace dmoe {
namespace {

std::vector<int32_t> topk(const std::vector<float>& logits, int32_t k) {
  std::vector<int32_t> ids(k, -7);
  topk_row(logits.data(), int32_t(logits.size()), k, ids.data());
  return ids;
}

// log Σ exp(l) in long double, shifted by the max so it cannot overflow.
double reference_lse(const float* logits, int32_t n) {
  long double m = logits[0];
  for (int32_t e = 1; e < n; ++e) m = std::max<long double>(m, logits[e]);
  long double s = 0;
  for (int32_t e = 0; e < n; ++e) s += std::exp((long double)logits[e] - m);
  return double(m + std::log(s));
}

TEST(RoutingTopK, TiesGoToLowerIndex) {
  EXPECT_EQ(topk({1, 1, 1, 1}, 2), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(topk({1, 3, 3, 0, 3}, 3), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(topk({1, 3, 3, 0, 3}, 2), (std::vector<int32_t>{1, 2}));
  // A tie below the first pick: the lower index comes first, then the higher one.
  EXPECT_EQ(topk({2, 5, 2, 2}, 3), (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(topk({-1, -1}, 2), (std::vector<int32_t>{0, 1}));
}

TEST(RoutingTopK, DescendingOrder) {
  EXPECT_EQ(topk({0.5f, 2.0f, -1.0f, 1.0f}, 3), (std::vector<int32_t>{1, 3, 0}));
  EXPECT_EQ(topk({-3.0f, -2.0f, -1.0f}, 2), (std::vector<int32_t>{2, 1}));
  const float inf = INFINITY;
  EXPECT_EQ(topk({-inf, 0.0f, inf, -inf}, 4), (std::vector<int32_t>{2, 1, 0, 3}));
}

TEST(RoutingTopK, KEqualsOne) {
  EXPECT_EQ(topk({0.1f, 0.7f, 0.3f}, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(topk({4.0f, 4.0f, 4.0f}, 1), (std::vector<int32_t>{0}));
  EXPECT_EQ(topk({42.0f}, 1), (std::vector<int32_t>{0}));
}

TEST(RoutingTopK, KEqualsAllExperts) {
  // Every expert appears once, sorted by (logit desc, index asc).
  EXPECT_EQ(topk({0.2f, -1.0f, 0.2f, 3.0f, -1.0f, 0.0f}, 6), (std::vector<int32_t>{3, 0, 2, 5, 1, 4}));
  Rng rng(11);
  std::vector<float> logits = rng.normal_vector(9, 1.0);
  logits[4] = logits[7];  // one tie
  std::vector<int32_t> ids = topk(logits, 9);
  std::vector<int32_t> sorted(9);
  std::iota(sorted.begin(), sorted.end(), 0);
  std::stable_sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  EXPECT_EQ(ids, sorted);
}

TEST(RoutingSoftmax, SumsToOneAndLse) {
  Rng rng(12);
  for (int32_t experts : {1, 2, 5, 64}) {
    std::vector<float> logits = rng.normal_vector(experts, 3.0);
    std::vector<float> probs(experts);
    const double lse = softmax_row<double>(logits.data(), experts, probs.data());
    double sum = 0;
    for (int32_t e = 0; e < experts; ++e) {
      sum += probs[e];
      // p_e = exp(l_e − lse); each prob is one float rounding (2^-24 relative) of the fp64 value.
      EXPECT_NEAR(probs[e], std::exp(double(logits[e]) - lse), 2e-7 * probs[e] + 1e-30) << "e=" << e;
    }
    // E float roundings of relative size 2^-24 each.
    EXPECT_NEAR(sum, 1.0, experts * 6e-8) << "E=" << experts;
    EXPECT_NEAR(lse, reference_lse(logits.data(), experts), 1e-13 * std::max(1.0, std::abs(lse)));
  }
}

TEST(RoutingSoftmax, LargeLogitsDoNotOverflow) {
  const std::vector<float> logits = {1000.0f, 1000.0f, -1000.0f};
  std::vector<float> probs(3);
  const double lse = softmax_row<double>(logits.data(), 3, probs.data());
  EXPECT_NEAR(lse, 1000.0 + std::log(2.0), 1e-12);
  EXPECT_FLOAT_EQ(probs[0], 0.5f);
  EXPECT_FLOAT_EQ(probs[1], 0.5f);
  EXPECT_EQ(probs[2], 0.0f);
}

TEST(RoutingGateWeights, RenormalizeOnOff) {
  const std::vector<float> probs = {0.1f, 0.4f, 0.2f, 0.3f};
  const std::vector<int32_t> ids = {1, 3};
  std::vector<float> w(2);
  gate_weights_row<double>(probs.data(), ids.data(), 2, false, w.data());
  EXPECT_EQ(w[0], 0.4f);  // exactly the probabilities
  EXPECT_EQ(w[1], 0.3f);
  gate_weights_row<double>(probs.data(), ids.data(), 2, true, w.data());
  EXPECT_FLOAT_EQ(w[0], float(0.4 / 0.7));
  EXPECT_FLOAT_EQ(w[1], float(0.3 / 0.7));
  EXPECT_NEAR(double(w[0]) + double(w[1]), 1.0, 2 * 6e-8);
  // k = 1 renormalised: the single weight is exactly 1.
  gate_weights_row<double>(probs.data(), ids.data(), 1, true, w.data());
  EXPECT_EQ(w[0], 1.0f);
}

// The CPU router is the per-row functions applied to every token.
TEST(RoutingCpuRouter, MatchesRowFunctions) {
  const int64_t tokens = 7, hidden = 6;
  const int32_t experts = 5, top_k = 2;
  Rng rng(13);
  const std::vector<float> x = rng.normal_vector(tokens * hidden, 1.0);
  const std::vector<float> wg = rng.normal_vector(experts * hidden, 0.5);
  std::vector<float> logits(tokens * experts);
  cpu::router_logits(x.data(), wg.data(), logits.data(), tokens, hidden, experts);
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t e = 0; e < experts; ++e) {
      double dot = 0;
      for (int64_t i = 0; i < hidden; ++i) dot += double(x[t * hidden + i]) * double(wg[e * hidden + i]);
      EXPECT_EQ(logits[t * experts + e], float(dot)) << "fp64 dot, rounded once: t=" << t << " e=" << e;
    }
  for (bool renormalize : {false, true}) {
    std::vector<float> probs(tokens * experts), weights(tokens * top_k), lse(tokens);
    std::vector<int32_t> ids(tokens * top_k);
    cpu::router_topk(logits.data(), probs.data(), ids.data(), weights.data(), lse.data(), tokens, experts,
                     top_k, renormalize);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<float> p(experts), w(top_k);
      std::vector<int32_t> id(top_k);
      const double l = softmax_row<double>(&logits[t * experts], experts, p.data());
      topk_row(&logits[t * experts], experts, top_k, id.data());
      gate_weights_row<double>(p.data(), id.data(), top_k, renormalize, w.data());
      EXPECT_EQ(lse[t], float(l));
      EXPECT_NEAR(lse[t], reference_lse(&logits[t * experts], experts), 1e-6 * std::max(1.0, std::abs(l)));
      for (int32_t e = 0; e < experts; ++e) EXPECT_EQ(probs[t * experts + e], p[e]);
      for (int32_t j = 0; j < top_k; ++j) {
        EXPECT_EQ(ids[t * top_k + j], id[j]);
        EXPECT_EQ(weights[t * top_k + j], w[j]);
      }
      if (renormalize) {
        EXPECT_NEAR(double(weights[t * top_k]) + weights[t * top_k + 1], 1.0, 2e-7);
      }
    }
  }
}

TEST(RoutingCpuRouter, RejectsNaNLogits) {
  // NaN compares false both ways: topk_row finds no second choice (-1); the router must report it rather
  // than read probs[-1].
  const std::vector<float> logits = {std::nanf(""), 1.0f, 2.0f};
  std::vector<float> probs(3), weights(2), lse(1);
  std::vector<int32_t> ids(2);
  EXPECT_THROW(cpu::router_topk(logits.data(), probs.data(), ids.data(), weights.data(), lse.data(), 1, 3, 2,
                                true),
               Error);
}

TEST(RoutingAuxPartials, HandComputed) {
  // T = 2, E = 3, k = 2.
  const std::vector<float> probs = {0.5f, 0.25f, 0.25f, 0.125f, 0.375f, 0.5f};
  const std::vector<float> lse = {1.5f, -2.0f};
  const std::vector<int32_t> ids = {0, 1, 2, 1};
  std::vector<double> prob_sum(3, 99), assigned(3, 99);  // overwritten, not accumulated
  double z_sum = 99;
  cpu::router_aux_partials(probs.data(), lse.data(), ids.data(), 2, 3, 2, prob_sum.data(), assigned.data(),
                           &z_sum);
  EXPECT_EQ(prob_sum, (std::vector<double>{0.625, 0.625, 0.75}));
  EXPECT_EQ(assigned, (std::vector<double>{1, 2, 1}));
  EXPECT_EQ(z_sum, 1.5 * 1.5 + 2.0 * 2.0);
}

TEST(RoutingAuxPartials, RejectsBadExpertId) {
  const std::vector<float> probs = {0.5f, 0.5f};
  const std::vector<float> lse = {0.0f};
  std::vector<double> prob_sum(2), assigned(2);
  double z_sum = 0;
  for (int32_t bad : {-1, 2}) {
    const std::vector<int32_t> ids = {bad};
    EXPECT_THROW(cpu::router_aux_partials(probs.data(), lse.data(), ids.data(), 1, 2, 1, prob_sum.data(),
                                          assigned.data(), &z_sum),
                 Error)
        << "id " << bad;
  }
}

}  // namespace
}  // namespace dmoe
