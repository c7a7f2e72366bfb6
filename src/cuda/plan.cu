// cuda/plan.cu — the send plan on the GPU: exactly core build_send_plan's result (routed, counts,
// offsets, slot, row_token, row_choice) for DropPolicy::latest_tokens (and dropless).
//
// The assignments a = t*k + j are cut into tiles of kTileAssignments, one warp per tile:
//   1. count:   per tile, how many assignments go to each expert       → tile_counts [E, tiles]
//   2. scan:    per expert, exclusive prefix over the tiles in order    → tile_base [E, tiles], routed [E]
//   3. offsets: kept[e] = min(routed[e], capacity), exclusive prefix     → offsets [E+1]
//   4. write:   each warp walks its tile in assignment order; an assignment's position inside its expert
//               is tile_base + the number of earlier assignments of the tile with the same expert
//               (__match_any_sync + popc), so an expert's rows come out in token order, exactly as the
//               CPU lists them; positions >= capacity are dropped (latest tokens first).
// Every step is a fixed computation (no order-dependent atomics), so the plan is identical run to run.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/routing_block.hpp"
#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kTileSteps = 8;                         // warp-wide steps per tile
constexpr int kTileAssignments = kWarp * kTileSteps;  // 256 assignments per tile
constexpr int kScanThreads = 256;                     // 8 experts per block in step 2
constexpr int kOffsetThreads = 1024;                  // step 3: one block

struct PlanCountParams {
  const int32_t* ids;   // [A] expert of assignment a = t*k + j
  int64_t assignments;  // A = T*k
  int32_t experts;
  int64_t tiles;
  int32_t* tile_counts;     // [E, tiles]
  int32_t* bad_assignment;  // first a with an id outside [0, E)
};

// Step 1: one warp per tile, a shared histogram of E counters.
__global__ void __launch_bounds__(kWarp) plan_count_kernel(const __grid_constant__ PlanCountParams p) {
  extern __shared__ int32_t s_hist[];  // [E]
  const int lane = lane_id();
  const int64_t tile = blockIdx.x;
  for (int32_t e = lane; e < p.experts; e += kWarp) s_hist[e] = 0;
  __syncwarp();
  for (int step = 0; step < kTileSteps; ++step) {
    const int64_t a = tile * kTileAssignments + step * kWarp + lane;
    if (a < p.assignments) {
      const int32_t e = p.ids[a];
      if (e >= 0 && e < p.experts)
        atomicAdd(&s_hist[e], 1);
      else
        atomicMin(p.bad_assignment, int32_t(a));
    }
  }
  __syncwarp();
  for (int32_t e = lane; e < p.experts; e += kWarp) p.tile_counts[int64_t(e) * p.tiles + tile] = s_hist[e];
}

struct PlanScanParams {
  int32_t* tile_counts;  // [E, tiles] in: counts; out: exclusive prefix over tiles (tile_base)
  int64_t tiles;
  int32_t experts;
  int64_t* routed;  // [E]
};

// Step 2: one warp per expert scans its row of tile counts, 32 tiles at a time.
__global__ void __launch_bounds__(kScanThreads) plan_scan_kernel(const __grid_constant__ PlanScanParams p) {
  const int lane = lane_id();
  const int32_t e = int32_t(blockIdx.x) * (kScanThreads / kWarp) + int32_t(threadIdx.x) / kWarp;
  if (e >= p.experts) return;  // whole warps leave together
  int32_t* row = p.tile_counts + int64_t(e) * p.tiles;
  int64_t running = 0;
  for (int64_t b0 = 0; b0 < p.tiles; b0 += kWarp) {
    const int64_t b = b0 + lane;
    const int32_t v = b < p.tiles ? row[b] : 0;
    const int32_t inclusive = warp_inclusive_scan(v, lane);
    if (b < p.tiles) row[b] = int32_t(running) + inclusive - v;
    running += __shfl_sync(kFullMask, inclusive, kWarp - 1);
  }
  if (lane == 0) p.routed[e] = running;
}

struct PlanOffsetsParams {
  const int64_t* routed;  // [E]
  int32_t experts;
  int64_t capacity;  // < 0: dropless
  int64_t* kept;     // [E]
  int64_t* offsets;  // [E+1]
};

