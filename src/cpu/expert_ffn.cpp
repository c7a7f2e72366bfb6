// cpu/expert_ffn.cpp — one expert's feed-forward block over its batch of rows, forward and backward.
//
//   relu / gelu:  out = act(x·w1^T)·w2^T
//   SwiGLU:       out = (silu(x·w1^T) ∘ (x·w3^T))·w2^T
//
// Stored activations (pre1, pre3, h, out, dx) are rounded to bf16 when storage is bf16, and every later
// step reads the rounded values, as a bf16 GPU kernel would. Weight gradients accumulate unrounded in
// fp64, every element summing the rows in order 0..n-1: an expert's rows split over ranks in (rank, token)
// order then give bit-identical gradients.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

namespace {

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The scalar activations in fp64; the public float versions and both passes below use these.
double act_value(Activation activation, double x) {
  switch (activation) {
    case Activation::relu: return x > 0 ? x : 0.0;
    case Activation::gelu: return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2));
    case Activation::swiglu: return x * sigmoid(x);  // silu, the gate half of SwiGLU
  }
  return 0;
}

double act_derivative(Activation activation, double x) {
  switch (activation) {
    case Activation::relu: return x > 0 ? 1.0 : 0.0;
    case Activation::gelu: {
      // d/dx [x·Φ(x)] = Φ(x) + x·φ(x)
      const double cdf = 0.5 * (1.0 + std::erf(x * kInvSqrt2));
      const double pdf = kInvSqrt2Pi * std::exp(-0.5 * x * x);
      return cdf + x * pdf;
    }
    case Activation::swiglu: {
      // d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x)))
      const double s = sigmoid(x);
      return s * (1.0 + x * (1.0 - s));
    }
  }
  return 0;
}

void round_if_bf16(float* v, int64_t count, DType storage) {
  if (storage != DType::bf16) return;
  for (int64_t i = 0; i < count; ++i) v[i] = round_to_bf16(v[i]);
}

// The backward pass works on chunks of rows. Both products below loop (a, chunk row, b) with b innermost
// and contiguous, so a row of w or dw is loaded once per chunk rather than once per row.
constexpr int64_t kRowChunk = 8;

// acc[c, b] += Σ_a g[c, a] · w[a, b]  (g [rows, A], w [A, B], acc [rows, B] fp64). Each element sums a in
// order, so a row's result does not depend on the chunk it is in.
template <typename G>
void add_row_products(const G* g, const float* w, double* acc, int64_t rows, int64_t a_dim, int64_t b_dim) {
  for (int64_t a = 0; a < a_dim; ++a) {
    const float* w_row = w + a * b_dim;
    for (int64_t c = 0; c < rows; ++c) {
      const double coef = double(g[c * a_dim + a]);
      double* acc_row = acc + c * b_dim;
      for (int64_t b = 0; b < b_dim; ++b) acc_row[b] += coef * double(w_row[b]);
    }
  }
}

// dw[a, b] += Σ_c g[c, a] · v[c, b]  (g [rows, A], v [rows, B], dw [A, B] fp64).
// NOTE: every element adds the rows in order c = 0..rows-1, exactly like a row-by-row loop, so chunking
// changes no bit and consecutive calls (chunks, or an expert's rows split over ranks) continue the order.
template <typename G>
void add_outer_products(const G* g, const float* v, double* dw, int64_t rows, int64_t a_dim, int64_t b_dim) {
  for (int64_t a = 0; a < a_dim; ++a) {
    double* dw_row = dw + a * b_dim;
    for (int64_t c = 0; c < rows; ++c) {
      const double coef = double(g[c * a_dim + a]);
      const float* v_row = v + c * b_dim;
      for (int64_t b = 0; b < b_dim; ++b) dw_row[b] += coef * double(v_row[b]);
    }
  }
}

}  // namespace

float activation_forward(Activation activation, float x) { return float(act_value(activation, x)); }

float activation_derivative(Activation activation, float x) {
  return float(act_derivative(activation, x));
}

