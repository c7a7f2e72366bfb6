// cpu/router.cpp — the gate: logits, softmax + top-k + gate weights, auxiliary-loss statistics, and the
// backward pass through all of them. The per-token math comes from core/routing.hpp (shared with the CUDA
// router); this file only loops over tokens and does the backward arithmetic in fp64.
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.hpp"
#include "core/routing.hpp"
#include "core/routing_block.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

void router_logits(const float* x, const float* wg, float* logits, int64_t tokens, int64_t hidden,
                   int32_t experts) {
  gemm_nt(x, wg, logits, tokens, experts, hidden);
}

void router_topk(const float* logits, float* probs, int32_t* ids, float* weights, float* lse,
                 int64_t tokens, int32_t experts, int32_t top_k, bool renormalize) {
  DMOE_REQUIRE(top_k >= 1 && top_k <= experts, "router_topk: top_k = {} is invalid; need 1 <= top_k <= {}",
               top_k, experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* logit_row = logits + t * experts;
    float* prob_row = probs + t * experts;
    int32_t* id_row = ids + t * top_k;
    lse[t] = float(softmax_row<double>(logit_row, experts, prob_row));
    topk_row(logit_row, experts, top_k, id_row);
    // NaN logits compare false both ways, so topk_row can find no candidate and return -1; reading
    // probs[-1] below would then be out of bounds.
    for (int32_t j = 0; j < top_k; ++j)
      DMOE_REQUIRE_INPUT(id_row[j] >= 0, "router_topk: token {} has no valid choice {}; its logits contain NaN "
                         "(x or the gate is not finite, or x times the gate overflowed float)", t, j);
    gate_weights_row<double>(prob_row, id_row, top_k, renormalize, weights + t * top_k);
  }
}

void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                         int32_t experts, int32_t top_k, double* prob_sum, double* assigned,
                         double* z_sum) {
  for (int32_t e = 0; e < experts; ++e) prob_sum[e] = assigned[e] = 0;
  double z = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t e = 0; e < experts; ++e) prob_sum[e] += double(probs[t * experts + e]);
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[t * top_k + j];
      // NOTE: an id outside [0, E) would write outside `assigned`.
      DMOE_REQUIRE(e >= 0 && e < experts,
                   "router_aux_partials: token {} choice {} has expert id {}; allowed [0, {})", t, j, e,
                   experts);
      assigned[e] += 1;
    }
    z += double(lse[t]) * double(lse[t]);
  }
  *z_sum = z;
}

void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                   int32_t experts, int32_t top_k, void* stats) {
  int32_t* assigned = AuxPartialsBlock::assigned(stats, experts);
  int32_t* bad = AuxPartialsBlock::bad(stats, experts);
  std::memset(bad, 0x7f, AuxPartialsBlock::bytes(experts) - size_t(reinterpret_cast<char*>(bad) -
                                                                   static_cast<char*>(stats)));  // and the padding
  *bad = kNoBadAssignment;
  for (int32_t e = 0; e < experts; ++e) assigned[e] = 0;
  for (int64_t a = 0; a < tokens * top_k; ++a) {
    const int32_t e = ids[a];
    if (e >= 0 && e < experts) ++assigned[e];
    else if (*bad == kNoBadAssignment) *bad = int32_t(a);
  }
  // prob_sum and z_sum summed as router_aux_partials sums them.
  double* prob_sum = AuxPartialsBlock::prob_sum(stats);
  for (int32_t e = 0; e < experts; ++e) prob_sum[e] = 0;
  double z = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t e = 0; e < experts; ++e) prob_sum[e] += double(probs[t * experts + e]);
    z += double(lse[t]) * double(lse[t]);
  }
  *AuxPartialsBlock::z_sum(stats, experts) = z;
}

void router_topk_backward(const float* probs, const int32_t* ids, const float* weights,
                          const float* dweights, float* dlogits, int64_t tokens, int32_t experts,
                          int32_t top_k, bool renormalize, const RouterAuxGrad& aux) {
  std::vector<double> dprobs(experts);  // dL/dp[t, e] of the current token
  for (int64_t t = 0; t < tokens; ++t) {
    const float* p = probs + t * experts;
    const int32_t* id = ids + t * top_k;
    const float* w = weights + t * top_k;
    const float* dw = dweights + t * top_k;

    for (int32_t e = 0; e < experts; ++e) dprobs[e] = 0;
    for (int32_t j = 0; j < top_k; ++j)
      DMOE_REQUIRE(id[j] >= 0 && id[j] < experts,
                   "router_topk_backward: token {} choice {} has expert id {}; allowed [0, {})", t, j,
                   id[j], experts);

    // Gate weights → probabilities. With w_j = p_{i_j} / S, S = Σ_l p_{i_l}:
    //   ∂w_j/∂p_{i_m} = (δ_jm − w_j) / S, so dp_{i_m} = (dw_m − Σ_j dw_j·w_j) / S.
    if (renormalize) {
      double sum_p = 0, dw_dot_w = 0;
      for (int32_t j = 0; j < top_k; ++j) {
        sum_p += double(p[id[j]]);
        dw_dot_w += double(dw[j]) * double(w[j]);
      }
      for (int32_t j = 0; j < top_k; ++j) dprobs[id[j]] += (double(dw[j]) - dw_dot_w) / sum_p;
    } else {
      for (int32_t j = 0; j < top_k; ++j) dprobs[id[j]] += double(dw[j]);
    }

    // Load balance: L_lb is linear in every p[t, e] (f_e is held constant).
    if (aux.expert_fraction != nullptr)
      for (int32_t e = 0; e < experts; ++e) dprobs[e] += aux.lb_scale * aux.expert_fraction[e];

    // Softmax: dlogit_e = p_e · (dp_e − Σ_e' dp_e'·p_e').
    double dp_dot_p = 0;
    for (int32_t e = 0; e < experts; ++e) dp_dot_p += dprobs[e] * double(p[e]);
    // z-loss acts on the logits directly: ∂lse/∂logit_e = p_e.
    const double z_term = aux.lse != nullptr ? aux.z_scale * double(aux.lse[t]) : 0.0;
    for (int32_t e = 0; e < experts; ++e)
      dlogits[t * experts + e] = float(double(p[e]) * (dprobs[e] - dp_dot_p) + z_term * double(p[e]));
  }
}

void router_logits_backward(const float* x, const float* wg, const float* dlogits, float* dx,
                            double* dwg, int64_t tokens, int64_t hidden, int32_t experts) {
  std::vector<double> dx_row(hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* dl = dlogits + t * experts;
    const float* x_row = x + t * hidden;
    // dx[t] += Σ_e dlogits[t, e] · wg[e]: rows of wg are contiguous, so the inner loop vectorises.
    for (int64_t i = 0; i < hidden; ++i) dx_row[i] = double(dx[t * hidden + i]);
    for (int32_t e = 0; e < experts; ++e) {
      const double g = dl[e];
      const float* wg_row = wg + e * hidden;
      for (int64_t i = 0; i < hidden; ++i) dx_row[i] += g * double(wg_row[i]);
    }
    for (int64_t i = 0; i < hidden; ++i) dx[t * hidden + i] = float(dx_row[i]);
    // dwg[e] += dlogits[t, e] · x[t]; tokens outer, so every element sums tokens in order.
    for (int32_t e = 0; e < experts; ++e) {
      const double g = dl[e];
      double* dwg_row = dwg + e * hidden;
      for (int64_t i = 0; i < hidden; ++i) dwg_row[i] += g * double(x_row[i]);
    }
  }
}

}  // namespace dmoe::cpu
