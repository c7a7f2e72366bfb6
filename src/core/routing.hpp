// routing.hpp — per-token routing math, shared by the CPU and CUDA routers (host + device).
//
// Softmax over a token's E logits, then top-k on the logits (the softmax is monotone, and selecting on
// logits avoids ties created by rounding the probabilities). Ties go to the lower expert index, so the
// choice is deterministic on every backend. The k chosen experts are listed in descending logit order.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.hpp"

namespace dmoe {

// True when expert a (logit va) ranks before expert b (logit vb): larger logit, ties to lower index.
DMOE_HD bool ranks_before(float va, int32_t a, float vb, int32_t b) {
  return va > vb || (va == vb && a < b);
}

// probs[e] = softmax(logits)[e]; returns log-sum-exp of the logits (for the z-loss).
// Acc is the accumulation type (double on the CPU reference, float on the GPU).
template <typename Acc>
DMOE_HD Acc softmax_row(const float* logits, int32_t num_experts, float* probs) {
  float max_logit = logits[0];
  for (int32_t e = 1; e < num_experts; ++e) max_logit = logits[e] > max_logit ? logits[e] : max_logit;
  Acc sum = 0;
  for (int32_t e = 0; e < num_experts; ++e) sum += Acc(exp(Acc(logits[e]) - Acc(max_logit)));
  for (int32_t e = 0; e < num_experts; ++e)
    probs[e] = float(Acc(exp(Acc(logits[e]) - Acc(max_logit))) / sum);
  return Acc(max_logit) + Acc(log(sum));
}

// ids[0..k) = the k best experts by (logit desc, index asc). O(k*E), no scratch memory.
DMOE_HD void topk_row(const float* logits, int32_t num_experts, int32_t top_k, int32_t* ids) {
  float prev_v = 0;
  int32_t prev_e = -1;
  for (int32_t j = 0; j < top_k; ++j) {
    int32_t best = -1;
    float best_v = 0;
    for (int32_t e = 0; e < num_experts; ++e) {
      const float v = logits[e];
      // Only experts ranking after the previous pick are candidates.
      if (prev_e >= 0 && !ranks_before(prev_v, prev_e, v, e)) continue;
      if (best < 0 || ranks_before(v, e, best_v, best)) {
        best = e;
        best_v = v;
      }
    }
    ids[j] = best;
    prev_v = best_v;
    prev_e = best;
  }
}

// weights[j] = probs[ids[j]], divided by their sum when renormalize is set.
template <typename Acc>
DMOE_HD void gate_weights_row(const float* probs, const int32_t* ids, int32_t top_k, bool renormalize,
                              float* weights) {
  Acc sum = 0;
  for (int32_t j = 0; j < top_k; ++j) sum += Acc(probs[ids[j]]);
  for (int32_t j = 0; j < top_k; ++j)
    weights[j] = renormalize ? float(Acc(probs[ids[j]]) / sum) : probs[ids[j]];
}

}  // namespace dmoe
