// test_cpu_kernels.cpp — the CPU reference kernels (src/cpu/): exact checks for data movement and for
// the fp64-accumulated products, central finite differences for every backward pass, and bf16-storage
// rounding. The problems are tiny (n = 3, H = 4, I = 5 …) so the whole suite runs in milliseconds, also
// under ASan + UBSan.
//
// Finite differences: a parameter is perturbed in float by ±step (the difference of the two float
// values actually stored is the denominator) and a scalar loss L = Σ out·R (R fixed, random, exactly
// representable in float, summed in double) is evaluated through the forward kernel.
//
// Run: dmoe_unit_tests --gtest_filter='CpuKernels*'
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fd_util.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "cpu/kernels.hpp"

namespace dmoe {
namespace {

using cpu::activation_derivative;
using cpu::activation_forward;

using test::expect_close;  // fd_util.hpp, shared with the model tests
using test::to_double;

// Central difference of loss() w.r.t. each element of param, perturbed in float.
std::vector<double> numeric_grad(std::vector<float>& param, float step, const std::function<double()>& loss) {
  std::vector<double> grad(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const float saved = param[i];
    const float up = saved + step, down = saved - step;
    param[i] = up;
    const double loss_up = loss();
    param[i] = down;
    const double loss_down = loss();
    param[i] = saved;
    grad[i] = (loss_up - loss_down) / (double(up) - double(down));
  }
  return grad;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

bool is_bf16_value(float v) { return round_to_bf16(v) == v; }

// ---- gemm ------------------------------------------------------------------------------------------

// NaN router logits come from the caller's data (a non-finite x or gate, e.g. through the Python API): an input
// error naming the cause, without a source location (it was an internal error, "(router.cpp:31)").
TEST(CpuKernelsRouter, NanLogitsAreAnInputError) {
  std::vector<float> logits = {0.5f, NAN, NAN, NAN}, probs(4), weights(2), lse(1);
  std::vector<int32_t> ids(2);
  try {
    cpu::router_topk(logits.data(), probs.data(), ids.data(), weights.data(), lse.data(), 1, 4, 2, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.is_input()) << e.what();
    EXPECT_NE(std::string(e.what()).find("x or the gate is not finite"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("router.cpp"), std::string::npos) << e.what();
  }
}

TEST(CpuKernelsGemm, MatchesNaiveFormula) {
  Rng rng(101);
  struct Shape { int64_t m, n, k; };
  // n = 7 and n = 1 cover the remainder columns after blocks of four; k = 0 gives zeros.
  for (Shape s : {Shape{5, 7, 9}, Shape{1, 4, 3}, Shape{3, 1, 1}, Shape{4, 9, 33}, Shape{2, 3, 0}}) {
    const std::vector<float> a = rng.normal_vector(s.m * s.k, 1.0);
    const std::vector<float> b = rng.normal_vector(s.n * s.k, 1.0);
    std::vector<float> c(s.m * s.n, -1.0f);
    cpu::gemm_nt(a.data(), b.data(), c.data(), s.m, s.n, s.k);
    for (int64_t i = 0; i < s.m; ++i)
      for (int64_t j = 0; j < s.n; ++j) {
        double acc = 0;  // the specification: fp64 in order p = 0..k-1, rounded once → bit-exact
        for (int64_t p = 0; p < s.k; ++p) acc += double(a[i * s.k + p]) * double(b[j * s.k + p]);
        EXPECT_EQ(c[i * s.n + j], float(acc)) << "m,n,k = " << s.m << "," << s.n << "," << s.k << " at (" << i
                                              << "," << j << ")";
      }
  }
}

// ---- grouped NN product (twin of the own kernel's NN variant) ---------------------------------------

// Groups: rows before, an empty group, a 1-row group, longer ones, rows after; with and without the second
// product; k = 0. Bit-exact against gemm_nt on the transposed weights (the same fp64 order: A·B's p =
// 0..k-1, then A2·B2's, which is gemm_nt over the concatenated [A | A2] and [B; B2]^T).
TEST(CpuKernelsGroupedGemmNN, MatchesGemmOfTransposedWeights) {
  Rng rng(103);
  for (const bool two : {false, true})
    for (const int64_t k : {int64_t(6), int64_t(1), int64_t(0)}) {
      const int32_t groups = 4;
      const int64_t n = 5;
      const std::vector<int64_t> offsets{2, 5, 5, 6, 9};  // rows 0-1 and 9-10 belong to no group
      const int64_t rows = 11;
      const std::vector<float> a = rng.normal_vector(rows * k, 1.0), a2 = rng.normal_vector(rows * k, 1.0);
      const std::vector<float> b = rng.normal_vector(groups * k * n, 1.0), b2 = rng.normal_vector(groups * k * n, 1.0);
      constexpr float kSentinel = -777.f;
      std::vector<float> c(rows * n, kSentinel);
      cpu::grouped_gemm_nn(a.data(), b.data(), two ? a2.data() : nullptr, two ? b2.data() : nullptr, c.data(),
                           offsets.data(), groups, n, k, DType::f32);
      const int64_t kk = two ? 2 * k : k;
      for (int32_t g = 0; g < groups; ++g) {
        const int64_t m = offsets[g + 1] - offsets[g];
        std::vector<float> at(m * kk), bt(n * kk), ref(m * n);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t p = 0; p < kk; ++p)
            at[r * kk + p] = p < k ? a[(offsets[g] + r) * k + p] : a2[(offsets[g] + r) * k + p - k];
        for (int64_t j = 0; j < n; ++j)
          for (int64_t p = 0; p < kk; ++p)
            bt[j * kk + p] = p < k ? b[(g * k + p) * n + j] : b2[(g * k + p - k) * n + j];
        cpu::gemm_nt(at.data(), bt.data(), ref.data(), m, n, kk);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j)
            EXPECT_EQ(c[(offsets[g] + r) * n + j], ref[r * n + j]) << "two " << two << " k " << k << " group " << g;
      }
      for (const int64_t r : {int64_t(0), int64_t(1), int64_t(9), int64_t(10)})
        for (int64_t j = 0; j < n; ++j) EXPECT_EQ(c[r * n + j], kSentinel) << "row " << r << " is in no group";
    }
}

TEST(CpuKernelsGroupedGemmNN, Bf16StorageRoundsOnceAndChecksArguments) {
  Rng rng(104);
  const int64_t n = 3, k = 4;
  const std::vector<int64_t> offsets{0, 2};
  const std::vector<float> a = rng.normal_vector(2 * k, 1.0), b = rng.normal_vector(k * n, 1.0);
  std::vector<float> c32(2 * n), c16(2 * n);
  cpu::grouped_gemm_nn(a.data(), b.data(), nullptr, nullptr, c32.data(), offsets.data(), 1, n, k, DType::f32);
  cpu::grouped_gemm_nn(a.data(), b.data(), nullptr, nullptr, c16.data(), offsets.data(), 1, n, k, DType::bf16);
  for (size_t i = 0; i < c32.size(); ++i) EXPECT_EQ(c16[i], round_to_bf16(c32[i]));
  EXPECT_THROW(cpu::grouped_gemm_nn(a.data(), b.data(), a.data(), nullptr, c32.data(), offsets.data(), 1, n, k,
                                    DType::f32),
               Error);
  const std::vector<int64_t> decreasing{0, 2, 1};
  EXPECT_THROW(cpu::grouped_gemm_nn(a.data(), b.data(), nullptr, nullptr, c32.data(), decreasing.data(), 2, n, k,
                                    DType::f32),
               Error);
}

// ---- grouped weight gradient (twin of the CUDA weight-gradient kernels) -------------------------------

// A descriptor over row-major A [·, lda] and B [·, ldb] and C (one group every `stride` elements), groups from
// `offsets`; a_first_row and b_first_row 0.
cpu::GroupedWgrad wgrad_descriptor(const std::vector<float>& a, const std::vector<float>& b, float* c,
                                   const std::vector<int64_t>& offsets, int64_t m, int64_t n, int64_t lda, int64_t ldb,
                                   int64_t stride, bool accumulate) {
  cpu::GroupedWgrad g;
  g.a = a.data();
  g.b = b.data();
  g.c = c;
  g.row_offsets = offsets.data();
  g.groups = int32_t(offsets.size()) - 1;
  g.m = m;
  g.n = n;
  g.lda = lda;
  g.ldb = ldb;
  g.c_group_stride = stride;
  g.accumulate = accumulate;
  return g;
}

// Groups: rows before the first, an empty group, a 1-row group, longer ones, a row after; A starting at a
// later row than the offsets (a_first_row), padded rows (lda > m, ldb > n) and padding between the groups'
// C (c_group_stride > m·n), which must stay as it was, as must an empty group's C. Bit-exact against the
// formula in the same fp64 order (rows in order, then the old value), stored and accumulated.
TEST(CpuKernelsGroupedWgrad, MatchesFormulaAndLeavesEmptyGroupsAlone) {
  Rng rng(107);
  const int32_t groups = 4;
  const int64_t m = 3, n = 5, lda = 4, ldb = 8, a_first = 1, b_first = 0, stride = m * n + 2;
  const std::vector<int64_t> offsets{2, 5, 5, 6, 10};
  const int64_t b_rows = 11, a_rows = b_rows - a_first;
  const std::vector<float> a = rng.normal_vector(a_rows * lda, 1.0), b = rng.normal_vector(b_rows * ldb, 1.0);
  const std::vector<float> c0 = rng.normal_vector(groups * stride, 1.0);
  for (const bool accumulate : {true, false}) {
    std::vector<float> c = c0;
    cpu::GroupedWgrad g = wgrad_descriptor(a, b, c.data(), offsets, m, n, lda, ldb, stride, accumulate);
    g.a_first_row = a_first;
    g.b_first_row = b_first;
    cpu::grouped_wgrad(g);
    for (int32_t e = 0; e < groups; ++e) {
      const bool empty = offsets[e + 1] == offsets[e];
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const size_t at = size_t(e * stride + i * n + j);
          if (empty) {
            EXPECT_EQ(c[at], c0[at]) << "group " << e << " has no rows";
            continue;
          }
          double sum = 0;
          for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
            sum += double(a[(r - a_first) * lda + i]) * double(b[(r - b_first) * ldb + j]);
          const float want = float(accumulate ? sum + double(c0[at]) : sum);
          EXPECT_EQ(c[at], want) << "accumulate " << accumulate << " group " << e << " (" << i << ", " << j << ")";
        }
      for (int64_t q = m * n; q < stride; ++q)
        EXPECT_EQ(c[size_t(e * stride + q)], c0[size_t(e * stride + q)]) << "padding after group " << e;
    }
  }
}

TEST(CpuKernelsGroupedWgrad, ChecksArguments) {
  const std::vector<float> a(16, 1.f), b(16, 1.f);
  std::vector<float> c(8, 0.f);
  const std::vector<int64_t> decreasing{0, 2, 1}, fine{1, 2};
  cpu::GroupedWgrad g;
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  g.row_offsets = decreasing.data();
  g.groups = 2;
  g.m = g.n = g.lda = g.ldb = 2;
  g.c_group_stride = 4;
  EXPECT_THROW(cpu::grouped_wgrad(g), Error);  // offsets decrease
  g.row_offsets = fine.data();
  g.groups = 1;
  g.a_first_row = 2;  // the group starts at row 1, before a's first row
  EXPECT_THROW(cpu::grouped_wgrad(g), Error);
  g.a_first_row = 0;
  g.lda = 1;  // rows shorter than m
  EXPECT_THROW(cpu::grouped_wgrad(g), Error);
  g.lda = 2;
  cpu::grouped_wgrad(g);
  EXPECT_EQ(c[0], 1.f);  // one row of ones: 1·1, accumulated onto 0
}

// The bf16 store (the PyTorch module's bf16 expert gradients): the f32 store's values rounded to bf16, a group
// without rows and the padding left as they were, and accumulation refused (a bf16 C is written, never added to).
TEST(CpuKernelsGroupedWgrad, Bf16StoreIsTheF32StoreRounded) {
  Rng rng(109);
  const int32_t groups = 3;
  const int64_t m = 4, n = 6, stride = m * n + 3;
  const std::vector<int64_t> offsets{0, 3, 3, 7};
  const std::vector<float> a = rng.normal_vector(7 * m, 1.0), b = rng.normal_vector(7 * n, 1.0);
  std::vector<float> c(size_t(groups * stride), 0.f);
  const bfloat16 marker = float_to_bf16(-7.f);
  std::vector<bfloat16> c16(c.size(), marker);
  cpu::GroupedWgrad g = wgrad_descriptor(a, b, c.data(), offsets, m, n, m, n, stride, false);
  cpu::grouped_wgrad(g);
  g.c = nullptr;
  g.c_bf16 = c16.data();
  cpu::grouped_wgrad(g);
  for (int32_t e = 0; e < groups; ++e)
    for (int64_t q = 0; q < stride; ++q) {
      const size_t at = size_t(e * stride + q);
      const bool written = offsets[e + 1] > offsets[e] && q < m * n;
      EXPECT_EQ(c16[at].bits, written ? float_to_bf16(c[at]).bits : marker.bits) << "group " << e << " element " << q;
    }
  g.accumulate = true;
  EXPECT_THROW(cpu::grouped_wgrad(g), Error);
}

// ---- activations ------------------------------------------------------------------------------------

TEST(CpuKernelsActivation, KnownValues) {
  // relu and its derivative (0 at x <= 0).
  EXPECT_EQ(activation_forward(Activation::relu, -2.0f), 0.0f);
  EXPECT_EQ(activation_forward(Activation::relu, 1.5f), 1.5f);
  EXPECT_EQ(activation_derivative(Activation::relu, -1.0f), 0.0f);
  EXPECT_EQ(activation_derivative(Activation::relu, 0.0f), 0.0f);
  EXPECT_EQ(activation_derivative(Activation::relu, 0.25f), 1.0f);
  // gelu(x) = x·Φ(x); gelu'(x) = Φ(x) + x·φ(x). Φ(1) = 0.8413447460685429, φ(1) = 0.24197072451914337.
  EXPECT_EQ(activation_forward(Activation::gelu, 0.0f), 0.0f);
  EXPECT_FLOAT_EQ(activation_forward(Activation::gelu, 1.0f), 0.8413447460685429f);
  EXPECT_FLOAT_EQ(activation_forward(Activation::gelu, -1.0f), -(1 - 0.8413447460685429f));
  EXPECT_FLOAT_EQ(activation_derivative(Activation::gelu, 0.0f), 0.5f);
  EXPECT_FLOAT_EQ(activation_derivative(Activation::gelu, 1.0f),
                  float(0.8413447460685429 + 0.24197072451914337));
  // silu(x) = x·σ(x); silu'(x) = σ(x)·(1 + x·(1 − σ(x))). σ(1) = 0.7310585786300049.
  EXPECT_EQ(activation_forward(Activation::swiglu, 0.0f), 0.0f);
  EXPECT_FLOAT_EQ(activation_forward(Activation::swiglu, 1.0f), 0.7310585786300049f);
  EXPECT_FLOAT_EQ(activation_derivative(Activation::swiglu, 0.0f), 0.5f);
  EXPECT_FLOAT_EQ(activation_derivative(Activation::swiglu, 1.0f),
                  float(0.7310585786300049 * (1 + (1 - 0.7310585786300049))));
  // Extreme inputs stay finite (exp overflow must not turn into NaN).
  for (Activation a : {Activation::relu, Activation::gelu, Activation::swiglu})
    for (float v : {-1e30f, -100.0f, 100.0f, 1e30f}) {
      EXPECT_TRUE(std::isfinite(activation_forward(a, v))) << activation_name(a) << " at " << v;
      EXPECT_TRUE(std::isfinite(activation_derivative(a, v))) << activation_name(a) << "' at " << v;
    }
}

TEST(CpuKernelsActivation, DerivativeMatchesFiniteDifference) {
  // Smooth activations, difference of the fp32 values at ±1e-2: truncation ~ step²/6·|f'''| < 1e-4,
  // rounding ~ 2·6e-8·|f| / 2e-2 < 1e-5.
  for (Activation a : {Activation::gelu, Activation::swiglu})
    for (float v : {-3.0f, -1.2f, -0.3f, 0.0f, 0.4f, 1.7f, 4.0f}) {
      const float step = 1e-2f;
      const double fd = (double(activation_forward(a, v + step)) - double(activation_forward(a, v - step))) /
                        (double(v + step) - double(v - step));
      EXPECT_NEAR(activation_derivative(a, v), fd, 2e-4) << activation_name(a) << " at " << v;
    }
}

// ---- expert FFN -------------------------------------------------------------------------------------

struct FfnProblem {
  int64_t n = 3, hidden = 4, ffn = 5;
  Activation activation = Activation::swiglu;
  std::vector<float> x, w1, w3, w2, r;  // r [n, H]: the loss weights R (= dout)

