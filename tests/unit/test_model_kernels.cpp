// test_model_kernels.cpp — the dense Transformer kernels (src/cpu/model_kernels.*): central finite
// differences for every backward pass, exact or closed-form checks for the forwards, AdamW against the
// PyTorch formulas written out by hand, and the clipping factor.
//
// Each gradient test differentiates L = Σ out·R (R fixed, random) through the forward kernel. The
// kernels store f32, so L carries rounding noise of about 1e-7·Σ|out·R|; divided by 2·step that is the
// floor of the finite-difference error, plus O(step²) truncation. Tolerances are set from those two
// terms, with the reason beside each check.
//
// Run: dmoe_unit_tests --gtest_filter='ModelKernels*'
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/random.hpp"
#include "cpu/model_kernels.hpp"
#include "fd_util.hpp"

namespace dmoe {
namespace {

using test::dot;
using test::expect_close;
using test::numeric_grad;
using test::to_double;


// ---- embedding -------------------------------------------------------------------------------------

TEST(ModelKernels, EmbeddingForwardCopiesRowsAndBackwardMatchesFiniteDifferences) {
  const int64_t V = 5, H = 3, n = 4;
  Rng rng(1);
  std::vector<float> table = rng.normal_vector(V * H, 1.0);
  const std::vector<int32_t> tokens = {3, 0, 3, 4};  // token 3 twice: its gradient rows must add up
  std::vector<float> out(n * H), r = rng.normal_vector(n * H, 1.0);
  cpu::embedding_forward(tokens.data(), table.data(), out.data(), n, V, H);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(out[t * H + i], table[tokens[t] * H + i]);  // a copy: exact

  std::vector<double> dtable(V * H, 0.0);
  cpu::embedding_backward(tokens.data(), r.data(), dtable.data(), n, V, H);
  auto loss = [&] {
    cpu::embedding_forward(tokens.data(), table.data(), out.data(), n, V, H);
    return dot(out, r);
  };
  // L is linear in the table: the difference quotient is exact up to the rounding of L (~1e-7).
  expect_close("dtable", dtable, numeric_grad(table, 0.25f, loss), 1e-5, 1e-5);

  const std::vector<int32_t> bad = {0, 5};
  EXPECT_THROW(cpu::embedding_forward(bad.data(), table.data(), out.data(), 2, V, H), Error);
}

// ---- RMSNorm ---------------------------------------------------------------------------------------

TEST(ModelKernels, RmsNormForwardIsTheFormulaAndBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, H = 6;
  const float eps = 1e-5f;
  Rng rng(2);
  std::vector<float> x = rng.normal_vector(rows * H, 1.0), w = rng.normal_vector(H, 1.0);
  std::vector<float> y(rows * H), rstd(rows), r = rng.normal_vector(rows * H, 1.0);
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, H, eps);
  std::vector<double> want(rows * H);
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) ss += double(x[i * H + j]) * x[i * H + j];
    for (int64_t j = 0; j < H; ++j) want[i * H + j] = w[j] * x[i * H + j] / std::sqrt(ss / H + eps);
  }
  // f32 rsqrt and two f32 products: a few ulps.
  expect_close("rmsnorm y", to_double(y), want, 1e-6, 1e-6);

  std::vector<float> dx(rows * H);
  std::vector<double> dw(H, 0.0);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), r.data(), dx.data(), dw.data(), rows, H);
  auto loss = [&] {
    cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, H, eps);
    return dot(y, r);
  };
  // step 1e-3 on O(1) values: truncation ~1e-6, f32 noise ~1e-7·18/2e-3 ≈ 1e-3 at worst, ~1e-4 typical.
  expect_close("rmsnorm dx", to_double(dx), numeric_grad(x, 1e-3f, loss), 5e-4, 1e-3);
  expect_close("rmsnorm dw", dw, numeric_grad(w, 1e-3f, loss), 5e-4, 1e-3);
}

// ---- RoPE ------------------------------------------------------------------------------------------

