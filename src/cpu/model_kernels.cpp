// cpu/model_kernels.cpp — the dense Transformer kernels and the optimizer step (see model_kernels.hpp).
#include "cpu/model_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

// ---- embedding -----------------------------------------------------------------------------------

void embedding_forward(const int32_t* tokens, const float* table, float* out, int64_t n, int64_t vocab,
                       int64_t hidden) {
  for (int64_t t = 0; t < n; ++t) {
    DMOE_REQUIRE(tokens[t] >= 0 && tokens[t] < vocab, "embedding: token {} at position {} is outside [0, {})",
                 tokens[t], t, vocab);
    std::copy(table + int64_t(tokens[t]) * hidden, table + int64_t(tokens[t] + 1) * hidden, out + t * hidden);
  }
}

void embedding_backward(const int32_t* tokens, const float* dout, double* dtable, int64_t n, int64_t vocab,
                        int64_t hidden) {
  for (int64_t t = 0; t < n; ++t) {
    DMOE_REQUIRE(tokens[t] >= 0 && tokens[t] < vocab, "embedding: token {} at position {} is outside [0, {})",
                 tokens[t], t, vocab);
    double* row = dtable + int64_t(tokens[t]) * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] += dout[t * hidden + i];
  }
}

// ---- RMSNorm -------------------------------------------------------------------------------------

void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t hidden,
                     float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += double(xr[i]) * double(xr[i]);
    const float mean = float(ss / double(hidden));
    const float s = 1.0f / std::sqrt(mean + eps);
    rstd[r] = s;
    for (int64_t i = 0; i < hidden; ++i) y[r * hidden + i] = w[i] * (xr[i] * s);
  }
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      double* dw, int64_t rows, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    const float* gr = dy + r * hidden;
    const double s = rstd[r];
    double dot = 0;  // Σ_j w_j dy_j x_j
    for (int64_t i = 0; i < hidden; ++i) dot += double(w[i]) * double(gr[i]) * double(xr[i]);
    const double c = s * s * s * dot / double(hidden);
    for (int64_t i = 0; i < hidden; ++i) {
      dx[r * hidden + i] = float(s * double(w[i]) * double(gr[i]) - c * double(xr[i]));
      dw[i] += double(gr[i]) * double(xr[i]) * s;
    }
  }
}

// ---- rotary position embedding -------------------------------------------------------------------

namespace {

// cos and sin of position s for the D/2 frequencies, in f32 as HF computes them:
// inv_freq = 1 / theta^(arange(0, D, 2)/D) in f32, angle = float(s) · inv_freq in f32.
void rope_angles(int64_t s, int64_t head_dim, double theta, std::vector<float>& c, std::vector<float>& sn) {
  const int64_t half = head_dim / 2;
  c.resize(half);
  sn.resize(half);
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = float(2 * j) / float(head_dim);
    const float inv_freq = 1.0f / std::pow(float(theta), exponent);
    const float angle = float(s) * inv_freq;
    c[j] = std::cos(angle);
    sn[j] = std::sin(angle);
  }
}

void check_rope(int64_t seq, int64_t head_dim, double theta) {
  DMOE_REQUIRE(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim = {} must be positive and even", head_dim);
  DMOE_REQUIRE(seq > 0, "rope: seq = {} must be positive", seq);
  DMOE_REQUIRE(theta > 0, "rope: theta = {} must be positive", theta);
}

}  // namespace

void rope_forward(const float* x, float* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                  double theta) {
  check_rope(seq, head_dim, theta);
  const int64_t half = head_dim / 2;
  std::vector<float> c, sn, v(head_dim);
  for (int64_t t = 0; t < n; ++t) {
    rope_angles(t % seq, head_dim, theta, c, sn);
    for (int64_t h = 0; h < heads; ++h) {
      const float* xv = x + (t * heads + h) * head_dim;
      float* yv = y + (t * heads + h) * head_dim;
      std::copy(xv, xv + head_dim, v.begin());  // x and y may alias
      for (int64_t j = 0; j < half; ++j) {
        // HF: q*cos + rotate_half(q)*sin, each product rounded to f32, then the f32 sum.
        yv[j] = v[j] * c[j] + (-v[j + half]) * sn[j];
        yv[j + half] = v[j + half] * c[j] + v[j] * sn[j];
      }
    }
  }
}