  bool is_swiglu() const { return activation == Activation::swiglu; }
};

struct FfnForward {
  std::vector<float> pre1, pre3, h, out;
};

FfnForward run_forward(const FfnProblem& p, DType storage) {
  FfnForward f;
  f.pre1.assign(p.n * p.ffn, 0);
  f.pre3.assign(p.is_swiglu() ? p.n * p.ffn : 0, 0);
  f.h.assign(p.n * p.ffn, 0);
  f.out.assign(p.n * p.hidden, 0);
  cpu::expert_ffn_forward(p.x.data(), p.w1.data(), p.is_swiglu() ? p.w3.data() : nullptr, p.w2.data(),
                          f.pre1.data(), p.is_swiglu() ? f.pre3.data() : nullptr, f.h.data(), f.out.data(),
                          p.n, p.hidden, p.ffn, p.activation, storage);
  return f;
}

struct FfnGrads {
  std::vector<float> dx;
  std::vector<double> dw1, dw3, dw2;
};

// Backward over rows [row_begin, row_end) accumulating into g (dx rows of that range overwritten).
void run_backward(const FfnProblem& p, const FfnForward& f, DType storage, FfnGrads& g, int64_t row_begin,
                  int64_t row_end) {
  const int64_t rows = row_end - row_begin;
  const bool sw = p.is_swiglu();
  cpu::expert_ffn_backward(p.x.data() + row_begin * p.hidden, p.w1.data(), sw ? p.w3.data() : nullptr,
                           p.w2.data(), f.pre1.data() + row_begin * p.ffn,
                           sw ? f.pre3.data() + row_begin * p.ffn : nullptr, f.h.data() + row_begin * p.ffn,
                           p.r.data() + row_begin * p.hidden, g.dx.data() + row_begin * p.hidden,
                           g.dw1.data(), sw ? g.dw3.data() : nullptr, g.dw2.data(), rows, p.hidden, p.ffn,
                           p.activation, storage);
}

FfnGrads zero_grads(const FfnProblem& p) {
  FfnGrads g;
  g.dx.assign(p.n * p.hidden, -1.0f);
  g.dw1.assign(p.ffn * p.hidden, 0);
  g.dw3.assign(p.is_swiglu() ? p.ffn * p.hidden : 0, 0);
  g.dw2.assign(p.hidden * p.ffn, 0);
  return g;
}

FfnProblem make_ffn_problem(Activation activation, uint64_t seed) {
  FfnProblem p;
  p.activation = activation;
  Rng rng(seed);
  p.x = rng.normal_vector(p.n * p.hidden, 1.0);
  p.w1 = rng.normal_vector(p.ffn * p.hidden, 0.5);  // 1/sqrt(H): pre-activations ~ N(0, 1)
  if (p.is_swiglu()) p.w3 = rng.normal_vector(p.ffn * p.hidden, 0.5);
  p.w2 = rng.normal_vector(p.hidden * p.ffn, 0.45);
  p.r = rng.normal_vector(p.n * p.hidden, 1.0);
  return p;
}

class CpuKernelsExpertFfn : public ::testing::TestWithParam<Activation> {};

TEST_P(CpuKernelsExpertFfn, BackwardMatchesFiniteDifferences) {
  const Activation activation = GetParam();
  const float step = 1e-2f;
  FfnProblem p = make_ffn_problem(activation, 200);
  if (activation == Activation::relu) {
    // relu is piecewise linear: the differences are exact as long as no pre-activation crosses 0.
    // A step moves pre1 by at most step·max(|x|, |w1|)·1 < 0.05 here, so require |pre1| > 0.2.
    for (uint64_t seed = 201;; ++seed) {
      const FfnForward f = run_forward(p, DType::f32);
      float margin = INFINITY;
      for (float v : f.pre1) margin = std::min(margin, std::abs(v));
      if (margin > 0.2f) break;
      ASSERT_LT(seed, 400u) << "no relu problem with |pre1| > 0.2 found";
      p = make_ffn_problem(activation, seed);
    }
  }
  const FfnForward base = run_forward(p, DType::f32);
  FfnGrads g = zero_grads(p);
  run_backward(p, base, DType::f32, g, 0, p.n);

  auto loss = [&] { return dot(run_forward(p, DType::f32).out, p.r); };
  // Tolerance: L sums 12 outputs ~1 stored in f32 (rounding ~1e-7 each, ≲ 2e-6 in total) → ≲ 1e-4
  // after dividing by 2·step; truncation step²/6·|L'''| ≲ 2e-5 for gelu/silu and 0 for relu.
  // 1e-3 leaves a margin of 10.
  const double atol = 1e-3, rtol = 1e-3;
  const std::string name = activation_name(activation);
  expect_close(name + " dx", to_double(g.dx), numeric_grad(p.x, step, loss), atol, rtol);
  expect_close(name + " dw1", g.dw1, numeric_grad(p.w1, step, loss), atol, rtol);
  if (p.is_swiglu()) expect_close(name + " dw3", g.dw3, numeric_grad(p.w3, step, loss), atol, rtol);
  expect_close(name + " dw2", g.dw2, numeric_grad(p.w2, step, loss), atol, rtol);
}

TEST_P(CpuKernelsExpertFfn, ForwardMatchesFormula) {
  const FfnProblem p = make_ffn_problem(GetParam(), 210);
  const FfnForward f = run_forward(p, DType::f32);
  std::vector<double> pre1(p.n * p.ffn), h(p.n * p.ffn), out(p.n * p.hidden);
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t o = 0; o < p.ffn; ++o) {
      double a1 = 0, a3 = 0;
      for (int64_t i = 0; i < p.hidden; ++i) {
        a1 += double(p.x[r * p.hidden + i]) * p.w1[o * p.hidden + i];
        if (p.is_swiglu()) a3 += double(p.x[r * p.hidden + i]) * p.w3[o * p.hidden + i];
      }
      pre1[r * p.ffn + o] = a1;
      const double act = activation_forward(p.activation, float(a1));
      h[r * p.ffn + o] = p.is_swiglu() ? act * a3 : act;
    }
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t j = 0; j < p.hidden; ++j) {
      double acc = 0;
      for (int64_t o = 0; o < p.ffn; ++o) acc += h[r * p.ffn + o] * p.w2[j * p.ffn + o];
      out[r * p.hidden + j] = acc;
    }
  // The kernel rounds pre1, pre3 and h to f32 on the way: a few f32 ulps of relative error.
  expect_close("pre1", to_double(f.pre1), pre1, 1e-6, 1e-6);
  expect_close("h", to_double(f.h), h, 1e-6, 1e-6);
  expect_close("out", to_double(f.out), out, 1e-6, 1e-6);
}