TEST(ModelKernels, RopeRotatesPairsByPositionAndBackwardIsTheTranspose) {
  const int64_t batch = 2, seq = 3, heads = 2, D = 4, n = batch * seq;
  const double theta = 10000.0;
  Rng rng(3);
  std::vector<float> x = rng.normal_vector(n * heads * D, 1.0), y(x.size()), r = rng.normal_vector(x.size(), 1.0);
  cpu::rope_forward(x.data(), y.data(), n, seq, heads, D, theta);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = t % seq;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xv = x.data() + (t * heads + h) * D;
      const float* yv = y.data() + (t * heads + h) * D;
      for (int64_t j = 0; j < D / 2; ++j) {
        // Pair (j, j + D/2) rotated by s·theta^(−2j/D): written in fp64 here.
        const double a = s * std::pow(theta, -2.0 * j / D);
        const double want0 = xv[j] * std::cos(a) - xv[j + D / 2] * std::sin(a);
        const double want1 = xv[j + D / 2] * std::cos(a) + xv[j] * std::sin(a);
        // f32 angle (s·inv_freq in f32, as HF) and f32 products: ~1e-6 on O(1) values.
        EXPECT_NEAR(yv[j], want0, 2e-6) << "t " << t << " h " << h << " j " << j;
        EXPECT_NEAR(yv[j + D / 2], want1, 2e-6) << "t " << t << " h " << h << " j " << j;
      }
      if (s == 0)
        for (int64_t j = 0; j < D; ++j) EXPECT_EQ(yv[j], xv[j]);  // position 0: cos 1, sin 0, exactly
    }
  }
  std::vector<float> dx(x.size());
  cpu::rope_backward(r.data(), dx.data(), n, seq, heads, D, theta);
  auto loss = [&] {
    cpu::rope_forward(x.data(), y.data(), n, seq, heads, D, theta);
    return dot(y, r);
  };
  // Linear in x: the difference quotient is exact up to the f32 rounding of y (~1e-7 / 0.5).
  expect_close("rope dx", to_double(dx), numeric_grad(x, 0.25f, loss), 1e-5, 1e-5);
  EXPECT_THROW(cpu::rope_forward(x.data(), y.data(), n, seq, heads, 3, theta), Error);  // odd head_dim
}

// ---- attention -------------------------------------------------------------------------------------

TEST(ModelKernels, AttentionIsCausalSoftmaxAndBackwardMatchesFiniteDifferences) {
  // GQA: 4 query heads over 2 kv heads, 2 sequences of 4 tokens, head_dim 3.
  const int64_t batch = 2, seq = 4, D = 3, n = batch * seq;
  const int32_t Hq = 4, Hkv = 2;
  Rng rng(4);
  std::vector<float> q = rng.normal_vector(n * Hq * D, 1.0), k = rng.normal_vector(n * Hkv * D, 1.0);
  std::vector<float> v = rng.normal_vector(n * Hkv * D, 1.0), out(n * Hq * D), lse(batch * Hq * seq);
  std::vector<float> r = rng.normal_vector(out.size(), 1.0);
  cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), batch, seq, Hq, Hkv, D);

  // The formula written out for (b 1, head 3 → kv head 1, query 2): softmax over keys 0..2.
  {
    const int64_t b = 1, i = 2;
    const int32_t h = 3, kvh = 1;
    std::vector<double> s(i + 1), want(D, 0.0);
    double z = 0;
    for (int64_t j = 0; j <= i; ++j) {
      double d = 0;
      for (int64_t c = 0; c < D; ++c)
        d += double(q[((b * seq + i) * Hq + h) * D + c]) * k[((b * seq + j) * Hkv + kvh) * D + c];
      s[j] = std::exp(d / std::sqrt(double(D)));
      z += s[j];
    }
    for (int64_t j = 0; j <= i; ++j)
      for (int64_t c = 0; c < D; ++c) want[c] += s[j] / z * v[((b * seq + j) * Hkv + kvh) * D + c];
    for (int64_t c = 0; c < D; ++c)
      EXPECT_NEAR(out[((b * seq + i) * Hq + h) * D + c], want[c], 1e-6);  // fp64 inside, one f32 rounding
    EXPECT_NEAR(lse[(b * Hq + h) * seq + i], std::log(z), 1e-6);
  }
  // Causality: changing the last token's key and value leaves every earlier output bit-identical.
  {
    std::vector<float> k2 = k, v2 = v, out2(out.size()), lse2(lse.size());
    for (int64_t c = 0; c < Hkv * D; ++c) {
      k2[((0 * seq + seq - 1) * Hkv) * D + c] += 1.0f;
      v2[((0 * seq + seq - 1) * Hkv) * D + c] -= 1.0f;
    }
    cpu::attention_forward(q.data(), k2.data(), v2.data(), out2.data(), lse2.data(), batch, seq, Hq, Hkv, D);
    for (int64_t t = 0; t < seq - 1; ++t)
      for (int64_t c = 0; c < Hq * D; ++c) EXPECT_EQ(out2[t * Hq * D + c], out[t * Hq * D + c]) << "token " << t;
  }

  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
  cpu::attention_backward(q.data(), k.data(), v.data(), lse.data(), r.data(), dq.data(), dk.data(), dv.data(),
                          batch, seq, Hq, Hkv, D);
  auto loss = [&] {
    cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), batch, seq, Hq, Hkv, D);
    return dot(out, r);
  };
  // step 1e-3: truncation ~1e-7, f32 noise of L (~1e-7·|Σ out·r| ≈ 1e-6) / 2e-3 ≈ 5e-4 at worst.
  expect_close("attention dq", to_double(dq), numeric_grad(q, 1e-3f, loss), 5e-4, 1e-3);
  expect_close("attention dk", to_double(dk), numeric_grad(k, 1e-3f, loss), 5e-4, 1e-3);
  // L is linear in v: a larger step removes the noise.
  expect_close("attention dv", to_double(dv), numeric_grad(v, 0.25f, loss), 1e-5, 1e-5);
  EXPECT_THROW(cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), batch, seq, 3, 2, D),
               Error);  // 3 query heads over 2 kv heads
}