void rope_backward(const float* dy, float* dx, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                   double theta) {
  check_rope(seq, head_dim, theta);
  const int64_t half = head_dim / 2;
  std::vector<float> c, sn, g(head_dim);
  for (int64_t t = 0; t < n; ++t) {
    rope_angles(t % seq, head_dim, theta, c, sn);
    for (int64_t h = 0; h < heads; ++h) {
      const float* gv = dy + (t * heads + h) * head_dim;
      float* dv = dx + (t * heads + h) * head_dim;
      std::copy(gv, gv + head_dim, g.begin());
      for (int64_t j = 0; j < half; ++j) {
        // y_j = v_j c_j − v_{j+h} s_j,  y_{j+h} = v_{j+h} c_j + v_j s_j.
        dv[j] = float(double(g[j]) * c[j] + double(g[j + half]) * sn[j]);
        dv[j + half] = float(double(g[j + half]) * c[j] - double(g[j]) * sn[j]);
      }
    }
  }
}

// ---- causal grouped-query attention ---------------------------------------------------------------

namespace {

void check_attention(int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim) {
  DMOE_REQUIRE(batch > 0 && seq > 0 && head_dim > 0, "attention: batch = {}, seq = {}, head_dim = {} must be "
               "positive", batch, seq, head_dim);
  DMOE_REQUIRE(kv_heads > 0 && heads > 0 && heads % kv_heads == 0,
               "attention: heads = {} must be a positive multiple of kv_heads = {}", heads, kv_heads);
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t batch,
                       int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim) {
  check_attention(batch, seq, heads, kv_heads, head_dim);
  const int32_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(double(head_dim));
  const int64_t D = head_dim;
  std::vector<double> score(seq), acc(D);
  for (int64_t b = 0; b < batch; ++b) {
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t kvh = h / group;
      for (int64_t i = 0; i < seq; ++i) {
        const float* qi = q + ((b * seq + i) * heads + h) * D;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = k + ((b * seq + j) * kv_heads + kvh) * D;
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += double(qi[d]) * double(kj[d]);
          score[j] = s * scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(score[j] - mx);
        const double l = mx + std::log(sum);
        lse[(b * heads + h) * seq + i] = float(l);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(score[j] - l);
          const float* vj = v + ((b * seq + j) * kv_heads + kvh) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p * double(vj[d]);
        }
        float* oi = out + ((b * seq + i) * heads + h) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = float(acc[d]);
      }
    }
  }
}

void attention_backward(const float* q, const float* k, const float* v, const float* lse, const float* dout,
                        float* dq, float* dk, float* dv, int64_t batch, int64_t seq, int32_t heads,
                        int32_t kv_heads, int64_t head_dim) {
  check_attention(batch, seq, heads, kv_heads, head_dim);
  const int32_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(double(head_dim));
  const int64_t D = head_dim;
  // dk, dv of one sequence's kv heads accumulate over queries (and query heads) in fp64, rounded once.
  std::vector<double> dk_acc(seq * kv_heads * D), dv_acc(seq * kv_heads * D), p(seq), dp(seq), dq_acc(D);
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
    std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t kvh = h / group;
      for (int64_t i = 0; i < seq; ++i) {
        const float* qi = q + ((b * seq + i) * heads + h) * D;
        const float* gi = dout + ((b * seq + i) * heads + h) * D;
        const double l = lse[(b * heads + h) * seq + i];
        double dot_pdp = 0;  // Σ_j p_ij dP_ij
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = k + ((b * seq + j) * kv_heads + kvh) * D;
          const float* vj = v + ((b * seq + j) * kv_heads + kvh) * D;
          double s = 0, g = 0;
          for (int64_t d = 0; d < D; ++d) {
            s += double(qi[d]) * double(kj[d]);
            g += double(gi[d]) * double(vj[d]);
          }
          p[j] = std::exp(s * scale - l);
          dp[j] = g;
          dot_pdp += p[j] * g;
        }
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dot_pdp) * scale;
          const float* kj = k + ((b * seq + j) * kv_heads + kvh) * D;
          double* dkj = dk_acc.data() + (j * kv_heads + kvh) * D;
          double* dvj = dv_acc.data() + (j * kv_heads + kvh) * D;
          for (int64_t d = 0; d < D; ++d) {
            dq_acc[d] += ds * double(kj[d]);
            dkj[d] += ds * double(qi[d]);
            dvj[d] += p[j] * double(gi[d]);
          }
        }
        float* dqi = dq + ((b * seq + i) * heads + h) * D;
        for (int64_t d = 0; d < D; ++d) dqi[d] = float(dq_acc[d]);
      }
    }
    for (int64_t x = 0; x < seq * kv_heads * D; ++x) {
      dk[b * seq * kv_heads * D + x] = float(dk_acc[x]);
      dv[b * seq * kv_heads * D + x] = float(dv_acc[x]);
    }
  }
}