// Splitting an expert's rows into consecutive pieces (as W ranks do, in (rank, token) order) must give
// bit-identical results: every weight-gradient element sums rows in order 0..n-1 into the fp64
// accumulator. n = 19 spans several of the kernel's internal row chunks; one row per call is the plain
// row-by-row loop.
TEST_P(CpuKernelsExpertFfn, RowSplitGivesIdenticalGradients) {
  FfnProblem p = make_ffn_problem(GetParam(), 220);
  p.n = 19;
  Rng rng(221);
  p.x = rng.normal_vector(p.n * p.hidden, 1.0);
  p.r = rng.normal_vector(p.n * p.hidden, 1.0);
  const FfnForward f = run_forward(p, DType::f32);
  FfnGrads whole = zero_grads(p);
  run_backward(p, f, DType::f32, whole, 0, p.n);
  const std::vector<std::vector<int64_t>> splits = {{0, 5, 6, 13, 19}, {0, 9, 19}};
  for (const std::vector<int64_t>& cuts : splits) {
    FfnGrads split = zero_grads(p);
    for (size_t s = 0; s + 1 < cuts.size(); ++s) run_backward(p, f, DType::f32, split, cuts[s], cuts[s + 1]);
    EXPECT_EQ(split.dx, whole.dx);
    EXPECT_EQ(split.dw1, whole.dw1);
    EXPECT_EQ(split.dw3, whole.dw3);
    EXPECT_EQ(split.dw2, whole.dw2);
  }
  FfnGrads by_row = zero_grads(p);
  for (int64_t r = 0; r < p.n; ++r) run_backward(p, f, DType::f32, by_row, r, r + 1);
  EXPECT_EQ(by_row.dx, whole.dx);
  EXPECT_EQ(by_row.dw1, whole.dw1);
  EXPECT_EQ(by_row.dw3, whole.dw3);
  EXPECT_EQ(by_row.dw2, whole.dw2);
}