// Step 3: one block; experts in chunks of the block size, a block-wide exclusive scan per chunk.
__global__ void __launch_bounds__(kOffsetThreads)
    plan_offsets_kernel(const __grid_constant__ PlanOffsetsParams p) {
  __shared__ int64_t s_warp_total[kOffsetThreads / kWarp];
  const int lane = lane_id();
  const int warp = int(threadIdx.x) / kWarp;
  int64_t carry = 0;
  for (int32_t e0 = 0; e0 < p.experts; e0 += kOffsetThreads) {
    const int32_t e = e0 + int32_t(threadIdx.x);
    int64_t kept = 0;
    if (e < p.experts) {
      kept = p.routed[e];
      if (p.capacity >= 0 && kept > p.capacity) kept = p.capacity;
      p.kept[e] = kept;
    }
    const int64_t inclusive = warp_inclusive_scan(kept, lane);
    if (lane == kWarp - 1) s_warp_total[warp] = inclusive;
    __syncthreads();
    int64_t before = carry;  // rows of earlier chunks and earlier warps of this chunk
    int64_t chunk_total = 0;
    for (int w = 0; w < kOffsetThreads / kWarp; ++w) {
      if (w < warp) before += s_warp_total[w];
      chunk_total += s_warp_total[w];
    }
    if (e < p.experts) p.offsets[e] = before + inclusive - kept;
    carry += chunk_total;
    __syncthreads();  // s_warp_total is rewritten by the next chunk
  }
  if (threadIdx.x == 0) p.offsets[p.experts] = carry;
}

struct PlanWriteParams {
  const int32_t* ids;  // [A]
  int64_t assignments;
  int32_t top_k;
  int32_t experts;
  int64_t tiles;
  int64_t capacity;          // < 0: dropless
  const int32_t* tile_base;  // [E, tiles]
  const int64_t* offsets;    // [E+1]
  int32_t* slot;             // [A]
  int32_t* row_token;        // [S]
  int32_t* row_choice;       // [S]
};

// Step 4: one warp per tile, a shared cursor per expert (the tile's next position inside the expert).
__global__ void __launch_bounds__(kWarp) plan_write_kernel(const __grid_constant__ PlanWriteParams p) {
  extern __shared__ int32_t s_cursor[];  // [E]
  const int lane = lane_id();
  const int64_t tile = blockIdx.x;
  for (int32_t e = lane; e < p.experts; e += kWarp) s_cursor[e] = p.tile_base[int64_t(e) * p.tiles + tile];
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int step = 0; step < kTileSteps; ++step) {
    const int64_t a = tile * kTileAssignments + step * kWarp + lane;
    int32_t e = a < p.assignments ? p.ids[a] : -1;
    if (e >= p.experts) e = -1;  // invalid ids were reported by step 1; they get no row
    // Lanes with the same expert, in lane (= assignment) order.
    const unsigned peers = __match_any_sync(kFullMask, e);
    if (e >= 0) {
      const int64_t position = int64_t(s_cursor[e]) + __popc(peers & lanes_below);
      if (p.capacity < 0 || position < p.capacity) {
        const int64_t row = p.offsets[e] + position;
        p.slot[a] = int32_t(row);
        p.row_token[row] = int32_t(a / p.top_k);
        p.row_choice[row] = int32_t(a % p.top_k);
      } else {
        p.slot[a] = -1;  // over capacity: the latest tokens are dropped
      }
    } else if (a < p.assignments) {
      p.slot[a] = -1;
    }
    __syncwarp();  // every lane has read the cursors before the lowest lane of each group moves them
    if (e >= 0 && (peers & lanes_below) == 0) s_cursor[e] += __popc(peers);
    __syncwarp();
  }
}

struct PlanShape {
  int64_t assignments = 0, tiles = 0;
  size_t hist_bytes = 0, tile_bytes = 0;  // shared histogram per block; tile counts [E, tiles] i32 in scratch
};

PlanShape plan_shape(int64_t tokens, int32_t top_k, int32_t experts) {
  DMOE_CUDA_REQUIRE(experts >= 1 && top_k >= 1, "plan_send: experts = %d, top_k = %d; both must be >= 1",
                    experts, top_k);
  PlanShape s;
  s.assignments = tokens * top_k;
  DMOE_CUDA_REQUIRE(s.assignments < (int64_t(1) << 31), "plan_send: T*k = %lld assignments; at most 2^31 - 1",
                    (long long)s.assignments);
  s.hist_bytes = size_t(experts) * sizeof(int32_t);
  DMOE_CUDA_REQUIRE(s.hist_bytes <= 48 * 1024, "plan_send: experts = %d; at most %d", experts,
                    int(48 * 1024 / sizeof(int32_t)));
  s.tiles = (s.assignments + kTileAssignments - 1) / kTileAssignments;
  s.tile_bytes = size_t(experts) * size_t(std::max<int64_t>(s.tiles, 1)) * sizeof(int32_t);
  return s;
}

