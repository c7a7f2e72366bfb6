// LayerSession (the facade the Python module wraps) and the engine features it rests on: borrowed weights
// and gradient buffers, per-call token counts, several forwards in flight. The CPU session must give
// run_cpu_layer's results bit for bit (same engine, same order of every sum).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/error.hpp"
#include "core/random.hpp"
#include "engine/layer_session.hpp"
#include "engine/reference.hpp"
#include "fd_util.hpp"

namespace dmoe {
namespace {

MoeConfig session_config(Activation act, int32_t world, double cf = 0) {
  MoeConfig c;
  c.tokens = 1;
  c.hidden = 16;
  c.ffn = 24;
  c.experts = 8;
  c.top_k = 2;
  c.activation = act;
  c.world = world;
  c.capacity_factor = cf;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

using test::expect_identical;

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

struct SessionRun {
  std::vector<float> y, dx, expert_weights, logits;
  std::vector<int32_t> ids;
  std::vector<double> dgate, dw1, dw3, dw2;
  RouterLosses losses;
};

struct Held {
  const MoeWeights& w;
  WeightViews views() const {
    return WeightViews{w.gate.data(), w.w1.data(), w.w3.empty() ? nullptr : w.w3.data(), w.w2.data()};
  }
};

// One train forward + backward of `rows` rows through the session.
SessionRun session_run(LayerSession& s, const MoeWeights& w, const std::vector<float>& x, const std::vector<float>& dy) {
  const MoeConfig& c = s.config();
  const int64_t rows = int64_t(x.size()) / c.hidden;
  SessionRun r;
  r.y.resize(x.size());
  r.dx.resize(x.size());
  r.ids.resize(size_t(rows * c.top_k));
  r.expert_weights.resize(r.ids.size());
  r.logits.resize(size_t(rows * c.experts));
  SessionForward f;
  f.x = x.data();
  f.y = r.y.data();
  f.rows = rows;
  f.weights = Held{w}.views();
  f.expert_ids = r.ids.data();
  f.expert_weights = r.expert_weights.data();
  f.router_logits = r.logits.data();
  const int64_t ticket = s.forward(f);
  r.losses = s.losses(ticket);
  r.dgate.assign(w.gate.size(), -1.0);  // garbage: the session must write every element
  r.dw1.assign(w.w1.size(), -1.0);
  r.dw3.assign(w.w3.size(), -1.0);
  r.dw2.assign(w.w2.size(), -1.0);
  SessionBackward b;
  b.ticket = ticket;
  b.dy = dy.data();
  b.dx = r.dx.data();
  b.grads = GradViews{r.dgate.data(), r.dw1.data(), r.dw3.empty() ? nullptr : r.dw3.data(), r.dw2.data()};
  s.backward(b);
  return r;
}

void expect_matches_reference(const SessionRun& r, const LayerResult& ref, const std::string& what) {
  expect_identical(r.y, ref.y, what + " y");
  expect_identical(r.ids, ref.expert_ids, what + " expert_ids");
  expect_identical(r.expert_weights, ref.expert_weights, what + " expert_weights");
  expect_identical(r.dx, ref.dx, what + " dx");
  expect_identical(to_float(r.dgate), ref.grads.gate, what + " grad gate");
  expect_identical(to_float(r.dw1), ref.grads.w1, what + " grad w1");
  expect_identical(to_float(r.dw3), ref.grads.w3, what + " grad w3");
  expect_identical(to_float(r.dw2), ref.grads.w2, what + " grad w2");
  EXPECT_EQ(r.losses.load_balance, ref.losses.load_balance) << what;
  EXPECT_EQ(r.losses.z_loss, ref.losses.z_loss) << what;
}

struct SessionCase {
  Activation act;
  int32_t world;
  double cf;
};

class SessionRanks : public ::testing::TestWithParam<SessionCase> {};

// The session's CPU engine with W simulated ranks equals run_cpu_layer for the same config, for two
// token counts in a row (the engines change T between calls), and again for the first count.
TEST_P(SessionRanks, EqualsRunCpuLayer) {
  const auto [act, world, cf] = GetParam();
  MoeConfig c = session_config(act, world, cf);
  SessionOptions o;
  LayerSession s(c, o);
  EXPECT_EQ(s.held_experts(), c.experts);
  EXPECT_EQ(s.grad_dtype(), DType::f64);
  const MoeWeights w = random_moe_weights(c, 5);
  Rng rng(3);
  for (const int64_t T : {6, 10, 6}) {
    const auto x = rng.normal_vector(size_t(world * T * c.hidden), 1.0);
    const auto dy = rng.normal_vector(x.size(), 1.0);
    const SessionRun r = session_run(s, w, x, dy);
    MoeConfig rc = c;
    rc.tokens = T;
    const LayerResult ref = run_cpu_layer(rc, w, x, &dy);
    expect_matches_reference(r, ref, "T=" + std::to_string(T));
    // logits: rows of x · gateᵀ as the router computes them; check one entry against a direct fp64 sum
    double dot = 0;
    for (int64_t h = 0; h < c.hidden; ++h) dot += double(x[size_t(h)]) * w.gate[size_t(c.hidden + h)];
    EXPECT_NEAR(r.logits[1], dot, 1e-5 * (1 + std::abs(dot)));
  }
  EXPECT_EQ(s.pending(), 0);
  EXPECT_EQ(s.engines(), 1);  // one forward at a time: one set of engines, reused
}

INSTANTIATE_TEST_SUITE_P(Session, SessionRanks,
                         ::testing::Values(SessionCase{Activation::swiglu, 1, 0}, SessionCase{Activation::swiglu, 2, 0},
                                           SessionCase{Activation::gelu, 4, 0}, SessionCase{Activation::relu, 2, 1.0},
                                           SessionCase{Activation::swiglu, 4, 1.25}));

// Two train forwards in flight, backwards in the opposite order: each backward uses its own forward's
// state (a second engine set), and an inference forward in between needs no ticket.
TEST(Session, ForwardsInFlight) {
  MoeConfig c = session_config(Activation::swiglu, 2);
  LayerSession s(c, SessionOptions{});
  const MoeWeights w = random_moe_weights(c, 9);
  Rng rng(4);
  const int64_t T = 5;
  const auto xa = rng.normal_vector(size_t(2 * T * c.hidden), 1.0), dya = rng.normal_vector(xa.size(), 1.0);
  const auto xb = rng.normal_vector(size_t(2 * T * c.hidden), 1.0), dyb = rng.normal_vector(xb.size(), 1.0);
  std::vector<float> ya(xa.size()), yb(xb.size()), yi(xb.size()), dxa(xa.size()), dxb(xb.size());
  SessionForward f;
  f.rows = 2 * T;
  f.weights = Held{w}.views();
  f.x = xa.data();
  f.y = ya.data();
  const int64_t ta = s.forward(f);
  f.x = xb.data();
  f.y = yb.data();
  const int64_t tb = s.forward(f);
  f.train = false;
  f.y = yi.data();
  EXPECT_EQ(s.forward(f), -1);
  expect_identical(yi, yb, "inference forward");
  EXPECT_EQ(s.pending(), 2);
  EXPECT_EQ(s.engines(), 3);  // the inference forward could not use a pending forward's engines
  std::vector<double> ga(w.gate.size()), g1(w.w1.size()), g3(w.w3.size()), g2(w.w2.size());
  SessionBackward b;
  b.grads = GradViews{ga.data(), g1.data(), g3.data(), g2.data()};
  b.ticket = tb;
  b.dy = dyb.data();
  b.dx = dxb.data();
  s.backward(b);
  MoeConfig rc = c;
  rc.tokens = T;
  const LayerResult refb = run_cpu_layer(rc, w, xb, &dyb);
  expect_identical(dxb, refb.dx, "dx of the second forward");
  expect_identical(to_float(g1), refb.grads.w1, "grad w1 of the second forward");
  b.ticket = ta;
  b.dy = dya.data();
  b.dx = dxa.data();
  s.backward(b);
  const LayerResult refa = run_cpu_layer(rc, w, xa, &dya);
  expect_identical(ya, refa.y, "y of the first forward");
  expect_identical(dxa, refa.dx, "dx of the first forward");
  expect_identical(to_float(ga), refa.grads.gate, "grad gate of the first forward");
  expect_identical(to_float(g2), refa.grads.w2, "grad w2 of the first forward");
  EXPECT_EQ(s.pending(), 0);
  // A released forward frees its engines for the next one; a used ticket is refused.
  f.train = true;
  const int64_t tc = s.forward(f);
  s.release(tc);
  EXPECT_EQ(s.pending(), 0);
  b.ticket = tc;
  try {
    s.backward(b);
    FAIL() << "a released ticket was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a pending train forward"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.engines(), 3);
}

TEST(Session, RefusesBadInput) {
  MoeConfig c = session_config(Activation::swiglu, 2);
  LayerSession s(c, SessionOptions{});
  const MoeWeights w = random_moe_weights(c, 1);
  std::vector<float> x(3 * 16), y(x.size());
  SessionForward f;
  f.x = x.data();
  f.y = y.data();
  f.rows = 3;
  f.weights = Held{w}.views();
  try {
    s.forward(f);
    FAIL() << "3 rows on 2 ranks were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_engine_kind("gpu"), Error);
  EXPECT_EQ(parse_engine_kind("flash"), EngineKind::flash);
  if (!cuda_engines_built()) {
    SessionOptions o;
    o.engine = EngineKind::ep;
    try {
      LayerSession cuda(c, o);
      FAIL() << "engine ep was accepted without CUDA";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
    }
  }
}

// EpEngine with borrowed weights and gradient buffers gives what set_weights() + grads() give.
TEST(Session, EngineWeightAndGradViews) {
  MoeConfig c = session_config(Activation::swiglu, 1);
  c.tokens = 7;
  const MoeWeights w = random_moe_weights(c, 2);
  Rng rng(8);
  const auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0), dy = rng.normal_vector(x.size(), 1.0);
  auto backend = make_cpu_backend(DType::f32);
  auto comms = make_thread_comms(1);
  EpEngine own(c, *backend, *comms[0]);
  own.set_weights(w);
  std::vector<float> y1(x.size()), dx1(x.size()), y2(x.size()), dx2(x.size());
  own.forward(x.data(), y1.data());
  own.backward(dy.data(), dx1.data());
  const MoeWeights g = own.grads();

  EpEngine views(c, *backend, *comms[0]);
  views.set_weight_views(Held{w}.views());
  views.forward(x.data(), y2.data());
  try {
    views.backward(dy.data(), dx2.data());
    FAIL() << "a backward without gradient buffers was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("set_grad_views"), std::string::npos) << e.what();
  }
  std::vector<double> gg(w.gate.size(), 7.0), g1(w.w1.size(), 7.0), g3(w.w3.size(), 7.0), g2(w.w2.size(), 7.0);
  views.set_grad_views(GradViews{gg.data(), g1.data(), g3.data(), g2.data()});
  views.forward(x.data(), y2.data());
  views.backward(dy.data(), dx2.data());
  expect_identical(y2, y1, "y");
  expect_identical(dx2, dx1, "dx");
  expect_identical(to_float(gg), g.gate, "grad gate");
  expect_identical(to_float(g1), g.w1, "grad w1");
  expect_identical(to_float(g3), g.w3, "grad w3");
  expect_identical(to_float(g2), g.w2, "grad w2");
  EXPECT_EQ(views.grad_views().gate, gg.data());
  EXPECT_TRUE(views.expert_grads_written());
}

}  // namespace
}  // namespace dmoe