TEST_P(CpuKernelsExpertFfn, Bf16StorageRoundsStoredValues) {
  const FfnProblem p = make_ffn_problem(GetParam(), 230);
  const FfnForward f = run_forward(p, DType::bf16);
  for (const auto* buf : {&f.pre1, &f.pre3, &f.h, &f.out})
    for (float v : *buf) EXPECT_TRUE(is_bf16_value(v)) << v;
  // Each stage reads the rounded values of the stage before, exactly as a bf16 kernel would.
  std::vector<float> pre1(p.n * p.ffn), out(p.n * p.hidden);
  cpu::gemm_nt(p.x.data(), p.w1.data(), pre1.data(), p.n, p.ffn, p.hidden);
  for (size_t i = 0; i < pre1.size(); ++i) EXPECT_EQ(f.pre1[i], round_to_bf16(pre1[i]));
  if (!p.is_swiglu()) {
    for (size_t i = 0; i < f.h.size(); ++i)
      EXPECT_EQ(f.h[i], round_to_bf16(activation_forward(p.activation, f.pre1[i])));
  }
  cpu::gemm_nt(f.h.data(), p.w2.data(), out.data(), p.n, p.hidden, p.ffn);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(f.out[i], round_to_bf16(out[i]));

  // Backward: dx is stored (rounded); weight gradients are fp64 accumulators and stay unrounded, so
  // they equal the f32-storage gradients computed from the same (bf16-valued) forward buffers.
  FfnGrads g16 = zero_grads(p), g32 = zero_grads(p);
  run_backward(p, f, DType::bf16, g16, 0, p.n);
  run_backward(p, f, DType::f32, g32, 0, p.n);
  for (size_t i = 0; i < g16.dx.size(); ++i) EXPECT_EQ(g16.dx[i], round_to_bf16(g32.dx[i]));
  EXPECT_EQ(g16.dw1, g32.dw1);
  EXPECT_EQ(g16.dw3, g32.dw3);
  EXPECT_EQ(g16.dw2, g32.dw2);
}

