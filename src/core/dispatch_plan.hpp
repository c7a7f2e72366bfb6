// dispatch_plan.hpp — who sends which row to which expert, and where every row lives.
//
// The plan is what makes engines comparable: every engine builds the same plan from the same routing.
//
//   send side (per source rank r):   send buffer [S_r, H], expert-major: rows for expert 0, then 1, …;
//                                    inside an expert, rows in token order. Experts are owned in
//                                    contiguous blocks, so the rows for destination rank d are one
//                                    contiguous segment.
//   receive side (per dest rank d):  after the all-to-all, a source-major receive buffer (rows from
//                                    rank 0, then 1, …; inside a source, expert-major), and the
//                                    expert-major batch the FFN runs on. The canonical order of rows in
//                                    an expert's batch is (source rank, token index).
//
// Capacity (when not dropless) applies per (source rank, expert): C = ceil(cf * T * k / E).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"

namespace dmoe {

// One tile of an expert's batch: rows [row_begin, row_begin + rows) of local expert local_expert.
// NOTE: plain data shared with device code; layout is fixed (16 bytes).
struct Tile {
  int32_t local_expert;
  int32_t rows;
  int64_t row_begin;  // row in the expert-major batch
};
static_assert(sizeof(Tile) == 16, "Tile is shared with device code; keep it 16 bytes");

struct SendPlan {
  int64_t tokens = 0;
  int32_t top_k = 0;
  int32_t experts = 0;
  std::vector<int64_t> routed;     // [E] assignments routed to each expert, before capacity
  std::vector<int64_t> counts;     // [E] rows kept for each expert
  std::vector<int64_t> offsets;    // [E+1] start of each expert's rows in the send buffer
  std::vector<int32_t> slot;       // [T*k] send-buffer row of assignment (t, j); -1 when dropped
  std::vector<int32_t> row_token;  // [S] token of each send-buffer row
  std::vector<int32_t> row_choice; // [S] which of the token's k choices (j) each row is

  int64_t rows() const { return offsets.empty() ? 0 : offsets.back(); }
  int64_t dropped() const;
  // Rows and first row of the segment that goes to rank dest (which owns experts_per_rank experts).
  int64_t rank_count(int32_t dest, int32_t experts_per_rank) const;
  int64_t rank_offset(int32_t dest, int32_t experts_per_rank) const;
};

// Builds the send plan of one source rank from its routing (ids, weights: [T, k]).
// capacity < 0 means dropless.
SendPlan build_send_plan(const int32_t* ids, const float* weights, int64_t tokens, int32_t top_k,
                         int32_t experts, int64_t capacity, DropPolicy policy);

struct ExpertBatchLayout {
  int32_t world = 0;
  int32_t local_experts = 0;
  std::vector<int64_t> counts;          // [W, Le] rows from source r for local expert e
  std::vector<int64_t> recv_offsets;    // [W, Le] first row of (r, e) in the source-major receive buffer
  std::vector<int64_t> batch_offsets;   // [W, Le] first row of (r, e) in the expert-major batch
  std::vector<int64_t> expert_offsets;  // [Le+1] first row of each local expert's batch (padding included)
  int32_t row_multiple = 1;             // each expert's batch is padded with zero rows to a multiple of this
  std::vector<int64_t> source_counts;   // [W] rows received from each source rank
  std::vector<int64_t> source_offsets;  // [W+1] first row from each source in the receive buffer

  int64_t rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  int64_t expert_rows(int32_t e) const { return expert_offsets[e + 1] - expert_offsets[e]; }
  bool padded() const { return row_multiple > 1; }
  // Tiles of at most tile_rows rows, expert by expert; an expert with no rows has no tile.
  std::vector<Tile> tiles(int32_t tile_rows) const;
};

// counts: [W, Le], rows that each source rank sends to each of this rank's local experts.
// row_multiple > 1 pads each expert's batch with zero rows up to a multiple of it ("padding only locally,
// to tile size"): every expert product then has a row count the GEMM tiles divide.
ExpertBatchLayout build_expert_batch_layout(const int64_t* counts, int32_t world, int32_t local_experts,
                                            int32_t row_multiple = 1);

// The whole system's plan as one process sees it (tests, single-process tools): routing of every rank.
struct DispatchPlan {
  std::vector<SendPlan> send;            // [W]
  std::vector<ExpertBatchLayout> recv;   // [W]
};

// ids[r], weights[r]: routing of rank r, each [T, k].
DispatchPlan build_dispatch_plan(const MoeConfig& config, const std::vector<const int32_t*>& ids,
                                 const std::vector<const float*>& weights);

}  // namespace dmoe
