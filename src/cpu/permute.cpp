// cpu/permute.cpp — data movement around the experts: gather tokens into the expert-major send buffer,
// move row segments between the receive buffer and the expert batch, and combine expert outputs back
// into tokens (forward and backward). Copies are exact; combine sums in fp64 and rounds once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "core/routing_block.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                         int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* counts) {
  const int64_t assignments = tokens * top_k;
  int64_t* routed = PlanCountsBlock::routed(counts);
  int64_t* kept = PlanCountsBlock::kept(counts, experts);
  int64_t* offsets = PlanCountsBlock::offsets(counts, experts);
  int32_t* bad = PlanCountsBlock::bad(counts, experts);
  counts[PlanCountsBlock::words(experts) - 1] = 0;
  *bad = kNoBadAssignment;
  std::fill(routed, routed + experts, 0);
  for (int64_t a = 0; a < assignments; ++a) {
    const int32_t e = ids[a];
    if (e < 0 || e >= experts) {
      *bad = int32_t(a);
      break;
    }
    ++routed[e];
  }
  std::fill(slot, slot + assignments, -1);
  if (*bad != kNoBadAssignment) {
    std::fill(routed, routed + experts, 0);
    std::fill(kept, kept + experts, 0);
    std::fill(offsets, offsets + experts + 1, 0);
    return;
  }
  offsets[0] = 0;
  for (int32_t e = 0; e < experts; ++e) {
    kept[e] = capacity < 0 ? routed[e] : std::min(routed[e], capacity);
    offsets[e + 1] = offsets[e] + kept[e];
  }
  // Canonical order: an expert's rows are its assignments t·k + j in increasing order; the latest are dropped.
  std::vector<int64_t> next(offsets, offsets + experts);
  for (int64_t a = 0; a < assignments; ++a) {
    const int32_t e = ids[a];
    if (next[e] == offsets[e + 1]) continue;  // over capacity
    const int64_t row = next[e]++;
    slot[a] = int32_t(row);
    row_token[row] = int32_t(a / top_k);
    row_choice[row] = int32_t(a % top_k);
  }
}

void gather_rows(const float* x, const int32_t* rows, float* out, int64_t n, int64_t hidden) {
  for (int64_t i = 0; i < n; ++i) {
    DMOE_REQUIRE(rows[i] >= 0, "gather_rows: row {} has source row {}; must be >= 0", i, rows[i]);
    std::copy_n(x + int64_t(rows[i]) * hidden, hidden, out + i * hidden);
  }
}

void permute_segments(const float* src, float* dst, const int64_t* src_offsets,
                      const int64_t* dst_offsets, const int64_t* counts, int64_t segments,
                      int64_t hidden) {
  for (int64_t s = 0; s < segments; ++s) {
    DMOE_REQUIRE(counts[s] >= 0 && src_offsets[s] >= 0 && dst_offsets[s] >= 0,
                 "permute_segments: segment {} has count {}, src offset {}, dst offset {}; all must be >= 0",
                 s, counts[s], src_offsets[s], dst_offsets[s]);
    std::copy_n(src + src_offsets[s] * hidden, counts[s] * hidden, dst + dst_offsets[s] * hidden);
  }
}

void combine(const float* rows, const int32_t* slot, const float* weights, const float* addend,
             float* y, int64_t tokens, int32_t top_k, int64_t hidden, DType storage) {
  std::vector<double> acc(hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t s = slot[t * top_k + j];
      DMOE_REQUIRE(s >= -1, "combine: token {} choice {} has slot {}; must be >= -1", t, j, s);
      if (s < 0) continue;  // dropped by capacity
      const double w = weights != nullptr ? double(weights[t * top_k + j]) : 1.0;
      const float* row = rows + int64_t(s) * hidden;
      for (int64_t i = 0; i < hidden; ++i) acc[i] += w * double(row[i]);
    }
    if (addend != nullptr)
      for (int64_t i = 0; i < hidden; ++i) acc[i] += double(addend[t * hidden + i]);
    for (int64_t i = 0; i < hidden; ++i) y[t * hidden + i] = stored_value(acc[i], storage);
  }
}

void combine_backward(const float* dy, const float* rows, const int32_t* slot, const float* weights,
                      float* drows, float* dweights, int64_t tokens, int32_t top_k, int64_t hidden,
                      DType storage) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* dy_row = dy + t * hidden;
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t s = slot[t * top_k + j];
      DMOE_REQUIRE(s >= -1, "combine_backward: token {} choice {} has slot {}; must be >= -1", t, j, s);
      if (s < 0) {  // dropped: the weight did not contribute to y
        dweights[t * top_k + j] = 0;
        continue;
      }
      const float* row = rows + int64_t(s) * hidden;
      float* drow = drows + int64_t(s) * hidden;
      const double w = weights[t * top_k + j];
      double dot = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        dot += double(dy_row[i]) * double(row[i]);
        drow[i] = stored_value(w * double(dy_row[i]), storage);
      }
      dweights[t * top_k + j] = float(dot);
    }
  }
}

}  // namespace dmoe::cpu
