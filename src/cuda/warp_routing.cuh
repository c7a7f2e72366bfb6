// cuda/warp_routing.cuh — one token's routing by one warp: softmax statistics and the top-k of
// core/routing.hpp, shared by the EP router (router.cu) and Flash's gate (flash/flash_kernel.cu), so that both
// choose the same experts with bit-identical probabilities.
//
// Lane l holds experts l, l + 32, ... (kSlots of them). Max and sum are warp reductions (f32; a different
// summation order than softmax_row's loop, so probabilities differ from the per-thread code in the last bits,
// but not with kSlots: slots past E add exactly 0). Each of the k picks is a warp arg-max under ranks_before,
// a strict total order on non-NaN logits, so the ids equal topk_row's. A row holding a NaN is left to the
// per-thread code of routing.hpp, which defines what NaN routing does.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/routing.hpp"
#include "cuda/device_utils.cuh"

namespace dmoe::cuda {

template <int kSlots>
struct WarpRoutingRow {
  float v[kSlots];   // logits of this lane's experts (−inf past E)
  float ex[kSlots];  // exp(v − max_logit) (0 past E)
  float max_logit = -INFINITY, sum = 0.f;  // the same on every lane
};

// Loads this lane's logits of `row` (any memory space, E <= 32·kSlots) and the softmax statistics. Returns
// false, with only v set, when the row holds a NaN.
template <int kSlots>
__device__ __forceinline__ bool warp_softmax_stats(const float* row, int32_t E, int lane, WarpRoutingRow<kSlots>& r) {
  bool nan = false;
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int32_t e = lane + kWarp * i;
    r.v[i] = e < E ? row[e] : -INFINITY;
    nan = nan || isnan(r.v[i]);
    max_logit = fmaxf(max_logit, r.v[i]);
  }
  if (__any_sync(kFullMask, nan)) return false;
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    max_logit = fmaxf(max_logit, __shfl_xor_sync(kFullMask, max_logit, offset));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    r.ex[i] = lane + kWarp * i < E ? expf(r.v[i] - max_logit) : 0.f;
    sum += r.ex[i];
  }
  r.max_logit = max_logit;
  r.sum = warp_sum(sum);
  return true;
}

// The k best experts in rank order; pick(j, expert, logit) runs on every lane with the same values. The
// chosen expert's probability is expf(logit − max_logit) / sum: the owner lane's ex / sum, bit for bit.
template <int kSlots, typename Pick>
__device__ __forceinline__ void warp_topk(const WarpRoutingRow<kSlots>& r, int32_t E, int32_t k, int lane, Pick pick) {
  float prev_v = 0.f;
  int32_t prev_e = -1;
  for (int32_t j = 0; j < k; ++j) {
    float best_v = 0.f;
    int32_t best = -1;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int32_t e = lane + kWarp * i;
      if (e >= E || (prev_e >= 0 && !ranks_before(prev_v, prev_e, r.v[i], e))) continue;
      if (best < 0 || ranks_before(r.v[i], e, best_v, best)) {
        best = e;
        best_v = r.v[i];
      }
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other_v = __shfl_xor_sync(kFullMask, best_v, offset);
      const int32_t other = __shfl_xor_sync(kFullMask, best, offset);
      if (other >= 0 && (best < 0 || ranks_before(other_v, other, best_v, best))) {
        best = other;
        best_v = other_v;
      }
    }
    pick(j, best, best_v);
    prev_v = best_v;
    prev_e = best;
  }
}

}  // namespace dmoe::cuda