// The plan's kernels: counts per tile, their scan, the offsets, the slots; results into `counts`
// (core/routing_block.hpp's PlanCountsBlock).
void launch_plan(const PlanShape& sh, const int32_t* ids, int32_t top_k, int32_t experts, int64_t capacity,
                 int32_t* slot, int32_t* row_token, int32_t* row_choice, int32_t* tile_counts, int64_t* counts,
                 const CudaContext& ctx) {
  int64_t* routed = PlanCountsBlock::routed(counts);
  int64_t* kept = PlanCountsBlock::kept(counts, experts);
  int64_t* offsets = PlanCountsBlock::offsets(counts, experts);
  int32_t* bad = PlanCountsBlock::bad(counts, experts);
  DMOE_CHECK_CUDA(cudaMemsetAsync(bad, 0x7f, sizeof(int64_t), ctx.stream));
  if (sh.tiles > 0) {
    plan_count_kernel<<<unsigned(sh.tiles), kWarp, sh.hist_bytes, ctx.stream>>>(
        PlanCountParams{ids, sh.assignments, experts, sh.tiles, tile_counts, bad});
    DMOE_CHECK_LAUNCH();
  }
  plan_scan_kernel<<<grid_for(experts, kScanThreads / kWarp), kScanThreads, 0, ctx.stream>>>(
      PlanScanParams{tile_counts, sh.tiles, experts, routed});
  DMOE_CHECK_LAUNCH();
  plan_offsets_kernel<<<1, kOffsetThreads, 0, ctx.stream>>>(
      PlanOffsetsParams{routed, experts, capacity, kept, offsets});
  DMOE_CHECK_LAUNCH();
  if (sh.tiles > 0) {
    plan_write_kernel<<<unsigned(sh.tiles), kWarp, sh.hist_bytes, ctx.stream>>>(
        PlanWriteParams{ids, sh.assignments, top_k, experts, sh.tiles, capacity, tile_counts, offsets, slot,
                        row_token, row_choice});
    DMOE_CHECK_LAUNCH();
  }
}

}  // namespace

void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                         int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* counts,
                         const CudaContext& ctx) {
  const PlanShape sh = plan_shape(tokens, top_k, experts);
  auto* tile_counts = static_cast<int32_t*>(ctx.workspace->reserve(sh.tile_bytes, ctx.stream));
  launch_plan(sh, ids, top_k, experts, capacity, slot, row_token, row_choice, tile_counts, counts, ctx);
}

void fail_bad_assignment(const int32_t* ids, int32_t bad, int32_t top_k, int32_t experts) {
  int32_t id = 0;
  DMOE_CHECK_CUDA(cudaMemcpy(&id, ids + bad, sizeof(int32_t), cudaMemcpyDeviceToHost));
  fail(__FILE__, __LINE__,
       "routing: token %d choice %d has expert id %d; allowed [0, %d) (id -1: the token's router logits "
       "are NaN: check the input for non-finite values)", bad / top_k, bad % top_k, id, experts);
}

void plan_send(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
               int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* routed_host,
               int64_t* counts_host, const CudaContext& ctx) {
  const PlanShape sh = plan_shape(tokens, top_k, experts);
  // Scratch: the tile counts, then the counts block that comes back to the host.
  const size_t block_bytes = PlanCountsBlock::bytes(experts);
  ScratchLayout layout;
  const size_t off_tiles = layout.add(sh.tile_bytes);
  const size_t off_block = layout.add(block_bytes);
  char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
  auto* block = reinterpret_cast<int64_t*>(ws + off_block);
  launch_plan(sh, ids, top_k, experts, capacity, slot, row_token, row_choice, reinterpret_cast<int32_t*>(ws + off_tiles),
              block, ctx);

  // routed, kept, offsets and bad are one transfer (only routed, kept and bad are needed here).
  std::vector<int64_t> host(PlanCountsBlock::words(experts));
  download_bounded(host.data(), block, block_bytes, ctx.stream, ctx.host_staging, "plan_send: reading the counts");
  const int32_t h_bad = PlanCountsBlock::read_bad(host.data(), experts);
  if (h_bad != kNoBadAssignment) fail_bad_assignment(ids, h_bad, top_k, experts);
  std::copy_n(PlanCountsBlock::routed(host.data()), experts, routed_host);
  std::copy_n(PlanCountsBlock::kept(host.data(), experts), experts, counts_host);
}

}  // namespace dmoe::cuda