std::string activation_test_name(const ::testing::TestParamInfo<Activation>& param_info) {
  return activation_name(param_info.param);
}

INSTANTIATE_TEST_SUITE_P(CpuKernels, CpuKernelsExpertFfn,
                         ::testing::Values(Activation::relu, Activation::gelu, Activation::swiglu),
                         activation_test_name);

// ---- router -----------------------------------------------------------------------------------------

struct RouterProblem {
  int64_t tokens = 4;
  int32_t experts = 5, top_k = 2;
  std::vector<float> logits;      // [T, E]
  std::vector<float> dweights;    // [T, k]: the loss weights D on the gate weights
  std::vector<double> fraction;   // [E]: f_e, held constant
  double lb_coef = 0.7, z_coef = 0.3;
};

RouterProblem make_router_problem(uint64_t seed) {
  RouterProblem p;
  Rng rng(seed);
  // Logits of a token: a shuffled grid 0.4 apart plus noise < 0.1, so any two differ by > 0.3 and a
  // ±1e-2 step never changes the top-k choice.
  for (int64_t t = 0; t < p.tokens; ++t) {
    std::vector<int32_t> rank(p.experts);
    for (int32_t e = 0; e < p.experts; ++e) rank[e] = e;
    for (int32_t e = p.experts - 1; e > 0; --e)  // Fisher-Yates shuffle
      std::swap(rank[e], rank[int32_t(rng.next() % uint64_t(e + 1))]);
    for (int32_t e = 0; e < p.experts; ++e)
      p.logits.push_back(float(0.4 * rank[e] - 0.8 + 0.1 * rng.uniform()));
  }
  p.dweights = rng.normal_vector(p.tokens * p.top_k, 1.0);
  p.fraction = {0.1, 0.3, 0.2, 0.25, 0.15};
  return p;
}

struct RouterForward {
  std::vector<float> probs, weights, lse;
  std::vector<int32_t> ids;
};

RouterForward run_router(const RouterProblem& p, bool renormalize) {
  RouterForward f;
  f.probs.resize(p.tokens * p.experts);
  f.weights.resize(p.tokens * p.top_k);
  f.lse.resize(p.tokens);
  f.ids.resize(p.tokens * p.top_k);
  cpu::router_topk(p.logits.data(), f.probs.data(), f.ids.data(), f.weights.data(), f.lse.data(), p.tokens,
                   p.experts, p.top_k, renormalize);
  return f;
}