// ---- linear ----------------------------------------------------------------------------------------

TEST(ModelKernels, LinearBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, in = 4, out = 5;
  Rng rng(5);
  std::vector<float> x = rng.normal_vector(rows * in, 1.0), w = rng.normal_vector(out * in, 1.0);
  std::vector<float> y(rows * out), r = rng.normal_vector(rows * out, 1.0), dx(rows * in);
  std::vector<double> dw(out * in, 0.0);
  cpu::linear_forward(x.data(), w.data(), y.data(), rows, in, out);
  EXPECT_NEAR(y[1 * out + 2], dot(std::vector<float>(x.begin() + 4, x.begin() + 8),
                                  std::vector<float>(w.begin() + 8, w.begin() + 12)), 1e-6);  // y = x·wᵀ
  cpu::linear_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), rows, in, out);
  auto loss = [&] {
    cpu::linear_forward(x.data(), w.data(), y.data(), rows, in, out);
    return dot(y, r);
  };
  // Bilinear: linear in each argument, so the quotient is exact up to the f32 rounding of y.
  expect_close("linear dx", to_double(dx), numeric_grad(x, 0.25f, loss), 1e-5, 1e-5);
  expect_close("linear dw", dw, numeric_grad(w, 0.25f, loss), 1e-5, 1e-5);
  // dw accumulates: a second backward doubles it.
  std::vector<double> dw2 = dw;
  cpu::linear_backward(x.data(), w.data(), r.data(), nullptr, dw2.data(), rows, in, out);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_DOUBLE_EQ(dw2[i], 2 * dw[i]);
}

// ---- cross-entropy ---------------------------------------------------------------------------------

TEST(ModelKernels, CrossEntropyIsTheMeanOverKeptRowsAndBackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, V = 6;
  const int32_t ignore = -100;
  Rng rng(6);
  std::vector<float> logits = rng.normal_vector(rows * V, 2.0), lse(rows), dlogits(rows * V);
  const std::vector<int32_t> targets = {2, ignore, 5, 0};
  double sum = 0;
  int64_t count = 0;
  cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), &sum, &count, rows, V, ignore);
  EXPECT_EQ(count, 3);
  double want = 0;
  for (int64_t r : {0, 2, 3}) {
    double z = 0;
    for (int64_t i = 0; i < V; ++i) z += std::exp(double(logits[r * V + i]));
    want += std::log(z) - logits[r * V + targets[r]];
  }
  EXPECT_NEAR(sum, want, 1e-12 * rows * 10);  // both in fp64: only summation order differs

  cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), dlogits.data(), rows, V, ignore,
                              1.0 / double(count));
  auto loss = [&] {
    double s = 0;
    int64_t c = 0;
    cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), &s, &c, rows, V, ignore);
    return s / double(c);
  };
  // The loss is computed in fp64 from the f32 logits, so FD noise is ~1e-16/step: truncation dominates
  // (step² · |f'''| ≈ 1e-6 · 0.1). The lse used by backward is stored in f32: ~1e-7 relative.
  const std::vector<double> fd = numeric_grad(logits, 1e-3f, loss);
  expect_close("cross entropy dlogits", to_double(dlogits), fd, 1e-6, 1e-5);
  for (int64_t i = 0; i < V; ++i) EXPECT_EQ(dlogits[1 * V + i], 0.0f);  // ignored row: exactly 0

  const std::vector<int32_t> bad = {2, 6, 0, 0};
  EXPECT_THROW(cpu::cross_entropy_forward(logits.data(), bad.data(), lse.data(), &sum, &count, rows, V, ignore),
               Error);
}

// ---- AdamW and clipping ----------------------------------------------------------------------------

