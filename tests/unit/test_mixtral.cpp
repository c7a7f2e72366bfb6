// test_mixtral.cpp — the Mixtral model on the CPU (src/model/mixtral.*): whole-model forward + backward
// against central finite differences on tiny configs (a few sampled elements of every parameter tensor),
// W = 2 ranks against one, and the errors for bad inputs.
//
// The MoE top-k is piecewise constant: a finite difference is only valid when the perturbation leaves
// every layer's routing unchanged, so each sample checks the expert ids at ±step and moves to the next
// element when they change (the test fails if too many do).
//
// Run: dmoe_unit_tests --gtest_filter='Mixtral*'
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/random.hpp"
#include "model/mixtral.hpp"
#include "fd_util.hpp"

namespace dmoe {
namespace {

MixtralConfig tiny_config(bool tied, bool aux) {
  MixtralConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 6;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = tied ? 1 : 2;  // GQA groups of 4 and of 2
  c.num_local_experts = 4;
  c.num_experts_per_tok = 2;
  c.rope_theta = 100.0;  // large angles at small positions, so RoPE matters
  c.tie_word_embeddings = tied;
  c.output_router_logits = aux;
  c.router_aux_loss_coef = aux ? 0.5 : 0.0;  // large, so the aux term's gradient is visible in the check
  c.max_position_embeddings = 64;
  c.initializer_range = 0.5;  // O(1) activations: gradients well above the finite-difference noise
  return c;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng.next() % uint64_t(vocab));
  return t;
}

std::vector<std::vector<int32_t>> routing(ModelState& st) {
  std::vector<std::vector<int32_t>> ids;
  for (auto& b : st.blocks) ids.push_back(b.moe->expert_ids());
  return ids;
}

void check_model_gradients(const MixtralConfig& c) {
  const int64_t B = 2, S = 5;
  auto comms = make_thread_comms(1);
  MixtralModel model(c, *comms[0]);
  model.set_weights(random_mixtral_weights(c, 7));
  const std::vector<int32_t> tokens = random_tokens(B * S, c.vocab_size, 3);
  ModelState st;
  const double loss0 = model.forward(tokens.data(), B, S, st);
  EXPECT_TRUE(std::isfinite(loss0));
  if (c.output_router_logits) EXPECT_GT(st.aux_loss, 0.0);
  const auto base_routing = routing(st);
  model.zero_grads();
  model.backward(st);

  std::vector<ParamView> params = parameter_views(model.weights(), c);
  std::vector<ParamView> grads = parameter_views(model.grads(), c);
  std::vector<double> got, want;
  int skipped = 0;
  Rng pick(11);
  for (size_t p = 0; p < params.size(); ++p) {
    int taken = 0;
    for (int attempt = 0; attempt < 12 && taken < 3; ++attempt) {
      const size_t i = size_t(pick.next() % uint64_t(params[p].numel));
      float& x = params[p].data[i];
      const float saved = x, step = 1e-3f, up = saved + step, down = saved - step;
      bool same_routing = true;
      auto eval = [&](float value) {
        x = value;
        model.weights_changed();
        ModelState s2;
        const double l = model.forward(tokens.data(), B, S, s2);
        same_routing = same_routing && routing(s2) == base_routing;
        return l;
      };
      const double lu = eval(up), ld = eval(down);
      x = saved;
      model.weights_changed();
      if (!same_routing) {
        ++skipped;
        continue;
      }
      got.push_back(grads[p].data[i]);
      want.push_back((lu - ld) / (double(up) - double(down)));
      ++taken;
    }
    EXPECT_GT(taken, 0) << params[p].name << ": every sampled element changed the routing";
  }
  // The loss carries the f32 rounding of the logits (~1e-7 relative, loss ≈ 2.4) and of every
  // activation: noise ~1e-6 / (2·step) = 5e-5; truncation O(step²) ≈ 1e-4 on O(1) second derivatives.
  test::expect_close(fmt::format("model gradients ({} samples, {} skipped for routing changes)", got.size(),
                                 skipped), got, want, 3e-4, 2e-2);
  EXPECT_LT(skipped, int(got.size()) / 4) << "too many samples changed the routing";
  // The check can fail: a gradient of the wrong sign somewhere shows up in these samples.
  double norm = 0;
  for (double g : got) norm += g * g;
  EXPECT_GT(norm, 1e-4) << "gradients are all ~0: the check would not see an error";
}

TEST(Mixtral, ForwardBackwardMatchesFiniteDifferences) { check_model_gradients(tiny_config(false, false)); }

TEST(Mixtral, TiedEmbeddingsAndAuxLossMatchFiniteDifferences) { check_model_gradients(tiny_config(true, true)); }

TEST(Mixtral, TwoRanksEqualOne) {
  // Data parallel over 2 sequences each, experts 2 + 2: the same logits, loss and gradients as one rank.
  // Differences: the loss sums and the dense gradients are added in another order (f32 all-reduce of two
  // partial sums): ~1e-7 relative.
  const MixtralConfig c = tiny_config(false, true);
  const int64_t B = 4, S = 4;
  const MixtralWeights w = random_mixtral_weights(c, 5);
  const std::vector<int32_t> tokens = random_tokens(B * S, c.vocab_size, 9);
  EvalResult one = run_cpu_model(c, w, tokens, B, S, 1, true);
  EvalResult two = run_cpu_model(c, w, tokens, B, S, 2, true);
  test::expect_close("logits", test::to_double(two.logits), test::to_double(one.logits), 1e-6, 1e-5);
  EXPECT_NEAR(two.loss, one.loss, 1e-6 * one.loss);
  EXPECT_NEAR(two.aux_loss, one.aux_loss, 1e-9);  // same f64 statistics, summed in another order
  std::vector<ParamView> g1 = parameter_views(one.grads, c), g2 = parameter_views(two.grads, c);
  ASSERT_EQ(g1.size(), g2.size());
  for (size_t p = 0; p < g1.size(); ++p)
    test::expect_close(g1[p].name, test::to_double(std::vector<float>(g2[p].data, g2[p].data + g2[p].numel)),
                       test::to_double(std::vector<float>(g1[p].data, g1[p].data + g1[p].numel)), 1e-6, 1e-4);
  EXPECT_THROW(run_cpu_model(c, w, std::vector<int32_t>(3 * S, 0), 3, S, 2, false), Error);  // 3 over 2 ranks
}

TEST(Mixtral, MicroBatchesInFlightKeepTheirOwnState) {
  // Flow keeps several micro-batches between forward and backward: forward A, forward B, backward B,
  // backward A must give the gradients of A then B run one after the other (each state holds its own
  // activations and MoE engines). Gradients add in another order: ~1e-7 relative.
  const MixtralConfig c = tiny_config(false, true);
  auto comms = make_thread_comms(1);
  MixtralModel model(c, *comms[0]);
  model.set_weights(random_mixtral_weights(c, 2));
  const std::vector<int32_t> a = random_tokens(2 * 4, c.vocab_size, 1), b = random_tokens(2 * 4, c.vocab_size, 2);
  ModelState sa, sb;
  model.zero_grads();
  const double la = model.forward(a.data(), 2, 4, sa);
  model.backward(sa);
  const double lb = model.forward(b.data(), 2, 4, sb);
  model.backward(sb);
  const MixtralWeights sequential = model.grads();
  model.zero_grads();
  ModelState ia, ib;
  EXPECT_EQ(model.forward(a.data(), 2, 4, ia), la);  // bit-identical: same computation
  EXPECT_EQ(model.forward(b.data(), 2, 4, ib), lb);
  model.backward(ib);
  model.backward(ia);
  MixtralWeights interleaved = model.grads(), seq = sequential;
  std::vector<ParamView> gi = parameter_views(interleaved, c), gs = parameter_views(seq, c);
  for (size_t p = 0; p < gi.size(); ++p)
    test::expect_close(gi[p].name, test::to_double(std::vector<float>(gi[p].data, gi[p].data + gi[p].numel)),
                       test::to_double(std::vector<float>(gs[p].data, gs[p].data + gs[p].numel)), 1e-7, 1e-5);
}

TEST(Mixtral, MicroBatchesAverageToTheFullBatchGradient) {
  // Without the aux loss (whose statistics are per forward, as in HF) two micro-batches of 2 sequences with
  // loss_scale 1/2 give the gradient of one batch of 4: each has the same count of predictions. Differences:
  // summation order, ~1e-7 relative.
  const MixtralConfig c = tiny_config(false, false);
  auto comms = make_thread_comms(1);
  MixtralModel model(c, *comms[0]);
  model.set_weights(random_mixtral_weights(c, 8));
  const std::vector<int32_t> t = random_tokens(4 * 5, c.vocab_size, 4);
  ModelState full, m0, m1;
  model.zero_grads();
  model.forward(t.data(), 4, 5, full);
  model.backward(full);
  MixtralWeights want = model.grads();
  model.zero_grads();
  model.forward(t.data(), 2, 5, m0);
  model.forward(t.data() + 2 * 5, 2, 5, m1);
  model.backward(m1, 0.5);
  model.backward(m0, 0.5);
  MixtralWeights got = model.grads();
  std::vector<ParamView> g = parameter_views(got, c), w = parameter_views(want, c);
  for (size_t p = 0; p < g.size(); ++p)
    test::expect_close(g[p].name, test::to_double(std::vector<float>(g[p].data, g[p].data + g[p].numel)),
                       test::to_double(std::vector<float>(w[p].data, w[p].data + w[p].numel)), 1e-7, 1e-5);
}

TEST(Mixtral, BadInputsAreNamed) {
  const MixtralConfig c = tiny_config(false, false);
  auto comms = make_thread_comms(1);
  MixtralModel model(c, *comms[0]);
  model.set_weights(random_mixtral_weights(c, 1));
  ModelState st;
  std::vector<int32_t> tokens = {1, 2, 11, 3};  // 11 is outside the vocabulary of 11
  try {
    model.forward(tokens.data(), 1, 4, st);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 11 at [0, 2]"), std::string::npos) << e.what();
  }
  tokens[2] = 0;
  EXPECT_THROW(model.forward(tokens.data(), 1, 1, st), Error);     // nothing to predict
  EXPECT_THROW(model.backward(st), Error);                          // no completed forward
  std::vector<int32_t> longer(65, 0);
  EXPECT_THROW(model.forward(longer.data(), 1, 65, st), Error);    // beyond max_position_embeddings
}

}  // namespace
}  // namespace dmoe