// L = Σ D·w  [+ lb_coef·E·Σ_e f_e·P_e + z_coef·Σ_t lse_t²/N], P_e = Σ_t p[t, e]/N, N = T.
double router_loss(const RouterProblem& p, bool renormalize, bool with_aux) {
  const RouterForward f = run_router(p, renormalize);
  double loss = dot(f.weights, p.dweights);
  if (with_aux) {
    const double n = double(p.tokens);
    for (int32_t e = 0; e < p.experts; ++e) {
      double prob_sum = 0;
      for (int64_t t = 0; t < p.tokens; ++t) prob_sum += f.probs[t * p.experts + e];
      loss += p.lb_coef * p.experts * p.fraction[e] * prob_sum / n;
    }
    for (float l : f.lse) loss += p.z_coef * double(l) * double(l) / n;
  }
  return loss;
}

TEST(CpuKernelsRouter, TopkBackwardMatchesFiniteDifferences) {
  for (bool renormalize : {false, true})
    for (bool with_aux : {false, true}) {
      RouterProblem p = make_router_problem(300 + 2 * renormalize + with_aux);
      const RouterForward f = run_router(p, renormalize);
      cpu::RouterAuxGrad aux;
      if (with_aux) {
        aux.expert_fraction = p.fraction.data();
        aux.lb_scale = p.lb_coef * p.experts / double(p.tokens);
        aux.lse = f.lse.data();
        aux.z_scale = 2 * p.z_coef / double(p.tokens);
      }
      std::vector<float> dlogits(p.tokens * p.experts, -9.0f);
      cpu::router_topk_backward(f.probs.data(), f.ids.data(), f.weights.data(), p.dweights.data(),
                                dlogits.data(), p.tokens, p.experts, p.top_k, renormalize, aux);
      // Step 1e-2 on logits ~1: truncation step²/6·|L'''| ≲ 2e-5; the loss reads f32 probabilities and
      // weights (≈ 20 terms, rounding ≲ 2e-6 in total) → ≲ 1e-4 after dividing by 2·step.
      const auto fd = numeric_grad(p.logits, 1e-2f, [&] { return router_loss(p, renormalize, with_aux); });
      expect_close(fmt::format("dlogits renormalize={} aux={}", renormalize, with_aux), to_double(dlogits),
                   fd, 5e-4, 1e-3);
    }
}

TEST(CpuKernelsRouter, TopkBackwardOfNothingIsZero) {
  const RouterProblem p = make_router_problem(310);
  const RouterForward f = run_router(p, true);
  const std::vector<float> zero(p.tokens * p.top_k, 0.0f);
  std::vector<float> dlogits(p.tokens * p.experts, -9.0f);
  cpu::router_topk_backward(f.probs.data(), f.ids.data(), f.weights.data(), zero.data(), dlogits.data(),
                            p.tokens, p.experts, p.top_k, true, cpu::RouterAuxGrad{});
  for (float v : dlogits) EXPECT_EQ(v, 0.0f);
}

TEST(CpuKernelsRouter, LogitsBackwardMatchesFiniteDifferences) {
  const int64_t tokens = 3, hidden = 4;
  const int32_t experts = 5;
  Rng rng(320);
  std::vector<float> x = rng.normal_vector(tokens * hidden, 1.0);
  std::vector<float> wg = rng.normal_vector(experts * hidden, 0.5);
  const std::vector<float> g = rng.normal_vector(tokens * experts, 1.0);  // L = Σ logits·G
  std::vector<float> dx(tokens * hidden, 0.0f);
  std::vector<double> dwg(experts * hidden, 1.0);  // accumulates: starts at 1
  cpu::router_logits_backward(x.data(), wg.data(), g.data(), dx.data(), dwg.data(), tokens, hidden, experts);
  for (double& v : dwg) v -= 1.0;

  auto loss = [&] {
    std::vector<float> logits(tokens * experts);
    cpu::router_logits(x.data(), wg.data(), logits.data(), tokens, hidden, experts);
    return dot(logits, g);
  };
  // Logits are linear in x and wg: no truncation error; 15 f32 logits ~1 (rounding ≲ 1e-6 in total)
  // → ≲ 5e-5 after dividing by 2·step.
  expect_close("router dx", to_double(dx), numeric_grad(x, 1e-2f, loss), 5e-4, 1e-4);
  expect_close("router dwg", dwg, numeric_grad(wg, 1e-2f, loss), 5e-4, 1e-4);

  // dx accumulates (+=): a second identical call doubles it exactly (the f32 sum is exact here).
  std::vector<float> dx2 = dx;
  cpu::router_logits_backward(x.data(), wg.data(), g.data(), dx2.data(), dwg.data(), tokens, hidden, experts);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_EQ(dx2[i], 2 * dx[i]) << i;
}

// ---- data movement ----------------------------------------------------------------------------------

// Payload encoding (row, column), exactly representable.
std::vector<float> tagged_rows(int64_t rows, int64_t hidden, float base) {
  std::vector<float> v(rows * hidden);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < hidden; ++i) v[r * hidden + i] = base + float(r * 100 + i);
  return v;
}

TEST(CpuKernelsPermute, GatherRowsExact) {
  const int64_t hidden = 3;
  const std::vector<float> x = tagged_rows(4, hidden, 0);
  const std::vector<int32_t> rows = {3, 0, 3, 1, 2};  // repeats allowed (one token, two experts)
  std::vector<float> out(rows.size() * hidden);
  cpu::gather_rows(x.data(), rows.data(), out.data(), int64_t(rows.size()), hidden);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < hidden; ++c) EXPECT_EQ(out[i * hidden + c], float(rows[i] * 100 + c));
  const std::vector<int32_t> bad = {0, -1};
  EXPECT_THROW(cpu::gather_rows(x.data(), bad.data(), out.data(), 2, hidden), Error);
}