TEST(ModelKernels, AdamWFollowsTheDecoupledFormulaWithBiasCorrection) {
  // First step by hand: m̂ = g, v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g), after the decay
  // p·(1 − lr·wd): p = 1, g = 0.5, lr 0.1, wd 0.01 → 1·0.999 − 0.1·0.5/(0.5 + 1e-8) = 0.899 (+2e-9).
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, -0.25f}, m(2, 0.0f), v(2, 0.0f);
  cpu::AdamWParams ap;
  ap.lr = 0.1;
  ap.weight_decay = 0.01;
  ap.step = 1;
  cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 2, ap);
  EXPECT_NEAR(p[0], 0.899, 1e-7);                // one f32 rounding of 0.899
  EXPECT_NEAR(p[1], -2.0 * 0.999 + 0.1, 1e-7);
  EXPECT_FLOAT_EQ(m[0], 0.05f);                  // (1 − 0.9)·0.5
  EXPECT_FLOAT_EQ(v[0], 0.00025f);               // (1 − 0.999)·0.25

  // Three more steps against the formulas in fp64 (a different gradient each step).
  double pd = p[0], md = m[0], vd = v[0];
  for (int64_t t = 2; t <= 4; ++t) {
    const double gt = 0.1 * double(t) - 0.3;
    std::vector<float> gg = {float(gt), 0.0f};
    ap.step = t;
    cpu::adamw_step(p.data(), gg.data(), m.data(), v.data(), 2, ap);
    pd *= 1 - ap.lr * ap.weight_decay;
    md = 0.9 * md + 0.1 * double(float(gt));
    vd = 0.999 * vd + 0.001 * double(float(gt)) * double(float(gt));
    pd -= ap.lr * (md / (1 - std::pow(0.9, t))) / (std::sqrt(vd / (1 - std::pow(0.999, t))) + ap.eps);
    // The kernel rounds p, m, v to f32 each step; the fp64 recursion does not: ~1e-7 per step.
    EXPECT_NEAR(p[0], pd, 1e-6) << "step " << t;
  }
  ap.step = 0;
  EXPECT_THROW(cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 2, ap), Error);
}

// The bf16-gradient twins (the GPU model's bf16 expert gradients): each gradient read as the float it holds, so the
// same results, bit for bit, as the f32 twins on those floats.
TEST(ModelKernels, Bf16GradientsAreReadAsTheirFloats) {
  const std::vector<float> values = {0.5f, -0.25f, 1e-3f, -7.3f, 3.0e-8f, 0.0f, 123.456f};
  std::vector<bfloat16> g16;
  std::vector<float> g32;
  for (float x : values) {
    g16.push_back(float_to_bf16(x));
    g32.push_back(bf16_to_float(g16.back()));
  }
  EXPECT_NE(g32[2], values[2]);  // bf16 rounded something: the test is of the float the bf16 holds
  EXPECT_EQ(cpu::sum_of_squares(g16.data(), int64_t(g16.size())), cpu::sum_of_squares(g32.data(), int64_t(g32.size())));
  const size_t n = values.size();
  std::vector<float> pa(n, 1.0f), ma(n, 0.01f), va(n, 0.02f);
  for (size_t i = 0; i < n; ++i) pa[i] = 0.1f * float(i) - 0.2f;
  std::vector<float> pb = pa, mb = ma, vb = va;
  cpu::AdamWParams ap;
  ap.lr = 1e-2;
  ap.weight_decay = 0.1;
  ap.step = 3;
  cpu::adamw_step(pa.data(), g16.data(), ma.data(), va.data(), int64_t(n), ap);
  cpu::adamw_step(pb.data(), g32.data(), mb.data(), vb.data(), int64_t(n), ap);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(ma, mb);
  EXPECT_EQ(va, vb);
  ap.step = 0;
  EXPECT_THROW(cpu::adamw_step(pa.data(), g16.data(), ma.data(), va.data(), int64_t(n), ap), Error);
}

