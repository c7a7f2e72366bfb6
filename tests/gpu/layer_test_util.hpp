// layer_test_util.hpp — what the GPU layer tests share: relative error with the worst element, and inputs
// whose router choices have a clear margin (so a GPU router's f32 sums choose what the CPU's fp64 ones do).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/config.hpp"
#include "core/random.hpp"
#include "cpu/kernels.hpp"
#include "flash/flash_kernel.hpp"
#include "gpu_test_util.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {
namespace {

// ‖a − b‖ / ‖b‖ over a range, with the first large element difference for the failure message.
struct Diff {
  double rel = 0;
  size_t worst = 0;
};
Diff rel_diff(const float* a, const float* b, size_t n) {
  double num = 0, den = 0, worst = -1;
  Diff d;
  for (size_t i = 0; i < n; ++i) {
    const double e = double(a[i]) - double(b[i]);
    num += e * e;
    den += double(b[i]) * b[i];
    if (std::abs(e) > worst) {
      worst = std::abs(e);
      d.worst = i;
    }
  }
  d.rel = std::sqrt(num / std::max(den, 1e-300));
  return d;
}

#define EXPECT_CLOSE(a, b, n, tol, what)                                                                  \
  do {                                                                                                    \
    const Diff d_ = rel_diff((a), (b), (n));                                                              \
    EXPECT_LE(d_.rel, (tol)) << what << ": rel. error " << d_.rel << ", worst at " << d_.worst << ": "    \
                             << (a)[d_.worst] << " vs " << (b)[d_.worst];                                 \
  } while (0)

// Inputs whose top-k choice has a clear margin (> `margin` in logits, default 1e-3) for every token, so that the GPU's
// fp32-accumulated router makes the same choices as the CPU's fp64 one and the comparison tests the math.
std::vector<float> inputs_without_near_ties(const MoeConfig& c, const MoeWeights& w, uint64_t seed,
                                            float margin = 1e-3f) {
  const int64_t rows = c.tokens * c.world;
  for (uint64_t s = seed; s < seed + 50; ++s) {
    Rng rng(s);
    auto x = rng.normal_vector(size_t(rows * c.hidden), 1.0);
    if (c.dtype == DType::bf16)
      for (auto& v : x) v = round_to_bf16(v);
    std::vector<float> logits(rows * c.experts);
    cpu::router_logits(x.data(), w.gate.data(), logits.data(), rows, c.hidden, c.experts);
    bool ok = true;
    for (int64_t t = 0; t < rows && ok; ++t) {
      std::vector<float> l(logits.begin() + t * c.experts, logits.begin() + (t + 1) * c.experts);
      std::sort(l.begin(), l.end(), std::greater<>());
      for (int32_t j = 0; j < c.top_k && ok; ++j)
        if (j + 1 < c.experts && l[j] - l[j + 1] < margin) ok = false;
    }
    if (ok) return x;
  }
  ADD_FAILURE() << "no input without near-tied router logits found";
  return {};
}

// Whether the Flash kernel can run here (an sm_90 GPU and this build's sm_90a code): its tests skip otherwise.
inline bool flash_runs_here() {
  if (!test::has_cuda_device()) return false;
  MoeConfig c;
  c.tokens = 8;
  c.hidden = 64;
  c.ffn = 64;
  c.experts = 4;
  c.top_k = 1;
  c.dtype = DType::bf16;
  return cuda::flash_unusable_reason(flash::make_shape(c, 1)).empty();
}

}  // namespace
}  // namespace dmoe