TEST(CpuKernelsPermute, PermuteSegmentsExact) {
  const int64_t hidden = 2;
  const std::vector<float> src = tagged_rows(7, hidden, 0);
  // Segments: src rows 0..2 → dst 4..6; src 3..3 (empty) → dst 0; src 3..4 → dst 0..1; src 6 → dst 3.
  const std::vector<int64_t> src_offsets = {0, 3, 3, 6}, dst_offsets = {4, 0, 0, 3}, counts = {3, 0, 2, 1};
  std::vector<float> dst(8 * hidden, -1.0f);
  cpu::permute_segments(src.data(), dst.data(), src_offsets.data(), dst_offsets.data(), counts.data(), 4,
                        hidden);
  const std::vector<int32_t> dst_from = {3, 4, -1, 6, 0, 1, 2, -1};  // -1: untouched
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t c = 0; c < hidden; ++c)
      EXPECT_EQ(dst[r * hidden + c], dst_from[r] < 0 ? -1.0f : float(dst_from[r] * 100 + c)) << "row " << r;
  const std::vector<int64_t> negative = {-1};
  EXPECT_THROW(cpu::permute_segments(src.data(), dst.data(), src_offsets.data(), dst_offsets.data(),
                                     negative.data(), 1, hidden),
               Error);
}

struct CombineProblem {
  int64_t tokens = 4, hidden = 3, rows = 8;
  int32_t top_k = 2;
  // slot [T, k]: token 1 choice 1 is dropped; send row 5 is referenced by no slot.
  std::vector<int32_t> slot = {2, 0, 4, -1, 1, 6, 3, 7};
  std::vector<float> rows_data, weights, addend, r;
};

CombineProblem make_combine_problem(uint64_t seed) {
  CombineProblem p;
  Rng rng(seed);
  p.rows_data = rng.normal_vector(p.rows * p.hidden, 1.0);
  p.weights = rng.normal_vector(p.tokens * p.top_k, 0.5);
  p.addend = rng.normal_vector(p.tokens * p.hidden, 1.0);
  p.r = rng.normal_vector(p.tokens * p.hidden, 1.0);
  return p;
}

std::vector<float> run_combine(const CombineProblem& p, bool with_weights, bool with_addend, DType storage) {
  std::vector<float> y(p.tokens * p.hidden, -1.0f);
  cpu::combine(p.rows_data.data(), p.slot.data(), with_weights ? p.weights.data() : nullptr,
               with_addend ? p.addend.data() : nullptr, y.data(), p.tokens, p.top_k, p.hidden, storage);
  return y;
}

TEST(CpuKernelsCombine, ForwardMatchesFormula) {
  const CombineProblem p = make_combine_problem(400);
  for (bool with_weights : {false, true})
    for (bool with_addend : {false, true}) {
      const std::vector<float> y = run_combine(p, with_weights, with_addend, DType::f32);
      const std::vector<float> y16 = run_combine(p, with_weights, with_addend, DType::bf16);
      for (int64_t t = 0; t < p.tokens; ++t)
        for (int64_t i = 0; i < p.hidden; ++i) {
          double acc = 0;  // the specification: fp64 over j in order, skipping dropped, then the addend
          for (int32_t j = 0; j < p.top_k; ++j) {
            const int32_t s = p.slot[t * p.top_k + j];
            if (s < 0) continue;
            acc += (with_weights ? double(p.weights[t * p.top_k + j]) : 1.0) * p.rows_data[s * p.hidden + i];
          }
          if (with_addend) acc += p.addend[t * p.hidden + i];
          EXPECT_EQ(y[t * p.hidden + i], float(acc)) << "t=" << t << " i=" << i;
          EXPECT_EQ(y16[t * p.hidden + i], round_to_bf16(float(acc))) << "bf16 t=" << t << " i=" << i;
        }
    }
}

TEST(CpuKernelsCombine, BackwardMatchesFiniteDifferences) {
  CombineProblem p = make_combine_problem(410);
  const float kUntouched = 123.0f;
  std::vector<float> drows(p.rows * p.hidden, kUntouched);
  std::vector<float> dweights(p.tokens * p.top_k, -9.0f);
  cpu::combine_backward(p.r.data(), p.rows_data.data(), p.slot.data(), p.weights.data(), drows.data(),
                        dweights.data(), p.tokens, p.top_k, p.hidden, DType::f32);
  EXPECT_EQ(dweights[1 * p.top_k + 1], 0.0f) << "dropped assignment";
  for (int64_t i = 0; i < p.hidden; ++i) EXPECT_EQ(drows[5 * p.hidden + i], kUntouched) << "unreferenced row";

  // L = Σ y·R is linear in the rows and in the weights: no truncation error; 12 f32 outputs ~1
  // (rounding ≲ 1e-6 in total) → ≲ 5e-5 after dividing by 2·step.
  auto loss = [&] { return dot(run_combine(p, true, true, DType::f32), p.r); };
  std::vector<double> fd_rows = numeric_grad(p.rows_data, 1e-2f, loss);
  std::vector<double> got_rows = to_double(drows);
  for (int64_t i = 0; i < p.hidden; ++i) got_rows[5 * p.hidden + i] = 0;  // its true gradient is 0
  expect_close("combine drows", got_rows, fd_rows, 5e-4, 1e-4);
  expect_close("combine dweights", to_double(dweights), numeric_grad(p.weights, 1e-2f, loss), 5e-4, 1e-4);

  // bf16 storage: drows are stored values (rounded); dweights are f32 gradients (not rounded).
  std::vector<float> drows16(p.rows * p.hidden, kUntouched), dweights16(p.tokens * p.top_k);
  cpu::combine_backward(p.r.data(), p.rows_data.data(), p.slot.data(), p.weights.data(), drows16.data(),
                        dweights16.data(), p.tokens, p.top_k, p.hidden, DType::bf16);
  for (size_t i = 0; i < drows.size(); ++i) EXPECT_EQ(drows16[i], round_to_bf16(drows[i])) << i;
  EXPECT_EQ(dweights16, dweights);
}

}  // namespace
}  // namespace dmoe

#include "core/dispatch_plan.hpp"
#include "core/routing_block.hpp"

namespace dmoe {
namespace {

// Distinct experts per token, in random order: ids [T, k].
std::vector<int32_t> random_routing(int64_t tokens, int32_t top_k, int32_t experts, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(size_t(tokens * top_k));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(experts);
    for (int32_t e = 0; e < experts; ++e) all[e] = e;
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t pick = j + int32_t(rng.uniform() * (experts - j));
      std::swap(all[j], all[std::min(pick, experts - 1)]);
      ids[size_t(t * top_k + j)] = all[j];
    }
  }
  return ids;
}