// The bf16-gradient twins on many values (the CPU oracles the GPU's bf16-gradient kernels are held to bit for bit,
// tests/gpu/test_model_kernels.cpp): the first step (zero moments, bias corrections 1 − β^1) against its closed form,
// later steps against the f32 twin on the held floats bit for bit, and Σ g² against an exact integer sum.
TEST(ModelKernels, Bf16GradientTwinsFirstStepAndExactSums) {
  Rng rng(11);
  const int64_t n = 1001;
  std::vector<float> raw = rng.normal_vector(n, 0.01);
  raw[5] = 0.0f;
  raw[6] = -0.0f;
  raw[7] = 1e-30f;  // far below eps: the update is ~0
  raw[8] = -1e4f;   // the update saturates at lr
  std::vector<bfloat16> g16(n);
  std::vector<float> held(n);
  for (int64_t i = 0; i < n; ++i) {
    g16[i] = float_to_bf16(raw[i]);
    held[i] = bf16_to_float(g16[i]);
  }
  cpu::AdamWParams ap;
  ap.lr = 1e-3;
  ap.weight_decay = 0.1;
  ap.step = 1;
  const std::vector<float> p0 = rng.normal_vector(n, 1.0);
  std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
  cpu::adamw_step(p.data(), g16.data(), m.data(), v.data(), n, ap);
  for (int64_t i = 0; i < n; ++i) {
    // Step 1 from zero moments: m = (1 − β1)·g, v = (1 − β2)·g² (one rounding each to f32), and
    // p = p0·(1 − lr·wd) − lr·g/(|g| + eps) (m̂ = g, v̂ = g² up to the bias corrections' last bits): the same double
    // up to a few 2^-53, so the same f32 but where that double is within them of a rounding boundary: 1 f32 ulp.
    const double g = held[i];
    EXPECT_EQ(m[i], float((1.0 - ap.beta1) * g)) << i;
    EXPECT_EQ(v[i], float((1.0 - ap.beta2) * g * g)) << i;
    const double want = double(p0[i]) * (1.0 - ap.lr * ap.weight_decay) - ap.lr * g / (std::fabs(g) + ap.eps);
    EXPECT_LE(std::fabs(double(p[i]) - want), std::ldexp(std::fabs(want), -23)) << i;
  }
  // Steps 2 and 3 (moments from step 1): the bf16 twin and the f32 twin on the held floats, the same bits.
  std::vector<float> pf = p, mf = m, vf = v;
  for (int64_t step : {2, 3}) {
    ap.step = step;
    cpu::adamw_step(p.data(), g16.data(), m.data(), v.data(), n, ap);
    cpu::adamw_step(pf.data(), held.data(), mf.data(), vf.data(), n, ap);
    EXPECT_EQ(p, pf) << "step " << step;
    EXPECT_EQ(m, mf) << "step " << step;
    EXPECT_EQ(v, vf) << "step " << step;
  }
  // Σ g² of random bf16 values: the f32 twin's on the held floats exactly (the same squares in the same order).
  EXPECT_EQ(cpu::sum_of_squares(g16.data(), n), cpu::sum_of_squares(held.data(), n));
  // Values of |g| in [2^-14, 2^-10) (8 significant bits) or ±0: each square is an integer multiple of 2^-42, so the
  // sum is exact in fp64 whatever the order — here against an integer sum of the multiples.
  std::vector<bfloat16> e16(4099);
  uint64_t units = 0;  // the exact sum in units of 2^-42
  for (size_t i = 0; i < e16.size(); ++i) {
    const uint64_t r = rng.next();
    const uint16_t sign = uint16_t((r & 1) << 15);
    if (i % 7 == 3) {
      e16[i].bits = sign;
      continue;
    }
    const int exponent = 127 - 14 + int((r >> 1) % 4);
    const uint64_t fraction = (r >> 8) & 0x7f;
    e16[i].bits = uint16_t(sign | (exponent << 7) | fraction);
    // value = (128 + fraction)·2^(exponent − 127 − 7); square = (128 + fraction)²·2^(2·(exponent − 134)) and
    // 2·(exponent − 134) + 42 >= 0.
    units += (128 + fraction) * (128 + fraction) << (2 * (exponent - 134) + 42);
  }
  EXPECT_EQ(cpu::sum_of_squares(e16.data(), int64_t(e16.size())), std::ldexp(double(units), -42));
}

TEST(ModelKernels, ClipCoefficientIsTorchs) {
  std::vector<float> a = {3.0f, 0.0f}, b = {4.0f};
  const double ss = cpu::sum_of_squares(a.data(), 2) + cpu::sum_of_squares(b.data(), 1);
  EXPECT_EQ(ss, 25.0);
  EXPECT_DOUBLE_EQ(cpu::clip_coefficient(ss, 1.0), 1.0 / (5.0 + 1e-6));  // norm 5 > 1: scaled
  EXPECT_EQ(cpu::clip_coefficient(ss, 10.0), 1.0);                        // under the limit: untouched
  EXPECT_EQ(cpu::clip_coefficient(ss, 0.0), 1.0);                         // 0 = no clipping
  cpu::scale_in_place(a.data(), 2, 0.5);
  EXPECT_EQ(a[0], 1.5f);
}

}  // namespace
}  // namespace dmoe