// ---- linear --------------------------------------------------------------------------------------

void linear_forward(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out) {
  gemm_nt(x, w, y, rows, out, in);
}

void linear_backward(const float* x, const float* w, const float* dy, float* dx, double* dw, int64_t rows,
                     int64_t in, int64_t out) {
  if (dx) {
    std::vector<double> acc(in);
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t o = 0; o < out; ++o) {
        const double g = dy[r * out + o];
        const float* wo = w + o * in;
        for (int64_t i = 0; i < in; ++i) acc[i] += g * double(wo[i]);
      }
      for (int64_t i = 0; i < in; ++i) dx[r * in + i] = float(acc[i]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    for (int64_t o = 0; o < out; ++o) {
      const double g = dy[r * out + o];
      double* dwo = dw + o * in;
      for (int64_t i = 0; i < in; ++i) dwo[i] += g * double(xr[i]);
    }
  }
}

// ---- softmax cross-entropy -----------------------------------------------------------------------

void cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, double* loss_sum,
                           int64_t* count, int64_t rows, int64_t vocab, int32_t ignore_index) {
  double total = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, double(row[i]));
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(row[i]) - mx);
    const double l = mx + std::log(sum);
    lse[r] = float(l);
    if (targets[r] == ignore_index) continue;
    DMOE_REQUIRE(targets[r] >= 0 && targets[r] < vocab,
                 "cross entropy: target {} of row {} is outside [0, {}) and is not the ignore index {}",
                 targets[r], r, vocab, ignore_index);
    total += l - double(row[targets[r]]);
    ++n;
  }
  *loss_sum = total;
  *count = n;
}

void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse, float* dlogits,
                            int64_t rows, int64_t vocab, int32_t ignore_index, double scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dlogits + r * vocab;
    if (targets[r] == ignore_index) {
      std::fill(d, d + vocab, 0.0f);
      continue;
    }
    const float* row = logits + r * vocab;
    const double l = lse[r];
    for (int64_t i = 0; i < vocab; ++i) {
      const double p = std::exp(double(row[i]) - l);
      d[i] = float(scale * (p - (i == targets[r] ? 1.0 : 0.0)));
    }
  }
}

// ---- optimizer -----------------------------------------------------------------------------------

namespace {

float grad_value(float g) { return g; }
float grad_value(bfloat16 g) { return bf16_to_float(g); }

template <typename G>
void adamw_step_any(float* param, const G* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  DMOE_REQUIRE(p.step >= 1, "adamw: step = {} must be >= 1 (bias corrections use 1 - beta^step)", p.step);
  const double bc1 = 1.0 - std::pow(p.beta1, double(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, double(p.step));
  const double decay = 1.0 - p.lr * p.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad_value(grad[i]);
    const double mi = p.beta1 * double(m[i]) + (1.0 - p.beta1) * g;
    const double vi = p.beta2 * double(v[i]) + (1.0 - p.beta2) * g * g;
    m[i] = float(mi);
    v[i] = float(vi);
    const double update = (mi / bc1) / (std::sqrt(vi / bc2) + p.eps);
    param[i] = float(double(param[i]) * decay - p.lr * update);
  }
}

template <typename G>
double sum_of_squares_any(const G* g, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(grad_value(g[i])) * double(grad_value(g[i]));
  return s;
}

}  // namespace

void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  adamw_step_any(param, grad, m, v, n, p);
}

void adamw_step(float* param, const bfloat16* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  adamw_step_any(param, grad, m, v, n, p);
}

double sum_of_squares(const float* g, int64_t n) { return sum_of_squares_any(g, n); }

double sum_of_squares(const bfloat16* g, int64_t n) { return sum_of_squares_any(g, n); }

void scale_in_place(float* g, int64_t n, double scale) {
  for (int64_t i = 0; i < n; ++i) g[i] = float(double(g[i]) * scale);
}

double clip_coefficient(double total_sum_of_squares, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double norm = std::sqrt(total_sum_of_squares);
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace dmoe::cpu