void expert_ffn_forward(const float* x, const float* w1, const float* w3, const float* w2, float* pre1,
                        float* pre3, float* h, float* out, int64_t n, int64_t hidden, int64_t ffn,
                        Activation activation, DType storage) {
  const bool is_swiglu = activation == Activation::swiglu;
  if (is_swiglu)
    DMOE_REQUIRE(w3 != nullptr && pre3 != nullptr, "expert_ffn_forward: SwiGLU needs w3 and pre3");

  gemm_nt(x, w1, pre1, n, ffn, hidden);  // pre1 [n, I]
  round_if_bf16(pre1, n * ffn, storage);
  if (is_swiglu) {
    gemm_nt(x, w3, pre3, n, ffn, hidden);  // pre3 [n, I]
    round_if_bf16(pre3, n * ffn, storage);
  }
  for (int64_t idx = 0; idx < n * ffn; ++idx) {
    const double a = act_value(activation, pre1[idx]);
    h[idx] = stored_value(is_swiglu ? a * double(pre3[idx]) : a, storage);
  }
  gemm_nt(h, w2, out, n, hidden, ffn);  // out [n, H]
  round_if_bf16(out, n * hidden, storage);
}

void expert_ffn_backward(const float* x, const float* w1, const float* w3, const float* w2,
                         const float* pre1, const float* pre3, const float* h, const float* dout,
                         float* dx, double* dw1, double* dw3, double* dw2, int64_t n, int64_t hidden,
                         int64_t ffn, Activation activation, DType storage) {
  const bool is_swiglu = activation == Activation::swiglu;
  if (is_swiglu)
    DMOE_REQUIRE(w3 != nullptr && pre3 != nullptr && dw3 != nullptr,
                 "expert_ffn_backward: SwiGLU needs w3, pre3 and dw3");

  // Scratch for one chunk of rows.
  std::vector<double> dh(kRowChunk * ffn);     // dL/dh [chunk, I]
  std::vector<double> dpre1(kRowChunk * ffn);  // dL/dpre1 [chunk, I]
  std::vector<double> dpre3(is_swiglu ? kRowChunk * ffn : 0);
  std::vector<double> dx_acc(kRowChunk * hidden);  // [chunk, H]

  for (int64_t r0 = 0; r0 < n; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, n - r0);

    // dh = dout · w2 (w2 is [H, I]).
    std::fill(dh.begin(), dh.end(), 0.0);
    add_row_products(dout + r0 * hidden, w2, dh.data(), rows, hidden, ffn);

    // Through the activation, using the stored pre-activations.
    for (int64_t idx = 0; idx < rows * ffn; ++idx) {
      const double p1 = pre1[r0 * ffn + idx];
      if (is_swiglu) {
        dpre1[idx] = dh[idx] * double(pre3[r0 * ffn + idx]) * act_derivative(activation, p1);
        dpre3[idx] = dh[idx] * act_value(activation, p1);
      } else {
        dpre1[idx] = dh[idx] * act_derivative(activation, p1);
      }
    }

    // dx = dpre1 · w1 (+ dpre3 · w3); w1, w3 are [I, H].
    std::fill(dx_acc.begin(), dx_acc.end(), 0.0);
    add_row_products(dpre1.data(), w1, dx_acc.data(), rows, ffn, hidden);
    if (is_swiglu) add_row_products(dpre3.data(), w3, dx_acc.data(), rows, ffn, hidden);
    for (int64_t idx = 0; idx < rows * hidden; ++idx) dx[r0 * hidden + idx] = stored_value(dx_acc[idx], storage);

    // Weight gradients: dw2 += dout^T · h, dw1 += dpre1^T · x, dw3 += dpre3^T · x.
    add_outer_products(dout + r0 * hidden, h + r0 * ffn, dw2, rows, hidden, ffn);
    add_outer_products(dpre1.data(), x + r0 * hidden, dw1, rows, ffn, hidden);
    if (is_swiglu) add_outer_products(dpre3.data(), x + r0 * hidden, dw3, rows, ffn, hidden);
  }
}

}  // namespace dmoe::cpu