// The plan with its counts left in a PlanCountsBlock is core build_send_plan's (latest tokens), dropless and with
// a capacity; an id outside [0, E) is named in the block's bad word instead of thrown.
TEST(CpuKernels, PlanSendOnDeviceIsBuildSendPlan) {
  const int64_t T = 29;
  const int32_t k = 2, E = 6;
  for (int64_t capacity : {int64_t(-1), int64_t(7), int64_t(0)}) {
    const auto ids = random_routing(T, k, E, 61);
    const SendPlan p = build_send_plan(ids.data(), nullptr, T, k, E, capacity, DropPolicy::latest_tokens);
    std::vector<int32_t> slot(T * k, 99), row_token(T * k, 99), row_choice(T * k, 99);
    std::vector<int64_t> block(PlanCountsBlock::words(E), 99);
    cpu::plan_send_on_device(ids.data(), T, k, E, capacity, slot.data(), row_token.data(), row_choice.data(),
                             block.data());
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    EXPECT_EQ(slot, p.slot);
    const int64_t S = p.rows();
    EXPECT_EQ(std::vector<int32_t>(row_token.begin(), row_token.begin() + S), p.row_token);
    EXPECT_EQ(std::vector<int32_t>(row_choice.begin(), row_choice.begin() + S), p.row_choice);
    EXPECT_EQ(std::vector<int64_t>(block.begin(), block.begin() + E), p.routed);
    EXPECT_EQ(std::vector<int64_t>(block.begin() + E, block.begin() + 2 * E), p.counts);
    EXPECT_EQ(std::vector<int64_t>(block.begin() + 2 * E, block.begin() + 3 * E + 1), p.offsets);
    EXPECT_EQ(PlanCountsBlock::read_bad(block.data(), E), kNoBadAssignment);
  }
  auto ids = random_routing(T, k, E, 67);
  ids[2 * k + 1] = -1;  // token 2's second choice: NaN logits
  ids[5 * k] = E;
  std::vector<int32_t> slot(T * k), row_token(T * k), row_choice(T * k);
  std::vector<int64_t> block(PlanCountsBlock::words(E));
  cpu::plan_send_on_device(ids.data(), T, k, E, -1, slot.data(), row_token.data(), row_choice.data(), block.data());
  EXPECT_EQ(PlanCountsBlock::read_bad(block.data(), E), 2 * k + 1) << "the first bad assignment";
  EXPECT_EQ(block[3 * E], 0) << "no rows";
  for (int32_t s : slot) EXPECT_EQ(s, -1);
}

// The aux sums in an AuxPartialsBlock decode to router_aux_partials' (same loops, fp64); a bad id is flagged.
TEST(CpuKernels, RouterAuxPartialsOnDeviceIsRouterAuxPartials) {
  const int64_t T = 23;
  const int32_t k = 2, E = 5;
  Rng rng(71);
  std::vector<float> probs(T * E), lse(T);
  for (auto& v : probs) v = float(rng.uniform());
  for (auto& v : lse) v = float(rng.uniform() * 3);
  auto ids = random_routing(T, k, E, 73);
  std::vector<double> ps(E), as(E), ps2(E), as2(E);
  double z = 0, z2 = 0;
  cpu::router_aux_partials(probs.data(), lse.data(), ids.data(), T, E, k, ps.data(), as.data(), &z);
  std::vector<int64_t> block(AuxPartialsBlock::bytes(E) / 8);
  cpu::router_aux_partials_on_device(probs.data(), lse.data(), ids.data(), T, E, k, block.data());
  AuxPartialsBlock::decode(block.data(), E, ps2.data(), as2.data(), &z2);
  EXPECT_EQ(ps, ps2);
  EXPECT_EQ(as, as2);
  EXPECT_EQ(z, z2);
  EXPECT_EQ(AuxPartialsBlock::read_bad(block.data(), E), kNoBadAssignment);
  ids[7] = -1;
  cpu::router_aux_partials_on_device(probs.data(), lse.data(), ids.data(), T, E, k, block.data());
  EXPECT_EQ(AuxPartialsBlock::read_bad(block.data(), E), 7);
}

// The device-offset GEMM's tile table: ceil(rows_g / block_m) · n_tiles tiles per group, offsets clipped into
// [0, rows] and made non-decreasing (a wrong table must not reach outside the operands).
TEST(CpuKernels, GroupedTileTableCountsAndClips) {
  const int64_t offsets[] = {0, 0, 129, 129, 300, 301};
  std::vector<int64_t> clipped(6);
  std::vector<int32_t> tiles_at(6);
  int32_t tiles = -1;
  cpu::grouped_tile_table(offsets, 5, 301, 3, 128, clipped.data(), tiles_at.data(), &tiles);
  EXPECT_EQ(clipped, std::vector<int64_t>(offsets, offsets + 6));
  // group rows 0, 129, 0, 171, 1 -> row tiles 0, 2, 0, 2, 1 (x 3 columns)
  EXPECT_EQ(tiles_at, (std::vector<int32_t>{0, 0, 6, 6, 12, 15}));
  EXPECT_EQ(tiles, 15);
  const int64_t wrong[] = {5, 200, 100, 1000};  // offsets[0] ignored (taken as 0), a decrease, past rows
  std::vector<int64_t> c2(4);
  std::vector<int32_t> t2(4);
  cpu::grouped_tile_table(wrong, 3, 250, 1, 128, c2.data(), t2.data(), &tiles);
  EXPECT_EQ(c2, (std::vector<int64_t>{0, 200, 200, 250}));
  EXPECT_EQ(t2, (std::vector<int32_t>{0, 2, 2, 3}));
  EXPECT_EQ(tiles, 3);
  EXPECT_THROW(cpu::grouped_tile_table(offsets, 5, 301, 0, 128, clipped.data(), tiles_at.data(), &tiles), Error);
}

}  // namespace
}  // namespace dmoe
